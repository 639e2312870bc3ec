"""The encode worker: one `EncodeService` behind HTTP and, with `--dynamo`, Dynamo RPC.

    python -m mm_encoder.worker --model tiny --http-port 8090 [--checkpoint DIR] [--dynamo]

Every option also reads from the environment (`MM_ENCODER_<OPTION>`; see `settings.py` and the
README). SIGTERM or SIGINT drains: new requests get 503 "draining", in-flight ones finish (up to
`--drain-timeout-s`), the Dynamo instance deregisters, then the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

from .encoder import Encoder
from .errors import MMEncoderError
from .settings import WorkerSettings

log = logging.getLogger("mm_encoder.worker")


class Worker:
    """Owns the encoder, the service and its transports; `start()` then `stop()`."""

    def __init__(self, settings: WorkerSettings, encoder: Encoder | None = None):
        self.settings = settings
        self.encoder = encoder
        self.service = None
        self.http_runner = None
        self.http_port: int | None = None
        self.dynamo = None
        self._stopped: asyncio.Future | None = None

    async def start(self) -> None:
        from .service import EncodeService

        s = self.settings
        if self.encoder is None:
            self.encoder = await asyncio.to_thread(load_encoder, s)
        self.service = EncodeService(self.encoder, s)
        await self.service.start()
        if s.http_port >= 0:
            from .http_app import start_http

            self.http_runner, self.http_port = await start_http(self.service, s.http_host, s.http_port)
            log.info("HTTP on http://%s:%d (POST /v1/encode)", s.http_host, self.http_port)
        if s.dynamo:
            from .dynamo_rpc import DynamoServer, make_runtime

            self.dynamo = DynamoServer(self.service, make_runtime(asyncio.get_running_loop()), s.namespace)
            await self.dynamo.start()

    async def stop(self) -> None:
        """Graceful: refuse new work, let in-flight requests finish, then close the transports.
        Idempotent; concurrent callers all wait for the one shutdown."""
        if self.service is None:
            return
        if self._stopped is None:
            self._stopped = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopped)

    async def _stop(self) -> None:
        timeout = self.settings.drain_timeout_s
        drained = asyncio.ensure_future(self.service.drain(timeout))
        if self.dynamo is not None:
            await self.dynamo.stop(timeout)
        await drained
        if self.http_runner is not None:
            await self.http_runner.cleanup()
        await self.service.close()
        log.info("stopped")


def load_encoder(s: WorkerSettings) -> Encoder:
    if s.torch_threads:
        import torch

        torch.set_num_threads(s.torch_threads)
    return Encoder.from_pretrained(
        s.model, checkpoint=s.checkpoint, device=s.device, dtype=s.dtype, limits=s.media_limits()
    )


async def serve(settings: WorkerSettings) -> None:
    """Run until SIGTERM/SIGINT, then stop gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    worker = Worker(settings)
    try:
        await worker.start()
        print(f"mm-encoder worker ready: model={worker.encoder.name} http_port={worker.http_port} "
              f"dynamo={settings.dynamo}", flush=True)
        await stop.wait()
        log.info("signal received: draining")
    finally:
        await worker.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    try:
        settings = WorkerSettings(_cli_parse_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        run = asyncio.run
        with contextlib.suppress(ImportError):
            import uvloop  # the `dynamo` extra; Dynamo's runtime expects it, and it is faster anyway

            run = uvloop.run
        run(serve(settings))
    except MMEncoderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ImportError as e:
        print(f"error: {e}; install the `dynamo` extra (pip install 'mm-encoder[dynamo]')", file=sys.stderr)
        return 1
    except OSError as e:  # most often: the HTTP port is taken
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
