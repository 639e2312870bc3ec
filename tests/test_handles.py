"""Embeddings by handle (`core.handle`): a real encode worker (in-process, HTTP) behind a real nginx
cluster tier, a real media origin on loopback. The frontend's side asks for headers only (HEAD);
the engine's side fetches the body and checks it against the handle."""

from __future__ import annotations

import asyncio
import hashlib
import json

import aiohttp
import pytest
import torch

from harness.media_factory import image_bytes, natural_image
from harness.topology import require_nginx, tiers
from harness.worker_fixtures import metric, run_origin, run_worker
from mm_encoder import wire
from mm_encoder.client import EncoderChain, HandleResolver
from mm_encoder.core.errors import HandleError, RemoteError
from mm_encoder.core.handle import MediaHandle
from mm_encoder.core.requests import EncodeRequest, cache_key

IMG = image_bytes(natural_image(112, 84, seed=31))
OTHER = image_bytes(natural_image(112, 84, seed=32))


def forwards(worker) -> float:
    return metric(worker, "dynamo_component_encode_forward_items_total", {})


async def tier_stats(tier) -> dict:
    async with aiohttp.ClientSession() as s, s.get(tier.url("/_cache/stats")) as r:
        return json.loads(await r.text())


async def evict_everywhere(tier, worker, tmp_path, requests: int) -> None:
    """Forget every entry at every level: the tier's cache files (once its `requests` requests have
    finished, so no fill is still writing) and the worker's LRUs."""
    await wait_for_stat(tier, "requests", requests)
    for f in (tmp_path / "cache-cluster").rglob("*"):
        if f.is_file():
            f.unlink()
    worker.service.bodies.clear()
    worker.service.alias.clear()


@pytest.fixture
async def stack(tiny, tmp_path):
    """origin -> worker -> cluster tier; yields (origin, worker, tier)."""
    require_nginx()
    async with run_origin() as origin, run_worker(tiny, fetch_allow_hosts=[origin.allow]) as w, tiers() as start:
        tier = await start(tmp_path, "cluster", "cluster", "--next", f"127.0.0.1:{w.http_port}")
        yield origin, w, tier


async def test_describe_sends_headers_only_and_the_engine_fetches_the_cached_body(stack):
    origin, w, tier = stack
    origin.files["a.png"] = IMG
    chain = EncoderChain(http_url=tier.url(""), route="cluster")
    source = EncodeRequest(model="tiny", url=origin.url("a.png"), modality="image")
    try:
        header, where = await chain.describe(source)
        assert where == "http:cluster=MISS" and chain.body_bytes == 0  # the tier fetched and kept the body
        assert header.modality == "image" and header.tokens_per_grid == [12]
        handle = MediaHandle.build(header, source, chain=chain.http_url, route="cluster", rpc=None)
        doc = json.dumps(handle.to_dict())
        assert len(doc) < 1024  # a few hundred bytes, whatever the embeddings' size
        resolver = HandleResolver([tier.url("")])
        body = await resolver.body(MediaHandle.parse(json.loads(doc)))
        assert wire.peek(body).mm_hash == handle.mm_hash == header.mm_hash
        assert (await tier_stats(tier)).get("HIT") == 1  # the engine's fetch: no second trip to the worker
        assert forwards(w) == 1 and origin.hits["a.png"] == 1
        await resolver.close()
    finally:
        await chain.close()


async def described(tier, origin, name: str) -> MediaHandle:
    """The frontend's side: a handle for origin's `name`, from headers only (HEAD through the tier)."""
    origin.files[name] = IMG
    chain = EncoderChain(http_url=tier.url(""), route="cluster")
    source = EncodeRequest(model="tiny", url=origin.url(name))
    try:
        header, _ = await chain.describe(source)
    finally:
        await chain.close()
    return MediaHandle.build(header, source, chain=chain.http_url, route="cluster", rpc=None)


async def test_an_entry_evicted_everywhere_is_re_encoded_once_to_the_same_bytes(stack, tmp_path):
    origin, w, tier = stack
    handle = await described(tier, origin, "b.png")
    resolver = HandleResolver([tier.url("")])
    try:
        first = await resolver.body(handle)
        await evict_everywhere(tier, w, tmp_path, requests=2)  # between handle and fetch
        again = await resolver.body(handle)
        assert again == first  # deterministic re-encode: byte-identical body
        assert forwards(w) == 2 and origin.hits["b.png"] == 2
    finally:
        await resolver.close()


async def test_a_handle_whose_source_now_serves_other_bytes_is_refused(stack, tmp_path):
    origin, w, tier = stack
    handle = await described(tier, origin, "c.png")
    resolver = HandleResolver([tier.url("")])
    try:
        origin.files["c.png"] = OTHER  # the URL changed content, and every cache forgot it
        await evict_everywhere(tier, w, tmp_path, requests=1)
        with pytest.raises(HandleError, match="not what the handle announced"):
            await resolver.body(handle)
    finally:
        await resolver.close()


def _handle(**changes) -> dict:
    body = wire.encode(mm_hash="ab" * 32, model="tiny", modality="image", embeds=torch.zeros(12, 8),
                       grid_thws=[[1, 6, 8]])
    source = EncodeRequest(model="tiny", url="https://media.test/x.png")
    doc = MediaHandle.build(wire.peek(body), source, chain="http://127.0.0.1:9/v1/encode", route="cluster",
                            rpc=None).to_dict()
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        target = doc
        for p in parents:
            target = target[p]
        target[leaf] = value
    return doc


@pytest.mark.parametrize("changes, message", [
    ({"mm_hash": "cd" * 32}, "disagree with its header"),  # tampered mm_hash
    ({"meta.mm_hash": "cd" * 32}, "disagree with its header"),
    ({"key": "0" * 64}, "not its source's key"),  # a 0.1 peer's key that is not the request's: would poison a tier
    ({"num_tokens": [13]}, "disagree with its header"),  # a 0.1 peer's token counts that are not the header's
    ({"meta.length": 99}, "length"),
    ({"v": 2}, "malformed"),
    ({"route": "cluster;rm -rf"}, "malformed"),
    ({"source.data": "aGk="}, "source.data: Input should be a valid bytes"),  # JSON: never raw bytes
    ({"source.url": None, "source.data": b"hi"}, "source: Value error, a handle's source names its media by `url`"),
    ({"source.extra": 1}, "source.extra: Extra inputs are not permitted"),
])
def test_a_tampered_or_malformed_handle_is_refused_before_any_fetch(changes, message):
    MediaHandle.parse(_handle())  # the untouched one is fine
    with pytest.raises(HandleError, match=message):
        MediaHandle.parse(_handle(**changes))


def test_a_handle_carries_each_fact_once_and_parses_a_01_peers_handle():
    """`key` and `num_tokens` (0.1 handles) are derived, not carried: a 0.1 frontend's handle still
    parses when they agree with what they derive from (a rolling upgrade: engines first), and the
    header is parsed once per handle."""
    doc = _handle()
    assert sorted(doc) == ["chain", "meta", "mm_hash", "route", "source", "v"]
    handle = MediaHandle.parse(doc)
    assert handle.num_tokens == [12] and handle.header is handle.header
    legacy = {**doc, "key": handle.source.legacy_key(), "num_tokens": [12]}
    assert MediaHandle.parse(legacy) == handle and MediaHandle.parse(legacy).to_dict() == doc
    assert handle.source.legacy_key() == cache_key("tiny", None, "https://media.test/x.png", "")
    # the tiers' key now: the sha256 of the canonical body the chain sends, as a tier hashes it
    assert handle.source.body() == b'{"model":"tiny","scope":"","url":"https://media.test/x.png"}'
    assert handle.source.key() == hashlib.sha256(handle.source.body()).hexdigest()


async def test_an_engine_fetches_only_from_chains_it_trusts():
    handle = MediaHandle.parse(_handle())
    with pytest.raises(HandleError, match="does not trust"):
        await HandleResolver(["http://127.0.0.1:1"]).body(handle)
    with pytest.raises(HandleError, match="no RPC client"):
        await HandleResolver().body(MediaHandle.parse(_handle(chain=None)))


async def test_an_engines_connection_pools_do_not_grow_with_the_routes_requests_name():
    """A handle's route comes from a request: 1,000 handles naming 1,000 routes through one trusted
    chain keep one chain and one connection; each route goes out as that call's X-Cache-Route. A
    stand-in chain on loopback answers every fetch."""
    from aiohttp import web

    seen: list[tuple[str | None, int]] = []

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        assert request.transport is not None
        seen.append((request.headers.get("X-Cache-Route"), request.transport.get_extra_info("peername")[1]))
        return web.Response(body=b"body")

    app = web.Application()
    app.router.add_post("/v1/encode/fetch", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    chain = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/encode"
    routes = ["r" + "".join(chr(97 + int(d)) for d in str(i)) for i in range(1000)]  # ra, rb, ..., rjjj
    header = wire.peek(wire.encode(mm_hash="ab" * 32, model="tiny", modality="image", embeds=torch.zeros(12, 8),
                                   grid_thws=[[1, 6, 8]]))
    source = EncodeRequest(model="tiny", url="https://media.test/x.png")
    resolver = HandleResolver([chain])
    try:
        for route in routes:
            handle = MediaHandle.build(header, source, chain=chain, route=route, rpc=None)
            assert await resolver.fetch(handle) == b"body"
        assert len(resolver._chains) == 1 and resolver.fetches == 1000
        assert [r for r, _ in seen] == routes and len({port for _, port in seen}) == 1
    finally:
        await resolver.close()
        await runner.cleanup()


async def test_a_handle_for_a_source_that_fails_gets_the_encoders_error(stack):
    origin, _, tier = stack
    source = EncodeRequest(model="tiny", url=origin.url("missing.png"))
    handle = MediaHandle.build(wire.peek(wire.encode(mm_hash="ab" * 32, model="tiny", modality="image",
                                                     embeds=torch.zeros(12, 8), grid_thws=[[1, 6, 8]])),
                               source, chain=tier.url("/v1/encode"), route="cluster", rpc=None)
    resolver = HandleResolver([tier.url("")])
    try:
        with pytest.raises(RemoteError) as e:
            await resolver.body(handle)
        assert e.value.code == "http_status" or 400 <= e.value.http_status < 500
        chain = EncoderChain(http_url=tier.url(""), route="cluster")
        with pytest.raises(RemoteError) as e2:  # HEAD: the code and message arrive in headers
            await chain.describe(source)
        await chain.close()
        assert e2.value.code == e.value.code and e2.value.message == e.value.message
    finally:
        await resolver.close()


async def test_a_long_videos_header_passes_the_tier_intact(tmp_path):
    """X-MM-Meta lists every chunk's grid and timestamp: for 1,000 chunks ~23 KB, past nginx's and
    aiohttp's default header sizes. A stand-in upstream answers it (the real worker would need a
    33-minute video to make one)."""
    from aiohttp import web

    require_nginx()
    n = 1000
    meta = {"mm_hash": "ab" * 32, "model": "tiny", "modality": "video", "dtype": "bfloat16", "shape": [n, 8],
            "grid_thws": [[4, 2, 2]] * n, "length": n,
            "timestamps": [f"{i * 2 // 3600:02d}:{i * 2 // 60 % 60:02d}:{i * 2 % 60:02d}.000" for i in range(n)]}
    text = json.dumps(meta, separators=(",", ":"))
    assert len(text) > 20_000

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"\0" * 1000, headers={"X-MM-Meta": text})

    app = web.Application()
    app.router.add_route("*", "/v1/encode", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with tiers() as start:
            tier = await start(tmp_path, "cluster", "cluster", "--next", f"127.0.0.1:{runner.addresses[0][1]}")
            chain = EncoderChain(http_url=tier.url(""), route="cluster")
            try:
                header, where = await chain.describe(EncodeRequest(model="tiny", url="https://m.test/long.mp4"))
            finally:
                await chain.close()
        assert where == "http:cluster=MISS" and len(header.grid_thws) == n and header.timestamps[-1] == "00:33:18.000"
    finally:
        await runner.cleanup()


async def test_an_engines_fetch_does_not_wait_on_a_fill_in_progress(tmp_path):
    """nginx wakes cache-lock waiters by polling every 500 ms: a fetch that arrives while the
    frontend's HEAD is still filling the entry asks the next level instead (`/v1/encode/fetch`,
    lock off). A stand-in upstream streams its body slowly and counts requests."""
    from aiohttp import web

    require_nginx()
    meta = {"mm_hash": "ab" * 32, "model": "tiny", "modality": "image", "dtype": "bfloat16", "shape": [12, 8],
            "grid_thws": [[1, 6, 8]], "length": 12, "timestamps": None}
    seen: list[str] = []
    release = asyncio.Event()

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        seen.append(request.path)
        r = web.StreamResponse(headers={"X-MM-Meta": json.dumps(meta), "Content-Length": "2000"})
        await r.prepare(request)
        await r.write(b"\0" * 1000)
        if len(seen) == 1:  # the HEAD's fill: the rest only once the test says so
            await release.wait()
        await r.write(b"\0" * 1000)
        return r

    app = web.Application()
    app.router.add_route("*", "/v1/encode", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    chain = None
    try:
        async with tiers() as start:
            tier = await start(tmp_path, "cluster", "cluster", "--next", f"127.0.0.1:{runner.addresses[0][1]}")
            chain = EncoderChain(http_url=tier.url(""), route="cluster")  # the frontend's
            engine = EncoderChain(http_url=tier.url(""), route="cluster")  # the engine's: its own connection
            source = EncodeRequest(model="tiny", url="https://m.test/slow.png")
            header, where = await chain.describe(source)  # headers back; the fill is still running
            assert where == "http:cluster=MISS" and header.length == 12
            body, where = await asyncio.wait_for(engine.fetch(source), 5)  # not behind the fill
            assert len(body) == 2000 and where == "http:cluster=MISS" and seen == ["/v1/encode", "/v1/encode"]
            release.set()
            await wait_for_stat(tier, "MISS", 2)
            body, where = await engine.fetch(source)
            assert where == "http:cluster=HIT" and len(seen) == 2
            await engine.close()
    finally:
        release.set()
        if chain is not None:
            await chain.close()
        await runner.cleanup()


async def wait_for_stat(tier, key: str, n: int, timeout: float = 10.0) -> None:
    """Until the tier's counter `key` reaches n (a request is counted when its log phase runs)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (await tier_stats(tier)).get(key, 0) < n:
        assert loop.time() < deadline, await tier_stats(tier)
        await asyncio.sleep(0.02)
