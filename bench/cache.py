"""The cache hierarchy (not a test): a hit at each level, a full encode, and coalescing.

    python -m bench.cache [--quick] [--rounds 3] [--json out.json]

One encode worker (`tiny-wide`: the tiny tower with a 7168-wide projector, so one 616x644 JPEG gives
a body of ~4.7 MB, the size of a 4K image's K2.5 embeddings on the reference stack) behind the
levels of graphs/epd.yaml, all on loopback: a cluster tier whose next level is the router, the
router with one shared shard, and the shard's next level the worker. After one warm-up request per
level, every request is a hit; wrk (Debian's `wrk`) sends the same POST (with the body's sha256 as
`X-Cache-Key`, as the frontend sends it: each tier hashes the body and checks it; a 52 KB msgpack body
with the JPEG, or a JSON body with its URL):
- req/s at 8 connections (`wrk -t2 -c8`) and p50 latency at 1 connection (`wrk -t1 -c1`);
- cluster tier hit; shared tier hit (router + shard), asked at the router and through the cluster
  tier (`X-Cache-Route: shared`: the cluster tier passes it on without caching); the worker's URL
  alias LRU (the same URL: no download); its mm_hash LRU (the same bytes: hash + lookup); the
  shared tier asked with no `X-Cache-Key` (the key is the body's sha256 either way);
- a full encode: a new JPEG per request straight to the worker (aiohttp client: 1 client for the
  latency, 8 for req/s);
- coalescing: 16 identical concurrent requests for a new image, straight to the worker (its
  single-flight) and through the cluster tier (nginx's cache lock, then the levels behind it);
  the worker's `dynamo_component_encode_forward_items_total` counts the forwards (must be 1).
Targets alternate in rounds in one process; figures are median (min-max) over rounds. wrk, nginx
and the worker share the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgpack

from bench import stats
from bench import worker as worker_bench  # bench/worker.py: the worker process and tiny-wide
from harness import topology
from harness.media_factory import image_bytes, natural_image
from harness.topology import TierProcess, WorkerProcess

WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = os.getenv("MM_BENCH_CTYPE")
local key = os.getenv("MM_BENCH_KEY")
if key and key ~= "" then wrk.headers["X-Cache-Key"] = key end
local route = os.getenv("MM_BENCH_ROUTE")
if route and route ~= "" then wrk.headers["X-Cache-Route"] = route end
local accept = os.getenv("MM_BENCH_ACCEPT")
if accept and accept ~= "" then wrk.headers["Accept"] = accept end
local f = assert(io.open(os.getenv("MM_BENCH_BODY"), "rb"))
wrk.body = f:read("*a")
f:close()
"""

REFERENCE = {"rps": 566.0, "p50_ms": 1.8}  # the reference stack's tier hit
COALESCE_N = 16


def start_tier(run: Path, name: str, tier: str, *args: str) -> TierProcess:
    """A tier (`harness.topology.start_tier`) under `run`, with nginx's default workers (one per core),
    its cache on tmpfs as deployed (the tier's default is under /dev/shm too); once healthy."""
    cache_dir = None
    if tier != "router":
        shm = Path("/dev/shm")
        cache_dir = Path(tempfile.mkdtemp(prefix=f"mm-bench-{name}-", dir=shm if shm.is_dir() else None))
        atexit.register(shutil.rmtree, cache_dir, True)
    return topology.start_tier(run, name, tier, *args, workers=None, cache_dir=cache_dir)


def post(url: str, body: bytes, key: str | None = None, ctype: str = "application/msgpack",
         route: str | None = None, accept: str | None = None) -> tuple[dict, bytes]:
    headers = {"Content-Type": ctype, **({"X-Cache-Key": key} if key else {}),
               **({"X-Cache-Route": route} if route else {}), **({"Accept": accept} if accept else {})}
    req = urllib.request.Request(f"{url}/v1/encode", data=body, headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(r.headers), r.read()


def wrk(url: str, script: Path, body: Path, key: str | None, threads: int, conns: int, seconds: float, *,
        ctype: str = "application/msgpack", route: str | None = None, accept: str | None = None) -> dict:
    """One wrk run: req/s, p50 and p99 latency (ms), non-2xx answers."""
    env = {**os.environ, "MM_BENCH_BODY": str(body), "MM_BENCH_KEY": key or "", "MM_BENCH_CTYPE": ctype,
           "MM_BENCH_ROUTE": route or "", "MM_BENCH_ACCEPT": accept or ""}
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{conns}", f"-d{seconds}s", "--latency", "-s", str(script), f"{url}/v1/encode"],
        capture_output=True, text=True, env=env, timeout=seconds + 60, check=True,
    ).stdout

    def pct(p: str) -> float:
        m = re.search(rf"\s{p}%\s+([0-9.]+)(us|ms|s)\b", out)
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rps": float(re.search(r"Requests/sec:\s+([0-9.]+)", out).group(1)), "p50_ms": pct("50"),
            "p99_ms": pct("99"), "non2xx": int(errors.group(1)) if errors else 0}


def serve_files(files: dict[str, bytes]) -> tuple[ThreadingHTTPServer, int]:
    """GET /<name> -> files[name], on loopback (the image's origin for URL requests)."""
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            data = files.get(self.path.lstrip("/"))
            self.send_response(200 if data is not None else 404)
            self.send_header("Content-Type", "image/jpeg")
            self.send_header("Content-Length", str(len(data or b"")))
            self.end_headers()
            self.wfile.write(data or b"")

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def forward_items(worker_url: str) -> float:
    with urllib.request.urlopen(f"{worker_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dynamo_component_encode_forward_items_total"))


def coalesce(worker_url: str, url: str, body: bytes, key: str | None) -> dict:
    """COALESCE_N identical concurrent requests for a new image: forwards run, answers, latency."""
    before = forward_items(worker_url)
    results: list[tuple[int, float]] = []
    lock = threading.Lock()

    def one():
        t0 = time.perf_counter()
        try:
            post(url, body, key)
            status = 200
        except urllib.error.HTTPError as e:
            status = e.code
        except OSError:
            status = 0
        with lock:
            results.append((status, (time.perf_counter() - t0) * 1e3))

    threads = [threading.Thread(target=one) for _ in range(COALESCE_N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    lat = sorted(ms for _, ms in results)
    return {"forwards": forward_items(worker_url) - before, "ok": sum(1 for s, _ in results if s == 200),
            "p50_ms": lat[len(lat) // 2], "max_ms": lat[-1]}


def full_encodes(worker_url: str, bodies: list[bytes], concurrency: int) -> dict:
    async def go():
        import aiohttp

        async with aiohttp.ClientSession() as s:
            typed = [("application/msgpack", b) for b in bodies]
            return await worker_bench.drive(s, worker_url, typed, concurrency, len(typed), 600)

    return asyncio.run(go())


def jpeg(seed: int) -> bytes:
    return image_bytes(natural_image(616, 644, seed=seed), "JPEG")


@dataclass
class Hierarchy:
    """The levels under test: an origin serving files, the encode worker, a shard, a router, a cluster tier."""

    origin_port: int
    worker: WorkerProcess
    shard_url: str
    router_url: str
    cluster_url: str


def run(args) -> dict:
    seconds = 2 if args.quick else 6
    rounds = 1 if args.quick else args.rounds
    n_encode = 6 if args.quick else 16
    run_dir = Path(tempfile.mkdtemp(prefix="mm-bench-cache-"))
    worker_bench.CONFIGS = worker_bench.bench_configs()
    hit_jpeg = jpeg(3)
    try:
        with contextlib.ExitStack() as stack:  # everything started is stopped, in reverse order
            h = start_hierarchy(stack, run_dir, hit_jpeg)
            size_mb, targets = prime(h, run_dir, hit_jpeg)
            raw, coal = measure_rounds(h, targets, run_dir / "post.lua", rounds, seconds, n_encode)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(worker_bench.CONFIGS, ignore_errors=True)
    labels = {name: t[0] for name, t in targets.items()} | {"encode": "full encode (a new 616x644 JPEG per request)"}
    levels = {}
    for name, rs in raw.items():
        levels[name] = {"label": labels[name], "non2xx": sum(r["non2xx"] for r in rs)}
        levels[name] |= {m: stats.summary(r[m] for r in rs) for m in ("rps_c8", "p50_c1_ms", "p99_c1_ms", "p50_c8_ms")}
    coalescing = {
        where: {"n": COALESCE_N, "forwards": stats.summary(r["forwards"] for r in rs),
                "ok": stats.summary(r["ok"] for r in rs), "p50_ms": stats.summary(r["p50_ms"] for r in rs),
                "max_ms": stats.summary(r["max_ms"] for r in rs)}
        for where, rs in coal.items()
    }
    return {"machine": stats.machine(), "body_mb": size_mb, "rounds": rounds, "seconds": seconds,
            "encode_requests": n_encode, "reference": REFERENCE, "levels": levels, "coalescing": coalescing}


def start_hierarchy(stack: contextlib.ExitStack, run_dir: Path, hit_jpeg: bytes) -> Hierarchy:
    origin, origin_port = serve_files({"a.jpg": hit_jpeg})
    stack.callback(origin.shutdown)
    worker = stack.enter_context(worker_bench.start_worker("tiny-wide",
                                                           fetch_allow_hosts=[f"127.0.0.1:{origin_port}"]))
    shard = stack.enter_context(start_tier(run_dir, "shared", "shared", "--next", worker.address))
    router = stack.enter_context(start_tier(run_dir, "router", "router", "--shard", shard.address))
    cluster = stack.enter_context(start_tier(run_dir, "cluster", "cluster", "--next", router.address,
                                             "--direct", worker.address))
    return Hierarchy(origin_port, worker, shard.url(""), router.url(""), cluster.url(""))


def prime(h: Hierarchy, run_dir: Path, hit_jpeg: bytes) -> tuple[float, dict[str, tuple[str, str, dict]]]:
    """Every level filled with the hit body and checked to answer from where it should; the response's
    size (MB) and the targets: name -> (label, URL, wrk's body/key/route/ctype)."""
    body = msgpack.packb({"model": "tiny-wide", "data": hit_jpeg})
    url_body = json.dumps({"model": "tiny-wide", "url": f"http://127.0.0.1:{h.origin_port}/a.jpg"}).encode()
    body_file, url_file = run_dir / "body.msgpack", run_dir / "url.json"
    body_file.write_bytes(body)
    url_file.write_bytes(url_body)
    (run_dir / "post.lua").write_text(WRK_SCRIPT)
    key = hashlib.sha256(body).hexdigest()  # what a tier computes, and checks a caller's key against
    headers, response = post(h.cluster_url, body, key)  # fills cluster, shard and the worker's mm_hash LRU
    assert headers["X-Cache-Status"].startswith("cluster=MISS"), headers["X-Cache-Status"]
    assert post(h.cluster_url, body, key)[0]["X-Cache-Status"] == "cluster=HIT"
    assert post(h.router_url, body, key)[0]["X-Cache-Status"].startswith("shared=HIT")
    assert post(h.cluster_url, body, key, route="shared")[0]["X-Cache-Status"].startswith("cluster=BYPASS")
    for _ in range(2):
        hdrs, _ = post(h.worker.url, url_body, ctype="application/json")
    assert hdrs["X-MM-Cache"] == "alias", hdrs
    assert post(h.worker.url, body)[0]["X-MM-Cache"] == "mm_hash"
    targets = {
        "cluster": ("cluster tier hit", h.cluster_url, dict(body=body_file, key=key)),
        "shared": ("shared tier hit (router + shard)", h.router_url, dict(body=body_file, key=key)),
        "shared_via_cluster": ("shared tier hit through the cluster tier (X-Cache-Route: shared)", h.cluster_url,
                               dict(body=body_file, key=key, route="shared")),
        "shared_lua_key": ("shared shard hit, no X-Cache-Key sent", h.shard_url,
                           dict(body=body_file, key=None)),
        "alias": ("worker URL-alias LRU hit (same URL)", h.worker.url,
                  dict(body=url_file, key=None, ctype="application/json")),
        "mm_hash": ("worker mm_hash LRU hit (same bytes)", h.worker.url, dict(body=body_file, key=None)),
    }
    return len(response) / 1e6, targets


def measure_rounds(h: Hierarchy, targets: dict, script: Path, rounds: int, seconds: float,
                   n_encode: int) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """Per round: each target under wrk (8 then 1 connection), full encodes, and coalescing at the worker
    and at the cluster tier."""
    raw: dict[str, list[dict]] = {name: [] for name in targets}
    raw["encode"] = []
    coal: dict[str, list[dict]] = {"worker": [], "cluster": []}
    seed = 10_000
    for _ in range(rounds):
        for name, (_, url, kw) in targets.items():
            kw = dict(kw)
            b, k = kw.pop("body"), kw.pop("key")
            c8 = wrk(url, script, b, k, 2, 8, seconds, **kw)
            c1 = wrk(url, script, b, k, 1, 1, seconds, **kw)
            raw[name].append({"rps_c8": c8["rps"], "p50_c1_ms": c1["p50_ms"], "p99_c1_ms": c1["p99_ms"],
                              "p50_c8_ms": c8["p50_ms"], "non2xx": c8["non2xx"] + c1["non2xx"]})
        bodies = [msgpack.packb({"model": "tiny-wide", "data": jpeg(seed + i)}) for i in range(3 * n_encode)]
        seed += 3 * n_encode
        one = full_encodes(h.worker.url, bodies[:n_encode], 1)
        eight = full_encodes(h.worker.url, bodies[n_encode:], 8)
        raw["encode"].append({"rps_c8": eight["rps"], "p50_c1_ms": one["p50_ms"], "p99_c1_ms": one["p99_ms"],
                              "p50_c8_ms": eight["p50_ms"], "non2xx": one["errors"] + eight["errors"]})
        for where, url in (("worker", h.worker.url), ("cluster", h.cluster_url)):
            new = msgpack.packb({"model": "tiny-wide", "data": jpeg(seed)})
            seed += 1
            key = hashlib.sha256(new).hexdigest() if where == "cluster" else None  # as the frontend sends it
            coal[where].append(coalesce(h.worker.url, url, new, key))
    return raw, coal


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 round of 2 s per level, 6 encodes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench/cache.py needs wrk: apt-get install -y wrk")
    result = run(args)
    stats.emit(result, args.json, "cache")


if __name__ == "__main__":
    main()
