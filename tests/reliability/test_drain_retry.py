"""A draining encoder costs no request (docs/cache-tiers.md, "Retries").

- A real nginx tier in front of two real encode workers, one of them draining (its service's own
  `drain`: every request answered 503 `draining`, as on a scale-down): every request is answered 200;
  those sent to the draining worker first were asked again of the other, as the tier's log shows.
- `overloaded` from every encoder (loopback aiohttp servers answering the worker's own 503, made by
  its `error_response`): each encoder is asked once per request, the 503 is passed on with its
  Retry-After and never cached, and the encoders are still asked afterwards (nginx never marks them
  down, which would answer 502 to everything for its fail_timeout).
- A lone next-level server (a Kubernetes Service) is asked again on a new connection.
- `EncoderChain` asks again at once when the chain answers `draining`, a bounded number of times,
  and never for another error.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
import msgpack
import pytest
from aiohttp import web

from harness.media_factory import image_bytes, natural_image
from harness.topology import require_nginx, tiers
from harness.worker_fixtures import metric, run_worker
from mm_encoder import wire
from mm_encoder.client.chain import DRAINING_TRIES, EncoderChain
from mm_encoder.core.errors import Draining, Overloaded, RemoteError
from mm_encoder.core.requests import EncodeRequest
from mm_encoder.encode_worker.http_app import error_response

REQUESTS = 24
DRAINING = Draining("this worker is shutting down; retry on another replica")
OVERLOADED = Overloaded("the encode queue is full (64 items); retry after 1 s or on another replica")


def body_for(seed: int) -> bytes:
    return msgpack.packb({"model": "tiny", "data": image_bytes(natural_image(48, 32, seed=seed))})


def requests(worker, outcome: str) -> float:
    return metric(worker, "dynamo_component_encode_requests_total", {"transport": "http", "outcome": outcome})


async def post(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    async with session.post(url, data=body, headers={"Content-Type": "application/msgpack"}) as r:
        return r.status, dict(r.headers), await r.read()


@asynccontextmanager
async def stand_in(answer: Callable[[int], web.Response]) -> AsyncIterator[dict]:
    """A loopback HTTP server on /v1/encode and /v1/encode/fetch: its n-th request (from 1) gets
    `answer(n)`; it records each request's client port and X-Cache-Route."""
    state: dict = {"asked": 0, "ports": [], "routes": []}

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        state["asked"] += 1
        peer = request.transport.get_extra_info("peername") if request.transport else None
        state["ports"].append(peer[1] if peer else None)
        state["routes"].append(request.headers.get("X-Cache-Route"))
        return answer(state["asked"])

    app = web.Application()
    app.router.add_route("*", "/v1/encode", handle)
    app.router.add_route("*", "/v1/encode/fetch", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    state["address"] = f"127.0.0.1:{port}"
    state["url"] = f"http://127.0.0.1:{port}/v1/encode"
    try:
        yield state
    finally:
        await runner.cleanup()


def access_lines(log) -> list[dict]:
    """The tier's JSON line per encode request (its log)."""
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"time"')]


async def logged(log, n: int, timeout: float = 10.0) -> list[dict]:
    """The tier's first `n` access lines, once written: nginx logs a request after its answer has gone."""
    deadline = asyncio.get_running_loop().time() + timeout
    while len(lines := access_lines(log)) < n:
        assert asyncio.get_running_loop().time() < deadline, f"{len(lines)} of {n} access lines after {timeout} s"
        await asyncio.sleep(0.05)
    return lines


async def test_a_tier_asks_another_encoder_when_one_is_draining(tiny, tmp_path):
    require_nginx()
    async with run_worker(tiny) as leaving, run_worker(tiny) as staying, tiers() as start, \
            aiohttp.ClientSession() as s:
        assert await leaving.service.drain(5)  # nothing in flight: it refuses from now on, as on SIGTERM
        addresses = [f"127.0.0.1:{w.http_port}" for w in (leaving, staying)]
        tier = await start(tmp_path, "shared", "shared", *[a for x in addresses for a in ("--next", x)])
        async def one_by_one() -> list[tuple[int, dict[str, str], bytes]]:
            return [await post(s, tier.url(), body_for(seed)) for seed in range(REQUESTS)]

        answers = await asyncio.wait_for(one_by_one(), 120)
        assert [a[0] for a in answers] == [200] * REQUESTS
        assert len({wire.decode(a[2]).mm_hash for a in answers}) == REQUESTS
        assert {a[1]["X-Cache-Status"] for a in answers} == {"shared=MISS"}
        assert requests(staying, "ok") == REQUESTS and requests(leaving, "ok") == 0
        # each request the draining worker refused was asked again of the other: nginx's $upstream_addr
        # names both ("a, b") for those, the staying worker alone for the rest
        upstreams = Counter(line["upstream"] for line in await logged(tier.log, REQUESTS))
        assert upstreams == {f"{addresses[0]}, {addresses[1]}": requests(leaving, "draining"),
                             addresses[1]: REQUESTS - requests(leaving, "draining")}
        assert requests(leaving, "draining") >= REQUESTS // 4  # round robin: it was asked its share first


async def test_overload_is_asked_of_another_encoder_then_passed_on_never_cached(tmp_path):
    require_nginx()
    async with stand_in(lambda n: error_response(OVERLOADED, retry_after=1)) as a, \
            stand_in(lambda n: error_response(OVERLOADED, retry_after=1)) as b, \
            tiers() as start, aiohttp.ClientSession() as s:
        tier = await start(tmp_path, "shared", "shared", "--next", a["address"], "--next", b["address"])
        for n in range(1, 4):  # the same body each time: a 503 is never an entry
            status, headers, body = await post(s, tier.url(), body_for(1))
            assert (status, headers["X-MM-Error-Code"], headers["Retry-After"]) == (503, "overloaded", "1")
            assert json.loads(body) == OVERLOADED.to_dict() and headers["X-Cache-Status"] == "shared=MISS"
            assert (a["asked"], b["asked"]) == (n, n)  # both asked once per request; neither marked down


async def test_a_lone_next_level_is_asked_again_on_a_new_connection(tmp_path):
    """One --next address (a Kubernetes Service): asked twice, the second time on a new connection,
    since the draining answer closed the first."""
    require_nginx()
    ok = b"wire body"
    async with stand_in(lambda n: error_response(DRAINING, 1) if n == 1 else web.Response(body=ok)) as lone, \
            tiers() as start, aiohttp.ClientSession() as s:
        tier = await start(tmp_path, "cluster", "cluster", "--next", lone["address"])
        status, headers, body = await post(s, tier.url(), body_for(2))
        assert (status, body, headers["X-Cache-Status"]) == (200, ok, "cluster=MISS")
        assert lone["asked"] == 2 and len(set(lone["ports"])) == 2


# --- EncoderChain --------------------------------------------------------------------------------

SOURCE = EncodeRequest(model="tiny", url="https://media.test/cat.png")


async def test_the_chain_asks_again_when_the_encoder_is_draining():
    body = b"the wire body"
    async with stand_in(lambda n: error_response(DRAINING, 1) if n == 1 else web.Response(body=body)) as once:
        chain = EncoderChain(http_url=once["url"], route="shared")
        try:
            assert await chain.fetch(SOURCE) == (body, "http:")
        finally:
            await chain.close()
        assert (once["asked"], chain.draining_retries) == (2, 1)


async def test_the_chain_asks_a_bounded_number_of_times_and_only_while_draining():
    async with stand_in(lambda n: error_response(DRAINING, 1)) as always, \
            stand_in(lambda n: error_response(OVERLOADED, 1)) as busy:
        for server, code, asked in ((always, "draining", DRAINING_TRIES), (busy, "overloaded", 1)):
            chain = EncoderChain(http_url=server["url"], route="shared")
            try:
                with pytest.raises(RemoteError) as e:
                    await chain.fetch(SOURCE)
            finally:
                await chain.close()
            assert (e.value.code, e.value.http_status) == (code, 503)
            assert server["asked"] == asked and chain.draining_retries == asked - 1
