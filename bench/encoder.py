"""Encoder benchmark (not a test): where one image's time goes, the old path against today's, bf16
against fp32 on the CPU, and the forward's FLOP/s against a plain matmul's.

    python -m bench.encoder [--quick] [--repeats N] [--json PATH]

Everything is measured in one process; figures compared with each other are measured in the same
run, alternating repeat by repeat; each is stats.summary (median, min, max, n) over the repeats.
Deterministic quantities (tokens, bytes, cosines, FLOP counts) are plain numbers.

1. Breakdown of one image (full HD, 4K) through today's worker path, stage by stage: fetch (the
   package's Fetcher, http on loopback from a threaded http.server), hash (mm_hash), decode,
   resize + patchify (preprocess), forward, pack (wire v1 as the worker packs), respond (the HTTP
   head + body written to a loopback TCP socket until the reading peer has all of it). Models: `tiny`
   and the full-width MoonViT (1152 wide) with 0 and 2 layers; 27 layers extrapolated per layer.
2. Before vs after, same weights: PIL BICUBIC resize + the eager reference forward
   (harness/reference.py) + a json+base64 body, against torch resize + the fast model + msgpack/zstd.
3. fp32 vs bf16 forward, same weights: time, speed-up, per-token cosine; achieved FLOP/s of the
   forward (counted analytically) against torch.matmul's on 4096x4096 in the same run.
Parity per registered model is bench/parity.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.server
import io
import json
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from bench import stats
from harness.media_factory import image_bytes, natural_image
from harness.models import random_model, ref_cfg
from harness.reference import reference_forward
from mm_encoder import Encoder, get_spec
from mm_encoder.core import wire
from mm_encoder.core.spec import ModelSpec
from mm_encoder.encode_worker.settings import WorkerSettings
from mm_encoder.fetch import Fetcher, FetchPolicy
from mm_encoder.model.checkpoint import build_empty
from mm_encoder.model.loading import default_dtype
from mm_encoder.model.preprocess import preprocess_frames, resize_target

SIZES = {"448x448": (448, 448), "full HD": (1920, 1080), "4K": (3840, 2160)}
STAGES = ("fetch", "hash", "decode", "preprocess", "forward", "pack", "respond")
WIDE = "kimi-k2.5-vision"  # the full-width MoonViT (1152 wide, 27 layers) + patchmerger -> 7168
REFERENCE_STACK = {"before_ms": 1040, "after_ms": 510, "what": "per 4K image on its GPU"}
MATMUL_N = 4096
# A measurement whose warm-up pass took under CHEAP_MS is warmed twice and repeated at least
# CHEAP_REPEATS times: on a shared machine one slow repeat would otherwise be half the figure.
CHEAP_MS, CHEAP_REPEATS = 500, 5
# What each mode measures: sizes per table and repeats. Full: ~5 min on 2 cores; quick: ~1 min.
MODES = {
    "full": {"repeats": 3, "wide_repeats": 2, "tiny_sizes": ["full HD", "4K"],
             "wide_sizes": ["448x448", "full HD", "4K"], "ba_sizes": ["448x448", "full HD", "4K"],
             "dtype_tiny": ["448x448", "full HD", "4K"],
             "dtype_wide": ["448x448", "full HD"], "matmul_n": MATMUL_N, "wide_full_448": True},
    "quick": {"repeats": 2, "wide_repeats": 2, "tiny_sizes": ["full HD", "4K"], "wide_sizes": ["448x448"],
              "ba_sizes": ["448x448", "full HD"], "dtype_tiny": ["448x448", "full HD"], "dtype_wide": ["448x448"],
              "matmul_n": MATMUL_N},
    # For tests/test_bench_report.py: every table and plot, tiny only, seconds.
    "smoke": {"repeats": 1, "wide_repeats": 1, "tiny_sizes": ["448x448"], "wide_sizes": [],
              "ba_sizes": ["448x448"], "dtype_tiny": ["448x448"], "dtype_wide": [], "matmul_n": 512},
}


def _file(size: str) -> str:
    return size.replace(" ", "-") + ".jpg"


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


# --- models ---------------------------------------------------------------------------------------


def with_layers(spec: ModelSpec, layers: int) -> ModelSpec:
    return spec.model_copy(update={"tower": spec.tower.model_copy(update={"num_layers": layers})})


def encoders(spec: ModelSpec) -> tuple[Encoder, Encoder]:
    """(fp32, bf16) encoders on the same random weights; the bf16 one is built as the package builds
    a bf16 model (every state-dict tensor cast)."""
    m32 = random_model(spec)
    m16 = build_empty(spec)
    m16.load_state_dict({k: v.to(torch.bfloat16) for k, v in m32.state_dict().items()}, strict=True, assign=True)
    cpu = torch.device("cpu")
    return (Encoder(spec, m32, device=cpu, dtype=torch.float32),
            Encoder(spec, m16.eval(), device=cpu, dtype=torch.bfloat16))


def forward_flops(spec: ModelSpec, grids: list[tuple[int, int, int]]) -> int:
    """Multiply-adds x 2 of the tower + projector: patch embed, per layer qkv, QK^T and AV over each
    item's own tokens, wo, MLP; the merger (a mean) is free; the projector on the merged tokens."""
    t, p = spec.tower, spec.projector
    d, mlp, pp, md = t.hidden_size, t.intermediate_size, 3 * t.patch_size**2, t.merged_dim
    total = 0
    for frames, h, w in grids:
        n = frames * h * w
        layer = 2 * n * d * 3 * d + 2 * 2 * n * n * d + 2 * n * d * d + 2 * 2 * n * d * mlp
        total += 2 * n * pp * d + t.num_layers * layer
        m = h * w // 4
        if p.type == "glm":
            total += 2 * m * md * p.out_dim + 3 * 2 * m * p.out_dim * p.context_dim
        else:  # patchmerger, patchmergerv2
            total += 2 * m * md * md + 2 * m * md * p.out_dim
    return total


def cosines(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    c = F.cosine_similarity(a.double(), b.double(), dim=-1)
    return float(c.mean()), float(c.min())


# --- loopback I/O: an origin to fetch from, a peer to respond to ------------------------------------


class Origin:
    """A threaded http.server on 127.0.0.1 serving fixed JPEG bytes (HTTP/1.1 keep-alive)."""

    def __init__(self, files: dict[str, bytes]):
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                body = files.get(self.path.lstrip("/"))
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/jpeg")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _recv_exact(sock: socket.socket, n: int, buf: bytearray) -> bool:
    view = memoryview(buf)
    while n:
        k = sock.recv_into(view, min(n, len(buf)))
        if not k:
            return False
        n -= k
    return True


class Sink:
    """A loopback TCP peer that reads every byte it is sent and then acknowledges with one byte.
    `send` is what respond measures: an HTTP response head + the body through the kernel, until the
    peer has read the last byte (plus a 1-byte ack)."""

    def __init__(self):
        srv = socket.create_server(("127.0.0.1", 0))
        self.tx = socket.create_connection(srv.getsockname())
        self.tx.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._rx, _ = srv.accept()
        srv.close()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        buf = bytearray(1 << 20)
        with contextlib.suppress(OSError):
            while _recv_exact(self._rx, 8, buf):
                if not _recv_exact(self._rx, struct.unpack("!Q", bytes(buf[:8]))[0], buf):
                    return
                self._rx.sendall(b"\x01")

    def send(self, body: bytes) -> float:
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/x-mm-embeddings\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body))
        t0 = time.perf_counter()
        self.tx.sendall(struct.pack("!Q", len(head) + len(body)) + head)
        self.tx.sendall(body)
        self.tx.recv(1)
        return _ms(t0)

    def close(self) -> None:
        self.tx.close()
        self._rx.close()


class Loopback:
    def __init__(self, files: dict[str, bytes]):
        self.origin = Origin(files)
        self.sink = Sink()
        self.loop = asyncio.new_event_loop()
        self.fetcher = Fetcher(FetchPolicy(allow_hosts=("127.0.0.1",)))

    def fetch(self, name: str) -> tuple[bytes, float]:
        t0 = time.perf_counter()
        got = self.loop.run_until_complete(self.fetcher.fetch(self.origin.url(name)))
        return got.data, _ms(t0)

    def close(self) -> None:
        self.loop.run_until_complete(self.fetcher.close())
        self.loop.close()
        self.sink.close()
        self.origin.close()


# --- the paths ------------------------------------------------------------------------------------

_WIRE = {k: WorkerSettings.model_fields[k].default for k in ("wire_dtype", "wire_byte_planes", "zstd_level")}


def _wire_dtype(enc: Encoder) -> str:
    """What the worker packs: its `--wire-dtype` default, else (unset) the dtype the model ran in."""
    from mm_encoder.encode_worker.batcher import wire_name

    return _WIRE["wire_dtype"] or wire_name(enc.steps.dtype)


def pack_today(enc: Encoder, h: str, out: torch.Tensor, grid) -> bytes:
    """The worker's pack (encode_worker/batcher.py): wire v1, its default dtype (the model's), byte planes and
    zstd level."""
    return wire.encode(mm_hash=h, model=enc.steps.spec.name, modality="image", embeds=out, grid_thws=[grid],
                       dtype=_wire_dtype(enc), byte_planes=_WIRE["wire_byte_planes"], level=_WIRE["zstd_level"])


@torch.inference_mode()
def today_pass(enc: Encoder, data: bytes) -> tuple[dict[str, float], bytes, torch.Tensor, object]:
    """hash -> decode -> preprocess (torch resize) -> fast forward -> pack: the worker's steps."""
    t0 = time.perf_counter()
    identified = enc.identify(data)
    times = {"hash": _ms(t0)}
    prepared = enc.preprocess_file(data, identified=identified)
    times["decode"] = prepared[0].timings_ms["decode"]
    times["preprocess"] = prepared[0].timings_ms["preprocess"]
    outputs, times["forward"] = enc.forward(prepared)
    t0 = time.perf_counter()
    body = pack_today(enc, identified[1], outputs[0], prepared[0].grid)
    times["pack"] = _ms(t0)
    return times, body, outputs[0], prepared[0].grid


@torch.inference_mode()
def before_pass(enc: Encoder, sd: dict, cfg: dict, data: bytes) -> tuple[dict[str, float], bytes]:
    """The old path on one thread: PIL decode + PIL BICUBIC resize on the CPU, pad/patchify, the eager
    fp32 reference forward, then a json+base64 body (same wire dtype as today)."""
    pc, patch = enc.steps.spec.preprocess, enc.steps.spec.tower.patch_size
    t0 = time.perf_counter()
    _, h = enc.identify(data)
    times = {"hash": _ms(t0)}
    t0 = time.perf_counter()
    img = Image.open(io.BytesIO(data)).convert("RGB")
    times["decode"] = _ms(t0)
    t0 = time.perf_counter()
    width, height = img.size
    new = resize_target(width, height, pc.in_patch_limit, pc, patch)
    if new != (width, height):
        img = img.resize(new, Image.BICUBIC)
    rgb = torch.from_numpy(np.asarray(img).copy())
    pixels, grid = preprocess_frames(rgb, pc, patch)  # already at its size: pad, patchify, normalise
    times["preprocess"] = _ms(t0)
    t0 = time.perf_counter()
    out = reference_forward(sd, cfg, pixels, [grid])[0]
    times["forward"] = _ms(t0)
    t0 = time.perf_counter()
    body = wire.encode_json(mm_hash=h, model=enc.steps.spec.name, modality="image", embeds=out, grid_thws=[grid],
                            dtype=_wire_dtype(enc))
    times["pack"] = _ms(t0)
    return times, body


# --- the tables -----------------------------------------------------------------------------------


def _collect(samples: list[dict[str, float]]) -> dict[str, dict]:
    keys = [k for k in STAGES if k in samples[0]]
    out = {k: stats.summary(s[k] for s in samples) for k in keys}
    out["total"] = stats.summary(sum(s[k] for k in keys) for s in samples)
    return out


def breakdown(io_: Loopback, label: str, encs: list[Encoder], size: str, repeats: int, warm: bool) -> list[dict]:
    """One row per encoder in `encs`, measured alternately repeat by repeat on the same image."""
    name = _file(size)
    samples: list[list[dict]] = [[] for _ in encs]
    bodies: list[bytes] = [b""] * len(encs)
    if warm:
        t0 = time.perf_counter()
        for enc in encs:
            today_pass(enc, io_.fetch(name)[0])
        if _ms(t0) < CHEAP_MS:  # cheap: warm once more and take more repeats (noise is a bigger share)
            for enc in encs:
                today_pass(enc, io_.fetch(name)[0])
            repeats = max(repeats, CHEAP_REPEATS)
    for _ in range(repeats):
        for i, enc in enumerate(encs):
            data, fetch_ms = io_.fetch(name)
            times, body, _, grid = today_pass(enc, data)
            times["fetch"] = fetch_ms
            times["respond"] = io_.sink.send(body)
            samples[i].append(times)
            bodies[i] = body
    rows = []
    for enc, s, body in zip(encs, samples, bodies, strict=True):
        spec = enc.steps.spec
        rows.append({"model": spec.name, "label": label, "layers": spec.tower.num_layers, "size": size,
                     "pixels": "x".join(map(str, SIZES[size])), "patches": grid[1] * grid[2],
                     "tokens": grid[1] * grid[2] // 4, "dtype": str(enc.steps.dtype).removeprefix("torch."),
                     "body_bytes": len(body), "stages": _collect(s), "samples": s})
    return rows


def extrapolate(r0: dict, r2: dict, layers: int) -> dict:
    """A `layers`-deep row from the 0- and 2-layer rows measured alternately: per repeat,
    forward = f0 + layers * (f2 - f0) / 2; the other stages are the 2-layer row's."""
    per_layer = [(b["forward"] - a["forward"]) / 2 for a, b in zip(r0["samples"], r2["samples"], strict=True)]
    samples = [{**b, "forward": a["forward"] + layers * pl}
               for a, b, pl in zip(r0["samples"], r2["samples"], per_layer, strict=True)]
    return {**r2, "layers": layers, "extrapolated": True, "per_layer_ms": stats.summary(per_layer),
            "stages": _collect(samples), "samples": samples}


def before_after(label: str, e32: Encoder, e16: Encoder, data: bytes, size: str, repeats: int) -> dict:
    sd = {k: v for k, v in e32.steps.model.state_dict().items()}
    cfg = ref_cfg(e32.steps.spec)
    before, after32, after16 = [], [], []
    bodies = {}
    t0 = time.perf_counter()
    today_pass(e32, data)
    today_pass(e16, data)
    if _ms(t0) < CHEAP_MS:
        before_pass(e32, sd, cfg, data)
        today_pass(e32, data)
        today_pass(e16, data)
        repeats = max(repeats, CHEAP_REPEATS)
    for _ in range(repeats):
        t, bodies["before"] = before_pass(e32, sd, cfg, data)
        before.append(t)
        t, bodies["after_fp32"], _, grid = today_pass(e32, data)
        after32.append(t)
        t, bodies["after_bf16"], _, _ = today_pass(e16, data)
        after16.append(t)
    b, a32, a16 = _collect(before), _collect(after32), _collect(after16)
    return {"label": label, "model": e32.steps.spec.name, "layers": e32.steps.spec.tower.num_layers, "size": size,
            "tokens": grid[1] * grid[2] // 4, "before": b, "after_fp32": a32, "after_bf16": a16,
            "speedup_fp32": stats.ratio(b["total"], a32["total"]),
            "speedup_bf16": stats.ratio(b["total"], a16["total"]),
            "body_bytes": {k: len(v) for k, v in bodies.items()}}


@torch.inference_mode()
def dtype_row(label: str, e32: Encoder, e16: Encoder, data: bytes, size: str, repeats: int, warm: bool,
              matmul: dict) -> dict:
    p32, p16 = e32.preprocess_item(data), e16.preprocess_item(data)
    if warm:
        t0 = time.perf_counter()
        e32.forward([p32])
        e16.forward([p16])
        if _ms(t0) < CHEAP_MS:
            e32.forward([p32])
            e16.forward([p16])
            repeats = max(repeats, CHEAP_REPEATS)
    t32, t16 = [], []
    for _ in range(repeats):
        o32, ms = e32.forward([p32])
        t32.append(ms)
        o16, ms = e16.forward([p16])
        t16.append(ms)
    s32, s16 = stats.summary(t32), stats.summary(t16)
    flops = forward_flops(e32.steps.spec, [p32.grid])
    mean, low = cosines(o16[0], o32[0])
    rate32 = stats.summary(flops / t / 1e6 for t in t32)  # GFLOP/s
    rate16 = stats.summary(flops / t / 1e6 for t in t16)
    return {"label": label, "model": e32.steps.spec.name, "layers": e32.steps.spec.tower.num_layers, "size": size,
            "patches": p32.num_patches, "tokens": p32.num_tokens, "fp32_ms": s32, "bf16_ms": s16,
            "speedup": stats.ratio(s32, s16), "cos_mean": mean, "cos_min": low, "gflop": flops / 1e9,
            "fp32_gflops": rate32, "bf16_gflops": rate16,
            "fp32_of_matmul": rate32["median"] / matmul["float32"]["median"],
            "bf16_of_matmul": rate16["median"] / matmul["bfloat16"]["median"]}


def matmul_rates(n: int, repeats: int) -> dict:
    """torch.matmul of two n x n matrices: GFLOP/s (2 n^3 per product) in fp32 and bf16."""
    out = {"n": n}
    gen = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a, b = a32.to(dt), b32.to(dt)
        torch.matmul(a, b)
        rates = []
        for _ in range(max(repeats, 2)):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            rates.append(2 * n**3 / (time.perf_counter() - t0) / 1e9)
        out[name] = stats.summary(rates)
    return out


def log(msg: str) -> None:
    print(msg, flush=True)


def run(mode: str, repeats: int | None) -> dict:
    m = MODES[mode]
    reps = repeats or m["repeats"]
    wide_reps = repeats or m["wide_repeats"]
    torch.manual_seed(0)
    images = {k: image_bytes(natural_image(w, h, seed=1), "JPEG", quality=90) for k, (w, h) in SIZES.items()}
    io_ = Loopback({_file(k): v for k, v in images.items()})
    today = default_dtype(torch.device("cpu"))
    result = {"mode": mode, "machine": stats.machine(), "default_dtype": str(today).removeprefix("torch."),
              "wire": _WIRE, "reference_stack": REFERENCE_STACK, "repeats": reps, "wide_repeats": wide_reps}
    t_start = time.perf_counter()
    try:
        log(f"matmul {m['matmul_n']}^3 ...")
        result["matmul"] = matmul = matmul_rates(m["matmul_n"], reps)
        log(f"  fp32 {stats.fmt(matmul['float32'], 0)} GFLOP/s, bf16 {stats.fmt(matmul['bfloat16'], 0)} GFLOP/s")
        t32, t16 = encoders(get_spec("tiny"))
        wide = {}
        if m["wide_sizes"] or m["dtype_wide"]:
            wide[0] = encoders(with_layers(get_spec(WIDE), 0))
            wide[2] = encoders(with_layers(get_spec(WIDE), 2))
            pick = 1 if today == torch.bfloat16 else 0
            for pair in wide.values():  # warm the kernels on a small image once
                today_pass(pair[pick], images["448x448"])
        result["breakdown"] = breakdowns(m, io_, today, (t32, t16), wide, reps, wide_reps)
        result["before_after"] = before_afters(m, images, (t32, t16), wide, reps)
        result["dtype"] = dtype_rows(m, images, (t32, t16), wide, reps, wide_reps, matmul)
    finally:
        io_.close()
    result["seconds"] = time.perf_counter() - t_start
    return result


def breakdowns(m: dict, io_: Loopback, today: torch.dtype, tiny: tuple[Encoder, Encoder],
               wide: dict[int, tuple[Encoder, Encoder]], reps: int, wide_reps: int) -> list[dict]:
    """Where the time goes: tiny per size, the full-width tower at 0 and 2 layers (27 extrapolated), and
    once at its real depth where that is affordable."""
    pick = 1 if today == torch.bfloat16 else 0
    rows = []
    for size in m["tiny_sizes"]:
        rows += breakdown(io_, "tiny", [tiny[pick]], size, reps, warm=True)
        log(f"breakdown tiny {size}: total {stats.fmt(rows[-1]['stages']['total'])} ms")
    for size in m["wide_sizes"]:
        r0, r2 = breakdown(io_, "MoonViT-1152", [wide[0][pick], wide[2][pick]], size, wide_reps, warm=False)
        rows += [r0, r2, extrapolate(r0, r2, get_spec(WIDE).tower.num_layers)]
        log(f"breakdown moonvit {size}: per layer {stats.fmt(rows[-1]['per_layer_ms'])} ms")
    if m.get("wide_full_448"):  # the real depth once, where it is affordable: checks the extrapolation
        cpu = torch.device("cpu")
        full = Encoder(get_spec(WIDE), random_model(get_spec(WIDE), dtype=today), device=cpu, dtype=today)
        rows += breakdown(io_, "MoonViT-1152", [full], "448x448", wide_reps, warm=True)
        del full
        log(f"breakdown moonvit 27 layers 448x448: forward {stats.fmt(rows[-1]['stages']['forward'])} ms")
    return rows


def before_afters(m: dict, images: dict[str, bytes], tiny: tuple[Encoder, Encoder],
                  wide: dict[int, tuple[Encoder, Encoder]], reps: int) -> list[dict]:
    ba = []
    for size in m["ba_sizes"]:
        ba.append(before_after("tiny", *tiny, images[size], size, reps))
        log(f"before/after tiny {size}: {ba[-1]['speedup_fp32']:.2f}x fp32, {ba[-1]['speedup_bf16']:.2f}x bf16")
    if 2 in wide:
        ba.append(before_after("MoonViT-1152, 2 layers", *wide[2], images["448x448"], "448x448", reps))
        log(f"before/after moonvit 2L 448: {ba[-1]['speedup_fp32']:.2f}x fp32")
    return ba


def dtype_rows(m: dict, images: dict[str, bytes], tiny: tuple[Encoder, Encoder],
               wide: dict[int, tuple[Encoder, Encoder]], reps: int, wide_reps: int, matmul: dict) -> list[dict]:
    dt = []
    for size in m["dtype_tiny"]:
        dt.append(dtype_row("tiny", *tiny, images[size], size, reps, True, matmul))
        log(f"dtype tiny {size}: bf16 {dt[-1]['speedup']:.2f}x, cos {dt[-1]['cos_mean']:.6f}")
    for size in m["dtype_wide"]:
        small = size == "448x448"
        dt.append(dtype_row("MoonViT-1152, 2 layers", *wide[2], images[size], size,
                            reps if small else wide_reps, small, matmul))
        log(f"dtype moonvit 2L {size}: bf16 {dt[-1]['speedup']:.2f}x, cos {dt[-1]['cos_mean']:.6f}")
    return dt


# --- the command ---------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (about a minute)")
    p.add_argument("--smoke", action="store_true", help="tiny only, 448x448, 1 repeat (seconds; for tests)")
    p.add_argument("--repeats", type=int, help="override the mode's repeats")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    result = run(mode, args.repeats)
    print(f"done in {result['seconds']:.0f} s", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
