"""Frontend benchmark (not a test): embeddings by handle vs through the frontend, side by side.

    python bench/frontend.py [--streams 50] [--tokens 200] [--repeats 5] [--quick] [--json PATH]

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
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import stats  # noqa: E402
from media_factory import image_bytes, natural_image  # noqa: E402
from nginx_fixtures import dynamo_system_port  # noqa: E402 (Dynamo reads DYN_SYSTEM_PORT as an i16)

from mm_encoder.deploy.local import free_port  # noqa: E402

BIG = str(256 << 20)
MODES = ("handle", "body")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start(name: str, run: Path, env: dict, *args: str, ready: str | None = None,
          url: str | None = None) -> subprocess.Popen:
    """A process, ready when it prints `ready` or when `url` answers 200."""
    log = (run / f"{name}.log").open("w")
    proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE if ready else log,
                            stderr=log, text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if ready:
            if ready in proc.stdout.readline():
                return proc
            continue
        try:
            with urllib.request.urlopen(url, timeout=2):
                return proc
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{name} did not start: {(run / f'{name}.log').read_text()[-2000:]}")


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
        worker_port, tier_port, self.port, self.engine_sys = free_port(), free_port(), free_port(), dynamo_system_port()
        self.procs: list[subprocess.Popen] = []
        allow = json.dumps([image_url.split("/")[2]])
        self.procs.append(start("worker", self.run, {**bodies, "MM_ENCODER_FETCH_ALLOW_HOSTS": allow},
                                "-m", "mm_encoder.worker", "--model", str(model_dir), "--dtype", "fp32",
                                "--dynamo", "--http-port", str(worker_port), ready="worker ready"))
        self.procs.append(start("tier", self.run, base, "-m", "mm_encoder.deploy.cache_tiers", "up", "--tier",
                                "cluster", "--listen", f"127.0.0.1:{tier_port}", "--next", f"127.0.0.1:{worker_port}",
                                "--run-dir", str(self.run / "tier"), "--cache-dir", str(self.run / "tier-cache"),
                                url=f"http://127.0.0.1:{tier_port}/_cache/health"))
        chain = f"http://127.0.0.1:{tier_port}"
        self.procs.append(start("engine", self.run, {**bodies, "DYN_SYSTEM_PORT": str(self.engine_sys)}, "-m",
                                "mm_encoder.engines", "--checkpoint", str(model_dir), "--encoder-chain",
                                chain, ready="engine ready"))
        self.frontend = start("frontend", self.run, bodies if mode == "body" else base,  # handles: default limit
                              "-m", "mm_encoder.frontend", "--model-dir", str(model_dir), "--http-port",
                              str(self.port), "--log-level", "WARNING", "--encoder-http", chain, "--encoder-route",
                              "cluster", "--media-transport", mode, ready="frontend ready")
        self.procs.append(self.frontend)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the model is served
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=5) as r:
                    if json.loads(r.read())["data"]:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{mode}: the frontend never listed the model")

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
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
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


def section(result: dict, plots: Path) -> str:
    h, b = result["handle"], result["body"]
    cfg = result.get("config", {"streams": 50, "tokens": 200, "repeats": "?"})

    def n(v) -> str:
        return "-" if v is None else f"{v:,.0f}"

    def over(x, y) -> str:
        return f"1/{y / x:,.0f}" if x and y and y / x >= 100 else f"1/{y / x:.1f}" if x and y else ""

    def rat(x, y) -> str:
        return f"{x / y:.2f}" if x and y else ""

    hb, bb = h["request_plane_bytes_per_4k_request"], b["request_plane_bytes_per_4k_request"]
    hr, br, hc, bc = h["ttft_repeated_ms"], b["ttft_repeated_ms"], h["ttft_cold_ms"], b["ttft_cold_ms"]
    hl, bl = h["ttft_under_load_median_s"], b["ttft_under_load_median_s"]
    lines = [
        "## Embeddings by handle vs through the frontend (`python bench/frontend.py`)",
        "",
        "Both stacks were up at once on loopback on one generated `wide` Kimi-K2.5 checkpoint (tiny MoonViT, "
        "7168-wide projector, a one-layer 7168-wide DeepseekV3), each with its own encode worker, nginx cluster "
        "tier, engine (the checkpoint's language model through transformers) and frontend. They differ only in "
        "`--media-transport`:",
        "- `handle`: the frontend asks for headers only, and the engine fetches the body through the tier "
        "(`/v1/encode/fetch`).",
        "- `body`: the frontend POSTs, receives the body and sends it to the engine, as before handles.",
        "",
        "A 3840x2160 image is 4,214 tokens x 7168 bf16 (~36.5 MB on the wire). Single requests alternate between "
        "the stacks (handle, body, handle, ...), so the machine's noise falls on both. The load test "
        f"({cfg['streams']} concurrent streams of {cfg['tokens']} tokens, `ignore_eos`, all about one 4K image) runs "
        "on one stack at a time; the frontend's RSS is sampled every 100 ms. Single-request figures are median "
        f"(min-max) of {cfg['repeats']}.",
        "",
        "| | handle | body | handle / body |",
        "|---|---:|---:|---:|",
        f"| request-plane bytes per 4K request, http(s) image URL | {n(hb['http_url'])} | {n(bb['http_url'])} | "
        f"{over(hb['http_url'], bb['http_url'])} |",
        f"| the same, image as a data: URL (1.1 MB JPEG) | {n(hb['data_url'])} | {n(bb['data_url'])} | "
        f"{over(hb['data_url'], bb['data_url'])} |",
        f"| TTFT, repeated 4K image (ms) | {stats.fmt(hr, 0)} | {stats.fmt(br, 0)} | "
        f"{rat(hr and hr['median'], br and br['median'])} |",
        f"| TTFT, cold 4K image, a new one each time (ms) | {stats.fmt(hc, 0)} | {stats.fmt(bc, 0)} | "
        f"{rat(hc and hc['median'], bc and bc['median'])} |",
        f"| frontend RSS before the burst (MB) | {n(h['rss_baseline_mb'])} | {n(b['rss_baseline_mb'])} | |",
        f"| frontend RSS peak over {cfg['streams']} streams (MB) | {n(h['rss_peak_mb'])} | {n(b['rss_peak_mb'])} | "
        f"{rat(h['rss_peak_mb'], b['rss_peak_mb'])} |",
        f"| streams completed (of {cfg['streams']}) | {h['streams_completed']} | {b['streams_completed']} | |",
        f"| TTFT under that load, median (s) | {stats.fmt(hl)} | {stats.fmt(bl)} | {rat(hl, bl)} |",
        f"| embedding bytes received by the frontend | {n(h['encoder_body_bytes'])} | {n(b['encoder_body_bytes'])} "
        "| |",
        "",
        "- Bytes are the engine's own `dynamo_component_request_bytes_total`. A handle request is token ids (4,214 "
        "placeholders) plus a ~0.5 KB handle. A data: URL rides inside the handle's source, so an engine can "
        "re-encode the image if every cache has evicted it. That makes such a request as large as the image the "
        "client sent, not the embeddings.",
        "- The `handle` frontend ran with Dynamo's default `DYN_TCP_MAX_MESSAGE_SIZE`. The `body` frontend needs it "
        "raised (256 MiB here).",
        "- Cold images: each path moves the 36.5 MB body twice after the encode (worker to tier, then tier to "
        "engine; or tier to frontend, then frontend to engine), so neither should be much faster; this run: "
        f"handle / body = {rat(hc and hc['median'], bc and bc['median']) or '-'}. The engine's fetch skips nginx's "
        "cache lock (which polls every 500 ms) and asks the next level (docs/cache-tiers.md).",
        "- The load test's TTFT is one engine taking the prefills of 4,214 tokens in turn; `--max-inflight-media 8` "
        "(the default) lets 8 at a time past encoding in both modes.",
        "- The RSS peak in `body` mode is those 8 requests' bodies in flight (8 x 36.5 MB, plus the aiohttp and "
        "msgpack copies). In `handle` mode what is above baseline is the streams' request state and the "
        "detokenizers; no embeddings.",
    ]
    failed = [m for m in (h, b) if m.get("failed_example")]
    for m in failed:
        lines.append(f"- A failed stream in `{m['transport']}` mode ended with: `{m['failed_example'][:200]}`")
    return "\n".join(lines) + "\n"


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
    stats.emit(out, args.json, section)


if __name__ == "__main__":
    main()
