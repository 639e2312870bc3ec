"""Encode-worker benchmark (not a test): requests/s and latency percentiles over loopback HTTP.

    python bench/worker.py [--quick] [--rounds 2] [--json out.json]

Starts the real worker (`python -m mm_encoder.worker`, model `tiny`) as a separate process and
drives it from this process with aiohttp at a fixed concurrency, bounded in count and time:
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import msgpack
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import stats  # noqa: E402
from media_factory import image_bytes, natural_image  # noqa: E402

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


class WorkerProcess:
    def __init__(self, model: str = "tiny", **settings):
        env = {**os.environ, "MM_ENCODER_HTTP_PORT": "0", "MM_ENCODER_LOG_LEVEL": "WARNING",
               "MM_ENCODER_CONFIGS": str(CONFIGS)}
        env.update({f"MM_ENCODER_{k.upper()}": (json.dumps(v) if isinstance(v, list) else str(v))
                    for k, v in settings.items()})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mm_encoder.worker", "--model", model],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        line = self.proc.stdout.readline()
        if "ready" not in line:
            self.proc.kill()
            raise RuntimeError(f"worker did not start: {line!r}")
        self.url = f"http://127.0.0.1:{int(line.split('http_port=')[1].split()[0])}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


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
                worker = WorkerProcess(post_workers=post, fetch_allow_hosts=[f"127.0.0.1:{origin_port}"])
                try:
                    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                        warm = images["448x448"][-8:]
                        await drive(s, worker.url, warm, 2, len(warm), 60)
                        for name in sizes:
                            key = f"full encode {name}, post_workers={post}"
                            bodies = images[name][: n_full[name]]
                            results.setdefault(key, []).append(
                                await drive(s, worker.url, bodies, args.concurrency, len(bodies), 120 * scale)
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
                finally:
                    worker.stop()
                # the GPU-like case: one core plays the device, the pack is a large share
                worker = WorkerProcess("tiny-wide", post_workers=post, torch_threads=1)
                try:
                    async with aiohttp.ClientSession() as s:
                        wide = [msgpack_body(msgpack.unpackb(b)["data"], "tiny-wide") for _, b in images["448x448"]]
                        await drive(s, worker.url, wide[-8:], 2, 8, 60)
                        key = f"full encode 448x448 tiny-wide (7168), torch_threads=1, post_workers={post}"
                        results.setdefault(key, []).append(
                            await drive(s, worker.url, wide[: n_full["448x448"]], args.concurrency,
                                        n_full["448x448"], 120 * scale)
                        )
                finally:
                    worker.stop()
    finally:
        await origin.cleanup()
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


LABELS = {
    "alias hit (URL)": "alias hit (same URL; no download)",
    "mm_hash hit (448x448 JPEG bytes)": "mm_hash hit (same 448x448 JPEG bytes; hash + lookup)",
    "full encode 448x448, post_workers=1": "full encode 448x448, postprocess pool",
    "full encode 448x448, post_workers=0": "full encode 448x448, no pool (pack on the device thread)",
    "full encode full-HD, post_workers=1": "full encode full HD, postprocess pool",
    "full encode full-HD, post_workers=0": "full encode full HD, no pool",
    "full encode 448x448 tiny-wide (7168), torch_threads=1, post_workers=1":
        "full encode 448x448, `tiny-wide` (-> 7168), 1 torch thread, pool",
    "full encode 448x448 tiny-wide (7168), torch_threads=1, post_workers=0": "same, no pool",
}
WIDE = "full encode 448x448 tiny-wide (7168), torch_threads=1, post_workers=1"
REFERENCE_OVERLAP = (1.10, 1.20)  # the reference stack: +10-20 % throughput from the overlap, on GPUs


def section(result: dict, plots: Path) -> str:
    rows = result["results"]
    lines = [
        "## Encode worker (`python bench/worker.py`)",
        "",
        "The real worker process (`python -m mm_encoder.worker`, model `tiny`, CPU) driven over loopback HTTP by "
        "aiohttp from a second process. Full encodes: a distinct JPEG per request (msgpack body with the bytes), "
        f"{result.get('concurrency', 8)} concurrent clients; hits: 32 concurrent clients. Both postprocess-pool "
        "settings (`--post-workers 1`, and `0`: packing on the device thread, so it cannot overlap the next "
        f"forward) measured in alternating rounds in one run; median (min-max) over {result['rounds']} rounds. "
        "The overlap where it matters is stood in for by `tiny-wide` (the tiny tower with a 7168-wide projector) "
        "with one torch thread: one core plays the device, the other packs.",
        "",
        "| scenario | requests | req/s | p50 ms | p99 ms | pool / no pool |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    order = [k for k in LABELS if k in rows] + [k for k in rows if k not in LABELS]
    for key in order:
        r = rows[key]
        ratio = ""
        if "vs_no_pool" in r:
            ratio = f"{r['vs_no_pool']:.2f}x"
            if r["vs_no_pool_rounds"]["n"] > 1:
                ratio += f" ({r['vs_no_pool_rounds']['min']:.2f}-{r['vs_no_pool_rounds']['max']:.2f})"
            if key == WIDE:
                ratio = f"**{ratio}**"
        lines.append(f"| {LABELS.get(key, key)} | {r['requests']} | {stats.fmt(r['rps'])} | {stats.fmt(r['p50_ms'])} "
                     f"| {stats.fmt(r['p99_ms'])} | {ratio} |")
    lo, hi = REFERENCE_OVERLAP

    def overlap(key: str) -> str | None:
        r = rows.get(key)
        if not r or "vs_no_pool" not in r:
            return None
        per = r["vs_no_pool_rounds"]
        text = f"{r['vs_no_pool']:.2f}x"
        if per["n"] > 1:
            text += f" (per round {per['min']:.2f}-{per['max']:.2f})"
            if per["min"] <= 1.0 <= per["max"]:
                text += ", within this machine's noise"
        return text

    tiny, wide = overlap("full encode 448x448, post_workers=1"), overlap(WIDE)
    wide_r = rows.get(WIDE, {}).get("vs_no_pool")
    lines += [
        "",
        "Reading the numbers:",
        f"- Pack overlap: the reference stack reported +{(lo - 1) * 100:.0f}-{(hi - 1) * 100:.0f} % throughput on "
        "GPUs. "
        + (f"With `tiny` at 448x448: {tiny}. There the forward already uses every core through torch's intra-op "
           "threads and packing a 256-wide output is a few % of the forward, so there is neither a free core nor "
           "much to overlap. " if tiny else "")
        + (f"With the stand-in (`tiny-wide`, one torch thread playing the device, the other core packing): {wide}, "
           f"{'above' if wide_r > hi else 'within' if wide_r >= lo else 'below'} the reference's range. The "
           "stand-in's pack share is larger than a real tower's, so expect less on a GPU." if wide else ""),
        "- A hit is a URL or hash lookup and one write of the cached body; the rate is bound by HTTP handling and "
        "the client on the same cores. "
        "An mm_hash hit also pays for receiving the 50 KB body and hashing it.",
        "- Full HD on `tiny`: the forward runs back to back; latency is queueing behind the clients.",
        "- Not measured on a GPU here.",
    ]
    return "\n".join(lines) + "\n"


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
    stats.emit(result, args.json, section)


if __name__ == "__main__":
    main()
