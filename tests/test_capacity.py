"""The capacity model (`mm-encoder capacity`, docs/capacity.md): its ring against the real nginx router,
the synthetic trace's statistics, its LRUs against a brute-force and an analytic answer, its patch
counts against the encoder's preprocessing, its validation and CLI, and (slow) the whole model
against a real EPD graph served here with the same trace."""

from __future__ import annotations

import asyncio
import http.server
import json
import math
import re
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter, OrderedDict
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from pydantic import ValidationError

from harness.autoscale import wait_until
from harness.ring import index_of, point_of, server_of
from harness.topology import require_nginx, tiers
from mm_encoder.cache_tiers.ring import HashRing, server_points
from mm_encoder.capacity import cli as capacity_cli
from mm_encoder.capacity.simulate import PAGE, TIER_ENTRY_OVERHEAD, simulate
from mm_encoder.capacity.traffic import Traffic, image_patches, make_trace, size_classes, zipf_ranks
from mm_encoder.core.registry import get_spec

# --- the ring ------------------------------------------------------------------------------------


def test_ring_points_follow_nginx_rules():
    """160 points per server, the chain of crc32s seeded by host \\0 port; names split only at a
    colon followed by digits."""
    import zlib

    pts = server_points("10.0.0.1:8080")
    assert len(pts) == 160 and len(server_points("a:1", weight=2)) == 320
    assert pts[0] == zlib.crc32(b"10.0.0.1\x008080" + bytes(4))
    assert pts[1] == zlib.crc32(b"10.0.0.1\x008080" + pts[0].to_bytes(4, "little"))
    assert server_points("shard:x1")[0] == zlib.crc32(b"shard:x1\x00" + bytes(4))  # no port: the whole name
    assert server_points("unix:/run/s.sock")[0] == zlib.crc32(b"/run/s.sock\x00" + bytes(4))
    ring = HashRing(["a:1", "b:2", "c:3"])
    assert abs(sum(ring.shares()) - 1) < 1e-9 and ring.hashes == sorted(ring.hashes)
    # the vectorised lookup is the scalar one
    keys = [f"k{i}" for i in range(2000)]
    vec = ring.indices_of_hashes(np.array([HashRing.key_hash(k) for k in keys], dtype=np.uint32))
    assert vec.tolist() == [index_of(ring, k) for k in keys]
    # a key past the last point wraps to the first point's server
    assert index_of(ring, b"") == ring.owners[point_of(ring, 0)]


async def _backend(name: str) -> web.AppRunner:
    async def ok(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=name.encode())

    app = web.Application()
    app.router.add_route("*", "/v1/encode", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


async def test_ring_predicts_the_real_routers_shard_for_every_key(tmp_path):
    """The real router (`mm-encoder cache up --tier router`, nginx) over 3 stand-in shards: the ring
    names the shard (`X-Cache-Shard`) of each of 600 keys, then, one shard stopped, the one each of
    its keys moves to (the next point's shard on the ring)."""
    require_nginx()
    runners = [await _backend(f"s{i}") for i in range(3)]
    try:
        names = [f"127.0.0.1:{r.addresses[0][1]}" for r in runners]
        ring = HashRing(names)
        rng = np.random.default_rng(3)
        keys = ([f"{rng.integers(1 << 62):x}" for _ in range(300)]
                + [bytes(rng.integers(0, 256, 32, dtype=np.uint8)).hex() for _ in range(300)])
        async with tiers() as start, aiohttp.ClientSession() as s:
            router = await start(tmp_path, "router", "router", *[a for n in names for a in ("--shard", n)])

            async def shard_of(key: str) -> str:
                async with s.post(router.url(), data=b"{}", headers={"X-Cache-Key": key}) as r:
                    assert r.status == 200
                    await r.read()
                    return r.headers["X-Cache-Shard"].split(",")[-1].strip()

            seen = [await shard_of(k) for k in keys]
            assert seen == [server_of(ring, k) for k in keys]
            assert set(seen) == set(names)
            await runners[1].cleanup()  # a stopped shard: its keys go to the next point's shard
            moved = [k for k in keys if server_of(ring, k) == names[1]][:100]
            assert [await shard_of(k) for k in moved] == [server_of(ring, k, down=[names[1]]) for k in moved]
            assert all(server_of(ring, k, down=[names[1]]) != names[1] for k in moved)
    finally:
        for r in runners:
            await r.cleanup()


# --- the trace -----------------------------------------------------------------------------------


@pytest.mark.parametrize("s", [0.0, 0.6, 1.0, 1.8])
def test_zipf_ranks_follow_the_law(s):
    """200,000 draws over 500 ranks: every rank's frequency within 5 standard errors of k^-s / H."""
    n, draws = 500, 200_000
    ranks = zipf_ranks(n, s, draws, np.random.default_rng(11))
    assert ranks.min() >= 1 and ranks.max() <= n
    p = np.arange(1, n + 1, dtype=np.float64) ** -s
    p /= p.sum()
    freq = np.bincount(ranks, minlength=n + 1)[1:] / draws
    sigma = np.sqrt(p * (1 - p) / draws)
    assert np.all(np.abs(freq - p) <= 5 * sigma + 1e-12), np.max(np.abs(freq - p) / sigma)


def test_zipf_on_a_billion_image_catalogue_is_cheap_and_in_range():
    t0 = time.perf_counter()
    ranks = zipf_ranks(1_000_000_000, 0.8, 1_000_000, np.random.default_rng(0))
    assert time.perf_counter() - t0 < 5
    assert ranks.min() >= 1 and ranks.max() <= 1_000_000_000
    # P(rank 1) = 1 / H(n, s): the first 1000 terms summed, the rest by Euler-Maclaurin
    n, s, m = 1e9, 0.8, 1000
    head = float(np.sum(np.arange(1, m) ** -s))
    tail = (n ** (1 - s) - m ** (1 - s)) / (1 - s) + (m ** -s + n ** -s) / 2 + s * (m ** (-s - 1) - n ** (-s - 1)) / 12
    assert abs(np.mean(ranks == 1) * (head + tail) - 1) < 0.1
    assert abs(np.mean(ranks == 2) * (head + tail) * 2 ** s - 1) < 0.1


def test_trace_sizes_clusters_and_media_per_request():
    t = Traffic(requests=40_000, media_per_request=2.5, clusters=4, popularity={"exponent": 0.7, "catalogue": 5000},
                image_mix="640x480:3,1920x1080:1")
    classes = size_classes(t)
    trace = make_trace(t, classes)
    assert len(trace.ranks) == t.items == 100_000
    # an image's size is its own: one class per rank, and the classes' shares of the catalogue as weighted
    pairs = set(zip(trace.ranks.tolist(), trace.classes.tolist(), strict=True))
    assert len(pairs) == len(set(trace.ranks.tolist()))
    by_rank = dict(pairs)
    assert abs(sum(1 for c in by_rank.values() if c == 0) / len(by_rank) - 0.75) < 0.03
    # each request's items on one cluster, clusters used evenly
    request_of = (np.arange(t.items) / 2.5).astype(int)
    per_request = {}
    for req, c in zip(request_of.tolist(), trace.clusters.tolist(), strict=True):
        assert per_request.setdefault(req, c) == c
    counts = Counter(per_request.values())
    assert set(counts) == {0, 1, 2, 3} and max(counts.values()) / min(counts.values()) < 1.1


@pytest.mark.parametrize("model", ["kimi-k2.5-vision", "kimi-vl-a3b", "glm-5.2-vision"])
def test_image_patches_are_the_encoders(model):
    """The model's patch count for a size, from the family's rule, is what the encoder's
    preprocessing (`model.preprocess.frame_grid`, torch) computes."""
    from mm_encoder.model.preprocess import frame_grid

    spec = get_spec(model)
    for w, h in [(64, 48), (97, 61), (1280, 720), (1920, 1080), (3840, 2160), (8000, 300), (448, 448)]:
        try:
            gh, gw = frame_grid(w, h, spec.preprocess, spec.tower.patch_size)
        except Exception as e:  # the model refuses this size: so does the capacity model
            with pytest.raises(type(e)):
                image_patches(w, h, spec)
            continue
        assert image_patches(w, h, spec) == gh * gw, (model, w, h)
    assert image_patches(1280, 720, get_spec("kimi-k2.5-vision")) == 1196 * 4  # README: 1196 rows


# --- the caches ----------------------------------------------------------------------------------


def _reference_lru(items: list[int], sizes: dict[int, int], cap: int) -> tuple[int, list[int]]:
    """A plain LRU by bytes, written out: (hits, the misses in order)."""
    held: OrderedDict[int, int] = OrderedDict()
    hits, misses = 0, []
    for u in items:
        if u in held:
            held.move_to_end(u)
            hits += 1
            continue
        misses.append(u)
        if sizes[u] <= cap:
            held[u] = sizes[u]
            while sum(held.values()) > cap:
                held.popitem(last=False)
    return hits, misses


def tier_entry_bytes(body: int) -> int:
    """A tier entry's bytes as the model counts them: the body and what nginx stores with it, in pages."""
    return -(-(body + TIER_ENTRY_OVERHEAD) // PAGE) * PAGE


def test_lru_levels_match_a_brute_force_lru():
    """One cluster tier, one shard: the cluster's hits are a plain LRU's over the trace, the shard's
    a plain LRU's over the cluster's misses, and every shard miss is an encode (one worker, no cache)."""
    t = Traffic(requests=6000, popularity={"exponent": 0.9, "catalogue": 3000}, shards=1,
                shard_name="only:1", cluster_tier_bytes="300m", shard_bytes="900m", encoder_cache_bytes=0,
                encoders=1, image_mix="640x480:1,1280x720:1,3840x2160:1")
    trace = make_trace(t, size_classes(t))
    r = simulate(t, trace)
    bodies = {c: x.body_bytes for c, x in enumerate(size_classes(t))}
    sizes = {rank: tier_entry_bytes(bodies[c]) for rank, c in zip(trace.ranks.tolist(), trace.classes.tolist(),
                                                                   strict=True)}
    c_hits, c_misses = _reference_lru(trace.ranks.tolist(), sizes, 300 << 20)
    s_hits, s_misses = _reference_lru(c_misses, sizes, 900 << 20)
    assert (r.cluster.hits, r.cluster.lookups) == (c_hits, 6000)
    assert (r.shared.hits, r.shared.lookups) == (s_hits, len(c_misses))
    assert r.encodes == len(s_misses) and r.encoder.hits == 0
    assert 0 < r.cluster.hits < 6000 and r.shared.hits > 0
    assert r.encoded_patches == sum(size_classes(t)[dict(zip(trace.ranks.tolist(), trace.classes.tolist(),
                                                             strict=True))[u]].patches for u in s_misses)


def test_uniform_popularity_lru_hit_ratio_is_cache_over_catalogue():
    """Independent requests, uniform over n equal items, an LRU holding k of them: the hit ratio
    is k/n (every item is equally likely to be among the k most recent)."""
    n, k = 2000, 500
    body = size_classes(Traffic(image_mix="640x480"))[0].body_bytes
    t = Traffic(requests=200_000, popularity={"exponent": 0, "catalogue": n}, image_mix="640x480",
                cluster_tier_bytes=k * tier_entry_bytes(body), shard_bytes=0, encoder_cache_bytes=0, encoders=1)
    r = simulate(t)
    assert abs(r.cluster.hit_ratio - k / n) < 0.01, r.cluster.hit_ratio
    assert r.shared.hits == 0 and r.encodes == r.cluster.lookups - r.cluster.hits


def test_shared_tier_serves_what_another_cluster_fetched():
    """Two clusters, caches that hold everything: each unique image is encoded once; the second
    cluster to see it finds it in the shared tier."""
    t = Traffic(requests=20_000, clusters=2, popularity={"exponent": 1.0, "catalogue": 500}, image_mix="640x480",
                cluster_tier_bytes="10g", shard_bytes="10g", shards=3, capacity_pps=1e4)
    r = simulate(t)
    assert r.encodes == r.unique and r.encodes_per_unique == 1.0
    assert r.shared.lookups == r.cluster.lookups - r.cluster.hits
    assert r.shared.hits == r.shared.lookups - r.unique > 0
    assert sum(r.shard_keys) == r.unique and r.busiest_shard_share >= 1 / 3
    patches = size_classes(t)[0].patches
    assert r.encoders_needed == math.ceil(r.unique * patches / t.duration_s / (1e4 * 0.7))


# --- validation and the command ---------------------------------------------------------------------


@pytest.mark.parametrize("args, named", [
    (["--requests", "50000001"], "requests (--requests)"),
    (["--catalogue", "1000000001"], "popularity.catalogue (--catalogue)"),
    (["--zipf", "-1"], "popularity.exponent (--zipf)"),
    (["--rps", "0"], "requests_per_second (--rps)"),
    (["--shard-size", "lots"], "shard_bytes (--shard-size)"),
    (["--image-mix", "1280by720"], "image_mix (--image-mix)"),
    (["--image-mix", "20000x10"], "image_mix.0.width"),
    (["--utilization", "1.5"], "target_utilization (--utilization)"),
    (["--model", "nope"], "model"),
    (["--dtype", "int4"], "dtype (--dtype)"),
    (["--requests", "3000000", "--media-per-request", "20"], "at most 50000000 media items"),
    (["--shards", "3", "--shard-name", "fixed:80"], "must contain {i}"),
])
def test_bad_values_exit_2_naming_the_field(args, named, capsys):
    assert capacity_cli.main(args) == 2
    err = capsys.readouterr().err
    assert named in err, err


def test_bad_traffic_file_names_the_field(tmp_path, capsys):
    f = tmp_path / "traffic.yaml"
    f.write_text("requests_per_second: 10\npopularity: {exponent: 1.1, catalog: 10}\n")
    assert capacity_cli.main(["--traffic", str(f)]) == 2
    assert "popularity.catalog" in capsys.readouterr().err
    f.write_text("- 1\n")
    assert capacity_cli.main(["--traffic", str(f)]) == 2
    assert "not a mapping" in capsys.readouterr().err
    with pytest.raises(ValidationError):
        Traffic(shard_names=("a:1", "a:1"))


def test_json_and_plot(tmp_path, capsys):
    """The file and the options together (options win), `--json`, and the SVG plot of a sweep."""
    f = tmp_path / "traffic.yaml"
    f.write_text("requests_per_second: 50\nrequests: 20000\nimage_mix: ['1280x720:1', {width: 640, height: 480}]\n"
                 "popularity: {exponent: 0.9, catalogue: 100000}\nshards: 4\n")
    svg = tmp_path / "capacity.svg"
    assert capacity_cli.main(["--traffic", str(f), "--rps", "80", "--capacity-pps", "5000", "--json",
                              "--plot", str(svg), "--scales", "0.5,1,2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["traffic"]["requests_per_second"] == 80 and doc["traffic"]["shards"] == 4
    fleet, trace = doc["fleet"], doc["trace"]
    assert trace["items"] == 20000 and trace["duration_s"] == 250
    assert fleet["encodes_per_second"] == pytest.approx(fleet["encodes"] / 250)
    assert fleet["encoders_needed"] == math.ceil(fleet["patches_per_second"] / (5000 * 0.7))
    assert len(doc["shards"]["lookups"]) == 4 and 0.25 <= doc["shards"]["busiest_share"] <= 1
    assert [p["scale"] for p in doc["sweep"]] == [0.5, 1.0, 2.0]
    hit = [p["hit_ratios"]["cluster"] for p in doc["sweep"]]
    assert hit == sorted(hit)  # a bigger cache never hits less here
    root = ET.fromstring(svg.read_text())
    assert root.tag.endswith("svg") and len(root.findall(".//{http://www.w3.org/2000/svg}polyline")) == 4
    assert capacity_cli.main(["--requests", "2000"]) == 0  # the table, without a capacity
    out = capsys.readouterr().out
    assert "cluster tier" in out and "give --capacity-pps" in out


def test_capacity_from_a_workers_metrics(capsys):
    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = (b"# TYPE dynamo_component_encode_capacity_patches_per_second gauge\n"
                    b"dynamo_component_encode_capacity_patches_per_second 12345.5\n")
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert capacity_cli.capacity_from(url) == 12345.5
        assert capacity_cli.main(["--requests", "1000", "--capacity-from", url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["fleet"]["capacity_pps"] == 12345.5
    finally:
        server.shutdown()
        server.server_close()
    assert capacity_cli.main(["--capacity-from", url]) == 2  # nothing listens now
    assert "capacity_from: cannot read" in capsys.readouterr().err


def test_the_command_loads_no_torch_and_a_million_requests_take_seconds():
    """`mm-encoder capacity` through the package's command, in a fresh interpreter: no torch; 1M
    requests (Zipf 0.9 over 10M images, 2 clusters, 4 shards) simulated in seconds."""
    code = ("import sys, json, io, contextlib\nfrom mm_encoder.cli import main\nout = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            "    rc = main(['capacity', '--requests', '1000000', '--zipf', '0.9', '--catalogue', '10000000',"
            " '--clusters', '2', '--shards', '4', '--capacity-pps', '20000', '--json'])\n"
            "assert rc == 0 and 'torch' not in sys.modules, 'torch was imported'\n"
            "print(json.loads(out.getvalue())['simulation_seconds'])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seconds = float(done.stdout.strip().splitlines()[-1])
    print(f"1M requests simulated in {seconds:.1f} s")
    assert seconds < 60  # ~6 s here (2 shared CPUs); docs/capacity.md


# --- against a real graph ----------------------------------------------------------------------------


def _heads(log: Path) -> list[dict]:
    """A tier's HEAD requests, as its access log's JSON lines record them."""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"time"')]
    return [line for line in lines if line["method"] == "HEAD"]


def _within(sim: float, measured: float, rel: float = 0.10) -> bool:
    return abs(sim - measured) <= rel * max(abs(sim), abs(measured))


@pytest.mark.slow  # a whole graph of subprocesses; `make test-quick` skips it
async def test_model_matches_a_real_epd_graph(tmp_path):
    """The model against a real run of the same traffic: 48 requests, one image each, drawn Zipf(1.0)
    from 16 distinct images of two sizes, each request on one of two LLM clusters as the model's
    trace says. Cluster A is the real EPD graph (graphs/epd.yaml: chat requests through the frontend,
    its cluster tier, the router, 2 shards, the encode worker); cluster B is a second cluster tier in
    front of the same router, asked as a frontend and an engine ask (a HEAD, then the fetch), so the
    shared tier serves one cluster what the other fetched. Then the same trace through the model,
    with the router's own shard names and the frontend's own keys.

    Per media item the frontend's HEAD walks the chain and the engine's fetch finds at the cluster
    tier what the HEAD wrote: a cluster tier counts 2 lookups per item. The item's own lookup is the
    HEAD (cluster A's from its tier's access log, cluster B's as the test asked it): a fetch that
    overtakes the HEAD's fill asks the next level by design, a second miss the model does not count
    (on a loaded machine, a few items in 48). Compared within 10%: encodes per unique image, the cluster
    tiers' and the shared tier's hit ratios per item, the busiest shard's share; the worker cache's
    hit ratio (0 when the tiers hold everything) within 0.1."""
    require_nginx()
    from harness.media_factory import image_bytes, natural_image
    from harness.serve_fixtures import QUESTION, Served, chat, data_url
    from harness.topology import free_port
    from mm_encoder.core.requests import EncodeRequest
    from mm_encoder.core.wire import CONTENT_TYPE
    from mm_encoder.families.model_card import ModelCard
    from mm_encoder.serve.status import collect

    traffic = Traffic(requests=48, requests_per_second=10, popularity={"exponent": 1.0, "catalogue": 16},
                      image_mix="64x48,96x64", clusters=2, cluster_tier_bytes="1g", shard_bytes="2g", encoders=1,
                      dtype="fp32", seed=7)  # the graph's sizes; bodies far too small to evict anything
    trace = make_trace(traffic, size_classes(traffic))
    trace.classes = trace.ranks % 2  # the sizes sent: 64x48 for even ranks, 96x64 for odd
    urls = {r: data_url(image_bytes(natural_image(*[(64, 48), (96, 64)][r % 2], seed=r)))
            for r in set(trace.ranks.tolist())}
    run, port = tmp_path / "run", free_port()
    with Served("graphs/epd.yaml", run, port) as served:
        served.wait_for("ready: OpenAI base URL", 240)
        card = ModelCard.read(run / "checkpoint" / "kimi-k2.5-tiny")
        # the frontend's requests, as it makes them (checked below: each key is a cluster-tier HIT)
        sources = {r: EncodeRequest(model=get_spec(card.spec_name).name, url=u, modality="image", scope="",
                                    revision=card.revision, dtype="float32") for r, u in urls.items()}
        address = {c["name"]: c["url"].removeprefix("http://") for c in served.state["components"] if c["url"]}
        async with tiers() as start, aiohttp.ClientSession() as s:
            other = await start(tmp_path, "cluster-b", "cluster", "--next", address["router"],
                                "--direct", address["encoder"], "--max-size", "1g")

            async def ask(tier: str, method: str, src: EncodeRequest, path: str = "/v1/encode") -> str:
                headers = {"Accept": CONTENT_TYPE, "Content-Type": "application/json", "X-Cache-Key": src.key(),
                           "X-Cache-Route": "cluster,shared"}
                async with s.request(method, f"http://{tier}{path}", data=src.body(), headers=headers) as r:
                    assert r.status == 200
                    await r.read()
                    return r.headers.get("X-Cache-Status", "")

            heads_b = []  # cluster B's HEAD answers: what the model calls its per-item lookups
            for rank, cluster in zip(trace.ranks.tolist(), trace.clusters.tolist(), strict=True):
                if cluster == 0:
                    content = [{"type": "text", "text": QUESTION},
                               {"type": "image_url", "image_url": {"url": urls[rank]}}]
                    await asyncio.to_thread(chat, port, content, max_tokens=1)
                else:
                    heads_b.append(await ask(other.address, "HEAD", sources[rank]))
                    await ask(other.address, "POST", sources[rank], "/v1/encode/fetch")
            items_a = sum(1 for c in trace.clusters.tolist() if c == 0)

            def every_head() -> list[dict] | None:
                """Cluster A's HEADs (the frontend's), once its tier's access log has them all."""
                heads = _heads(run / "cluster.log")
                return heads if len(heads) == items_a else None

            heads_a = wait_until("cluster A's tier logging every HEAD", every_head, 30)
            rows = {c["name"]: c for c in collect(run)["components"]}
            raw = json.loads(await (await s.get(f"http://{other.address}/_cache/stats")).read())
            seen_a = {r for r, c in zip(trace.ranks.tolist(), trace.clusters.tolist(), strict=True) if c == 0}
            assert {await ask(address["cluster"], "POST", sources[r]) for r in seen_a} == {"cluster=HIT"}
    router_conf = (run / "nginx-router" / "nginx.conf").read_text()
    shard_names = re.findall(r"^\s*server (\S+) max_fails", router_conf, re.M)
    assert len(shard_names) == 2
    sim = simulate(traffic.model_copy(update={"shard_names": tuple(shard_names)}), trace,
                   key_hashes={r: HashRing.key_hash(src.key()) for r, src in sources.items()})

    shards = [rows["shared-0"], rows["shared-1"]]
    lookups_a, lookups_b = rows["cluster"]["requests"], raw["requests"]
    # per item, the HEAD's answer: an engine's fetch that overtakes the HEAD's fill asks the next level
    # by design (configs/nginx/cache-tier.conf), a second miss at the tier the model does not count
    hits_c = sum(h["cache"] == "HIT" for h in heads_a) + sum(h.startswith("cluster=HIT") for h in heads_b)
    shard_requests = sum(x["requests"] for x in shards)
    measured = {
        "encodes per unique image": rows["encoder"]["encodes"] / sim.unique,
        "cluster tiers' hit ratio per item": hits_c / sim.items,
        "shared tier's hit ratio": sum(x["hit_ratio"] * x["requests"] for x in shards) / shard_requests,
        "busiest shard's share": max(x["requests"] for x in shards) / shard_requests,
    }
    simulated = {"encodes per unique image": sim.encodes_per_unique,
                 "cluster tiers' hit ratio per item": sim.cluster.hit_ratio,
                 "shared tier's hit ratio": sim.shared.hit_ratio,
                 "busiest shard's share": sim.busiest_shard_share}
    worker = (sim.encoder.hit_ratio or 0.0, rows["encoder"]["hit_mm_hash"] or 0.0)
    print("".join(f"\n{k}: simulated {simulated[k]:.3f}, measured {measured[k]:.3f}" for k in measured)
          + f"\nworker cache hit ratio: simulated {worker[0]:.3f}, measured {worker[1]:.3f}"
          + f"\n(items {sim.items}, unique {sim.unique}, cluster lookups {lookups_a} + {lookups_b},"
            f" shard lookups {[x['requests'] for x in shards]})")
    assert lookups_a + lookups_b == 2 * sim.items
    assert 0 < sim.shared.hit_ratio < 1 and 0 < sim.cluster.hit_ratio < 1
    for k in measured:
        assert _within(simulated[k], measured[k]), (k, simulated[k], measured[k])
    assert abs(worker[0] - worker[1]) <= 0.1
