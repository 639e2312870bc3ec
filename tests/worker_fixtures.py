"""Servers for the worker tests: an in-process worker on a real loopback port, a media origin
that can hold its responses until the test releases them, and a per-test Dynamo file store.

"Gates" are test control, not mocks: they hold a real request at a known point (the origin's
response, or the device thread's forward) so a test can observe queueing, coalescing, cancelling
and draining without sleeping.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from mm_encoder.service.settings import WorkerSettings
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
