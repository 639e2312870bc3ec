"""The encode worker: one `EncodeService` behind HTTP and, with `--dynamo`, Dynamo RPC.

    python -m mm_encoder.worker --model tiny --http-port 8090 [--checkpoint DIR] [--dynamo]

Every option also reads from the environment (`MM_ENCODER_<OPTION>`; see `service/settings.py`
and the README). SIGTERM or SIGINT drains: new requests get 503 "draining", in-flight ones finish (up to
`--drain-timeout-s`), the Dynamo instance deregisters, then the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from .encode_worker.dynamo_server import DynamoServer
from .encode_worker.http_app import start_http
from .encode_worker.pipeline import EncodeService
from .encode_worker.settings import WorkerSettings
from .encode_worker.stock_encode import StockEncoder
from .model.encoder import Encoder
from .runtime.dynamo import make_runtime
from .runtime.process import parse_settings, run, stop_on_signals

log = logging.getLogger(__name__)


class Worker:
    """Owns the encoder, the service and its transports; `start()` then `stop()`."""

    def __init__(self, settings: WorkerSettings, encoder: Encoder | None = None):
        """`encoder`: an already loaded model (tests, the demo); the settings' limits and batch cap
        apply to it as they would to one the worker loads."""
        self.settings = settings
        if encoder is not None:
            encoder = encoder.configured(limits=settings.media_limits(), batch_max_patches=settings.batch_max_patches)
        self.encoder = encoder
        self.service = None
        self.http_runner = None
        self.http_port: int | None = None
        self.dynamo = None
        self.stock = None
        self._stopped: asyncio.Future | None = None

    async def start(self) -> None:
        s = self.settings
        if self.encoder is None:
            self.encoder = await asyncio.to_thread(load_encoder, s)
        self.service = EncodeService(self.encoder, s)
        await self.service.start()
        if s.http_port >= 0:
            self.http_runner, self.http_port = await start_http(self.service, s.http_host, s.http_port)
            log.info("HTTP on http://%s:%d (POST /v1/encode)", s.http_host, self.http_port)
        if s.dynamo:
            self.dynamo = DynamoServer(self.service, make_runtime(asyncio.get_running_loop()), s.namespace)
            await self.dynamo.start()
        if s.stock_model_dir:  # also Dynamo's Encode worker, for the stock frontend
            self.stock = StockEncoder(self.service, self.dynamo.runtime, s.namespace, s.stock_model_dir, s.stock_name,
                                      s.handle_chain, s.handle_route)
            await self.stock.start()

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
            await self.dynamo.stop(timeout)  # shuts the runtime down: both Dynamo endpoints drain
        if self.stock is not None:
            await self.stock.stop(timeout)
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
        s.model, checkpoint=s.checkpoint, device=s.device, dtype=s.dtype, limits=s.media_limits(),
        batch_max_patches=s.batch_max_patches,
    )


async def serve(settings: WorkerSettings) -> None:
    """Run until SIGTERM/SIGINT, then stop gracefully."""
    stop = stop_on_signals()
    worker = Worker(settings)
    try:
        await worker.start()
        print(f"mm-encoder worker ready: model={worker.encoder.name} http_port={worker.http_port} "
              f"dynamo={settings.dynamo}", flush=True)
        await stop.wait()
        log.info("signal received: draining")
    finally:
        await worker.stop()


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(WorkerSettings, argv)
    return 2 if settings is None else run(serve(settings), settings.log_level)


if __name__ == "__main__":
    sys.exit(main())
