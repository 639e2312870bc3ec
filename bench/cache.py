"""Cache-hit benchmark (not a test): nginx tier, router + tier, and the worker's own cache.

    python bench/cache.py [--quick] [--rounds 3] [--json out.json]

One encode worker (`tiny-wide`: the tiny tower with a 7168-wide projector, so one image gives a
body of ~4.7 MB like a 4K image's K2.5 embeddings on the reference stack), one shared cache tier in
front of it, and a router in front of the tier, all on loopback. After one warm-up request, every
request is a hit; wrk (Debian's `wrk`) sends the same POST with the frontend's `X-Cache-Key`:
- requests/s at 8 connections (`wrk -t2 -c8`) and p50 latency at 1 connection (`wrk -t1 -c1`);
- through the tier, through router + tier, and straight to the worker (its mm_hash LRU);
- also the tier without `X-Cache-Key` (nginx hashes the ~50 KB request body in Lua).
The targets run in alternating rounds in one process; medians over rounds. wrk, nginx and the
worker share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import worker as worker_bench  # noqa: E402  (bench/worker.py: the worker process and tiny-wide)
from media_factory import image_bytes, natural_image  # noqa: E402

from mm_encoder.deploy.local import free_port  # noqa: E402

WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/msgpack"
local key = os.getenv("MM_BENCH_KEY")
if key and key ~= "" then wrk.headers["X-Cache-Key"] = key end
local f = assert(io.open(os.getenv("MM_BENCH_BODY"), "rb"))
wrk.body = f:read("*a")
f:close()
"""



def start_tier(run: Path, name: str, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "mm_encoder.deploy.cache_tiers", "up", "--listen", f"127.0.0.1:{port}",
           "--run-dir", str(run / name), *args]
    if "router" not in args:
        cmd += ["--cache-dir", str(run / f"cache-{name}")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=(run / f"{name}.log").open("w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while True:
        try:
            with urllib.request.urlopen(f"{url}/_cache/health", timeout=1):
                return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx {name} did not start: {(run / f'{name}.log').read_text()[-1000:]}") from None
            time.sleep(0.05)


def post(url: str, body: bytes, key: str | None) -> tuple[dict, bytes]:
    headers = {"Content-Type": "application/msgpack", **({"X-Cache-Key": key} if key else {})}
    req = urllib.request.Request(f"{url}/v1/encode", data=body, headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        return dict(r.headers), r.read()


def wrk(url: str, script: Path, body: Path, key: str | None, threads: int, conns: int, seconds: float) -> dict:
    env = {**os.environ, "MM_BENCH_BODY": str(body), "MM_BENCH_KEY": key or ""}
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{conns}", f"-d{seconds}s", "--latency", "-s", str(script), f"{url}/v1/encode"],
        capture_output=True, text=True, env=env, timeout=seconds + 60, check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([0-9.]+)", out).group(1))
    p50 = re.search(r"\s50%\s+([0-9.]+)(us|ms|s)\b", out)
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[p50.group(2)]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rps": rps, "p50_ms": float(p50.group(1)) * scale, "non2xx": int(errors.group(1)) if errors else 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench/cache.py needs wrk: apt-get install -y wrk")
    seconds = 3 if args.quick else 8
    run = Path(tempfile.mkdtemp(prefix="mm-bench-cache-"))
    worker_bench.CONFIGS = worker_bench.bench_configs()
    procs: list[subprocess.Popen] = []
    worker = None
    try:
        worker = worker_bench.WorkerProcess("tiny-wide")
        tier, tier_url = start_tier(run, "tier", "--tier", "shared", "--next", worker.url.split("//")[1])
        procs.append(tier)
        router, router_url = start_tier(run, "router", "--tier", "router", "--shard", tier_url.split("//")[1])
        procs.append(router)
        body = msgpack.packb({"model": "tiny-wide", "data": image_bytes(natural_image(616, 644, seed=3), "JPEG")})
        body_file = run / "body.msgpack"
        body_file.write_bytes(body)
        script = run / "post.lua"
        script.write_text(WRK_SCRIPT)
        key = "bench-" + str(len(body))
        _, response = post(router_url, body, key)  # fills the tier (and the worker's cache)
        size_mb = len(response) / 1e6
        assert post(tier_url, body, key)[0]["X-Cache-Status"] == "shared=HIT"
        post(tier_url, body, None)  # the body-hash key is another entry: fill it too
        post(worker.url, body, None)
        targets = {
            "nginx tier (X-Cache-Key)": (tier_url, key),
            "router + tier (X-Cache-Key)": (router_url, key),
            "nginx tier (key = sha256 of body, in Lua)": (tier_url, None),
            "worker in-process cache (mm_hash LRU)": (worker.url, None),
        }
        rows: dict[str, list[dict]] = {name: [] for name in targets}
        for _ in range(args.rounds):
            for name, (url, k) in targets.items():
                c8 = wrk(url, script, body_file, k, 2, 8, seconds)
                c1 = wrk(url, script, body_file, k, 1, 1, seconds)
                rows[name].append({"rps_c8": c8["rps"], "p50_c1_ms": c1["p50_ms"], "p50_c8_ms": c8["p50_ms"],
                                   "non2xx": c8["non2xx"] + c1["non2xx"]})
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        if worker is not None:
            worker.stop()
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(worker_bench.CONFIGS, ignore_errors=True)
    summary = {
        name: {m: statistics.median(r[m] for r in rs) for m in ("rps_c8", "p50_c1_ms", "p50_c8_ms")}
        | {"non2xx": sum(r["non2xx"] for r in rs)}
        for name, rs in rows.items()
    }
    base = summary["nginx tier (X-Cache-Key)"]["rps_c8"]
    print(f"cache hits, {size_mb:.2f} MB body, {os.cpu_count()} cores shared by wrk, nginx and the worker; "
          f"{args.rounds} rounds x {seconds} s per run, medians")
    print("| path | req/s at c=8 | vs tier | p50 ms at c=1 | p50 ms at c=8 | non-2xx |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in summary.items():
        print(f"| {name} | {r['rps_c8']:.0f} | {r['rps_c8'] / base:.2f}x | {r['p50_c1_ms']:.2f} | "
              f"{r['p50_c8_ms']:.1f} | {r['non2xx']} |")
    if args.json:
        args.json.write_text(json.dumps({"body_mb": size_mb, "results": summary}, indent=2))


if __name__ == "__main__":
    main()
