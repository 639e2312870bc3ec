"""`python -m mm_encoder.planner`: the encode planner, a graph's `kind: planner` component.

It serves `GET /status` (JSON: wanted and running encoders, the last decision and why, the
signals it was taken on), `GET /metrics` and `GET /healthz` on `--http-port`, and registers
`<namespace>.encode_planner.status` in Dynamo's discovery: a second planner for the same namespace
finds it there and refuses to start (two planners would fight over one count)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any

from aiohttp import web

from ..core.errors import MMEncoderError
from ..runtime import logs
from ..runtime.dynamo import PLANNER_COMPONENT, PLANNER_ENDPOINT, endpoint_path, planner_connector, serve_endpoint
from ..runtime.process import Lifecycle, parse_settings, run
from .service import EncodePlanner, load_path
from .settings import PlannerSettings

log = logging.getLogger(__name__)
RIVAL_WAIT_S = 2.0  # how long discovery gets to show another planner of the namespace, and it to answer


def _app(planner: EncodePlanner) -> web.Application:
    async def status(_: web.Request) -> web.Response:
        return web.Response(text=json.dumps(planner.status()), content_type="application/json")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=planner.metrics.render(), content_type="text/plain")

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes([web.get("/status", status), web.get("/metrics", metrics), web.get("/healthz", healthz)])
    return app


async def _refuse_a_rival(rivals: Any, namespace: str) -> None:
    """Another planner of the namespace that answers: refuse to start. One in discovery that does
    not answer (killed; its lease not yet expired) is a predecessor: take over."""
    try:
        found = await asyncio.wait_for(rivals.wait_for_instances(), RIVAL_WAIT_S)
    except asyncio.TimeoutError:
        return
    for instance in found:
        try:
            stream = await asyncio.wait_for(rivals.direct({}, instance), RIVAL_WAIT_S)
            await asyncio.wait_for(anext(aiter(stream)), RIVAL_WAIT_S)
        except Exception as e:  # gone: its entry outlives it until its lease expires
            log.info("a previous planner (instance %x) does not answer (%s): taking over", instance,
                     type(e).__name__)
            continue
        raise MMEncoderError(f"another encode planner already plans namespace {namespace} (instance "
                             f"{instance:x}): two would fight over one count", "planner_exists", 409)


async def serve(s: PlannerSettings) -> None:
    async with Lifecycle("mm-encoder planner") as life:
        rt = life.runtime
        path = endpoint_path(s.namespace, PLANNER_COMPONENT, PLANNER_ENDPOINT)
        await _refuse_a_rival(await rt.endpoint(path).client(), s.namespace)
        connector = planner_connector(s.connector, rt, s.namespace, s.model_name, s.component)
        # importing Dynamo's planner hands the root logger to Dynamo's (DYN_LOG-filtered) bridge: ours again
        logs.configure(s.log_level, force=True)
        await connector.async_init()
        load = await rt.endpoint(load_path(s.namespace)).client()
        planner = EncodePlanner(s, load, connector)

        async def whoami(request: Any, context: Any) -> Any:
            yield planner.status()

        life.serve(serve_endpoint(rt.endpoint(path), whoami))
        runner = web.AppRunner(_app(planner), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, s.http_host, s.http_port)
        await site.start()
        life.on_exit(runner.cleanup)
        port = runner.addresses[0][1]
        life.serve(planner.run(life.stop))
        life.ready(component=s.component, connector=s.connector, http_port=port,
                   bounds=f"{s.min_replicas}-{s.max_replicas}")
        await life.wait()


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(PlannerSettings, argv)
    return 2 if settings is None else run(serve(settings), settings.log_level)


if __name__ == "__main__":
    sys.exit(main())
