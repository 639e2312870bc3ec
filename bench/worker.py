"""Encode-worker benchmark (not a test): requests/s and latency percentiles over loopback HTTP.

    python -m bench.worker [--quick] [--rounds 2] [--json out.json]

Starts the real worker (`python -m mm_encoder.encode_worker`, model `tiny`, through `harness.topology`)
as a separate process and drives it from this process with aiohttp at a fixed concurrency, bounded in
count and time:
- alias hits: the same URL again and again (served from the URL-alias LRU, no download);
- mm_hash hits: the same bytes in a msgpack body (hash, then the mm_hash LRU);
- full encodes: a distinct image per request (decode, preprocess, forward, pack), at 448x448 and
  full HD, with the postprocess pool (`--post-workers 1`) and without it (`0`: packing runs on
  the device thread, so it cannot overlap the next forward).
- the overlap where it matters: on a GPU the forward leaves the host cores free and the pack
  (device-to-host copy, bf16 bytes, zstd of a 7168-wide output) is a large share of the time. The
  CPU stand-in: `tiny-wide` (the tiny tower with a Kimi-K2.5-width projector, 7168) with one torch
  thread (`--torch-threads 1`), so one core plays the device and the other packs.
Both pool settings are measured in alternating rounds in one run; median (min-max) over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import aiohttp
import msgpack
from aiohttp import web

from bench import stats
from harness import topology
from harness.media_factory import image_bytes, natural_image
from harness.topology import Tls, WorkerProcess

ROOT = Path(__file__).resolve().parents[1]

CONFIGS: Path | None = None  # set in main(): a temporary configs directory with tiny-wide


TINY_WIDE = """name: tiny-wide
description: the tiny tower with a Kimi-K2.5-width projector (benchmark only)
revision: tiny-wide-v1
tower: moonvit-tiny
projector: {type: patchmerger, out_dim: 7168, ln_eps: 1.0e-5}
prompt: {image: "<|media_pad|>", video: "<|media_pad|>", placeholder: "<|media_pad|>"}
"""


def bench_configs() -> Path:
    """The repository's configs plus `tiny-wide`, in a temporary directory."""
    root = Path(tempfile.mkdtemp(prefix="mm-bench-configs-"))
    shutil.copytree(ROOT / "configs", root, dirs_exist_ok=True)
    (root / "models" / "tiny-wide.yaml").write_text(TINY_WIDE)
    return root


def start_worker(model: str = "tiny", *, tls: Tls | None = None, **settings) -> WorkerProcess:
    """The real worker (`harness.topology.start_worker`, its HTTP port a free one) as the benchmarks run
    it: warnings only, `tiny-wide` among its models; `settings`: its options, given in its environment."""
    env = {**os.environ, "MM_ENCODER_LOG_LEVEL": "WARNING", "MM_ENCODER_CONFIGS": str(CONFIGS)}
    return topology.start_worker(model=model, tls=tls, env=env, settings=settings, timeout=180)


async def drive(session, url: str, bodies, concurrency: int, max_requests: int, max_seconds: float) -> dict:
    """Send up to `max_requests` requests (cycling through `bodies`) for at most `max_seconds`."""
    latencies: list[float] = []
    errors = 0
    next_i = 0
    deadline = time.perf_counter() + max_seconds

    async def one_client():
        nonlocal next_i, errors
        while next_i < max_requests and time.perf_counter() < deadline:
            ctype, body = bodies[next_i % len(bodies)]
            next_i += 1
            t0 = time.perf_counter()
            async with session.post(f"{url}/v1/encode", data=body, headers={"Content-Type": ctype}) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
            latencies.append((time.perf_counter() - t0) * 1e3)

    t0 = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    latencies.sort()
    n = len(latencies)
    return {
        "requests": n,
        "errors": errors,
        "rps": n / wall,
        "p50_ms": latencies[n // 2],
        "p99_ms": latencies[min(n - 1, int(n * 0.99))],
    }


def msgpack_body(data: bytes, model: str = "tiny") -> tuple[str, bytes]:
    return "application/msgpack", msgpack.packb({"model": model, "data": data})


async def start_origin(files: dict[str, bytes]) -> tuple[web.AppRunner, int]:
    async def handle(request):
        return web.Response(body=files[request.match_info["name"]], content_type="image/png")

    app = web.Application()
    app.router.add_get("/{name}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


async def run(args) -> dict:
    scale = 0.25 if args.quick else 1.0
    sizes = {"448x448": (448, 448), "full-HD": (1920, 1080)}
    n_full = {"448x448": int(200 * scale), "full-HD": int(40 * scale)}
    images = {
        name: [msgpack_body(image_bytes(natural_image(w, h, seed=1000 + i), "JPEG", quality=90))
               for i in range(n_full[name] + 8)]
        for name, (w, h) in sizes.items()
    }
    hit_png = image_bytes(natural_image(448, 448, seed=1), "JPEG", quality=90)
    origin, origin_port = await start_origin({"a.jpg": hit_png})
    results: dict[str, list[dict]] = {}
    try:
        for _ in range(args.rounds):
            for post in (1, 0):
                worker = start_worker(post_workers=post, fetch_allow_hosts=[f"127.0.0.1:{origin_port}"])
                try:
                    await tiny_worker(worker, post, images, n_full, hit_png, origin_port, args.concurrency, scale,
                                      results)
                finally:
                    worker.stop()
                # the GPU-like case: one core plays the device, the pack is a large share
                worker = start_worker("tiny-wide", post_workers=post, torch_threads=1)
                try:
                    await wide_worker(worker, post, images["448x448"], n_full["448x448"], args.concurrency, scale,
                                      results)
                finally:
                    worker.stop()
    finally:
        await origin.cleanup()
    return summarize(results)


async def tiny_worker(worker: WorkerProcess, post: int, images: dict[str, list], n_full: dict[str, int],
                      hit_png: bytes, origin_port: int, concurrency: int, scale: float,
                      results: dict[str, list[dict]]) -> None:
    """Full encodes per size; with the post pool, the alias and mm_hash hits too."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        warm = images["448x448"][-8:]
        await drive(s, worker.url, warm, 2, len(warm), 60)
        for name in images:
            key = f"full encode {name}, post_workers={post}"
            bodies = images[name][: n_full[name]]
            results.setdefault(key, []).append(
                await drive(s, worker.url, bodies, concurrency, len(bodies), 120 * scale)
            )
        if post == 1:
            url_req = json.dumps({"model": "tiny", "url": f"http://127.0.0.1:{origin_port}/a.jpg"})
            alias = [("application/json", url_req.encode())]
            await drive(s, worker.url, alias, 1, 1, 30)
            results.setdefault("alias hit (URL)", []).append(
                await drive(s, worker.url, alias, 32, int(4000 * scale), 20)
            )
            byts = [msgpack_body(hit_png)]
            results.setdefault("mm_hash hit (448x448 JPEG bytes)", []).append(
                await drive(s, worker.url, byts, 32, int(4000 * scale), 20)
            )


async def wide_worker(worker: WorkerProcess, post: int, images: list, n_full: int, concurrency: int, scale: float,
                      results: dict[str, list[dict]]) -> None:
    """448x448 full encodes on tiny-wide with one torch thread."""
    async with aiohttp.ClientSession() as s:
        wide = [msgpack_body(msgpack.unpackb(b)["data"], "tiny-wide") for _, b in images]
        await drive(s, worker.url, wide[-8:], 2, 8, 60)
        key = f"full encode 448x448 tiny-wide (7168), torch_threads=1, post_workers={post}"
        results.setdefault(key, []).append(
            await drive(s, worker.url, wide[:n_full], concurrency, n_full, 120 * scale)
        )


def summarize(results: dict[str, list[dict]]) -> dict[str, dict]:
    summary: dict[str, dict] = {}
    for key, rows in results.items():
        summary[key] = {m: stats.summary(r[m] for r in rows) for m in ("rps", "p50_ms", "p99_ms")}
        summary[key]["requests"] = sum(r["requests"] for r in rows)
        summary[key]["errors"] = sum(r["errors"] for r in rows)
    for key in list(summary):
        if key.endswith("post_workers=1"):
            other = key.replace("post_workers=1", "post_workers=0")
            summary[key]["vs_no_pool"] = stats.ratio(summary[key]["rps"], summary[other]["rps"])
            # the same ratio per round: the two settings ran back to back in each round
            summary[key]["vs_no_pool_rounds"] = stats.summary(
                a["rps"] / b["rps"] for a, b in zip(results[key], results[other], strict=True))
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8, help="clients for full encodes (hits use 32)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    global CONFIGS
    CONFIGS = bench_configs()
    try:
        summary = asyncio.run(run(args))
    finally:
        shutil.rmtree(CONFIGS, ignore_errors=True)
    result = {"machine": stats.machine(), "rounds": args.rounds, "quick": args.quick,
              "concurrency": args.concurrency, "results": summary}
    stats.emit(result, args.json, "worker")


if __name__ == "__main__":
    main()
