"""EPD vs the aggregated baseline (not a test): the same requests against both graphs.

    python bench/graphs.py [--quick]

Each graph runs alone under `mm-encoder serve` (tiny vision model, random-weight LLM), then:
- cold: chat requests, each with a new 1280x720 image (1,196 image tokens), one at a time;
- repeat: the same image again (EPD: a cluster-tier hit; agg: encoded again);
- interference: time to first token of text-only streaming requests, idle and for 15 s while two
  background clients keep sending new images (does media encoding stall token generation?).
Medians; both graphs measured in one run on the same machine (2 shared cores: every process of
a graph competes for them, so this shows scheduling effects, not GPU capacity).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
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

from media_factory import image_bytes, natural_image  # noqa: E402

from mm_encoder.deploy.local import free_port  # noqa: E402


def post(port: int, content, *, stream: bool = False, max_tokens: int = 8) -> float:
    """Seconds to the full answer, or to the first chunk when streaming."""
    body = json.dumps({"model": "mm-chat", "max_tokens": max_tokens, "stream": stream,
                       "messages": [{"role": "user", "content": content}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        if stream:
            for line in r:
                if line.startswith(b"data: {"):
                    first = time.perf_counter() - t0
                    r.read()
                    return first
        r.read()
    return time.perf_counter() - t0


def image_part(seed: int) -> list[dict]:
    data = base64.b64encode(image_bytes(natural_image(1280, 720, seed=seed), "JPEG", quality=90)).decode()
    return [{"type": "text", "text": "What is in this image?"},
            {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{data}"}}]


def measure(graph: str, n: int, load_s: float) -> dict:
    port = free_port()
    run = Path(tempfile.mkdtemp(prefix="mm-bench-graph-"))
    proc = subprocess.Popen([sys.executable, "-m", "mm_encoder.cli", "serve", str(ROOT / graph), "--run-dir",
                             str(run), "--port", str(port), "--status-interval", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "ready: OpenAI base URL" in line:
                break
        else:
            raise RuntimeError(f"{graph} did not start")
        threading.Thread(target=lambda: proc.stdout.read(), daemon=True).start()
        post(port, "warm up")
        post(port, image_part(0))
        cold = [post(port, image_part(100 + i)) for i in range(n)]
        repeat = [post(port, image_part(100 + i)) for i in range(n)]
        text = [{"type": "text", "text": "Tell me a story about a fox. " * 4}]
        idle = [post(port, text, stream=True) for _ in range(n)]
        stop = threading.Event()
        sent = [0]
        images = [image_part(1000 + i) for i in range(400)]

        def background(k: int):
            i = k
            while not stop.is_set() and i < len(images):
                post(port, images[i])
                sent[0] += 1
                i += 2

        clients = [threading.Thread(target=background, args=(k,), daemon=True) for k in range(2)]
        for c in clients:
            c.start()
        loaded = []
        deadline = time.monotonic() + load_s
        while time.monotonic() < deadline and len(loaded) < 2000:  # text requests while images keep coming
            loaded.append(post(port, text, stream=True))
            time.sleep(0.05)  # pacing of the text client (a load shape, not synchronisation)
        stop.set()
        for c in clients:
            c.join(300)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    med = statistics.median
    loaded.sort()
    return {"cold_ms": med(cold) * 1e3, "repeat_ms": med(repeat) * 1e3, "ttft_idle_ms": med(idle) * 1e3,
            "ttft_loaded_ms": med(loaded) * 1e3, "ttft_loaded_p90_ms": loaded[int(len(loaded) * 0.9)] * 1e3,
            "ttft_loaded_max_ms": loaded[-1] * 1e3, "text_requests_loaded": len(loaded),
            "background_media_requests": sent[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    n, load_s = (4, 4.0) if args.quick else (10, 15.0)
    results = {g: measure(f"graphs/{g}.yaml", n, load_s) for g in ("epd", "agg")}
    print(f"EPD vs aggregated, {n} requests per row, medians ({os.cpu_count()} cores shared by all processes)")
    print("| graph | cold image ms | repeated image ms | text TTFT idle ms | TTFT under image load: p50 | p90 | max "
          "| text reqs | image reqs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for g, r in results.items():
        print(f"| {g} | {r['cold_ms']:.0f} | {r['repeat_ms']:.0f} | {r['ttft_idle_ms']:.1f} | "
              f"{r['ttft_loaded_ms']:.1f} | {r['ttft_loaded_p90_ms']:.1f} | {r['ttft_loaded_max_ms']:.0f} | "
              f"{r['text_requests_loaded']} | {r['background_media_requests']} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
