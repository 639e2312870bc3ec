"""Frontend benchmark (not a test): embeddings by handle vs through the frontend, side by side.

    python -m bench.frontend [--streams 50] [--tokens 200] [--repeats 5] [--quick] [--json PATH]

Per transport (`--media-transport handle`, and `body`: the frontend fetching each body and sending
it to the engine, as before handles), one stack on loopback, both up at once (Dynamo file discovery + TCP), all
on one generated `wide` Kimi-K2.5 checkpoint (tiny MoonViT, 7168-wide projector, a one-layer
7168-wide DeepseekV3): its encode worker, an nginx cluster tier in front of it, one engine (the
checkpoint's language model through transformers) and the frontend. A 3840x2160 image
is 4,214 tokens x 7168 bf16: a ~40 MB body. Measured per transport, in one run:
- bytes on Dynamo's request plane per 4K request (the engine's `dynamo_component_request_bytes_total`);
- time to first token of a cold 4K image (a new image each time) and of a repeated one, medians,
  single requests interleaved between the two stacks;
- the frontend's RSS over N concurrent streams about the same 4K image (sampled every 100 ms),
  one stack at a time.
In `handle` mode the frontend runs with Dynamo's default `DYN_TCP_MAX_MESSAGE_SIZE`; `body` mode
needs it raised (256 MiB here) on the frontend and the engine.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench import stats
from harness.media_factory import image_bytes, natural_image
from harness.processes import Process
from harness.topology import (
    TierProcess,
    WorkerProcess,
    dynamo_system_port,
    free_port,
    start_tier,
    start_worker,
    stop_all,
)

BIG = str(256 << 20)
MODES = ("handle", "body")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start(name: str, run: Path, env: dict, *args: str, ready: str) -> Process:
    """An engine or a frontend (harness.processes), ready when it prints `ready`."""
    proc = Process([sys.executable, *args], name=name, env=env, log=run / f"{name}.log")
    try:
        proc.wait_for(ready, 180)
    except AssertionError as e:
        proc.stop()
        raise RuntimeError(f"{name} did not start: {e}") from None
    return proc


def chat_body(img: bytes | str, tokens: int) -> bytes:
    url = img if isinstance(img, str) else "data:image/jpeg;base64," + base64.b64encode(img).decode()
    content = [{"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": url}}]
    return json.dumps({"model": "kimi-k2.5-wide", "max_tokens": tokens, "stream": True, "ignore_eos": True,
                       "messages": [{"role": "user", "content": content}]}).encode()


def stream_chat(port: int, body: bytes, result: dict) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    first, n, last = None, 0, b""
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    n += 1
                    last = line
                    first = first if first is not None else time.monotonic() - t0
    except OSError as e:
        last = str(e).encode()
    usage = (json.loads(last[6:]).get("usage") or {}) if last.startswith(b"data: ") else {}
    result.update(first_s=first, chunks=n, total_s=time.monotonic() - t0, last=last[:300],
                  completion_tokens=usage.get("completion_tokens"))


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith((name + " ", name + "{")))


def serve_image(img: bytes) -> tuple[ThreadingHTTPServer, str]:
    """The 4K image at an http URL on loopback (a handle then names a URL, not a data: URL)."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/jpeg")
            self.send_header("Content-Length", str(len(img)))
            self.end_headers()
            self.wfile.write(img)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/4k.jpg"


def request_bytes(port: int, engine_sys: int, img: bytes | str) -> int:
    """Bytes the engine received on the request plane for one request about `img`."""
    before = metric(engine_sys, "dynamo_component_request_bytes_total")
    stream_chat(port, chat_body(img, 1), {})
    return int(metric(engine_sys, "dynamo_component_request_bytes_total") - before)


class Stack:
    """One transport's processes: encode worker, cluster tier, engine, frontend."""

    def __init__(self, mode: str, model_dir: Path, image_url: str):
        self.mode = mode
        self.run = Path(tempfile.mkdtemp(prefix=f"mm-bench-frontend-{mode}-"))
        base = {**os.environ, "DYN_FILE_KV": str(self.run / "kv"), "DYN_TCP_RPC_HOST": "127.0.0.1",
                "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "DYN_LOG": "error", "DYN_SELF_HOST_METADATA": "0",
                "MM_ENCODER_LOG_LEVEL": "WARNING"}
        base.pop("DYN_TCP_MAX_MESSAGE_SIZE", None)
        bodies = {**base, "DYN_TCP_MAX_MESSAGE_SIZE": BIG}  # the encoder and engine carry bodies in both modes
        self.port, self.engine_sys = free_port(), dynamo_system_port()
        self.procs: list[Process | WorkerProcess | TierProcess] = []
        try:  # a process that does not start: those started before it stop too
            worker = start_worker("--dtype", "fp32", "--dynamo", model=str(model_dir), env=bodies,
                                  settings={"fetch_allow_hosts": [image_url.split("/")[2]]}, name="worker",
                                  log=self.run / "worker.log")
            self.procs.append(worker)
            tier = start_tier(self.run, "tier", "cluster", "--next", worker.address, workers=None, env=base,
                              log=self.run / "tier.log", timeout=180)
            self.procs.append(tier)
            chain = tier.url("")
            self.procs.append(start("engine", self.run, {**bodies, "DYN_SYSTEM_PORT": str(self.engine_sys)}, "-m",
                                    "mm_encoder.engines", "--checkpoint", str(model_dir), "--encoder-chain",
                                    chain, ready="engine ready"))
            self.frontend = start("frontend", self.run, bodies if mode == "body" else base,  # handles: default limit
                                  "-m", "mm_encoder.frontend", "--model-dir", str(model_dir), "--http-port",
                                  str(self.port), "--log-level", "WARNING", "--encoder-http", chain, "--encoder-route",
                                  "cluster", "--media-transport", mode, ready="frontend ready")
            self.procs.append(self.frontend)
            try:  # until the model is served
                self.frontend.wait_url(f"http://127.0.0.1:{self.port}/v1/models", 60,
                                       lambda b: bool(json.loads(b)["data"]))
            except AssertionError as e:
                raise RuntimeError(f"{mode}: the frontend never listed the model: {e}") from None
        except BaseException:
            self.stop()
            raise

    def ttft(self, img: bytes | str) -> float:
        r: dict = {}
        stream_chat(self.port, chat_body(img, 1), r)
        return r["first_s"]

    def request_bytes(self, img: bytes | str) -> int:
        """Bytes the engine received on the request plane for one request about `img`."""
        before = metric(self.engine_sys, "dynamo_component_request_bytes_total")
        self.ttft(img)
        return int(metric(self.engine_sys, "dynamo_component_request_bytes_total") - before)

    def load(self, img: bytes, streams: int, tokens: int) -> dict:
        """The frontend's RSS over `streams` concurrent streams of `tokens` tokens about `img`."""
        body = chat_body(img, tokens)
        baseline = rss_mb(self.frontend.pid)
        samples: list[float] = []
        results = [{} for _ in range(streams)]
        threads = [threading.Thread(target=stream_chat, args=(self.port, body, r)) for r in results]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            samples.append(rss_mb(self.frontend.pid))
            time.sleep(0.1)
        for t in threads:
            t.join()
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/mm/stats", timeout=10) as r:
            stats = json.loads(r.read())["processors"][0]
        firsts = [r["first_s"] for r in results if r["first_s"] is not None]
        return {"rss_baseline_mb": round(baseline, 1), "rss_peak_mb": round(max(samples), 1),
                "streams_completed": sum(1 for r in results if r["completion_tokens"] == tokens),
                "ttft_under_load_median_s": round(statistics.median(firsts), 2) if firsts else None,
                "encoder_body_bytes": stats["encoder_body_bytes"],
                "failed_example": next((r["last"].decode(errors="replace") for r in results
                                        if r["completion_tokens"] != tokens), None)}

    def stop(self) -> None:
        stop_all(self.procs)
        if not os.environ.get("MM_BENCH_KEEP"):
            shutil.rmtree(self.run, ignore_errors=True)


def measure(args, model_dir: Path) -> dict:
    """Both stacks up at once; single requests interleaved (handle, body, handle, ...) so the
    machine's noise falls on both; the concurrent load runs on one stack at a time."""
    shared_img = image_bytes(natural_image(3840, 2160, seed=4), "JPEG", quality=90)
    origin, image_url = serve_image(shared_img)
    stacks: dict[str, Stack] = {}
    try:
        for mode in MODES:
            stacks[mode] = Stack(mode, model_dir, image_url)
        out: dict[str, dict] = {m: {"transport": m} for m in MODES}
        for m, st in stacks.items():  # warm: the shared image encoded once per stack, by data: URL and URL
            st.ttft(shared_img)
            st.ttft(image_url)
            out[m]["request_plane_bytes_per_4k_request"] = {"data_url": st.request_bytes(shared_img),
                                                            "http_url": st.request_bytes(image_url)}
        repeated: dict[str, list[float]] = {m: [] for m in MODES}
        cold: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(args.repeats):
            img = image_bytes(natural_image(3840, 2160, seed=1000 + i), "JPEG", quality=90)
            for m, st in stacks.items():
                repeated[m].append(st.ttft(shared_img))
                cold[m].append(st.ttft(img))  # new to this stack: the same pixels are cold in each
        for m, st in stacks.items():
            out[m] |= {"ttft_repeated_ms": _spread(repeated[m]), "ttft_cold_ms": _spread(cold[m]),
                       **st.load(shared_img, args.streams, args.tokens)}
        return out
    finally:
        origin.shutdown()
        for st in stacks.values():
            st.stop()


def _spread(values: list[float]) -> dict | None:
    ms = [v * 1e3 for v in values if v is not None]
    return stats.summary(ms) if ms else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=50)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="10 streams of 60 tokens, 3 repeats")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        args.streams, args.tokens, args.repeats = 10, 60, 3
    from mm_encoder.engines.tiny_checkpoint import write_checkpoint

    work = Path(tempfile.mkdtemp(prefix="mm-bench-frontend-"))
    model_dir = write_checkpoint(work / "kimi-k2.5-wide", "wide")
    try:
        out = measure(args, model_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"machine": stats.machine(), "config": {"streams": args.streams, "tokens": args.tokens,
                                                  "repeats": args.repeats}, **out}
    print(json.dumps(out, indent=2))
    stats.emit(out, args.json, "frontend")


if __name__ == "__main__":
    main()
