"""Frontend memory benchmark (not a test): RSS across concurrent long streams with 4K-sized embeddings.

    python bench/frontend.py [--streams 50] [--tokens 200] [--quick]

Processes on loopback (Dynamo file discovery + TCP): an encode worker serving `tiny-wide` (tiny
tower, 7168-wide projector), one reference engine for it (0 transformer blocks: embeddings, norm,
head; width 7168), and the frontend (RPC to the encoder). N clients ask at once about the same
3840x2160 image (4,214 tokens x 7168 bf16: a ~40 MB body per request) and stream `--tokens`
tokens each. The frontend's RSS is sampled every 100 ms: before, at its peak (bodies in flight
until each request's prefill), and through the decode phase, when it should hold no embeddings.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import worker as worker_bench  # noqa: E402  (bench/worker.py: tiny-wide configs)
from media_factory import image_bytes, natural_image  # noqa: E402

from mm_encoder.deploy.local import free_port  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0



def start(name: str, run: Path, env: dict, *args: str, ready: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE,
                            stderr=(run / f"{name}.log").open("w"), text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if ready in line:
            return proc
        if not line and proc.poll() is not None:
            break
    raise RuntimeError(f"{name} did not start: {(run / f'{name}.log').read_text()[-2000:]}")


def stream_chat(port: int, body: bytes, result: dict) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    first = None
    n = 0
    last = b""
    with urllib.request.urlopen(req, timeout=900) as r:
        for line in r:
            if line.startswith(b"data: {"):
                n += 1
                last = line
                if first is None:
                    first = time.monotonic() - t0
    usage = json.loads(last[6:]).get("usage") or {} if last else {}
    result.update(first_s=first, chunks=n, total_s=time.monotonic() - t0, last=last[:300],
                  completion_tokens=usage.get("completion_tokens"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=50)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="10 streams of 60 tokens")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        args.streams, args.tokens = 10, 60
    run = Path(tempfile.mkdtemp(prefix="mm-bench-frontend-"))
    configs = worker_bench.bench_configs()
    os.environ["MM_ENCODER_CONFIGS"] = str(configs)
    from mm_encoder.engines.model_dir import make_model_dir

    model_dir = make_model_dir(run / "wide-chat", "tiny-wide", name="wide-chat", context_length=8192, num_layers=0)
    env = {**os.environ, "DYN_FILE_KV": str(run / "kv"), "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_LOG": "error",
           # a 4K image's engine request is ~40 MB, above the request plane's default message limit
           "DYN_TCP_MAX_MESSAGE_SIZE": os.environ.get("DYN_TCP_MAX_MESSAGE_SIZE", str(256 << 20)),
           "DYN_SELF_HOST_METADATA": "0", "MM_ENCODER_CONFIGS": str(configs), "MM_ENCODER_LOG_LEVEL": "WARNING"}
    port = free_port()
    procs = []
    try:
        procs.append(start("worker", run, env, "-m", "mm_encoder.worker", "--model", "tiny-wide", "--dynamo",
                           "--http-port", "-1", ready="worker ready"))
        procs.append(start("engine", run, env, "-m", "mm_encoder.engines.reference", "--model-dir", str(model_dir),
                           ready="engine ready"))
        frontend = start("frontend", run, env, "-m", "mm_encoder.frontend", "--model-dir", str(model_dir),
                         "--http-port", str(port), "--log-level", "WARNING", ready="frontend ready")
        procs.append(frontend)
        img = image_bytes(natural_image(3840, 2160, seed=4), "JPEG", quality=90)
        url = "data:image/jpeg;base64," + base64.b64encode(img).decode()
        body = json.dumps({"model": "wide-chat", "max_tokens": args.tokens, "stream": True,
                           "ignore_eos": True, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Describe it."},
                                         {"type": "image_url", "image_url": {"url": url}}]}]}).encode()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until the model is served, then warm the encoder's cache
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    if json.loads(r.read())["data"]:
                        break
            except OSError:
                pass
            time.sleep(0.1)
        warm: dict = {}
        stream_chat(port, body, warm)
        baseline = rss_mb(frontend.pid)
        samples: list[tuple[float, float]] = []
        results = [{} for _ in range(args.streams)]
        threads = [threading.Thread(target=stream_chat, args=(port, body, r)) for r in results]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            samples.append((time.monotonic() - t0, rss_mb(frontend.pid)))
            time.sleep(0.1)
        for t in threads:
            t.join()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/mm/stats", timeout=10) as r:
            stats = json.loads(r.read())["processors"][0]
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(configs, ignore_errors=True)
    last_first = max(r["first_s"] for r in results)
    decode = [mb for t, mb in samples if t > last_first]
    body_mb = 4214 * 7168 * 2 / 1e6
    out = {
        "streams": args.streams, "tokens": args.tokens, "embeddings_mb_per_request": round(body_mb, 1),
        "rss_baseline_mb": round(baseline, 1), "rss_peak_mb": round(max(mb for _, mb in samples), 1),
        "rss_decode_median_mb": round(statistics.median(decode), 1) if decode else None,
        "rss_decode_max_mb": round(max(decode), 1) if decode else None,
        "rss_end_mb": round(samples[-1][1], 1), "last_first_token_s": round(last_first, 2),
        "decode_phase_s": round(samples[-1][0] - last_first, 2), "decode_samples": len(decode),
        "chunks_per_stream_min": min(r["chunks"] for r in results),
        "chunks_per_stream_max": max(r["chunks"] for r in results),
        "streams_completed": sum(1 for r in results if r["completion_tokens"] == args.tokens),
        "failed_example": next((r["last"].decode(errors="replace") for r in results
                                if r["completion_tokens"] != args.tokens), None),
        "last_event_example": results[0]["last"].decode(errors="replace"),
        "live_embedding_requests_at_end": stats["live_embedding_requests"],
    }
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps({**out, "samples": samples}, indent=2))
    if not os.environ.get("MM_BENCH_KEEP"):
        shutil.rmtree(run, ignore_errors=True)
    else:
        print(f"kept {run}")


if __name__ == "__main__":
    main()
