"""AIPerf beside our own client (not a test): the field's benchmark client against EPD and the baseline.

    python -m bench.aiperf [--quick] [--requests N] [--concurrency C] [--image WxH] [--json PATH]

Operators of Dynamo measure with AIPerf (`aiperf profile`); this runs it, from its own virtualenv
(`make aiperf-venv`: .venv-aiperf, AIPERF_PIN in the Makefile), against each graph under
`mm-encoder serve GRAPH --dtype fp32 --preset tiny` on a free port with a run directory of its own:
graphs/epd.yaml (the encode worker, cache tiers, engines that get embeddings) and graphs/agg.yaml
(engines that encode pixels themselves), one after the other, each stopped cleanly. Per graph, after
a warm-up (a text request, then images at the cases' concurrency so that neither client pays for
the first batches):
- miss: AIPerf's synthetic chat requests with one `--image-source noise` JPEG each, a new random image
  per request (its way to keep a server from deduplicating inputs): every image is a cache miss;
- hit: an AIPerf input file (`--custom-dataset-type single_turn`, written here) whose every line
  names the same noise JPEG. AIPerf re-encodes an image file it reads, so the bytes the server caches
  are AIPerf's, not the file's: a one-request AIPerf run with the same file sends them first, then
  every request of the measured run is a cache hit.
Every request streams `--osl` tokens (AIPerf's `max_completion_tokens`), at most --concurrency in
flight, a fixed count (--requests); in each case AIPerf first, then our client. AIPerf's figures are
read from its JSON export (`profile_export_aiperf.json`): request latency, TTFT, request throughput,
p50/p99.

Our own measurement of the same work, beside it:
- the frontend's own records of exactly AIPerf's requests: each request's `first_token_ms` (from its
  admission to the engine's first item) in /mm/stats `recent`, and its request-duration histogram
  (`dynamo_frontend_request_duration_seconds`: sum and count before and after, so a mean; its buckets
  are too coarse for a median);
- our client (bench/graphs.py's `chat`): as many requests of the same shape at the same concurrency,
  right after AIPerf's (fresh noise images for miss, the same image for hit), its medians and p99;
- encodes per request: EPD counts the encode worker's forwards, agg the media items its engines encoded
  (it has no cache): 1 for a miss, 0 for an EPD hit, 1 for every agg request.
AIPerf's own processes (its controller, dataset manager, workers, record processors) share the machine's
cores with the graph: the CPU seconds each client spent are measured (AIPerf's: its process tree's, from
getrusage(RUSAGE_CHILDREN) around its run, and its live processes' from /proc between the lines it prints
as its profiling phase starts and completes; ours: this process's over its requests).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench import stats
from bench.graphs import chat, counters, model_name, serving
from harness.processes import Process
from mm_encoder.serve.site import free_port

ROOT = Path(__file__).resolve().parents[1]
AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"
GRAPHS = ("epd", "agg")
CASES = ("miss", "hit")
PRESET = "tiny"
MODEL = model_name(PRESET)
SEED = 20261207
TEXT = "Describe this picture in a few words, then say what its colours are and where the light comes from."
AIPERF_TIMEOUT_S = 600  # one `aiperf profile` run, its start included (~10 s of it here)
# From AIPerf's JSON export: (our key, its metric, unit); each a dict {"avg", "p50", "p90", "p99", "min", "max"}.
METRICS = (("request_latency_ms", "request_latency", "ms"), ("ttft_ms", "time_to_first_token", "ms"),
           ("itl_ms", "inter_token_latency", "ms"), ("request_throughput", "request_throughput", "requests/sec"),
           ("output_token_throughput", "output_token_throughput", "tokens/sec"),
           ("prompt_tokens", "usage_prompt_tokens", "tokens"), ("request_kb_sent", "http_req_data_sent", "KB"),
           ("benchmark_duration_s", "benchmark_duration", "sec"))
STATS = ("avg", "p50", "p90", "p99", "min", "max")


# --- pure parts (tests/test_bench_aiperf.py) ----------------------------------------------------------------


def noise_jpeg(width: int, height: int, seed: int) -> bytes:
    """Uniform random pixels as a JPEG (PIL's default quality), like AIPerf's `--image-source noise`:
    a hit image of the same size and kind as its miss images."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG")
    return out.getvalue()


def write_input_file(path: Path, text: str, images: list[Path]) -> Path:
    """AIPerf's `single_turn` JSONL: one request per line, `{"text": ..., "image": PATH}` (AIPerf
    reads the file and sends it as a data: URL). The same path on every line: every request a hit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for image in images:
            f.write(json.dumps({"text": text, "image": str(image)}) + "\n")
    return path


def aiperf_command(url: str, tokenizer: Path, artifacts: Path, *, requests: int, concurrency: int, osl: int,
                   width: int, height: int, input_file: Path | None = None, seed: int = SEED,
                   aiperf: Path = AIPERF) -> list[str]:
    """`aiperf profile` for one case: synthetic noise images (input_file None) or the input file's."""
    cmd = [str(aiperf), "profile", "--model", MODEL, "--url", url, "--endpoint-type", "chat", "--streaming",
           # The served checkpoint's own tokenizer, by its absolute path (AIPerf then asks no hub); only to
           # build synthetic prompts: token counts come from the server's usage (a random model's text
           # re-tokenizes differently).
           "--tokenizer", str(tokenizer), "--use-server-token-count",
           "--osl", str(osl), "--request-count", str(requests), "--concurrency", str(concurrency),
           "--random-seed", str(seed), "--request-timeout-seconds", "120",
           "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry", "--artifact-dir", str(artifacts)]
    if input_file is None:
        cmd += ["--image-source", "noise", "--image-width-mean", str(width), "--image-height-mean", str(height),
                "--image-format", "jpeg", "--image-batch-size", "1", "--isl", "24",
                "--conversation-num", str(requests)]  # an entry per request: no image sent twice
    else:
        cmd += ["--input-file", str(input_file), "--custom-dataset-type", "single_turn",
                "--dataset-sampling-strategy", "sequential"]
    return cmd


def parse_export(export: dict) -> dict:
    """The figures we report from AIPerf's JSON export (`profile_export_aiperf.json`): each metric's
    {avg, p50, p90, p99, min, max} (None where AIPerf gives none), the request counts, errors."""
    out: dict = {"aiperf_version": export.get("aiperf_version"), "was_cancelled": export.get("was_cancelled")}
    for key, name, unit in METRICS:
        m = export.get(name)
        if not isinstance(m, dict):
            out[key] = None
            continue
        if m.get("unit") != unit:
            raise ValueError(f"AIPerf's {name} is in {m.get('unit')!r}, not {unit!r}")
        out[key] = {s: m.get(s) for s in STATS}
    count = export.get("request_count") or {}
    done = export.get("completed_request_count") or {}
    out["requests"] = int(count["avg"]) if count.get("avg") is not None else None
    out["completed"] = int(done["avg"]) if done.get("avg") is not None else out["requests"]
    errors = export.get("error_summary") or []
    out["errors"] = sum(int(e.get("count", 0)) for e in errors) if isinstance(errors, list) else None
    return out


DURATION = "dynamo_frontend_request_duration_seconds"


def duration_histogram(metrics_text: str) -> tuple[float, float]:
    """(sum s, count) of the frontend's request-duration histogram, all label sets summed."""
    total, count = 0.0, 0.0
    for line in metrics_text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        base = series.split("{", 1)[0]
        if base == DURATION + "_sum":
            total += float(value)
        elif base == DURATION + "_count":
            count += float(value)
    return total, count


def dist(values: list[float]) -> dict | None:
    """{avg, p50, p90, p99, min, max} of `values`, AIPerf's shape (numpy's linear percentiles); None for none."""
    if not values:
        return None
    return {"avg": float(np.mean(values)), **{f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)},
            "min": float(min(values)), "max": float(max(values))}


def frontend_figures(before: dict, after: dict) -> dict:
    """The frontend's view of the requests between two snapshots ({"duration": (sum, count), "recent":
    [/mm/stats records]}): its mean request duration and its records' first_token_ms (ms)."""
    seen = {r["request_id"] for r in before["recent"]}
    new = [r for r in after["recent"] if r["request_id"] not in seen]
    s, n = after["duration"][0] - before["duration"][0], after["duration"][1] - before["duration"][1]
    return {"requests": int(n), "request_mean_ms": s / n * 1e3 if n > 0 else None, "records": len(new),
            "first_token_ms": dist([r["timings"]["first_token_ms"] for r in new
                                    if r.get("timings", {}).get("first_token_ms") is not None])}


def client_figures(results: list[dict], wall_s: float) -> dict:
    """Our client's figures in AIPerf's shape: latency and TTFT {avg, p50, p90, p99, min, max} in ms, throughput."""
    ok = [r for r in results if r["ok"]]
    return {"requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
            "request_latency_ms": dist([r["total_s"] * 1e3 for r in ok]),
            "ttft_ms": dist([r["ttft_s"] * 1e3 for r in ok]),
            "request_throughput": {"avg": len(ok) / wall_s if wall_s > 0 else None}}


# --- running ----------------------------------------------------------------------------------------------


def _frontend(port: int) -> dict:
    """What frontend_figures compares: the duration histogram and /mm/stats' recent records (256 kept)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        duration = duration_histogram(r.read().decode())
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/mm/stats", timeout=10) as r:
        recent = [x for p in json.loads(r.read()).get("processors", []) for x in p.get("recent", [])]
    return {"duration": duration, "recent": recent}


def _encodes(graph: str, before: dict, after: dict) -> float:
    """EPD: forwards the encode worker ran; agg: media items its engines encoded (no cache)."""
    key = "forwards" if graph == "epd" else "media_items"
    return after[key] - before[key]


def _content(jpeg: bytes) -> list[dict]:
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    return [{"type": "text", "text": TEXT}, {"type": "image_url", "image_url": {"url": url}}]


def _cpu_s(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


PHASE_STARTED, PHASE_COMPLETE = "Phase profiling (profiling) started", "Phase profiling (profiling) complete"


def session_cpu_s(sid: int, proc: Path = Path("/proc")) -> float:
    """CPU seconds (user + system) of the live processes of session `sid` (AIPerf's, started in a
    session of its own): its workers while they run, not only once reaped."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            f = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(f[3]) == sid:  # after the name: state ppid pgrp session ... utime(11) stime(12)
            total += int(f[11]) + int(f[12])
    return total / tick


def run_aiperf(cmd: list[str], artifacts: Path, log: Path) -> tuple[dict, dict]:
    """One `aiperf profile` in its own session (stopped with its workers past AIPERF_TIMEOUT_S): its
    export, and the CPU seconds its processes used: in all (they are reaped by it, it by us:
    RUSAGE_CHILDREN) and over its profiling phase (from its own lines; None where one was not seen)."""
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1"}
    # Not HF_HUB_OFFLINE: AIPerf 0.13.0 then looks a tokenizer up in the hub's cache only, a local path too.
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    cpu0 = _cpu_s(resource.RUSAGE_CHILDREN)
    phase: dict[str, float] = {}

    def on_line(line: str) -> None:
        for key, needle in (("start", PHASE_STARTED), ("end", PHASE_COMPLETE)):
            if needle in line and key not in phase:
                phase[key] = session_cpu_s(proc.pid)

    proc = Process(cmd, name="aiperf", env=env, cwd=artifacts.parent, log=log, on_line=on_line)
    try:
        rc = proc.wait(AIPERF_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.stop(signal.SIGTERM, grace_s=10, group=True)
        raise RuntimeError(f"aiperf ran past {AIPERF_TIMEOUT_S} s; its last lines:\n{proc.tail(20)}") from None
    proc.stop(grace_s=10, group=True)  # anything it left in its session
    export = artifacts / "profile_export_aiperf.json"
    if rc != 0 or not export.is_file():
        raise RuntimeError(f"aiperf exited {rc} (export written: {export.is_file()}); its last lines:\n{proc.tail(30)}")
    cpu = {"cpu_s": _cpu_s(resource.RUSAGE_CHILDREN) - cpu0,
           "profiling_cpu_s": phase["end"] - phase["start"] if len(phase) == 2 else None}
    return json.loads(export.read_text()), cpu


def own_client(port: int, contents: list[list[dict]], concurrency: int, osl: int) -> tuple[list[dict], float, float]:
    """`contents` as streaming chat requests, `concurrency` at a time (closed loop, like AIPerf's
    --concurrency); (results, wall seconds, CPU seconds of this process meanwhile)."""
    results: list[dict] = []
    lock = threading.Lock()
    queue = list(enumerate(contents))

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                _, content = queue.pop(0)
            r = chat(port, MODEL, content, max_tokens=osl)
            with lock:
                results.append(r)

    t0, cpu0 = time.perf_counter(), _cpu_s(resource.RUSAGE_SELF)
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(AIPERF_TIMEOUT_S)
    return results, time.perf_counter() - t0, _cpu_s(resource.RUSAGE_SELF) - cpu0


def measure(graph: str, args, work: Path) -> dict:
    """One graph under `mm-encoder serve`: warm-up, then per case AIPerf and our client."""
    port, run = free_port(), work / f"run-{graph}"
    width, height = args.width, args.height
    out: dict = {"graph": graph, "cases": {}}
    with serving(graph, run, port, PRESET) as startup_s:
        out["startup_s"] = startup_s
        tokenizer = run / "checkpoint" / MODEL
        # warm-up: a text request, then images `concurrency` at a time (the batch shapes the cases will
        # see compiled and cached before either client measures: the first client would pay for them)
        warm = [_content(noise_jpeg(width, height, SEED - 1 - i)) for i in range(2 * args.concurrency)]
        for r in [chat(port, MODEL, "warm up", max_tokens=args.osl), *own_client(port, warm, args.concurrency,
                                                                                 args.osl)[0]]:
            if not r["ok"]:
                raise RuntimeError(f"{graph}: a warm-up request failed (HTTP {r['status']})")
        hit_jpeg = work / "hit.jpg"
        hit_jpeg.write_bytes(noise_jpeg(width, height, SEED))
        for case in CASES:
            out["cases"][case] = one_case(graph, case, port, run, tokenizer, hit_jpeg, args, work)
    return out


def one_case(graph: str, case: str, port: int, run: Path, tokenizer: Path, hit_jpeg: Path, args, work: Path) -> dict:
    artifacts = work / f"aiperf-{graph}-{case}"
    input_file = (write_input_file(work / f"hit-{graph}.jsonl", TEXT, [hit_jpeg] * args.requests)
                  if case == "hit" else None)
    shape = dict(concurrency=args.concurrency, osl=args.osl, width=args.width, height=args.height,
                 input_file=input_file)
    url = f"http://127.0.0.1:{port}"
    if input_file is not None:  # AIPerf's bytes of the image sent once, by AIPerf, before the run
        prime = work / f"aiperf-{graph}-{case}-prime"
        run_aiperf(aiperf_command(url, tokenizer, prime, requests=1, **shape), prime, work / f"{prime.name}.log")
    # AIPerf's run, between two snapshots of the encodes and the frontend's records
    cmd = aiperf_command(url, tokenizer, artifacts, requests=args.requests, **shape)
    t0, enc0, front0 = time.perf_counter(), counters(port, run), _frontend(port)
    export, cpu = run_aiperf(cmd, artifacts, work / f"aiperf-{graph}-{case}.log")
    aiperf_wall, enc1, front1 = time.perf_counter() - t0, counters(port, run), _frontend(port)
    ap = parse_export(export)
    ap["client_cpu_s"], ap["client_wall_s"] = cpu["cpu_s"], aiperf_wall  # its start and exit included
    ap["profiling_cpu_s"] = cpu["profiling_cpu_s"]  # over its profiling phase alone
    ap["encodes_per_request"] = _encodes(graph, enc0, enc1) / max(1, ap["requests"] or 0)
    server = frontend_figures(front0, front1)
    if args.keep_exports:
        args.keep_exports.mkdir(parents=True, exist_ok=True)
        shutil.copy(artifacts / "profile_export_aiperf.json", args.keep_exports / f"{graph}-{case}.json")
    # our client: the same shape of request, right after AIPerf's, between two snapshots too
    if case == "hit":  # our bytes of the image, seen once before: every request of ours a hit
        contents = [_content(hit_jpeg.read_bytes())] * args.requests
        chat(port, MODEL, contents[0], max_tokens=args.osl)
    else:
        contents = [_content(noise_jpeg(args.width, args.height, SEED + 1000 + i)) for i in range(args.requests)]
    enc2, front2 = counters(port, run), _frontend(port)
    results, wall, ours_cpu = own_client(port, contents, args.concurrency, args.osl)
    enc3, front3 = counters(port, run), _frontend(port)
    ours = client_figures(results, wall)
    ours["client_cpu_s"], ours["client_wall_s"] = ours_cpu, wall
    ours["encodes_per_request"] = _encodes(graph, enc2, enc3) / max(1, len(results))
    ours_server = frontend_figures(front2, front3)
    print(f"  {graph} {case}: aiperf latency p50 {_f(ap['request_latency_ms'], 'p50')} ms, TTFT p50 "
          f"{_f(ap['ttft_ms'], 'p50')} ms, {_f(ap['request_throughput'], 'avg', 2)} req/s, encodes/request "
          f"{ap['encodes_per_request']:.2f}; ours latency p50 {_f(ours['request_latency_ms'], 'p50')} ms, TTFT p50 "
          f"{_f(ours['ttft_ms'], 'p50')} ms, {_f(ours['request_throughput'], 'avg', 2)} req/s; the frontend's first "
          f"token p50 {_f(server['first_token_ms'], 'p50')} ms over {server['records']} records", flush=True)
    # the frontend's own record of each client's requests: "frontend" AIPerf's, "frontend_ours" ours;
    # the machine's 1-minute load average as the case ended (above its cores: other work shared them)
    return {"aiperf": ap, "frontend": server, "ours": ours, "frontend_ours": ours_server, "command": _shown(cmd, work),
            "loadavg_1m": os.getloadavg()[0]}


def _f(d: dict | None, key: str, digits: int = 0) -> str:
    return "-" if not d or d.get(key) is None else f"{d[key]:.{digits}f}"


def _shown(cmd: list[str], work: Path) -> str:
    """The command as a reader would type it: the aiperf venv's path relative, the temporary folder as $WORK."""
    text = " ".join(cmd).replace(str(AIPERF), ".venv-aiperf/bin/aiperf").replace(str(work), "$WORK")
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="20 requests per case (default 40)")
    p.add_argument("--requests", type=int, default=40, help="requests per case and client")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight (AIPerf's --concurrency)")
    p.add_argument("--osl", type=int, default=8, help="tokens each request streams")
    p.add_argument("--image", default="640x480", help="WxH of every noise JPEG")
    p.add_argument("--graphs", default=",".join(GRAPHS), help="comma-separated, of epd,agg")
    p.add_argument("--keep-exports", type=Path, help="copy each AIPerf JSON export here as GRAPH-CASE.json")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        args.requests = 20
    args.width, args.height = (int(x) for x in args.image.lower().split("x"))
    if not AIPERF.is_file():
        raise SystemExit(f"error: {AIPERF.relative_to(ROOT)} is missing: make aiperf-venv")
    version = subprocess.run([str(AIPERF), "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="mm-bench-aiperf-"))
    try:
        graphs = {g: measure(g, args, work) for g in args.graphs.split(",")}
    finally:
        if not os.environ.get("MM_BENCH_KEEP"):
            shutil.rmtree(work, ignore_errors=True)
    result = {"machine": stats.machine(), "wall_s": time.perf_counter() - t0, "aiperf_version": version,
              "config": {"requests": args.requests, "concurrency": args.concurrency, "osl": args.osl,
                         "image": f"{args.width}x{args.height} noise JPEG", "preset": PRESET, "dtype": "fp32",
                         "quick": args.quick},
              "graphs": graphs}
    stats.emit(result, args.json, "aiperf")
    print(f"wall {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
