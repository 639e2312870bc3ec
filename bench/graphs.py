"""EPD vs the aggregated baseline (not a test): the same open-loop mixed workload against both graphs.

    python bench/graphs.py [--quick] [--preset tiny|small] [--rates 2,4,8] [--duration 30] [--pool 30]
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
  (`mm_encoder_forward_items_total`); agg counts the media items its engine encoded: it has no
  cache and encodes every media item it is sent (`engines.inline`), which is the frontend's
  `media_items` (/mm/stats).
The schedule (arrival times, classes, images) is the same for both graphs. All processes share the
machine's cores, so this shows scheduling effects, not GPU capacity.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import stats  # noqa: E402
from media_factory import image_bytes, natural_image  # noqa: E402

from mm_encoder.deploy.local import free_port  # noqa: E402

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


def chat(port: int, model: str, content, timeout: float = 120.0) -> dict:
    """One streaming chat request: {"ok", "status", "ttft_s", "total_s"}."""
    body = json.dumps({"model": model, "max_tokens": 8, "stream": True,
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
    from mm_encoder.deploy.status import collect

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


def measure(graph: str, preset: str, rates: list[float], duration: float, pool: int, n_single: int) -> dict:
    port = free_port()
    run = Path(tempfile.mkdtemp(prefix=f"mm-bench-graph-{graph}-{preset}-"))
    model = model_name(preset)
    t_start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mm_encoder.cli", "serve", str(ROOT / "graphs" / f"{graph}.yaml"),
                             "--run-dir", str(run), "--port", str(port), "--status-interval", "0",
                             "--dtype", "fp32", "--preset", preset],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    tail: list[str] = []
    ready = threading.Event()

    def watchdog() -> None:  # stops a graph that never gets ready: its output ends, and so does the wait below
        if not ready.wait(STARTUP_S) and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        for line in proc.stdout:
            tail = [*tail, line][-30:]
            if "ready: OpenAI base URL" in line:
                if served_model(line) != model:
                    raise RuntimeError(f"{graph} ({preset}) serves {served_model(line)!r}, not {model!r}: {line}")
                ready.set()
                break
        else:
            raise RuntimeError(f"{graph} ({preset}) was not ready (it exited, or was stopped after {STARTUP_S} s); "
                               f"its last output:\n{''.join(tail)}")
        threading.Thread(target=lambda: proc.stdout.read(), daemon=True).start()
        startup = time.perf_counter() - t_start
        for warm in ("warm up", image_part(0)):
            r = chat(port, model, warm)
            if not r["ok"]:
                raise RuntimeError(f"{graph} ({preset}): the warm-up request failed (HTTP {r['status']})")
        single = {"cold_ms": [], "repeat_ms": [], "text_idle_ttft_ms": []}
        for key, parts in (("cold_ms", [image_part(100 + i) for i in range(n_single)]),
                           ("repeat_ms", [image_part(100 + i) for i in range(n_single)]),
                           ("text_idle_ttft_ms", [TEXT] * (2 * n_single))):
            for content in parts:  # one at a time; a failed request is no latency figure
                r = chat(port, model, content)
                if r["ok"]:
                    single[key].append(r["ttft_s" if key == "text_idle_ttft_ms" else "total_s"] * 1e3)
            if not single[key]:
                raise RuntimeError(f"{graph} ({preset}): every single request for {key} failed")
        levels = []
        for i, rate in enumerate(rates):
            r = open_loop(port, model, run, schedule(rate, duration, pool, i), duration)
            r["rate"] = rate
            e = encodes_per_unique(graph, r)
            r["encodes_per_unique_image"] = None if e is None else stats.summary([e])
            levels.append(r)
            print(f"  {graph} ({preset}) @ {rate} req/s: text p50 {stats.fmt(r['text']['ttft_p50_ms'])} p99 "
                  f"{stats.fmt(r['text']['ttft_p99_ms'])}, image p50 {stats.fmt(r['image']['ttft_p50_ms'])}; "
                  f"forwards {r['forwards']}, media {r['media_items']}, unique {r['unique_images']}", flush=True)
    finally:
        ready.set()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if not os.environ.get("MM_BENCH_KEEP"):
            shutil.rmtree(run, ignore_errors=True)
    return {"model": model, "startup_s": startup, **{k: stats.summary(v) for k, v in single.items()},
            "levels": levels}


def encodes_per_unique(graph: str, level: dict) -> float | None:
    """EPD: forwards run by the encode worker; agg: media items the engine encoded inline."""
    n = level["forwards"] if graph == "epd" else level["media_items"]
    return n / level["unique_images"] if level["unique_images"] else None


def _ms(v: dict | None) -> str:
    return "-" if v is None else stats.fmt(v, 1 if v["median"] < 100 else 0)


def section(result: dict, plots: Path) -> str:
    cfg = result["config"]
    head = "## EPD vs the aggregated baseline (`python bench/graphs.py`)"
    if "presets" not in result:  # a graphs.json from before the graphs served a real model
        return (f"{head}\n\n_The stored figures are from before the graphs served a Kimi-K2.5 checkpoint; rerun "
                "`python bench/report.py --only graphs`._\n")
    runs = result["presets"]
    lines = [
        head,
        "",
        "Each graph alone under `mm-encoder serve GRAPH --dtype fp32`, serving a generated Kimi-K2.5 checkpoint "
        "with random weights (preset `tiny`: vision 64 wide x 2 layers, text model 256 wide x 2 layers with MoE; "
        "`small`: vision 384 x 4, text 768 x 6 with 8 experts), written by serve into its run directory and "
        "served as `kimi-k2.5-<preset>`. EPD: the encode worker runs the checkpoint's vision tower, behind the "
        "cluster tier, the router and 2 shards; 2 engines run its language model (transformers' DeepseekV3) on the "
        "spliced rows; a frontend. agg: 1 engine that runs the whole transformers model, its own vision tower on "
        "the pixels, in the loop that generates tokens; a frontend. Chat requests with a 1280x720 JPEG (1,196 "
        "image tokens) or text only, 8 streamed tokens each; TTFT is the time to the first chunk. The mixed "
        "workload is open loop: Poisson arrivals at each offered rate for "
        f"{cfg['duration_s']:.0f} s (seed {cfg['seed']}), half text-only, half with an image drawn from a pool of "
        f"{cfg['pool']} with a Zipf distribution (s={cfg['zipf_s']}), a fresh pool per rate; the same schedule for "
        "both graphs and both presets. Encodes per unique image: EPD counts the encode worker's forwards "
        "(`mm_encoder_forward_items_total`); agg counts the media items its engine encoded (it has no cache and "
        "encodes every media item it is sent: the frontend's `media_items`). Each preset's two graphs in one run, "
        "one after the other; all processes share the machine's cores. Single-request rows: median (min-max) over "
        "requests, one at a time.",
        "",
        "| preset | graph | startup s | cold image ms | repeated image ms | text TTFT idle ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for preset, pr in runs.items():
        for name, r in pr["graphs"].items():
            lines.append(f"| {preset} | {name} | {r['startup_s']:.0f} | {stats.fmt(r['cold_ms'], 0)} | "
                         f"{stats.fmt(r['repeat_ms'], 0)} | {stats.fmt(r['text_idle_ttft_ms'], 1)} |")
    lines += [
        "",
        "| preset | offered req/s | graph | text TTFT p50 ms | text p99 | image TTFT p50 ms | image p99 | "
        "text ok/sent | image ok/sent | unique images | encodes per unique image |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for preset, pr in runs.items():
        for i, rate in enumerate(cfg["rates"]):
            for name, r in pr["graphs"].items():
                lv = r["levels"][i]
                t, im = lv["text"], lv["image"]
                e = encodes_per_unique(name, lv)
                lines.append(f"| {preset} | {rate:g} | {name} | {_ms(t['ttft_p50_ms'])} | {_ms(t['ttft_p99_ms'])} | "
                             f"{_ms(im['ttft_p50_ms'])} | {_ms(im['ttft_p99_ms'])} | {t['ok']}/{t['sent']} | "
                             f"{im['ok']}/{im['sent']} | {lv['unique_images']} | {'-' if e is None else f'{e:.2f}'} |")
    lines += [""]
    for preset, pr in runs.items():
        lines += _findings(preset, pr["graphs"], cfg["rates"])
    png = _plot(result, plots)
    if png:
        lines += ["", f"![text TTFT under image load]({png})"]
    return "\n".join(lines) + "\n"


def _findings(preset: str, g: dict, rates: list[float]) -> list[str]:
    if "epd" not in g or "agg" not in g:
        return []
    out = []
    top = len(rates) - 1
    e, a = g["epd"]["levels"][top]["text"], g["agg"]["levels"][top]["text"]
    ee = [x for x in (encodes_per_unique("epd", lv) for lv in g["epd"]["levels"]) if x is not None]
    ae = [x for x in (encodes_per_unique("agg", lv) for lv in g["agg"]["levels"]) if x is not None]
    if e["ttft_p50_ms"] and a["ttft_p50_ms"]:
        out.append(
            f"- {preset}: text latency while images are encoded, at {rates[top]:g} req/s: text TTFT p50 "
            f"{_ms(e['ttft_p50_ms'])} ms in EPD vs {_ms(a['ttft_p50_ms'])} ms in agg "
            f"({stats.ratio(a['ttft_p50_ms'], e['ttft_p50_ms']):.1f}x), p99 {_ms(e['ttft_p99_ms'])} vs "
            f"{_ms(a['ttft_p99_ms'])} ms. In the aggregated engine every image encode runs in the loop that "
            "generates tokens, so a text request waits behind it.")
    if ee and ae:
        out.append(
            f"- {preset}: encodes per unique image: EPD {min(ee):.2f}-{max(ee):.2f} (roughly once: repeats are "
            f"cluster-tier hits and identical concurrent misses coalesce), agg {min(ae):.2f}-{max(ae):.2f} (every "
            "repeat is encoded again).")
    ec, ac = g["epd"]["cold_ms"], g["agg"]["cold_ms"]
    er, ar = g["epd"]["repeat_ms"], g["agg"]["repeat_ms"]
    out.append(f"- {preset}: a single cold image: EPD {stats.fmt(ec, 0)} ms, agg {stats.fmt(ac, 0)} ms; repeated: "
               f"EPD {stats.fmt(er, 0)} ms (a cluster-tier hit, then prefill), agg {stats.fmt(ar, 0)} ms (encoded "
               "again).")
    if ec["median"] > ac["median"]:
        out.append(f"- {preset}: the cold image is faster in agg on this machine: EPD adds hops (frontend -> tier -> "
                   "router -> shard -> worker and back, plus the RPC to the engine) and every process shares the "
                   "same cores with the encoder. On the intended hardware the encoder runs on its own GPU(s).")
    return out


def _plot(result: dict, plots: Path) -> str | None:
    plt = stats.pyplot()
    if plt is None:
        return None
    rates = result["config"]["rates"]
    runs = result["presets"]
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4), squeeze=False)
    for ax, (preset, pr) in zip(axes[0], runs.items(), strict=True):
        for name, color in (("epd", "#4c72b0"), ("agg", "#c44e52")):
            if name not in pr["graphs"]:
                continue
            lv = pr["graphs"][name]["levels"]
            for key, style in (("ttft_p50_ms", "-o"), ("ttft_p99_ms", "--^")):
                ys = [x["text"][key] for x in lv]
                ax.plot(rates, [float("nan") if y is None else y["median"] for y in ys], style, color=color,
                        label=f"{name} text TTFT {key.split('_')[1]}")
        ax.set_yscale("log")
        ax.set_xlabel("offered load, req/s (half with an image)")
        ax.set_ylabel("text TTFT, ms (log)")
        ax.set_title(f"Text TTFT under image load: EPD vs agg ({model_name(preset)})")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return stats.save_png(fig, plots, "graphs-text-ttft.png")


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
    stats.emit(result, args.json, section)
    print(f"wall {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
