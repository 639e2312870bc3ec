"""The encode worker process: one `EncodeService` behind HTTP and, with `--dynamo`, Dynamo RPC.

    python -m mm_encoder.encode_worker --model tiny --http-port 8090 [--checkpoint DIR] [--dynamo]

`python -m mm_encoder.worker` and `mm-encoder worker` run the same `main`. Every option also reads
from the environment (`MM_ENCODER_<OPTION>`; see `settings.py` and the README). SIGTERM or SIGINT
drains: new requests get 503 "draining", in-flight ones finish (up to `--drain-timeout-s`), the
Dynamo instance deregisters, then the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

from aiohttp import web

from ..model.encoder import Encoder
from ..model.loading import load
from ..model.steps import EncodeSteps
from ..runtime.dynamo import make_runtime
from ..runtime.process import Lifecycle, parse_settings, run
from .dynamo_server import DynamoServer
from .http_app import start_http
from .pipeline import EncodeService
from .settings import WorkerSettings
from .stock_encode import StockEncoder

log = logging.getLogger(__name__)


class Worker:
    """Owns the encoder (its `EncodeSteps`), the service and its transports; `start()` then `stop()`."""

    def __init__(self, settings: WorkerSettings, encoder: Encoder | None = None):
        """`encoder`: an already loaded model (tests, the demo); the settings' limits and batch cap
        apply to it as they would to one the worker loads."""
        self.settings = settings
        self.encoder: EncodeSteps | None = None
        if encoder is not None:
            self.encoder = encoder.steps.configured(limits=settings.media_limits(),
                                                    batch_max_patches=settings.batch_max_patches)
        self.service: EncodeService | None = None
        self.http_runner: web.AppRunner | None = None
        self.http_port: int | None = None
        self.ops_runner: web.AppRunner | None = None  # with TLS: health and metrics in plaintext
        self.ops_port: int | None = None
        self.tls: ssl.SSLContext | None = None  # the HTTPS port's context (its files re-read by `reload_tls`)
        self.dynamo: DynamoServer | None = None
        self.stock: StockEncoder | None = None
        self._stopped: asyncio.Future[None] | None = None

    async def start(self) -> None:
        s = self.settings
        if self.encoder is None:
            self.encoder = await asyncio.to_thread(load_encoder, s)
        service = self.service = EncodeService(self.encoder, s)
        await service.start()
        if s.http_port >= 0:
            self.tls = s.server_context() if s.tls else None
            callers = frozenset(s.tls_allow) if s.tls else None
            self.http_runner, self.http_port = await start_http(service, s.http_host, s.http_port,
                                                                ssl_context=self.tls, callers=callers)
            scheme = "https" if s.tls else "http"
            log.info("HTTP on %s://%s:%d (POST /v1/encode)%s", scheme, s.http_host, self.http_port,
                     f"; callers: {', '.join(sorted(callers))}" if callers else "")
        if s.tls and s.ops_port >= 0:
            self.ops_runner, self.ops_port = await start_http(service, s.http_host, s.ops_port, ops=True)
        if s.dynamo:
            dynamo = self.dynamo = DynamoServer(service, make_runtime(asyncio.get_running_loop()), s.namespace)
            await dynamo.start()
            if s.stock_model_dir:  # also Dynamo's Encode worker, for the stock frontend (settings: needs --dynamo)
                self.stock = StockEncoder(service, dynamo.runtime, s.namespace, s.stock_model_dir, s.stock_name,
                                          s.handle_chain, s.handle_route)
                await self.stock.start()

    def reload_tls(self) -> None:
        """Rotation (SIGHUP): the HTTPS port's certificate read again; open connections keep theirs."""
        if self.tls is not None:
            self.settings.reload(self.tls)

    async def stop(self) -> None:
        """Graceful: refuse new work, let in-flight requests finish, then close the transports.
        Idempotent; concurrent callers all wait for the one shutdown."""
        if self.service is None:
            return
        if self._stopped is None:
            self._stopped = asyncio.ensure_future(self._stop(self.service))
        await asyncio.shield(self._stopped)

    async def _stop(self, service: EncodeService) -> None:
        timeout = self.settings.drain_timeout_s
        drained = asyncio.ensure_future(service.drain(timeout))
        if self.dynamo is not None:
            await self.dynamo.stop(timeout)  # shuts the runtime down: both Dynamo endpoints drain
        if self.stock is not None:
            await self.stock.stop(timeout)
        await drained
        for runner in (self.http_runner, self.ops_runner):
            if runner is not None:
                await runner.cleanup()
        await service.close()
        log.info("stopped")


def load_encoder(s: WorkerSettings) -> EncodeSteps:
    if s.torch_threads:
        import torch

        torch.set_num_threads(s.torch_threads)
    loaded = load(s.model, checkpoint=s.checkpoint, device=s.device, dtype=s.dtype)
    return EncodeSteps(loaded.spec, loaded.model, device=loaded.device, dtype=loaded.dtype, limits=s.media_limits(),
                       batch_max_patches=s.batch_max_patches)


async def serve(settings: WorkerSettings) -> None:
    """Run until SIGTERM/SIGINT, then stop gracefully (`Worker.stop`: drain, then the transports)."""
    async with Lifecycle("mm-encoder worker") as life:
        worker = Worker(settings)
        life.on_stop(worker.stop)
        life.on_reload(worker.reload_tls, files=(settings.tls_cert, settings.tls_key) if settings.tls else ())
        await worker.start()
        assert worker.encoder is not None  # start() loaded it
        ops = {"ops_port": worker.ops_port} if worker.ops_port is not None else {}
        life.ready(model=worker.encoder.spec.name, http_port=worker.http_port, dynamo=settings.dynamo,
                   tls=settings.tls, **ops)
        await life.wait()
        log.info("signal received: draining")


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(WorkerSettings, argv)
    return 2 if settings is None else run(serve(settings), settings.log_level)
