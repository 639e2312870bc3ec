"""A model cluster's way to its encoder site: the cluster tier's breaker as the plan and the nginx config
state it, the fallback encoder a cluster may name, the chain's reading of the tier's typed 503 (an
aiohttp server stands in for the tier; a stub for Dynamo's client), and a real tier on loopback whose
stand-in site goes away and comes back. With real hosts and a cut link: tests/reliability/test_site_faults.py."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest
from aiohttp import web

from harness.topology import free_port, require_nginx, tiers
from mm_encoder.cache_tiers.config import TierConfig
from mm_encoder.cache_tiers.nginx import render
from mm_encoder.client.chain import EncoderChain
from mm_encoder.core.errors import EncoderSiteUnreachable, RemoteError
from mm_encoder.core.requests import EncodeRequest
from mm_encoder.graph.plan import plan
from mm_encoder.graph.schema import Graph, load_graph
from mm_encoder.graph.shipped import graphs_dir
from mm_encoder.serve.site import LocalSite

SITE = "198.18.0.1:8090"


def cluster_graph(tls: bool = False, fallback: bool = False) -> Graph:
    """graphs/model-cluster.yaml as `serve --encoder-site` makes it, with TLS, with a fallback encoder."""
    g = load_graph(graphs_dir() / "model-cluster.yaml").model_dump()
    g["encoder_site"]["url"] = f"{'https' if tls else 'http'}://{SITE}"
    if tls:
        g["tls"] |= {"enabled": True, "trust_domain": "example.org"}
    if fallback:
        g["components"]["fallback"] = {"kind": "encoder"}
    return Graph.model_validate(g)


def tier_of(g, tmp_path) -> TierConfig:
    cp = next(c for c in plan(g, LocalSite(g, tmp_path)) if c.kind == "cache-cluster")
    assert cp.replicas[0].tier is not None
    return cp.replicas[0].tier


def test_a_model_clusters_tier_breaks_its_circuit_to_the_site(tmp_path):
    cfg = tier_of(cluster_graph(), tmp_path)
    assert cfg.site_breaker and (cfg.connect, cfg.timeout, cfg.site_retry_s) == ("2s", "60s", 5)
    conf = render(cfg, "/usr/lib/nginx/modules")
    assert conf.count(f"server {SITE} max_fails=1 fail_timeout=5s;") == 4  # twice in each upstream
    assert "zone mm_next_peers 64k;" in conf and "zone mm_direct_peers 64k;" in conf  # one breaker, all workers
    assert "proxy_next_upstream error non_idempotent;" in conf  # a 503 there is the site's answer: not retried
    assert "proxy_connect_timeout 2s;" in conf and "proxy_read_timeout 60s;" in conf
    assert "error_page 502 504 = @mm_site_unreachable;" in conf
    named = conf[conf.index("location @mm_site_unreachable"):]
    assert "add_header Retry-After 5 always;" in named and "X-MM-Error-Code encoder_site_unreachable" in named
    assert re.search(r"return 503 '\{\"error\": \{\"code\": \"encoder_site_unreachable\"", named)


def test_other_tiers_keep_their_retries_and_never_mark_a_server_down(tmp_path):
    cfg = TierConfig(tier="cluster", next=("127.0.0.1:1",), run_dir=tmp_path, cache_dir=tmp_path / "c")
    conf = render(cfg, "/usr/lib/nginx/modules")
    assert conf.count("max_fails=0;") == 4 and "fail_timeout" not in conf and "@mm_site_unreachable" not in conf
    assert "proxy_next_upstream error http_503 non_idempotent;" in conf and "proxy_connect_timeout 5s;" in conf
    assert "proxy_read_timeout 1500s;" in conf
    options = TierConfig(tier="cluster", next=("127.0.0.1:1",), site_breaker=True, site_retry_s=9,
                         connect_timeout="3s", read_timeout="300s")
    assert (options.connect, options.timeout) == ("3s", "300s")
    with pytest.raises(ValueError, match="site-breaker"):
        TierConfig(tier="shared", next=("127.0.0.1:1",), site_breaker=True)


def test_a_model_cluster_may_name_a_fallback_encoder_off_the_tiers_path(tmp_path):
    g = cluster_graph(tls=True, fallback=True)
    cfg = tier_of(g, tmp_path)
    assert cfg.next == cfg.direct == (SITE,)  # the fallback is never behind the tier
    assert cfg.tls_server_name == "cache-router.encoder-site.example.org"  # the site's router, not the fallback
    kinds = [c.kind for c in plan(g, LocalSite(g, tmp_path))]
    assert "encoder" in kinds
    with pytest.raises(ValueError, match="runs no cache-router"):
        Graph.model_validate({**g.model_dump(), "components": {**g.model_dump()["components"],
                                                                "router": {"kind": "cache-router"}}})


class Rpc:
    """Dynamo's client to the cluster's own encoders: `n` registered, each answer an error we can see."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def instance_ids(self) -> list[int]:
        return list(range(self.n))

    async def round_robin(self, request: dict):
        self.calls += 1
        raise RemoteError("the fallback answered", "fallback_reached", 418)


async def test_the_chain_reads_the_tiers_typed_503_and_falls_back_only_to_a_registered_encoder():
    async def unreachable(request: web.Request) -> web.Response:
        return web.json_response({"error": {"code": "encoder_site_unreachable", "message": "down"}}, status=503,
                                 headers={"X-MM-Error-Code": "encoder_site_unreachable", "X-MM-Error": "down",
                                          "Retry-After": "5"})

    app = web.Application()
    app.router.add_route("*", "/v1/encode", unreachable)
    app.router.add_route("*", "/v1/encode/fetch", unreachable)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    source = EncodeRequest(model="tiny", url="https://media.test/a.png")
    try:
        for rpc in (None, Rpc(0)):
            chain = EncoderChain(http_url=f"http://127.0.0.1:{port}", rpc_client=rpc)
            with pytest.raises(EncoderSiteUnreachable) as e:
                await chain.describe(source)
            assert e.value.http_status == 503 and e.value.message == "down"
            await chain.close()
        rpc = Rpc(1)
        chain = EncoderChain(http_url=f"http://127.0.0.1:{port}", rpc_client=rpc)
        with pytest.raises(RemoteError, match="fallback answered"):
            await chain.fetch(source)
        assert rpc.calls == 1 and chain.fallbacks == 1
        await chain.close()
    finally:
        await runner.cleanup()


async def _origin(port: int) -> web.AppRunner:
    """The encoder site as the tier sees it: 200 with the body it was sent."""
    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=b"encoded:" + await request.read())

    app = web.Application()
    app.router.add_post("/v1/encode", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def test_a_real_tier_serves_hits_refuses_misses_at_once_and_lets_the_site_back_in(tmp_path):
    """Real nginx on loopback, the site a stand-in that goes away and comes back on its port: a stopped
    site is refused at once (the kernel's RST; a cut link is tests/reliability/test_site_faults.py)."""
    require_nginx()
    port = free_port()
    site = await _origin(port)
    async with tiers() as start, aiohttp.ClientSession() as s:
        tier = await start(tmp_path, "cluster", "cluster", "--next", f"127.0.0.1:{port}", "--site-breaker",
                           "--site-retry-s", "2", workers=2)

        async def post(body: bytes) -> tuple[int, dict, bytes, float]:
            t0 = time.monotonic()
            async with s.post(tier.url(), data=body) as r:
                return r.status, dict(r.headers), await r.read(), time.monotonic() - t0

        assert (await post(b"kept"))[0] == 200
        await site.cleanup()  # the site is gone
        hit = await post(b"kept")
        assert hit[0] == 200 and hit[1]["X-Cache-Status"] == "cluster=HIT" and hit[2] == b"encoded:kept"
        for i in range(5):  # the first marks both entries down; the rest are answered without trying
            status, headers, body, seconds = await post(f"new {i}".encode())
            assert status == 503 and seconds < 1, (status, headers, body)
            assert headers["X-MM-Error-Code"] == "encoder_site_unreachable" and headers["Retry-After"] == "2"
            assert b'"code": "encoder_site_unreachable"' in body
        # the breaker's answers are counted as upstream errors (nginx counts a request after its answer)
        deadline = time.monotonic() + 5
        while (stats := tier.stats())["requests"] < 7 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert stats["requests"] == 7 and stats["clusters"]["unknown"]["errors"] == 5, stats

        site = await _origin(port)  # back on its port: one probe after --site-retry-s lets it in
        try:
            t0 = time.monotonic()
            while (await post(b"after"))[0] != 200:
                assert time.monotonic() - t0 < 2 + 3, "the breaker never closed"
                await asyncio.sleep(0.2)
        finally:
            await site.cleanup()
