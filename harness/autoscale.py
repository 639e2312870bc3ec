"""Driving an autoscaling graph from outside: a load of unique images (every answer kept: status,
Retry-After, latency, or the error that lost it) and decisions published as an encode planner
publishes them (Dynamo's VirtualConnector through `runtime.dynamo`, in a process of its own)."""

from __future__ import annotations

import contextlib
import json
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

from harness.media_factory import image_bytes, natural_image
from harness.processes import Process
from harness.serve_fixtures import MODEL, data_url

DECIDE = """
import asyncio, sys
from mm_encoder.runtime.dynamo import encoder_target, make_runtime, planner_connector
async def main(namespace, count):
    runtime = make_runtime(asyncio.get_running_loop())
    connector = planner_connector("virtual", runtime, namespace, "test", "encoder")
    await connector.async_init()
    await connector.set_component_replicas([encoder_target("encoder", count)], blocking=False)
    print("published", flush=True)
    await asyncio.Event().wait()  # until the test stops this process
asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def wait_until(what: str, check, timeout: float):
    """`check()`'s first true value, asked every 0.2 s; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@contextlib.contextmanager
def deciding(namespace: str, count: int, runtime_env: dict[str, str],
             tls_env: dict[str, str] | None = None) -> Iterator[None]:
    """`count` encoders for `namespace`, published as a running planner publishes it, for the block's
    length: the decision lives in etcd under the publisher's lease, so it stays up until the
    executor has acted (a restarted coordinator's decision may even look acknowledged already:
    its ids start from 0 again)."""
    env = {**runtime_env, "DYN_DISCOVERY_BACKEND": "etcd", "DYN_REQUEST_PLANE": "tcp", "DYN_LOG": "error",
           "PATH": "/usr/bin:/bin", **(tls_env or {})}
    proc = Process([sys.executable, "-c", DECIDE, namespace, str(count)], name=f"decide {count}", env=env)
    try:
        proc.wait_for("published", 120)
        yield
    finally:
        proc.stop()


@dataclass
class Answer:
    at: float  # seconds since the load started
    status: int | None  # None: lost (no HTTP answer at all)
    latency_s: float
    retry_after: str | None = None
    error: str = ""
    ttft_s: float | None = None  # streamed 200s: seconds to the first chunk carrying generated content


@dataclass
class Load:
    """`clients` threads, each sending chat requests with a new image (`side` x `side`: a photo-like
    base with the request's number stamped into its pixels, so no two are alike) until stopped or
    `max_requests` in all; bounded in count and time (`max_s`). `stream`: streamed requests (usage
    included), each 200 with its time to first token. `active` clients send (all by default);
    `set_clients(n)` changes that during the run (a ramp): a thread whose index is `n` or more idles
    until it is let in again or the load ends. `tenant_header`: a tenant-serving frontend's header,
    client i sending as tenant-i."""

    port: int
    clients: int = 2
    side: int = 448
    max_requests: int = 2000
    max_s: float = 600.0
    stream: bool = False
    max_tokens: int = 2
    active: int | None = None
    answers: list[Answer] = field(default_factory=list)
    tls: ssl.SSLContext | None = None  # a TLS graph's frontend: HTTPS with this context
    tenant_header: str | None = None

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Condition()
        self._sent = 0
        self.active = self.clients if self.active is None else max(0, min(self.active, self.clients))
        self._bases: dict[int, bytes] = {}
        self.started = time.monotonic()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.clients)]
        for t in self._threads:
            t.start()

    def set_clients(self, n: int) -> None:
        """From now on `n` clients send (at most `clients`); the others finish their request and idle."""
        with self._lock:
            self.active = max(0, min(n, self.clients))
            self._lock.notify_all()

    def _over(self) -> bool:
        return self._stop.is_set() or self._sent >= self.max_requests or time.monotonic() - self.started > self.max_s

    def _next(self, index: int) -> int | None:
        """The next request's number for client `index` (waiting while it is not active); None: the end."""
        with self._lock:
            while not self._over() and index >= (self.active or 0):
                self._lock.wait(0.5)
            if self._over():
                return None
            self._sent += 1
            return self._sent

    def _image(self, n: int) -> bytes:
        """Request `n`'s JPEG: one of 4 photo-like bases, with `n` written into a corner as pixels."""
        import numpy as np
        from PIL import Image

        k = n % 4
        if k not in self._bases:
            self._bases[k] = np.asarray(natural_image(self.side, self.side, seed=k)).tobytes()
        pixels = np.frombuffer(self._bases[k], np.uint8).reshape(self.side, self.side, 3).copy()
        for bit in range(24):  # 24 squares of 8 x 8, black or white by the bits of n
            pixels[:8, 8 * bit:8 * bit + 8] = 255 if (n >> bit) & 1 else 0
        pixels[8:16, :16] = (n * 37 % 256, n * 91 % 256, n * 53 % 256)
        return image_bytes(Image.fromarray(pixels, "RGB"), "JPEG")

    def _request(self, n: int, index: int = 0) -> urllib.request.Request:
        body: dict = {"model": MODEL, "max_tokens": self.max_tokens, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(self._image(n), "image/jpeg")}},
            {"type": "text", "text": "what is it?"}]}]}
        if self.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        scheme = "https" if self.tls is not None else "http"
        tenant = {self.tenant_header: f"tenant-{index}"} if self.tenant_header else {}
        return urllib.request.Request(f"{scheme}://127.0.0.1:{self.port}/v1/chat/completions",
                                      data=json.dumps(body).encode(), headers={"Content-Type": "application/json",
                                                                               **tenant})

    def _client(self, index: int) -> None:
        while (n := self._next(index)) is not None:
            req = self._request(n, index)
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(req, timeout=300, context=self.tls) as r:
                    ttft = _first_token(r, t0) if self.stream else None
                    if not self.stream:
                        r.read()
                    answer = Answer(t0 - self.started, r.status, time.monotonic() - t0, ttft_s=ttft)
            except urllib.error.HTTPError as e:
                answer = Answer(t0 - self.started, e.code, time.monotonic() - t0, e.headers.get("Retry-After"),
                                e.read().decode(errors="replace")[:300])
            except (OSError, ValueError) as e:
                answer = Answer(t0 - self.started, None, time.monotonic() - t0, error=f"{type(e).__name__}: {e}")
            with self._lock:
                self.answers.append(answer)

    def count(self) -> int:
        with self._lock:
            return len(self.answers)

    def stop(self) -> list[Answer]:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        for t in self._threads:
            t.join(320)
        return self.answers


def _first_token(r, t0: float) -> float | None:
    """Reads a streamed answer (SSE) to its end; the seconds from `t0` to the first chunk carrying
    generated content. A stream that ends without `[DONE]` or a usage chunk raises ValueError (a
    200 cut short is not an answer)."""
    ttft, usage, done = None, False, False
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            done = True
            continue
        event = json.loads(line[6:])
        usage = usage or bool(event.get("usage"))
        if ttft is None and any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
            ttft = time.monotonic() - t0
    if not (done and usage):
        raise ValueError(f"a streamed 200 cut short (done={done}, usage={usage})")
    return ttft
