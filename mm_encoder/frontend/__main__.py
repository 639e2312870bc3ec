"""`python -m mm_encoder.frontend`: Dynamo's HTTP frontend with the multimodal chat processor
(`provider.ProcessorFactory`). Dynamo after 1.6.1 loads the same factory through the entry point
`dynamo.frontend.chat_processors: mm-encoder` instead (`provider.chat_processor`)."""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from typing import Any

from ..core.prompt import check_model_dir
from ..runtime.dynamo import http_frontend
from ..runtime.process import Lifecycle, parse_settings, run
from ..security.tenants import Tenants, forward_header
from .drain import drain
from .metrics import exposition
from .provider import ProcessorFactory
from .settings import FrontendSettings


async def serve(s: FrontendSettings) -> None:
    async with Lifecycle("mm-encoder frontend") as life:
        factory = ProcessorFactory(s, life.runtime)
        life.on_exit(factory.close)  # once the runtime is down and the HTTP server has stopped
        # its client certificate (the HTTPS port's: a restart, Dynamo's server reads it once)
        life.on_reload(factory.reload_tls, files=(s.tls_cert, s.tls_key) if s.tls else ())
        await factory.parts()  # fail fast (a bad model dir) before serving

        def stats(_ctx: object) -> dict[str, list[dict[str, Any]]]:  # _ctx: Dynamo's request context, unused
            return {"processors": factory.snapshots()}

        # appended to Dynamo's system server /metrics (DYN_SYSTEM_PORT); no endpoint needs serving for it
        life.runtime.endpoint(f"{s.namespace}.frontend.mm_processor").metrics.register_prometheus_expfmt_callback(
            exposition(factory.snapshots))
        https = (str(s.https_cert or s.tls_cert), str(s.https_key or s.tls_key),
                 str(s.tls_ca) if s.https_client_auth else None) if s.https else None
        life.serve(await http_frontend(life.runtime, factory, host=s.http_host, port=s.http_port,
                                       namespace=s.namespace, routes={"/mm/stats": stats}, https=https))
        life.ready(f"{'https' if s.https else 'http'}://{s.http_host}:{s.http_port}", model_dir=s.model_dir)
        await life.wait()
        await drain(factory, s)


RUNTIME_THREADS = "DYN_RUNTIME_NUM_WORKER_THREADS"


def set_runtime_threads(s: FrontendSettings, env: MutableMapping[str, str] = os.environ) -> None:
    """`--runtime-threads` into the variable Dynamo's runtime reads when it starts; unset: the
    variable as it is, else 1."""
    if s.runtime_threads is not None:
        env[RUNTIME_THREADS] = str(s.runtime_threads)
    else:
        env.setdefault(RUNTIME_THREADS, "1")


def _check(s: FrontendSettings) -> None:
    """Refused before any start-up: a model directory that is not one, a tenant key that cannot be
    used; and Dynamo's HTTP frontend told (before its runtime starts) to pass the tenant header on."""
    check_model_dir(s.model_dir)
    Tenants.from_files(s.tenant_header, s.tenant_key)
    forward_header(s.tenant_header)


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(FrontendSettings, argv, check=_check)
    if settings is None:
        return 2
    set_runtime_threads(settings)  # before the first call into Dynamo
    return run(serve(settings), settings.log_level)


if __name__ == "__main__":
    sys.exit(main())
