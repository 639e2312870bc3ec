"""Wire format benchmark (not a test): body size, encode/decode speed and cache-hit req/s per format.

    python bench/wire.py [--repeats 5] [--rounds 3] [--quick] [--json out.json]

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
  whose next level is a stub origin returning the body for its `X-Cache-Key`. After one miss per
  format, wrk sends the same POST with that key: every request is a tier hit, the origin is never
  asked again. req/s at 8 connections, p50 at 1; formats alternate in --rounds rounds;
- req/s against body size alone: random bodies of 2-8 MB through the same tier;
- and the two formats the worker serves on their real path (`tiny-wide`, one 616x644 JPEG): hits
  straight to the worker (its mm_hash LRU; JSON converted from the cached v1 body per request) and
  through a cluster tier in front of it.
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import stats  # noqa: E402

from mm_encoder import wire  # noqa: E402
from mm_encoder.core.registry import get_spec  # noqa: E402
from mm_encoder.model.checkpoint import build_empty, init_random  # noqa: E402

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
        "msgpack raw (no zstd)": (lambda **kw: wire._pack(**kw, byte_planes=False), wire._unpack),
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
        "raw": ("application/msgpack", wire._pack(**item, byte_planes=False)),
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
    """POST /v1/encode -> the body named by X-Cache-Key (the tier's next level; asked once per key)."""
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
    import cache  # bench/cache.py: the tier and wrk helpers

    tokens = HIT_GRID[0] * HIT_GRID[1] * HIT_GRID[2] // 4
    x, grids = realistic_embeds(tokens, seed=7, grid=HIT_GRID)
    item = {"mm_hash": "1" * 64, "model": MODEL, "modality": "image", "embeds": x, "grid_thws": grids}
    bodies = {f"wire-{name.replace('+', '-')}": (ctype, body) for name, (ctype, body) in hit_bodies(item).items()}
    keys = dict(zip(HIT_FORMATS, bodies, strict=True))
    sweep = {mb: f"sweep-{mb}" for mb in SWEEP_MB}  # random bytes: req/s against body size alone
    bodies |= {key: ("application/octet-stream", os.urandom(int(mb * 1e6))) for mb, key in sweep.items()}
    run = Path(tempfile.mkdtemp(prefix="mm-bench-wire-"))
    origin, port, asked = stub_origin(bodies)
    tier = None
    try:
        tier, url = cache.start_tier(run, "cluster", "--tier", "cluster", "--next", f"127.0.0.1:{port}")
        request = run / "request.msgpack"
        request.write_bytes(b"\x80")  # an empty msgpack map: the key, not the body, names the entry
        script = run / "post.lua"
        script.write_text(cache.WRK_SCRIPT)
        for name, key in keys.items():
            accept = "application/json" if name == "json+base64" else None
            headers, got = cache.post(url, request.read_bytes(), key, accept=accept)
            assert got == bodies[key][1] and "MISS" in headers["X-Cache-Status"], (name, headers)
            assert cache.post(url, request.read_bytes(), key, accept=accept)[0]["X-Cache-Status"] == "cluster=HIT"
        for key in sweep.values():
            cache.post(url, request.read_bytes(), key)
        raw: dict[str, list[dict]] = {name: [] for name in keys}
        swept: dict[float, list[float]] = {mb: [] for mb in sweep}
        for _ in range(rounds):
            for name, key in keys.items():
                accept = "application/json" if name == "json+base64" else None
                c8 = cache.wrk(url, script, request, key, 2, 8, seconds, accept=accept)
                c1 = cache.wrk(url, script, request, key, 1, 1, seconds, accept=accept)
                raw[name].append({"rps_c8": c8["rps"], "p50_c1_ms": c1["p50_ms"], "p50_c8_ms": c8["p50_ms"],
                                  "non2xx": c8["non2xx"] + c1["non2xx"]})
            for mb, key in sweep.items():
                swept[mb].append(cache.wrk(url, script, request, key, 2, 8, seconds)["rps"])
    finally:
        if tier is not None:
            cache.stop(tier)
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
    import cache  # bench/cache.py: the tier and wrk helpers
    import msgpack
    import worker as worker_bench  # bench/worker.py: the worker process and tiny-wide
    from media_factory import image_bytes, natural_image

    run = Path(tempfile.mkdtemp(prefix="mm-bench-wire-worker-"))
    worker_bench.CONFIGS = worker_bench.bench_configs()
    proc = tier = None
    try:
        proc = worker_bench.WorkerProcess("tiny-wide")
        tier, tier_url = cache.start_tier(run, "cluster", "--tier", "cluster", "--next", proc.url.split("//")[1])
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
            cache.stop(tier)
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
    stats.emit(result, args.json, section)


def section(result: dict, plots: Path) -> str:
    tokens, hidden, raw_mb = result["tokens"], result["hidden"], result["raw_mb"]
    ref = result.get("reference", REFERENCE)
    by = {r["format"]: r for r in result["rows"]}
    what = ("a 4K image's embeddings" if tokens == 4096 else f"a --quick payload ({tokens:,} tokens; the full run "
            "uses a 4K image's 4,096)")
    lines = ["## Wire format (`python bench/wire.py`)", ""]
    hits = result.get("hits")
    if hits:
        hf = hits["formats"]
        split = hf["raw+split+zstd"]
        gbs = [r["rps_c8"]["median"] * r["size_mb"] / 1e3 for r in hf.values()]
        lines += [
            f"Per format: MB per response and req/s of a cache hit. The payload is the size of the reference "
            f"stack's 4K response: {hits['tokens']} tokens x {hidden} bf16 = {hits['raw_mb']:.2f} MB raw, from the "
            "real Kimi-K2.5 projector (random weights) on layer-normed gaussian features. The worker serves only "
            "wire v1 (raw+split+zstd) and, converted per request, json+base64; it cannot produce raw or raw+zstd. "
            "So, like for like, each format's pre-built body is served by the same nginx cluster tier (the real "
            "`mm-encoder cache up --tier cluster` config, from tmpfs) whose next level is a stub origin returning "
            "the body named by `X-Cache-Key`. After one miss per format, wrk sends the same POST with that key, "
            f"so every request is a tier hit (the origin was asked {hits['origin_requests']} times in all). "
            f"req/s at 8 connections, p50 at 1; formats alternate in {hits['rounds']} round(s) of "
            f"{hits['seconds']} s per run; median (min-max). wrk and nginx share the machine's cores.",
            "",
            "| format | MB per response | reference MB | req/s on hits (c=8) | reference req/s | p50 ms (c=1) "
            "| p50 ms (c=8) | req/s vs json+base64 | payload GB/s (c=8) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in hf.items():
            rf = ref.get(name, {})
            bold = "**" if name == "raw+split+zstd" else ""
            ref_mb = f"{rf['mb']:.2f}" if rf else "-"
            ref_rps = f"{rf['rps']:.0f}" if rf else "-"
            lines.append(f"| {bold}{name}{bold} | {r['size_mb']:.2f} | {ref_mb} | {stats.fmt(r['rps_c8'], 0)} | "
                         f"{ref_rps} | {stats.fmt(r['p50_c1_ms'], 2)} | {stats.fmt(r['p50_c8_ms'], 1)} | "
                         f"{stats.ratio(r['rps_c8'], hf['json+base64']['rps_c8']):.2f}x | "
                         f"{r['rps_c8']['median'] * r['size_mb'] / 1e3:.2f} |")
        lines += [
            "",
            f"- The default body (raw+split+zstd) is {split['size_mb'] / hf['json+base64']['size_mb']:.2f}x the size "
            f"of json+base64 and its hits run {stats.ratio(split['rps_c8'], hf['json+base64']['rps_c8']):.2f}x the "
            "req/s. A hit is nginx copying the cached body through loopback TCP to wrk: if copying were the only "
            "cost, req/s would go as 1 / MB and every row would show the same GB/s; here they range "
            f"{min(gbs):.2f}-{max(gbs):.2f} GB/s (this machine's cores are shared with wrk and other jobs). The "
            f"reference stack's ratios: {ref['raw']['rps'] / ref['json+base64']['rps']:.2f}x (raw) and "
            f"{ref['raw+zstd']['rps'] / ref['json+base64']['rps']:.2f}x (raw+zstd) the req/s of json+base64.",
        ]
        sw = hits.get("sweep")
        if sw:
            pts = ", ".join(f"{p['size_mb']:g} MB {p['rps_c8']['median']:,.0f} req/s "
                            f"({p['rps_c8']['median'] * p['size_mb'] / 1e3:.1f} GB/s)" for p in sw)
            wmem = hits.get("tcp_wmem_max")
            rel = [r["rps_c8"]["median"] / _interp(sw, r["size_mb"]) for r in hf.values()]
            lines.append(
                f"- req/s against body size alone (random bytes through the same tier, c=8, median of "
                f"{sw[0]['rps_c8']['n']}): {pts}. The payload rate is not constant in size on this machine"
                + (f" (the kernel caps a TCP send buffer at {wmem / 2**20:g} MiB, `net.ipv4.tcp_wmem`)" if wmem else "")
                + f", so the formats' req/s ratios are not just their size ratios. Each format ran at "
                f"{min(rel):.2f}-{max(rel):.2f}x the req/s of a random body of its size: what a format changes on a "
                "hit is its size.")
        lines += [
            "",
        ]
    wh = result.get("worker_hits")
    if wh:
        lines += [
            f"The two formats the worker serves, on their real path (`{wh['model']}`, a {wh['image']}; the worker "
            "straight, and a cluster tier in front of it; the same wrk runs): the worker answers json+base64 by "
            "converting its cached v1 body per request, a tier caches each representation as its own entry.",
            "",
            "| format, served by | MB per response | req/s on hits (c=8) | p50 ms (c=1) |",
            "|---|---:|---:|---:|",
        ]
        for t, r in wh["targets"].items():
            lines.append(f"| {t} | {r['size_mb']:.2f} | {stats.fmt(r['rps_c8'], 0)} | {stats.fmt(r['p50_c1_ms'], 2)} |")
        lines.append("")
    lines += [
        f"Size and speed: {what}, {tokens:,} tokens x {hidden} (Kimi-K2.5 width), bf16, {raw_mb:.2f} MB raw. "
        f"All rows in one process, median (min-max) of {result['repeats']}; MB/s are MB of raw embeddings per "
        "second, one core.",
        "",
        "| format | body MB | vs json+base64 | encode MB/s | decode MB/s |",
        "|---|---:|---:|---:|---:|",
    ]
    default = f"raw+split+zstd L{wire.DEFAULT_LEVEL}"
    for r in result["rows"]:
        name = f"**{r['format']} (the default)**" if r["format"] == default else r["format"]
        lines.append(f"| {name} | {stats.fmt(r['size_mb'], 2)} | {r['ratio']:.3f}x | "
                     f"{stats.fmt(r['encode_mbps'], 0)} | {stats.fmt(r['decode_mbps'], 0)} |")
    plain, splitr = by.get("raw+zstd L3"), by.get("raw+split+zstd L3")
    hi, lo = result["plane_ratios"][:2]
    ref_ratio = ref["raw+zstd"]["mb"] / ref["json+base64"]["mb"]
    if plain and splitr:
        lines += [
            "",
            f"- Target (raw+zstd at most 0.60x of json+base64; the reference stack: {ref['raw+zstd']['mb']} vs "
            f"{ref['json+base64']['mb']} MB = {ref_ratio:.2f}x): {'met' if plain['ratio'] <= 0.60 else 'MISSED'} "
            f"at {plain['ratio']:.3f}x (L3); the byte-plane split takes it to {splitr['ratio']:.3f}x.",
        ]
    lines += [
        f"- Why the split works: alone, the high-byte plane (sign + exponent) compresses to {hi:.2f} of its size; "
        f"the low-byte plane (mantissa) to {lo:.2f}. Interleaved, zstd sees noise every other byte.",
        f"- Default `byte_planes=True, level={wire.DEFAULT_LEVEL}`: packed in the postprocess pool, off the device "
        "thread, once per unique image thanks to the caches.",
        "- Random weights: real embeddings (outlier channels) may compress differently; rerun on a real checkpoint "
        "when one is at hand.",
    ]
    png = _plot(result, plots)
    if png:
        lines += ["", f"![payload per format]({png})"]
    return "\n".join(lines) + "\n"


def _interp(sweep: list[dict], mb: float) -> float:
    """The sweep's req/s at `mb`, linear between its points (clamped at the ends)."""
    xs = [p["size_mb"] for p in sweep]
    ys = [p["rps_c8"]["median"] for p in sweep]
    if mb <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys, strict=True), zip(xs[1:], ys[1:], strict=True), strict=False):
        if mb <= x1:
            return y0 + (y1 - y0) * (mb - x0) / (x1 - x0)
    return ys[-1]


def _plot(result: dict, plots: Path) -> str | None:
    plt = stats.pyplot()
    if plt is None:
        return None
    ref = result.get("reference", REFERENCE)
    hits = result.get("hits")
    panels = 1 + bool(hits) + bool(hits and hits.get("sweep"))
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    ax = axes[0][0]
    rows = result["rows"]
    ax.barh(range(len(rows)), [r["size_mb"]["median"] for r in rows], color="#4c72b0")
    ax.set_yticks(range(len(rows)), [r["format"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("MB per response")
    ax.set_title(f"{result['tokens']:,} tokens x {result['hidden']} bf16 ({result['raw_mb']:.1f} MB raw)", fontsize=9)
    if hits:
        ax = axes[0][1]
        names = list(hits["formats"])
        xs = range(len(names))
        ax.bar([i - 0.2 for i in xs], [hits["formats"][n]["size_mb"] for n in names], 0.4, label="ours",
               color="#4c72b0")
        ax.bar([i + 0.2 for i in xs], [ref.get(n, {}).get("mb", 0) for n in names], 0.4, label="reference stack",
               color="#dd8452")
        ax.set_xticks(list(xs), names, fontsize=8)
        ax.set_ylabel("MB per response")
        ax.set_title(f"reference-sized payload ({hits['tokens']} tokens, {hits['raw_mb']:.2f} MB raw)", fontsize=9)
        ax.legend(fontsize=8)
    if hits and hits.get("sweep"):
        ax = axes[0][2]
        sw = hits["sweep"]
        ax.plot([p["size_mb"] for p in sw], [p["rps_c8"]["median"] for p in sw], "-", color="grey",
                label="random bodies")
        for n, r in hits["formats"].items():
            ax.plot(r["size_mb"], r["rps_c8"]["median"], "o", color="#4c72b0")
            ax.annotate(n, (r["size_mb"], r["rps_c8"]["median"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        refs = [(v["mb"], v["rps"]) for v in ref.values()]
        ax.plot([m for m, _ in refs], [r for _, r in refs], "s", color="#dd8452", label="reference stack")
        ax.set_xlabel("MB per response")
        ax.set_ylabel("req/s of a tier hit (c=8)")
        ax.set_title("cache-hit req/s against body size", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle("Payload per response by wire format")
    return stats.save_png(fig, plots, "wire-payload.png")


if __name__ == "__main__":
    main()
