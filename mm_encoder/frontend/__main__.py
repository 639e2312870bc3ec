"""`python -m mm_encoder.frontend`: Dynamo's HTTP frontend with the multimodal chat processor
(`provider.ProcessorFactory`). Dynamo after 1.6.1 loads the same factory through the entry point
`dynamo.frontend.chat_processors: mm-encoder` instead (`provider.chat_processor`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

from ..core.prompt import check_model_dir
from ..runtime.dynamo import http_frontend, make_runtime
from ..runtime.process import parse_settings, run, stop_on_signals
from .drain import drain
from .metrics import exposition
from .provider import ProcessorFactory
from .settings import FrontendSettings


async def serve(s: FrontendSettings) -> None:
    runtime = make_runtime(asyncio.get_running_loop())
    factory = ProcessorFactory(s, runtime)
    await factory.parts()  # fail fast (a bad model dir) before serving

    def stats(_ctx):
        return {"processors": factory.snapshots()}

    # appended to Dynamo's system server /metrics (DYN_SYSTEM_PORT); no endpoint needs serving for it
    runtime.endpoint(f"{s.namespace}.frontend.mm_processor").metrics.register_prometheus_expfmt_callback(
        exposition(factory.snapshots))

    stop = stop_on_signals()
    serving = await http_frontend(runtime, factory, host=s.http_host, port=s.http_port, namespace=s.namespace,
                                  routes={"/mm/stats": stats})
    print(f"mm-encoder frontend ready: http://{s.http_host}:{s.http_port} model_dir={s.model_dir}", flush=True)
    await asyncio.wait({serving, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    await drain(factory, s)
    runtime.shutdown()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(serving, 30)
    await factory.close()


RUNTIME_THREADS = "DYN_RUNTIME_NUM_WORKER_THREADS"


def set_runtime_threads(s: FrontendSettings, env=os.environ) -> None:
    """`--runtime-threads` into the variable Dynamo's runtime reads when it starts; unset: the
    variable as it is, else 1."""
    if s.runtime_threads is not None:
        env[RUNTIME_THREADS] = str(s.runtime_threads)
    else:
        env.setdefault(RUNTIME_THREADS, "1")


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(FrontendSettings, argv, check=lambda s: check_model_dir(s.model_dir))
    if settings is None:
        return 2
    set_runtime_threads(settings)  # before the first call into Dynamo
    return run(serve(settings), settings.log_level)


if __name__ == "__main__":
    sys.exit(main())
