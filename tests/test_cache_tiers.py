"""nginx cache tiers and the shard router in front of the real encode worker (`tiny`), all real
processes on loopback. Where a test needs an origin that misbehaves (a 500 with Cache-Control,
or one that echoes the headers it received), a small aiohttp server stands in for the worker;
each such test says so."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
from collections import Counter

import aiohttp
import msgpack
import pytest
import yaml
from aiohttp import web
from pydantic import ValidationError

from harness.media_factory import image_bytes, natural_image
from harness.serve_fixtures import data_url
from harness.topology import free_port, require_nginx, tiers
from harness.worker_fixtures import ForwardGate, metric, run_worker, wait_for
from mm_encoder import wire
from mm_encoder.cache_tiers import nginx as cache_tiers
from mm_encoder.cache_tiers.config import TierConfig
from mm_encoder.cache_tiers.nginx import render
from mm_encoder.core.errors import CacheTierError
from mm_encoder.core.registry import config_dir


@pytest.fixture(autouse=True)
def _nginx():
    require_nginx()


def body_for(seed: int, size: tuple[int, int] = (96, 64)) -> bytes:
    return msgpack.packb({"model": "tiny", "data": image_bytes(natural_image(*size, seed=seed))})


async def post(session, url: str, body: bytes, **headers) -> tuple[int, dict, bytes]:
    headers = {"Content-Type": "application/msgpack", **headers}
    async with session.post(url, data=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


def forwards(worker) -> float:
    return metric(worker, "dynamo_component_encode_forward_items_total")


def worker_requests(worker, outcome: str = "ok") -> float:
    return metric(worker, "dynamo_component_encode_requests_total",
                                        {"transport": "http", "outcome": outcome})


async def test_two_tiers_and_router_report_miss_and_hit_per_tier(tiny, tmp_path):
    async with run_worker(tiny) as w, tiers() as start, aiohttp.ClientSession() as s:
        origin = f"127.0.0.1:{w.http_port}"
        s1 = await start(tmp_path, "s1", "shared", "--next", origin)
        s2 = await start(tmp_path, "s2", "shared", "--next", origin)
        router = await start(tmp_path, "router", "router", "--shard", s1.address, "--shard", s2.address)
        c1 = await start(tmp_path, "c1", "cluster", "--next", router.address, "--direct", origin)
        c2 = await start(tmp_path, "c2", "cluster", "--next", router.address, "--direct", origin)
        body = body_for(1)

        first = await post(s, c1.url(), body)
        assert first[0] == 200 and first[1]["X-Cache-Status"] == "cluster=MISS, shared=MISS"
        again = await post(s, c1.url(), body)
        assert again[1]["X-Cache-Status"] == "cluster=HIT"
        other_cluster = await post(s, c2.url(), body)
        assert other_cluster[1]["X-Cache-Status"] == "cluster=MISS, shared=HIT"
        assert first[2] == again[2] == other_cluster[2] and wire.decode(first[2]).model == "tiny"
        assert forwards(w) == 1 and worker_requests(w) == 1

        # X-Cache-Route names the chain: skip the shared tier, or skip this tier's cache.
        direct = await post(s, c1.url(), body_for(2), **{"X-Cache-Route": "cluster,direct"})
        assert direct[1]["X-Cache-Status"] == "cluster=MISS" and "X-Cache-Shard" not in direct[1]
        assert (await post(s, c1.url(), body_for(2)))[1]["X-Cache-Status"] == "cluster=HIT"
        shared_only = await post(s, c2.url(), body_for(3), **{"X-Cache-Route": "shared"})
        assert shared_only[1]["X-Cache-Status"] == "cluster=BYPASS, shared=MISS"
        assert (await post(s, c2.url(), body_for(3)))[1]["X-Cache-Status"] == "cluster=MISS, shared=HIT"
        # Legacy JSON is another representation: its own entry, never the v1 body.
        legacy = await post(s, c1.url(), body, Accept="application/json")
        assert legacy[1]["X-Cache-Status"] == "cluster=MISS, shared=MISS"
        assert json.loads(legacy[2])["mm_hash"] == wire.decode(first[2]).mm_hash


async def test_32_identical_concurrent_requests_make_one_encode(tiny, tmp_path):
    async with run_worker(tiny) as w, tiers() as start, aiohttp.ClientSession() as s:
        shard = await start(tmp_path, "s1", "shared", "--next", f"127.0.0.1:{w.http_port}")
        router = await start(tmp_path, "router", "router", "--shard", shard.address)
        cluster = await start(tmp_path, "c1", "cluster", "--next", router.address)
        gate = ForwardGate(w.service)
        body = body_for(7)
        tasks = [asyncio.create_task(post(s, cluster.url(), body)) for _ in range(32)]
        await wait_for(lambda: gate.entered == 1, what="the one encode to start")
        # Every request is inside nginx (its stub_status counts this probe as one more writer).
        deadline = asyncio.get_running_loop().time() + 15
        while (await cluster.status())["writing"] < 33:
            assert asyncio.get_running_loop().time() < deadline, f"not all at the tier: {await cluster.status()}"
            await asyncio.sleep(0.01)
        gate.release()
        results = await asyncio.gather(*tasks)
        assert {r[0] for r in results} == {200} and len({r[2] for r in results}) == 1
        assert forwards(w) == 1 and worker_requests(w) == 1
        statuses = Counter(r[1]["X-Cache-Status"] for r in results)
        assert statuses["cluster=MISS, shared=MISS"] == 1, statuses


async def test_different_bodies_never_share_an_entry_even_when_spooled(tiny, tmp_path):
    """Bodies above client_body_buffer_size are spooled to a file; the key hashes the file."""
    async with run_worker(tiny) as w, tiers() as start, aiohttp.ClientSession() as s:
        tier = await start(tmp_path, "s1", "shared", "--next", f"127.0.0.1:{w.http_port}",
                           "--client-body-buffer-size", "8k")
        a, b = body_for(11, (160, 120)), body_for(12, (160, 120))
        assert len(a) > 8192 and len(b) > 8192
        same_size = [msgpack.packb({"model": "tiny", "data": image_bytes(natural_image(64, 48, seed=13)) + tail})
                     for tail in (b"\0", b"\1")]  # equal length, differ in the last byte
        assert len(same_size[0]) == len(same_size[1])
        seen = {}
        for body in (a, b, *same_size):
            status, headers, out = await post(s, tier.url(), body)
            assert status == 200 and headers["X-Cache-Status"] == "shared=MISS"
            seen[body] = out
        for body in (a, b, *same_size):
            status, headers, out = await post(s, tier.url(), body)
            assert headers["X-Cache-Status"] == "shared=HIT" and out == seen[body]
        assert len({wire.decode(v).mm_hash for v in seen.values()}) == 4
        assert forwards(w) == 4


@pytest.fixture
async def origin():
    """Stands in for the worker where the test needs an origin that misbehaves or echoes."""
    state = {"hits": Counter(), "headers": [], "responses": {}}

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        state["hits"][body] += 1
        state["headers"].append(dict(request.headers))
        status, headers = state["responses"].get(body, (200, {}))
        return web.Response(status=status, body=b"answer:" + body, headers=headers)

    app = web.Application()
    app.router.add_post("/v1/encode", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    state["address"] = f"127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield state
    finally:
        await runner.cleanup()


async def test_only_200s_are_cached_whatever_the_headers(tiny, tmp_path, origin):
    async with run_worker(tiny) as w, tiers() as start, aiohttp.ClientSession() as s:
        real = await start(tmp_path, "real", "shared", "--next", f"127.0.0.1:{w.http_port}")
        bad = msgpack.packb({"model": "nope", "data": b"x"})
        for _ in range(2):
            status, headers, _ = await post(s, real.url(), bad)
            assert status == 404 and headers["X-Cache-Status"] == "shared=MISS"
        assert worker_requests(w, "unknown_model") == 2  # the worker saw both: nothing cached

        fake = await start(tmp_path, "fake", "shared", "--next", origin["address"])
        cases = {
            b"500": (500, {"Cache-Control": "public, max-age=3600"}),
            b"503": (503, {"Cache-Control": "max-age=3600", "Expires": "Thu, 01 Jan 2099 00:00:00 GMT"}),
            b"404": (404, {"X-Accel-Expires": "3600"}),
            b"nostore": (200, {"Cache-Control": "no-store, private", "Set-Cookie": "a=b", "Vary": "*"}),
        }
        origin["responses"].update(cases)
        for body in cases:
            for _ in range(2):
                status, headers, _ = await post(s, fake.url(), body)
                assert status == cases[body][0] and "Set-Cookie" not in headers
        # errors never cached, the 200 always; a 503 is asked again (a lone next level is listed twice)
        assert [origin["hits"][b] for b in cases] == [2, 4, 2, 1]


async def test_a_tier_keys_an_entry_by_its_body_and_checks_a_callers_key(tmp_path, origin):
    """The key is the body's sha256, computed by each tier; a caller's X-Cache-Key that is not it is
    refused (400 `bad_cache_key`, in the headers too: a HEAD answer has no body), by a tier and
    through the router (which routes by it; the shard checks it). Echo origin stand-in: it records the
    headers each request arrived with."""
    async with tiers() as start, aiohttp.ClientSession() as s:
        shard = await start(tmp_path, "s1", "shared", "--next", origin["address"])
        router = await start(tmp_path, "router", "router", "--shard", shard.address)
        outer = await start(tmp_path, "c1", "cluster", "--next", router.address)
        body = b"some request body"
        key = hashlib.sha256(body).hexdigest()
        status, headers, _ = await post(s, outer.url(), body)
        assert (status, headers["X-Cache-Status"]) == (200, "cluster=MISS, shared=MISS")
        assert origin["headers"][-1]["X-Cache-Key"] == key and "X-Cache-Key-From" not in origin["headers"][-1]
        assert (await post(s, outer.url(), body, **{"X-Cache-Key": key}))[1]["X-Cache-Status"] == "cluster=HIT"

        for url in (outer.url(), router.url(), shard.url()):
            status, headers, text = await post(s, url, b"other body", **{"X-Cache-Key": key})
            assert (status, headers["X-MM-Error-Code"], json.loads(text)["error"]["code"]) == \
                (400, "bad_cache_key", "bad_cache_key")
            async with s.head(url, data=b"other body", headers={"X-Cache-Key": key}) as r:
                assert (r.status, r.headers["X-MM-Error-Code"]) == (400, "bad_cache_key")
        status, _, text = await post(s, shard.url(), b"x", **{"X-Cache-Key": "bad key!"})
        assert status == 400 and json.loads(text)["error"]["code"] == "bad_cache_key"
        assert len(origin["headers"]) == 1  # nothing refused reached the origin

        # --drop-client-key: a caller's key is ignored instead of checked
        dropping = await start(tmp_path, "c2", "cluster", "--next", router.address, "--drop-client-key")
        status, headers, _ = await post(s, dropping.url(), b"third", **{"X-Cache-Key": "forged"})
        assert status == 200 and origin["headers"][-1]["X-Cache-Key"] == hashlib.sha256(b"third").hexdigest()


async def test_a_caller_cannot_store_a_body_under_another_requests_key(tiny, tmp_path):
    """A caller (a frontend's or an engine's certificate is all it takes) sends one request's body
    with another request's X-Cache-Key, by each method, before and after the other's entry exists:
    refused each time, and the other request still gets its own embeddings."""
    from mm_encoder.client import EncoderChain
    from mm_encoder.core.requests import EncodeRequest

    victim, attacker = (EncodeRequest(model="tiny", url=data_url(image_bytes(natural_image(64, 48, seed=seed))))
                        for seed in (41, 42))
    forged = {"Content-Type": "application/json", "X-Cache-Key": victim.key()}
    async with run_worker(tiny) as w, tiers() as start, aiohttp.ClientSession() as s:
        cluster = await start(tmp_path, "c1", "cluster", "--next", f"127.0.0.1:{w.http_port}")
        chain = EncoderChain(http_url=cluster.url(""), route="cluster")
        try:
            bodies = []
            for where in ("http:cluster=MISS", "http:cluster=HIT"):
                for method, path in (("POST", "/v1/encode"), ("POST", "/v1/encode/fetch"), ("HEAD", "/v1/encode")):
                    async with s.request(method, cluster.url(path), data=attacker.body(), headers=forged) as r:
                        assert (r.status, r.headers["X-MM-Error-Code"]) == (400, "bad_cache_key")
                body, got = await chain.fetch(victim)
                assert got == where
                bodies.append(body)
            assert bodies[0] == bodies[1] and forwards(w) == 1  # only the victim's request was encoded
            other, _ = await chain.fetch(attacker)
            assert wire.decode(other).mm_hash != wire.decode(bodies[0]).mm_hash
        finally:
            await chain.close()


async def test_aborted_client_still_leaves_the_entry_cached(tiny, tmp_path):
    async with run_worker(tiny) as w, tiers() as start, aiohttp.ClientSession() as s:
        cluster = await start(tmp_path, "c1", "cluster", "--next", f"127.0.0.1:{w.http_port}")
        gate = ForwardGate(w.service)
        body = body_for(21)
        async with aiohttp.ClientSession() as impatient:
            task = asyncio.create_task(post(impatient, cluster.url(), body))
            await wait_for(lambda: gate.entered == 1, what="the encode to start")
            task.cancel()
        gate.release()
        await wait_for(lambda: worker_requests(w) == 1, what="the worker to answer the abandoned miss")
        status, headers, out = await post(s, cluster.url(), body)
        assert status == 200 and headers["X-Cache-Status"] == "cluster=HIT" and wire.decode(out)
        assert forwards(w) == 1


async def test_adding_shards_moves_about_one_nth_of_keys_all_to_the_new_shard(tmp_path, origin):
    """The router is the subject; one echo origin stand-in answers behind every shard tier."""
    async with tiers() as start, aiohttp.ClientSession() as s:
        shards = [await start(tmp_path, f"s{i}", "shared", "--next", origin["address"]) for i in range(3)]
        keys = [f"key-{i}" for i in range(300)]
        placement = []
        for n in (1, 2, 3):
            shard_args = [a for t in shards[:n] for a in ("--shard", t.address)]
            router = await start(tmp_path, f"router{n}", "router", *shard_args)
            where = {}
            for k in keys:
                status, headers, _ = await post(s, router.url(), k.encode())  # keyed by the body's sha256
                assert status == 200
                where[k] = headers["X-Cache-Shard"]
            placement.append(where)
            await router.astop()
        for n, (before, after) in enumerate(itertools.pairwise(placement), start=2):
            moved = [k for k in keys if before[k] != after[k]]
            assert {after[k] for k in moved} == {shards[n - 1].address}  # all to the new shard
            assert abs(len(moved) / len(keys) - 1 / n) < 0.15, (n, len(moved))


async def test_a_stopped_shard_makes_its_keys_miss_not_fail(tiny, tmp_path):
    async with run_worker(tiny) as w, tiers() as start, aiohttp.ClientSession() as s:
        origin = f"127.0.0.1:{w.http_port}"
        shards = [await start(tmp_path, f"s{i}", "shared", "--next", origin) for i in range(2)]
        router = await start(tmp_path, "router", "router", *[a for t in shards for a in ("--shard", t.address)])
        body = body_for(31)
        first = await post(s, router.url(), body)
        assert (await post(s, router.url(), body))[1]["X-Cache-Status"] == "shared=HIT"
        owner = next(t for t in shards if t.address == first[1]["X-Cache-Shard"])
        survivor = next(t for t in shards if t is not owner)
        await owner.astop()
        status, headers, out = await post(s, router.url(), body)
        assert status == 200 and out == first[2]
        assert headers["X-Cache-Status"] == "shared=MISS" and headers["X-Cache-Shard"].endswith(survivor.address)
        assert (await post(s, router.url(), body))[1]["X-Cache-Status"] == "shared=HIT"


def test_missing_nginx_says_which_packages(monkeypatch):
    monkeypatch.setattr(cache_tiers, "find_nginx", lambda: None)
    monkeypatch.setattr(cache_tiers, "find_modules_dir", lambda: None)
    with pytest.raises(CacheTierError) as e:
        cache_tiers.check_install()
    msg = str(e.value)
    assert "apt-get install -y --no-install-recommends nginx libnginx-mod-http-lua lua-nginx-string" in msg
    assert "ngx_http_lua_module.so" in msg


def test_config_validation_and_rendering(tmp_path):
    with pytest.raises(ValidationError):
        TierConfig(tier="router", listen="127.0.0.1:1")  # no shards
    with pytest.raises(ValidationError):
        TierConfig(tier="cluster", listen="127.0.0.1:1", next=("x:1",), lock_timeout="ten seconds")
    with pytest.raises(ValidationError):
        TierConfig(tier="shared", listen="nope", next=("x:1",))
    with pytest.raises(ValidationError, match="--cluster-name is for a cluster tier"):
        TierConfig(tier="shared", listen="127.0.0.1:1", next=("x:1",), cluster_name="a")
    with pytest.raises(ValidationError):
        TierConfig(tier="cluster", listen="127.0.0.1:1", next=("x:1",), cluster_name="Not_A_Name")
    text = render(TierConfig(tier="shared", listen="127.0.0.1:9000", next=("enc-0:8090", "enc-1:8090"),
                             run_dir=tmp_path, cache_dir=tmp_path / "c"))
    for line in ("proxy_cache_valid 200 24h;", "inactive=24h", "proxy_cache_lock on;", "proxy_ignore_client_abort on;",
                 "server enc-0:8090 max_fails=0;", "server enc-1:8090 max_fails=0;", "proxy_cache_lock_timeout 600s;",
                 "proxy_next_upstream error http_503 non_idempotent;", "proxy_next_upstream_tries 3;"):
        assert line in text
    assert not [line for line in text.splitlines() if "@" in line and not line.lstrip().startswith("#")]
    # each tier waits longer than everything behind it: the cluster tier waits on the shared tier
    assert "proxy_read_timeout 900s;" in text
    cluster = render(TierConfig(tier="cluster", listen="127.0.0.1:9001", next=("127.0.0.1:9000",), run_dir=tmp_path))
    assert "proxy_read_timeout 1500s;" in cluster and 'set $mm_cluster_own "";' in cluster
    named = TierConfig(tier="cluster", listen="127.0.0.1:9001", next=("x:1",), run_dir=tmp_path, cluster_name="a")
    assert 'set $mm_cluster_own "a";' in render(named)
    # a lone next level is listed twice: a 503 or a failed connection is asked again, on a new connection
    assert cluster.count("server 127.0.0.1:9000 max_fails=0;") == 4  # mm_next and mm_direct
    explicit = TierConfig(tier="cluster", listen="127.0.0.1:9001", next=("x:1",), run_dir=tmp_path, read_timeout="9s")
    assert "proxy_read_timeout 9s;" in render(explicit)


def test_kubernetes_manifests_are_well_formed():
    docs = [d for d in yaml.safe_load_all((config_dir() / "k8s" / "cache-tiers.yaml").read_text()) if d]
    kinds = Counter(d["kind"] for d in docs)
    assert kinds["StatefulSet"] == 1 and kinds["Deployment"] == 2 and kinds["Service"] >= 3
    shards = next(d for d in docs if d["kind"] == "StatefulSet")
    pod = shards["spec"]["template"]["spec"]
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])
    args = pod["containers"][0]["args"]
    assert args[:4] == ["cache", "up", "--tier", "shared"]


async def test_graphs_of_two_dtypes_behind_one_tier_never_get_each_others_bodies(tmp_path):
    """One shared tier; behind it first a bf16 encode worker, then (same address) an fp32 one, as two
    graphs of different `--dtype` share a tier. Each worker packs the dtype its model runs in; the
    frontend names its dtype in the request, which is part of the tiers' key: the fp32 request is a
    miss answered with fp32 rows, never the bf16 body the tier holds, and the bf16 one stays a hit.
    A worker asked for another dtype than it packs answers 409 `dtype_mismatch`, which no tier caches."""
    from mm_encoder.client import EncoderChain
    from mm_encoder.core.errors import RemoteError
    from mm_encoder.core.requests import EncodeRequest
    from mm_encoder.model.encoder import Encoder
    from mm_encoder.serve.site import free_port

    url = "data:image/png;base64," + base64.b64encode(image_bytes(natural_image(96, 64, seed=5))).decode()
    bf16, fp32 = (EncodeRequest(model="tiny", url=url, dtype=d) for d in ("bfloat16", "float32"))
    assert bf16.key() != fp32.key() != EncodeRequest(model="tiny", url=url).key()
    port = free_port()
    async with tiers() as start:
        shared = await start(tmp_path, "s", "shared", "--next", f"127.0.0.1:{port}")
        chain = EncoderChain(http_url=shared.url(""), route="shared")
        try:
            async with run_worker(Encoder.from_pretrained("tiny", dtype="bf16"), http_port=port) as w:
                body, where = await chain.fetch(bf16)
                assert where == "http:shared=MISS" and wire.decode(body).dtype == "bfloat16"
                with pytest.raises(RemoteError) as e:
                    await chain.fetch(fp32)
                assert (e.value.code, e.value.http_status) == ("dtype_mismatch", 409)
                assert forwards(w) == 1
            async with run_worker(Encoder.from_pretrained("tiny", dtype="fp32"), http_port=port) as w:
                body32, where = await chain.fetch(fp32)
                assert where == "http:shared=MISS" and wire.decode(body32).dtype == "float32"
                again, where = await chain.fetch(bf16)
                assert where == "http:shared=HIT" and again == body
                assert forwards(w) == 1
            assert wire.decode(body).mm_hash == wire.decode(body32).mm_hash  # the same input, other rows
        finally:
            await chain.close()


async def tier_metrics(tier) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """A tier's /metrics (on its ops port), parsed with prometheus_client (so the format is checked too):
    {sample name: {its labels but `tier`, sorted: value}}, every family as FAMILIES declares it."""
    from prometheus_client.parser import text_string_to_metric_families

    from mm_encoder.cache_tiers.metrics import FAMILIES

    async with aiohttp.ClientSession() as s, s.get(tier.ops_url("/metrics")) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await r.text()
    declared = {f.name.removesuffix("_total"): f for f in FAMILIES if tier.tier in f.tiers}
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        f = declared.pop(family.name)
        assert (family.type, family.documentation) == (f.type, f.help)
        for sample in family.samples:
            assert sample.labels.pop("tier") == tier.tier and set(sample.labels) == set(f.labels)
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    assert not declared, f"families missing from {tier.name}'s /metrics: {sorted(declared)}"
    return out


async def counted(tier, requests: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """`tier_metrics` once the tier has counted `requests` requests in all (nginx counts a request in
    its log phase, after the answer has gone)."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        found = await tier_metrics(tier)
        seen = sum(found.get("dynamo_component_cache_tier_requests_total", {}).values())
        if seen >= requests or asyncio.get_running_loop().time() > deadline:
            assert seen == requests, (tier.name, found)
            return found
        await asyncio.sleep(0.02)


def by_cluster(found, name: str, **labels: str) -> dict[str, float]:
    """A family's samples by `cluster`, of those with `labels`."""
    return {dict(k)["cluster"]: v for k, v in found.get(name, {}).items() if labels.items() <= dict(k).items()}


REQUESTS, RESULTS = "dynamo_component_cache_tier_requests_total", "dynamo_component_cache_tier_results_total"
ERRORS, BYTES = "dynamo_component_cache_tier_upstream_errors_total", "dynamo_component_cache_tier_response_bytes_total"


async def test_two_clusters_tiers_count_each_clusters_requests_and_hits(tmp_path, origin):
    """Two cluster tiers (`--cluster-name a`, `b`) in front of one shared tier; the same request through
    a, then b: the shared tier counts a's miss and b's hit, each cluster tier its own. A client's forged
    X-MM-Cluster is overwritten by its cluster tier. Echo origin stand-in: it records the headers."""
    async with tiers() as start, aiohttp.ClientSession() as s:
        shared = await start(tmp_path, "s", "shared", "--next", origin["address"])
        a = await start(tmp_path, "a", "cluster", "--next", shared.address, "--cluster-name", "a")
        b = await start(tmp_path, "b", "cluster", "--next", shared.address, "--cluster-name", "b")
        assert (await post(s, a.url(), b"same"))[1]["X-Cache-Status"] == "cluster=MISS, shared=MISS"
        assert (await post(s, b.url(), b"same"))[1]["X-Cache-Status"] == "cluster=MISS, shared=HIT"
        assert origin["headers"][-1]["X-MM-Cluster"] == "a"  # the shared tier passes it on too

        found = await counted(shared, 2)
        assert by_cluster(found, REQUESTS) == {"a": 1, "b": 1}
        assert found[RESULTS] == {(("cluster", "a"), ("result", "MISS")): 1, (("cluster", "b"), ("result", "HIT")): 1}
        assert ERRORS not in found and set(by_cluster(found, BYTES)) == {"a", "b"}
        for tier, name in ((a, "a"), (b, "b")):
            own = await counted(tier, 1)
            assert own[RESULTS] == {(("cluster", name), ("result", "MISS")): 1}, own
        stats = shared.stats()
        assert (stats["requests"], stats["HIT"], stats["MISS"]) == (2, 1, 1)  # the counters of old, as they were
        assert {k: (v["requests"], v.get("HIT", 0), v.get("MISS", 0), v["errors"]) for k, v in
                stats["clusters"].items()} == {"a": (1, 0, 1, 0), "b": (1, 1, 0, 0)}
        assert stats["clusters"]["a"]["bytes"] == by_cluster(found, BYTES)["a"]

        # a client of cluster tier a says it is b: a sends its own name on, and the shared tier counts a
        await post(s, a.url(), b"forged", **{"X-MM-Cluster": "b"})
        assert origin["headers"][-1]["X-MM-Cluster"] == "a"
        assert by_cluster(await counted(shared, 3), RESULTS, result="MISS") == {"a": 2}


async def test_a_tier_labels_unnamed_callers_and_counts_upstream_errors(tmp_path, origin):
    """Straight to a shared tier: X-MM-Cluster as received, `unknown` without one, `invalid` when it is
    not 1-63 of [a-z0-9-]; past 64 names, `other` (a caller cannot grow the tier's memory). The next
    level's 5xx and one nginx could not reach count as upstream errors, by status. Echo origin stand-in."""
    async with tiers() as start, aiohttp.ClientSession() as s:
        shared = await start(tmp_path, "s", "shared", "--next", origin["address"])
        for i, header in enumerate(({}, {"X-MM-Cluster": ""}, {"X-MM-Cluster": "Upper"}, {"X-MM-Cluster": "x" * 64},
                                    {"X-MM-Cluster": "a b"}, {"X-MM-Cluster": "ok-1"})):
            assert (await post(s, shared.url(), b"q%d" % i, **header))[0] == 200
        found = await counted(shared, 6)
        assert by_cluster(found, REQUESTS) == {"unknown": 2, "invalid": 3, "ok-1": 1}
        assert [h["X-MM-Cluster"] for h in origin["headers"]] == ["unknown"] * 2 + ["invalid"] * 3 + ["ok-1"]

        origin["responses"][b"busy"] = (503, {})
        assert (await post(s, shared.url(), b"busy", **{"X-MM-Cluster": "ok-1"}))[0] == 503
        gone = await start(tmp_path, "gone", "cluster", "--next", f"127.0.0.1:{free_port()}", "--cluster-name", "c")
        assert (await post(s, gone.url(), b"q"))[0] == 502
        assert by_cluster(await counted(shared, 7), ERRORS, status="503") == {"ok-1": 1}
        assert (await counted(gone, 1))[ERRORS] == {(("cluster", "c"), ("status", "502")): 1}

        names = [f"c{i}" for i in range(70)]
        for name in names:
            await post(s, shared.url(), b"q", **{"X-MM-Cluster": name})
        found = await counted(shared, 7 + len(names))
        labels = by_cluster(found, REQUESTS)
        assert len(labels) == 65 and labels["other"] == 70 - (64 - 3)  # 3 names were known already
        assert set(labels) - {"other"} == {"unknown", "invalid", "ok-1", *names[:61]}


async def test_the_router_counts_per_cluster_and_shard_and_passes_the_cluster_on(tmp_path, origin):
    """cluster tier `a` -> router -> two shards, and a caller of the router's own: the router counts
    requests per cluster and per shard, and sends each shard the cluster it resolved. Echo origin stand-in."""
    async with tiers() as start, aiohttp.ClientSession() as s:
        shards = [await start(tmp_path, f"s{i}", "shared", "--next", origin["address"]) for i in range(2)]
        router = await start(tmp_path, "router", "router", *[x for t in shards for x in ("--shard", t.address)])
        a = await start(tmp_path, "a", "cluster", "--next", router.address, "--cluster-name", "a")
        answered = Counter()
        for i in range(8):
            answered[(await post(s, a.url(), b"item %d" % i))[1]["X-Cache-Shard"]] += 1
        answered[(await post(s, router.url(), b"direct", **{"X-MM-Cluster": "b"}))[1]["X-Cache-Shard"]] += 1
        found = await counted(router, 9)
        assert by_cluster(found, REQUESTS) == {"a": 8, "b": 1} and RESULTS not in found
        per_shard = {dict(k)["shard"]: v for k, v in found["dynamo_component_cache_tier_shard_requests_total"].items()}
        assert per_shard == dict(answered)
        stats = router.stats()  # what `mm-encoder status` reads: per cluster only (the router caches nothing)
        assert {k: v["requests"] for k, v in stats.pop("clusters").items()} == {"a": 8, "b": 1} and stats == {}
        together: Counter[str] = Counter()
        for shard in shards:
            together.update(by_cluster(await counted(shard, answered[shard.address]), REQUESTS))
        assert together == {"a": 8, "b": 1}


async def test_an_encoder_sites_shared_tier_routes_each_request_to_its_models_encoders(tmp_path):
    """Several models' encoders behind one shared tier (`--next-model MODEL=host:port`): a request goes to
    the encoders of the model its X-MM-Model names (whole, without case), one without it (or naming
    another) to --next. Two echo origin stand-ins for the two models' encoders, which record who got what."""
    got: dict[str, list[bytes]] = {"kimi": [], "glm": []}
    runners, addresses = [], {}
    for name in got:
        async def handle(request: web.Request, name=name) -> web.Response:
            got[name].append(await request.read())
            return web.Response(body=b"answer from " + name.encode())

        app = web.Application()
        app.router.add_post("/v1/encode", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        addresses[name] = f"127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with tiers() as start, aiohttp.ClientSession() as s:
            shard = await start(tmp_path, "s1", "shared", "--next", addresses["kimi"],
                                "--next-model", f"Kimi-K2.5={addresses['kimi']}",
                                "--next-model", f"moonshotai/Kimi-K2.5={addresses['kimi']}",
                                "--next-model", f"GLM-4.5V={addresses['glm']}")
            cases = [(b"1", "kimi-k2.5", "kimi"), (b"2", "GLM-4.5V", "glm"), (b"3", "glm-4.5v", "glm"),
                     (b"4", "moonshotai/Kimi-K2.5", "kimi"), (b"5", None, "kimi"), (b"6", "GLM-4.5V-x", "kimi")]
            for body, model, expected in cases:
                status, _, out = await post(s, shard.url(), body, **({"X-MM-Model": model} if model else {}))
                assert (status, out) == (200, b"answer from " + expected.encode()), (body, model)
            assert got == {"kimi": [b"1", b"4", b"5", b"6"], "glm": [b"2", b"3"]}
    finally:
        for runner in runners:
            await runner.cleanup()


def test_next_model_is_model_equals_address_and_not_the_routers():
    with pytest.raises(ValidationError, match="is not MODEL=host:port"):
        TierConfig(tier="shared", next=("127.0.0.1:1",), next_model=("no-address",))
    with pytest.raises(ValidationError, match="not --next/--direct/--next-model"):
        TierConfig(tier="router", shards=("127.0.0.1:1",), next_model=("m=127.0.0.1:2",))
    cfg = TierConfig(tier="shared", next=("127.0.0.1:1",), next_model=("A=127.0.0.1:2", "a=127.0.0.1:3"))
    assert cfg.models == {"a": ("127.0.0.1:2", "127.0.0.1:3")}
