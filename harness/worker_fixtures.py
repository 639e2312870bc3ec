"""Servers for the worker tests: an in-process worker on a real loopback port, a media origin
that can hold its responses until the test releases them, and a per-test Dynamo file store; and for
the frontend's in-process tests, the real engine beside a worker on one Dynamo runtime, and the
processor in front of them.

"Gates" are test control, not mocks: they hold a real request at a known point (the origin's
response, or the device thread's forward) so a test can observe queueing, coalescing, cancelling
and draining without sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from mm_encoder.encode_worker.settings import WorkerSettings
from mm_encoder.worker import Worker


async def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `predicate()` on the loop until true; fail after `timeout` seconds (a readiness check)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)


@dataclass
class Origin:
    """An aiohttp media server on 127.0.0.1: `files[path] = bytes`; counts hits per path."""

    files: dict[str, bytes] = field(default_factory=dict)
    redirects: dict[str, str] = field(default_factory=dict)  # path -> Location
    hits: Counter = field(default_factory=Counter)
    gate: asyncio.Event | None = None  # when set to an unset Event, responses wait for it
    waiting: int = 0
    port: int = 0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    @property
    def allow(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.Response:
        path = request.match_info["path"]
        self.hits[path] += 1
        if self.gate is not None:
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        if path in self.redirects:
            raise web.HTTPFound(self.redirects[path])
        if path not in self.files:
            raise web.HTTPNotFound()
        return web.Response(body=self.files[path], content_type="application/octet-stream")


@asynccontextmanager
async def run_origin():
    origin = Origin()
    app = web.Application()
    app.router.add_get("/{path:.*}", origin.handle)
    runner = web.AppRunner(app, shutdown_timeout=1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    origin.port = runner.addresses[0][1]
    try:
        yield origin
    finally:
        if origin.gate is not None:
            origin.gate.set()
        await runner.cleanup()


@asynccontextmanager
async def run_worker(encoder, **overrides):
    """A Worker on an ephemeral loopback port, sharing the session's `tiny` encoder."""
    settings = WorkerSettings(_cli_parse_args=[], **{"http_port": 0, "drain_timeout_s": 5, **overrides})
    worker = Worker(settings, encoder=encoder)
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


class ForwardGate:
    """Holds every forward on the device thread until `release()`: test control of the real path."""

    def __init__(self, service):
        self.service = service
        self._event = threading.Event()
        self.entered = 0
        self._real = service.batcher._forward
        service.batcher._forward = self._forward

    def _forward(self, batch):
        self.entered += 1
        if not self._event.wait(timeout=30):
            raise TimeoutError("ForwardGate was never released")
        return self._real(batch)

    def release(self) -> None:
        self._event.set()


def metric(worker: Worker, name: str, labels: dict[str, str] | None = None) -> float:
    """An in-process worker's metric sample by its own labels (0 when absent); a deprecated 0.2 name
    reads its alias, as /metrics shows it."""
    metrics = worker.service.metrics
    found = metrics.own.get_sample_value(name, labels or {})
    if found is None:
        found = metrics.registry.get_sample_value(name, labels or {})
    return found or 0.0


def url_for(worker: Worker, path: str = "/v1/encode") -> str:
    return f"http://127.0.0.1:{worker.http_port}{path}"


async def post_json(session: aiohttp.ClientSession, worker: Worker, payload: dict, **headers):
    async with session.post(url_for(worker), json=payload, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


class Canary:
    """A TCP listener on loopback that only counts the connections it accepts."""

    def __init__(self):
        self.accepted = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def _on_connect(self, reader, writer):
        self.accepted += 1
        writer.close()

    async def settled_count(self) -> int:
        """Connections accepted so far, after a probe of our own has been accepted: the kernel
        hands out connections in order, so every earlier attempt has been counted by then."""
        before = self.accepted
        _, writer = await asyncio.open_connection("127.0.0.1", self.port)
        await wait_for(lambda: self.accepted > before, what="the canary's probe connection")
        writer.close()
        return self.accepted - 1


@asynccontextmanager
async def run_canary():
    canary = Canary()
    canary.server = await asyncio.start_server(canary._on_connect, "127.0.0.1", 0)
    canary.port = canary.server.sockets[0].getsockname()[1]
    try:
        yield canary
    finally:
        canary.server.close()
        await canary.server.wait_closed()


# --- the engine beside a worker, and the processor in front (tests/test_frontend_parts.py) ---------

SERVED = "kimi-k2.5-tiny"  # the served model name
SPEC = "kimi-k2.5-vision"  # the checkpoint's registry model


@asynccontextmanager
async def engine_for(checkpoint, publisher=None, rpc=None):
    """The real engine as its worker builds it (`build_engine`: the checkpoint's language model, its
    tokenizer and the registry's prompts), on CPU in fp32; its thread is shut down afterwards."""
    from mm_encoder.engines.process import EngineSettings, build_engine

    settings = EngineSettings(checkpoint=checkpoint, device="cpu", dtype="fp32", block_size=16)
    engine = await asyncio.to_thread(build_engine, settings, publisher, rpc)
    try:
        yield engine
    finally:
        engine._pool.shutdown(wait=True)


@asynccontextmanager
async def engine_beside_worker(encoder, checkpoint, tmp_path, monkeypatch, **worker):
    """A real encode worker (Dynamo RPC, `worker` overriding its settings) and the real engine
    fetching bodies from it by handle, registered as `kimi-k2.5-tiny`, on one Dynamo runtime in this
    process, through the package's Dynamo seam (`runtime.dynamo`) as the engine process uses it. Yields
    (runtime, rpc client of the worker, engine)."""
    from mm_encoder.runtime.dynamo import kv_event_publisher, register_engine

    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path / "kv"))
    monkeypatch.setenv("DYN_TCP_RPC_HOST", "127.0.0.1")
    async with run_worker(encoder, dynamo=True, **worker) as w:
        rt = w.dynamo.runtime
        endpoint = rt.endpoint("mm.engine.generate")
        rpc = await rt.endpoint("mm.mm_encoder.encode").client()
        await asyncio.wait_for(rpc.wait_for_instances(), 30)
        async with engine_for(checkpoint, kv_event_publisher(endpoint, 16), rpc) as engine:
            serving = asyncio.ensure_future(endpoint.serve_endpoint(engine.respond))
            try:
                await register_engine(endpoint, str(checkpoint), SERVED, 16)
                yield rt, rpc, engine
            finally:
                serving.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await serving


async def processor_beside(rt, rpc, tokenizer, wrap=None):
    """The processor for `kimi-k2.5-tiny` (spec `kimi-k2.5-vision`) over the runtime's engine
    endpoint (its client passed through `wrap` if given), once the KV router sees the engine."""
    from dynamo.llm import KvRouter, KvRouterConfig

    from mm_encoder.client.encoder import EncoderClient
    from mm_encoder.core.registry import get_spec
    from mm_encoder.frontend.processor import Limits, MultimodalProcessor

    endpoint = rt.endpoint("mm.engine.generate")
    client = await endpoint.client()
    await asyncio.wait_for(client.wait_for_instances(), 30)
    router = KvRouter(endpoint, 16, KvRouterConfig())
    await until_routable(router)
    return MultimodalProcessor(
        served_name=SERVED, spec=get_spec(SPEC), tokenizer=tokenizer,
        encoder=EncoderClient(SPEC, rpc_client=rpc, namespace="mm"), router=router,
        engine_client=wrap(client) if wrap else client, block_size=16, eos_token_ids=[],
        limits=Limits(context_length=256))


class MeasuredClient:
    """An engine client passing requests through, recording each one (`payloads`) and its msgpack size (`sizes`)."""

    def __init__(self, client):
        self.client = client
        self.sizes: list[int] = []
        self.payloads: list[dict] = []

    def instance_ids(self):
        return self.client.instance_ids()

    async def direct(self, payload, worker):
        import msgpack

        self.sizes.append(len(msgpack.packb(payload)))
        self.payloads.append(payload)
        return await self.client.direct(payload, worker)


async def until_routable(router, timeout: float = 30.0) -> None:
    """The router learns about engines asynchronously: poll a query-only best_worker (a readiness check)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            await router.best_worker([1, 2, 3])
            return
        except Exception:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.02)
