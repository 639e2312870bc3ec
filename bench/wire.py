"""Wire format benchmark (not a test): body size, encode/decode speed and cache-hit req/s per format.

    python -m bench.wire [--repeats 5] [--rounds 3] [--quick] [--json out.json]

Payloads come from the real projector (the spec's PatchMerger, seeded random weights exactly as
`init_random` fills them) applied to layer-normed gaussian tower-like features [tokens, 4, 1152],
so their exponent spread is that of a real projector output; bf16, 7168 wide (Kimi-K2.5):
- size and speed: a 4K image's embeddings, 4,096 tokens (--quick: 1,024 tokens, fewer repeats and
  levels); every format side by side in one process, median (min-max) over --repeats; MB = 10^6
  bytes; encode/decode MB/s are MB of raw embeddings (tokens x hidden x 2) per second, one thread;
- req/s of cache hits per format: a payload the size of the reference stack's 4K response (414
  tokens, 5.94 MB raw). The worker serves only wire v1 (raw+split+zstd) and, converted per request,
  json+base64; it cannot produce the other two. So, like for like, each format's pre-built body is
  served by the same nginx cluster tier (`mm-encoder cache up --tier cluster`, the real config)
  whose next level is a stub origin returning the body for its `X-Cache-Key` (the sha256 of the
  request body, a small one per format, which the tier computes and forwards). After one miss per
  format, wrk sends the same POST: every request is a tier hit, the origin is never asked again.
  req/s at 8 connections, p50 at 1; formats alternate in --rounds rounds;
- req/s against body size alone: random bodies of 2-8 MB through the same tier;
- and the two formats the worker serves on their real path (`tiny-wide`, one 616x644 JPEG): hits
  straight to the worker (its mm_hash LRU; JSON converted from the cached v1 body per request) and
  through a cluster tier in front of it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import torch.nn.functional as F
import zstandard

from bench import stats
from harness import wire_raw
from mm_encoder import wire
from mm_encoder.core.registry import get_spec
from mm_encoder.model.checkpoint import build_empty, init_random

MODEL = "kimi-k2.5-vision"
# The reference stack's 4K response: MB per format, and req/s of a cache hit.
REFERENCE = {"json+base64": {"mb": 7.91, "rps": 189.0}, "raw": {"mb": 5.94, "rps": 315.0},
             "raw+zstd": {"mb": 4.69, "rps": 566.0}}
HIT_GRID = (1, 36, 46)  # 414 tokens x 7168 bf16 = 5.94 MB raw, the reference's raw body
# The four formats of the comparison: (name in the table, content type, encoder)
HIT_FORMATS = ("json+base64", "raw", "raw+zstd", "raw+split+zstd")
SWEEP_MB = (2.0, 3.0, 4.0, 5.0, 6.0, 8.0)  # random bodies through the same tier: req/s against size alone


@torch.inference_mode()
def realistic_embeds(tokens: int, seed: int = 0, grid: tuple[int, int, int] | None = None
                     ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """bf16 [tokens, out_dim] from the spec's projector on random weights, and a grid giving `tokens`
    (square unless `grid` is given: (1, h, w) patches, h*w/4 tokens)."""
    if grid is None:
        side = 2 * int(tokens**0.5)  # h = w patches, h*w/4 tokens
        assert side * side // 4 == tokens, "tokens must be a square"
        grid = (1, side, side)
    assert grid[0] * grid[1] * grid[2] // 4 == tokens, f"grid {grid} does not give {tokens} tokens"
    spec = get_spec(MODEL)
    # The full model on meta costs nothing; only the projector (54M params) gets real weights.
    projector = build_empty(spec).mm_projector
    init_random(projector, seed=seed, device=torch.device("cpu"), dtype=torch.float32)  # type: ignore[arg-type]
    d = spec.tower.hidden_size
    g = torch.Generator().manual_seed(seed + 1)
    feats = F.layer_norm(torch.randn(tokens, 4, d, generator=g), (d,))  # MoonViT ends in a LayerNorm
    out = torch.cat([projector(chunk) for chunk in feats.split(1024)])
    return out.to(torch.bfloat16), [grid]


def times_s(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def formats(levels: list[int]) -> dict[str, tuple[Callable[..., bytes], Callable[[bytes], wire.WireMessage]]]:
    out: dict[str, tuple[Callable[..., bytes], Callable[[bytes], wire.WireMessage]]] = {
        "json+base64": (lambda **kw: wire.encode_json(**kw, byte_planes=False), wire.decode_json),
        "msgpack raw (no zstd)": (lambda **kw: wire_raw.pack(**kw, byte_planes=False), wire._unpack),
    }
    for split in (False, True):
        for level in levels:
            name = f"raw+{'split+' if split else ''}zstd L{level}"
            out[name] = (lambda s=split, lv=level, **kw: wire.encode(**kw, byte_planes=s, level=lv), wire.decode)
    return out


def hit_bodies(item: dict) -> dict[str, tuple[str, bytes]]:
    """Each compared format's body for one item, with the content type a server would send."""
    level = wire.DEFAULT_LEVEL
    return {
        "json+base64": (wire.JSON_CONTENT_TYPE, wire.encode_json(**item, byte_planes=False)),
        "raw": ("application/msgpack", wire_raw.pack(**item, byte_planes=False)),
        "raw+zstd": ("application/zstd", wire.encode(**item, byte_planes=False, level=level)),
        "raw+split+zstd": (wire.CONTENT_TYPE, wire.encode(**item, byte_planes=True, level=level)),
    }


def plane_sizes(x: torch.Tensor, level: int = 3) -> list[float]:
    """Compressed/raw ratio of each byte plane alone, most significant first."""
    u8 = x.contiguous().view(torch.uint8).reshape(-1, x.element_size())
    cctx = zstandard.ZstdCompressor(level=level)
    ratios = []
    for j in reversed(range(u8.shape[1])):  # little-endian: the last byte is the most significant
        plane = u8[:, j].contiguous().numpy().tobytes()
        ratios.append(len(cctx.compress(plane)) / len(plane))
    return ratios


def stub_origin(bodies: dict[str, tuple[str, bytes]]) -> tuple[ThreadingHTTPServer, int, list[int]]:
    """POST /v1/encode -> the body named by X-Cache-Key, which the tier sets to its request body's
    sha256 (the tier's next level; asked once per key)."""
    asked = [0]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            asked[0] += 1
            ctype, body = bodies[self.headers["X-Cache-Key"]]
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1], asked


def measure_hits(rounds: int, seconds: float) -> dict:
    """req/s and latency of a cluster-tier hit for each format's body of the reference-sized payload."""
    from bench import cache  # bench/cache.py: the tier and wrk helpers

    tokens = HIT_GRID[0] * HIT_GRID[1] * HIT_GRID[2] // 4
    x, grids = realistic_embeds(tokens, seed=7, grid=HIT_GRID)
    item = {"mm_hash": "1" * 64, "model": MODEL, "modality": "image", "embeds": x, "grid_thws": grids}
    bodies = {f"wire-{name.replace('+', '-')}": (ctype, body) for name, (ctype, body) in hit_bodies(item).items()}
    keys = dict(zip(HIT_FORMATS, bodies, strict=True))
    sweep = {mb: f"sweep-{mb}" for mb in SWEEP_MB}  # random bytes: req/s against body size alone
    bodies |= {key: ("application/octet-stream", os.urandom(int(mb * 1e6))) for mb, key in sweep.items()}
    run = Path(tempfile.mkdtemp(prefix="mm-bench-wire-"))
    # each entry's request: a small body of its own, whose sha256 (the tier's key) names the entry
    request = {key: run / f"{key}.request" for key in bodies}
    for key, path in request.items():
        path.write_bytes(key.encode())
    origin, port, asked = stub_origin({hashlib.sha256(key.encode()).hexdigest(): b for key, b in bodies.items()})
    tier = None
    try:
        tier = cache.start_tier(run, "cluster", "cluster", "--next", f"127.0.0.1:{port}")
        url = tier.url("")
        script = run / "post.lua"
        script.write_text(cache.WRK_SCRIPT)
        for name, key in keys.items():
            accept = "application/json" if name == "json+base64" else None
            headers, got = cache.post(url, request[key].read_bytes(), accept=accept)
            assert got == bodies[key][1] and "MISS" in headers["X-Cache-Status"], (name, headers)
            assert cache.post(url, request[key].read_bytes(), accept=accept)[0]["X-Cache-Status"] == "cluster=HIT"
        for key in sweep.values():
            cache.post(url, request[key].read_bytes())
        raw: dict[str, list[dict]] = {name: [] for name in keys}
        swept: dict[float, list[float]] = {mb: [] for mb in sweep}
        for _ in range(rounds):
            for name, key in keys.items():
                accept = "application/json" if name == "json+base64" else None
                c8 = cache.wrk(url, script, request[key], None, 2, 8, seconds, accept=accept)
                c1 = cache.wrk(url, script, request[key], None, 1, 1, seconds, accept=accept)
                raw[name].append({"rps_c8": c8["rps"], "p50_c1_ms": c1["p50_ms"], "p50_c8_ms": c8["p50_ms"],
                                  "non2xx": c8["non2xx"] + c1["non2xx"]})
            for mb, key in sweep.items():
                swept[mb].append(cache.wrk(url, script, request[key], None, 2, 8, seconds)["rps"])
    finally:
        if tier is not None:
            tier.stop()
        origin.shutdown()
        shutil.rmtree(run, ignore_errors=True)
    out = {}
    for name, rs in raw.items():
        out[name] = {"size_mb": len(bodies[keys[name]][1]) / 1e6, "non2xx": sum(r["non2xx"] for r in rs)}
        out[name] |= {m: stats.summary(r[m] for r in rs) for m in ("rps_c8", "p50_c1_ms", "p50_c8_ms")}
    return {"tokens": tokens, "grid": list(HIT_GRID), "raw_mb": x.numel() * 2 / 1e6, "rounds": rounds,
            "seconds": seconds, "origin_requests": asked[0], "formats": out, "tcp_wmem_max": tcp_wmem_max(),
            "sweep": [{"size_mb": mb, "rps_c8": stats.summary(v)} for mb, v in swept.items()]}


def tcp_wmem_max() -> int | None:
    """The kernel's limit on an autotuned TCP send buffer (bytes), if readable."""
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, ValueError, IndexError):
        return None


def measure_worker_hits(rounds: int, seconds: float) -> dict:
    """The two formats the worker serves, on its real path: straight to the worker (mm_hash LRU hit; JSON is
    converted from the cached v1 body per request) and through a cluster tier in front of it (a tier hit)."""
    import msgpack

    from bench import cache  # bench/cache.py: the tier and wrk helpers
    from bench import worker as worker_bench  # bench/worker.py: the worker process and tiny-wide
    from harness.media_factory import image_bytes, natural_image

    run = Path(tempfile.mkdtemp(prefix="mm-bench-wire-worker-"))
    worker_bench.CONFIGS = worker_bench.bench_configs()
    proc = tier = None
    try:
        proc = worker_bench.start_worker("tiny-wide")
        tier = cache.start_tier(run, "cluster", "cluster", "--next", proc.address)
        tier_url = tier.url("")
        request = run / "request.msgpack"
        request.write_bytes(msgpack.packb({"model": "tiny-wide", "data": image_bytes(natural_image(616, 644, seed=3),
                                                                                     "JPEG")}))
        script = run / "post.lua"
        script.write_text(cache.WRK_SCRIPT)
        key = "wire-worker-hit"
        accepts = {"json+base64": "application/json", "raw+split+zstd": wire.CONTENT_TYPE}
        sizes = {}
        for name, accept in accepts.items():
            sizes[name] = len(cache.post(tier_url, request.read_bytes(), key, accept=accept)[1]) / 1e6
            assert cache.post(tier_url, request.read_bytes(), key, accept=accept)[0]["X-Cache-Status"] == "cluster=HIT"
            cache.post(proc.url, request.read_bytes(), None, accept=accept)
        targets = {f"{name}, {where}": (url, k, accept) for name, accept in accepts.items()
                   for where, url, k in (("worker (mm_hash LRU)", proc.url, None), ("cluster tier", tier_url, key))}
        raw: dict[str, list[dict]] = {t: [] for t in targets}
        for _ in range(rounds):
            for t, (url, k, accept) in targets.items():
                c8 = cache.wrk(url, script, request, k, 2, 8, seconds, accept=accept)
                c1 = cache.wrk(url, script, request, k, 1, 1, seconds, accept=accept)
                raw[t].append({"rps_c8": c8["rps"], "p50_c1_ms": c1["p50_ms"], "non2xx": c8["non2xx"] + c1["non2xx"]})
    finally:
        if tier is not None:
            tier.stop()
        if proc is not None:
            proc.stop()
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(worker_bench.CONFIGS, ignore_errors=True)
    out = {}
    for t, rs in raw.items():
        out[t] = {"size_mb": sizes[t.split(",")[0]], "non2xx": sum(r["non2xx"] for r in rs)}
        out[t] |= {m: stats.summary(r[m] for r in rs) for m in ("rps_c8", "p50_c1_ms")}
    return {"model": "tiny-wide", "image": "616x644 JPEG", "rounds": rounds, "seconds": seconds, "targets": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="rounds of cache-hit wrk runs per format")
    p.add_argument("--quick", action="store_true", help="1,024 tokens, 2 repeats, zstd levels 1 and 3; 1 hit round")
    p.add_argument("--no-hits", action="store_true", help="sizes and speeds only (no nginx, no wrk)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    tokens, repeats, levels = (1024, 2, [1, 3]) if args.quick else (4096, args.repeats, [1, 3, 9])
    torch.manual_seed(0)

    t0 = time.perf_counter()
    x, grids = realistic_embeds(tokens)
    raw_mb = x.numel() * x.element_size() / 1e6
    print(f"{MODEL}: {tokens} tokens x {x.shape[1]} bf16 = {raw_mb:.2f} MB raw "
          f"(projector forward {time.perf_counter() - t0:.1f} s); std {x.float().std():.4f}; "
          f"zstandard {zstandard.__version__} (libzstd {'.'.join(map(str, zstandard.ZSTD_VERSION))}), "
          f"{platform.processor() or platform.machine()}, {repeats} repeats", flush=True)
    item = {"mm_hash": "0" * 64, "model": MODEL, "modality": "image", "embeds": x, "grid_thws": grids}

    rows = []
    for name, (enc, dec) in formats(levels).items():
        body = enc(**item)
        m = dec(body)
        assert torch.equal(m.embeds.view(torch.int16), x.view(torch.int16)), f"{name}: not bit-exact"
        assert enc(**item) == body, f"{name}: not deterministic"
        enc_s = times_s(lambda e=enc: e(**item), repeats)
        dec_s = times_s(lambda d=dec, b=body: d(b), repeats)
        rows.append({"format": name, "size_mb": stats.summary([len(body) / 1e6]),
                     "encode_mbps": stats.summary(raw_mb / t for t in enc_s),
                     "decode_mbps": stats.summary(raw_mb / t for t in dec_s)})
        r = rows[-1]
        print(f"  {name:24s} {len(body) / 1e6:7.2f} MB  enc {stats.fmt(r['encode_mbps'], 0)} MB/s  "
              f"dec {stats.fmt(r['decode_mbps'], 0)} MB/s", flush=True)
    base = rows[0]["size_mb"]
    for r in rows:
        r["ratio"] = stats.ratio(r["size_mb"], base)
    result = {"machine": stats.machine(), "model": MODEL, "tokens": tokens, "hidden": x.shape[1], "raw_mb": raw_mb,
              "repeats": repeats, "levels": levels, "rows": rows, "plane_ratios": plane_sizes(x),
              "reference": REFERENCE}
    if not args.no_hits:
        if shutil.which("wrk") is None:
            sys.exit("the cache-hit part needs wrk (apt-get install -y wrk), or pass --no-hits")
        rounds, seconds = (1, 2) if args.quick else (args.rounds, 4)
        result["hits"] = measure_hits(rounds, seconds)
        result["worker_hits"] = measure_worker_hits(rounds, seconds)
    stats.emit(result, args.json, "wire")


if __name__ == "__main__":
    main()
