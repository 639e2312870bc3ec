"""EPD vs the aggregated baseline (not a test): the same open-loop mixed workload against both graphs.

    python -m bench.graphs [--quick] [--preset tiny|small] [--rates 2,4,8] [--duration 30] [--pool 30]
                           [--json PATH]

The model: a generated Kimi-K2.5 checkpoint with random weights (`engines.tiny_checkpoint`, preset
`tiny` or `small`; without --preset both, tiny then small, each graph pair in one run; --quick: tiny
only), written by serve into the run directory and served as `kimi-k2.5-<preset>` with
`mm-encoder serve GRAPH --dtype fp32 --preset PRESET`. EPD (graphs/epd.yaml): the encode
worker runs the checkpoint's vision tower, the engines its language model through transformers;
agg (graphs/agg.yaml): one engine that runs the whole transformers model, its own vision tower on
pixels. Each graph runs alone, then:
- single requests: a cold image (new each time) and the same image repeated, one at a time, and
  text-only TTFT with the graph idle;
- an open-loop mixed workload per offered rate: Poisson arrivals (fixed seed), half text-only
  streaming requests, half chat requests with one 1280x720 JPEG (1,196 image tokens), the image
  drawn from a pool with a Zipf distribution (s=1.1), a fresh pool per rate so each rate starts
  cold. Arrivals do not wait for answers (open loop); at most 128 requests in flight from the
  client. Every request streams 8 tokens; TTFT = time to the first chunk.
- encodes per unique image: EPD counts the encode worker's forwards
  (`dynamo_component_encode_forward_items_total`); agg counts the media items its engine encoded: it has no
  cache and encodes every media item it is sent (`engines.inline`), which is the frontend's
  `media_items` (/mm/stats).
The schedule (arrival times, classes, images) is the same for both graphs. All processes share the
machine's cores, so this shows scheduling effects, not GPU capacity.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from bench import stats
from harness.media_factory import image_bytes, natural_image
from harness.serve_fixtures import Served
from mm_encoder.serve.site import free_port

ZIPF_S = 1.1
SEED = 20261201
MAX_INFLIGHT = 128
TEXT = [{"type": "text", "text": "Tell me a story about a fox. " * 4}]
STARTUP_S = 600  # a graph that is not ready by then (the small checkpoint is written in seconds) is stopped
PRESETS = ("tiny", "small")
GRAPHS = ("epd", "agg")


def model_name(preset: str) -> str:
    """The served name of the checkpoint serve generates for `preset` (its directory's name)."""
    return f"kimi-k2.5-{preset}"


def chat(port: int, model: str, content, timeout: float = 120.0, max_tokens: int = 8) -> dict:
    """One streaming chat request: {"ok", "status", "ttft_s", "total_s"}."""
    body = json.dumps({"model": model, "max_tokens": max_tokens, "stream": True,
                       "messages": [{"role": "user", "content": content}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for line in r:
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter() - t0
            return {"ok": first is not None, "status": r.status, "ttft_s": first, "total_s": time.perf_counter() - t0}
    except urllib.error.HTTPError as e:
        return {"ok": False, "status": e.code, "ttft_s": None, "total_s": time.perf_counter() - t0}
    except OSError:
        return {"ok": False, "status": 0, "ttft_s": None, "total_s": time.perf_counter() - t0}


_IMAGES: dict[int, list[dict]] = {}


def image_part(seed: int) -> list[dict]:
    if seed not in _IMAGES:
        data = base64.b64encode(image_bytes(natural_image(1280, 720, seed=seed), "JPEG", quality=90)).decode()
        _IMAGES[seed] = [{"type": "text", "text": "What is in this image?"},
                         {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{data}"}}]
    return _IMAGES[seed]


def schedule(rate: float, duration: float, pool: int, level: int) -> list[tuple[float, int | None]]:
    """(arrival offset s, image seed or None for text) for one offered rate; seeded, the same for both graphs."""
    rng = np.random.default_rng(SEED + level)
    p = 1.0 / np.arange(1, pool + 1) ** ZIPF_S
    p /= p.sum()
    out, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / rate)
        if t >= duration:
            return out
        image = int(rng.choice(pool, p=p)) if rng.random() < 0.5 else None
        out.append((t, None if image is None else 100_000 * (level + 1) + image))


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def counters(port: int, run: Path) -> dict:
    """Encodes so far: the encode worker's forwarded items (EPD) and the frontend's media items."""
    from mm_encoder.serve.status import collect

    out = {"forwards": 0.0, "media_items": 0.0}
    for c in collect(run)["components"]:
        if c["kind"] == "encoder":
            out["forwards"] += c.get("encodes") or 0
    for p in _get_json(f"http://127.0.0.1:{port}/mm/stats").get("processors", []):
        out["media_items"] += p.get("media_items", 0)
    return out


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def open_loop(port: int, model: str, run: Path, plan: list[tuple[float, int | None]], duration: float) -> dict:
    for _, seed in plan:  # images built before the clock starts
        if seed is not None:
            image_part(seed)
    before = counters(port, run)
    results: list[tuple[str, dict]] = []
    lock = threading.Lock()
    inflight = threading.Semaphore(MAX_INFLIGHT)
    skipped = [0]

    def one(seed: int | None):
        try:
            r = chat(port, model, TEXT if seed is None else image_part(seed))
            with lock:
                results.append(("text" if seed is None else "image", r))
        finally:
            inflight.release()

    threads = []
    t0 = time.perf_counter()
    for at, seed in plan:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if not inflight.acquire(blocking=False):
            skipped[0] += 1
            continue
        th = threading.Thread(target=one, args=(seed,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(max(1.0, t0 + duration + 150 - time.perf_counter()))
    wall = time.perf_counter() - t0
    after = counters(port, run)
    out: dict = {"sent": len(threads), "skipped": skipped[0], "wall_s": wall,
                 "unique_images": len({s for _, s in plan if s is not None}),
                 "forwards": after["forwards"] - before["forwards"],
                 "media_items": after["media_items"] - before["media_items"]}
    for cls in ("text", "image"):
        rs = [r for c, r in results if c == cls]
        ttft = [r["ttft_s"] * 1e3 for r in rs if r["ok"]]
        out[cls] = {"sent": sum(1 for _, s in plan if (s is None) == (cls == "text")), "ok": len(ttft),
                    "errors": {str(k): sum(1 for r in rs if not r["ok"] and r["status"] == k)
                               for k in sorted({r["status"] for r in rs if not r["ok"]})},
                    **{k: (None if v is None else stats.summary([v])) for k, v in (
                        ("ttft_p50_ms", pct(ttft, 50)), ("ttft_p99_ms", pct(ttft, 99)),
                        ("ttft_max_ms", max(ttft, default=None)))}}
    return out


def served_model(line: str) -> str | None:
    """The model name in serve's ready line: `... ready: OpenAI base URL ... (model NAME); ...`."""
    _, sep, rest = line.partition("(model ")
    return rest.split(")", 1)[0] if sep else None


@contextlib.contextmanager
def serving(graph: str, run: Path, port: int, preset: str) -> Iterator[float]:
    """`mm-encoder serve graphs/<graph>.yaml` in fp32 on the generated `preset` checkpoint
    (harness.serve_fixtures.Served) for the block, once ready and serving that checkpoint's model: the
    seconds it took to be ready. Stopped, and checked to leave nothing, when the block ends."""
    model, t_start = model_name(preset), time.perf_counter()
    with Served(f"graphs/{graph}.yaml", run, port, "--dtype", "fp32", "--preset", preset) as served:
        try:
            line = served.proc.wait_for("ready: OpenAI base URL", STARTUP_S)
        except AssertionError as e:
            raise RuntimeError(f"{graph} ({preset}) was not ready: {e}") from None
        if served_model(line) != model:
            raise RuntimeError(f"{graph} ({preset}) serves {served_model(line)!r}, not {model!r}: {line}")
        yield time.perf_counter() - t_start


def measure(graph: str, preset: str, rates: list[float], duration: float, pool: int, n_single: int) -> dict:
    """One graph under `mm-encoder serve` (`serving`): single requests, then each rate."""
    port, model = free_port(), model_name(preset)
    run = Path(tempfile.mkdtemp(prefix=f"mm-bench-graph-{graph}-{preset}-"))
    try:
        with serving(graph, run, port, preset) as startup:
            single = single_requests(graph, preset, port, model, n_single)
            levels = [offered_rate(graph, preset, port, model, run, rate, i, duration, pool)
                      for i, rate in enumerate(rates)]
    finally:
        if not os.environ.get("MM_BENCH_KEEP"):
            shutil.rmtree(run, ignore_errors=True)
    return {"model": model, "startup_s": startup, **{k: stats.summary(v) for k, v in single.items()},
            "levels": levels}


def single_requests(graph: str, preset: str, port: int, model: str, n_single: int) -> dict[str, list[float]]:
    """Warm-up, then one at a time: cold images, the same images again, text-only TTFT (ms)."""
    for warm in ("warm up", image_part(0)):
        r = chat(port, model, warm)
        if not r["ok"]:
            raise RuntimeError(f"{graph} ({preset}): the warm-up request failed (HTTP {r['status']})")
    single: dict[str, list[float]] = {"cold_ms": [], "repeat_ms": [], "text_idle_ttft_ms": []}
    for key, parts in (("cold_ms", [image_part(100 + i) for i in range(n_single)]),
                       ("repeat_ms", [image_part(100 + i) for i in range(n_single)]),
                       ("text_idle_ttft_ms", [TEXT] * (2 * n_single))):
        for content in parts:  # one at a time; a failed request is no latency figure
            r = chat(port, model, content)
            if r["ok"]:
                single[key].append(r["ttft_s" if key == "text_idle_ttft_ms" else "total_s"] * 1e3)
        if not single[key]:
            raise RuntimeError(f"{graph} ({preset}): every single request for {key} failed")
    return single


def offered_rate(graph: str, preset: str, port: int, model: str, run: Path, rate: float, level: int,
                 duration: float, pool: int) -> dict:
    r = open_loop(port, model, run, schedule(rate, duration, pool, level), duration)
    r["rate"] = rate
    e = encodes_per_unique(graph, r)
    r["encodes_per_unique_image"] = None if e is None else stats.summary([e])
    print(f"  {graph} ({preset}) @ {rate} req/s: text p50 {stats.fmt(r['text']['ttft_p50_ms'])} p99 "
          f"{stats.fmt(r['text']['ttft_p99_ms'])}, image p50 {stats.fmt(r['image']['ttft_p50_ms'])}; "
          f"forwards {r['forwards']}, media {r['media_items']}, unique {r['unique_images']}", flush=True)
    return r


def encodes_per_unique(graph: str, level: dict) -> float | None:
    """EPD: forwards run by the encode worker; agg: media items the engine encoded inline."""
    n = level["forwards"] if graph == "epd" else level["media_items"]
    return n / level["unique_images"] if level["unique_images"] else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny only, rates 2 and 6, 12 s each, a pool of 12, 2 single requests")
    p.add_argument("--preset", choices=PRESETS, action="append",
                   help="the generated checkpoint's size (repeatable; default: tiny then small; --quick: tiny)")
    p.add_argument("--rates", default="2,4,8", help="offered loads, req/s, comma-separated")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    p.add_argument("--pool", type=int, default=30, help="distinct images per rate (Zipf over them)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    duration, pool, n_single = args.duration, args.pool, 4
    presets = list(PRESETS)
    if args.quick:
        rates, duration, pool, n_single = [2.0, 6.0], 12.0, 12, 2
        presets = ["tiny"]
    presets = list(dict.fromkeys(args.preset)) if args.preset else presets
    t0 = time.perf_counter()
    runs = {}
    for preset in presets:
        print(f"preset {preset} ({model_name(preset)})", flush=True)
        runs[preset] = {"model": model_name(preset),
                        "graphs": {g: measure(g, preset, rates, duration, pool, n_single) for g in GRAPHS}}
    result = {"machine": stats.machine(), "wall_s": time.perf_counter() - t0,
              "config": {"rates": rates, "duration_s": duration, "pool": pool, "zipf_s": ZIPF_S, "seed": SEED,
                         "image": "1280x720 JPEG", "max_tokens": 8, "dtype": "fp32", "presets": presets},
              "presets": runs}
    stats.emit(result, args.json, "graphs")
    print(f"wall {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
