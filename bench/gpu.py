"""GPU benchmark and checks (issue 14): one run on one GPU, one results folder. Start it with
bench/gpu.sh, which finds or makes a Python environment with CUDA torch first.

    bash bench/gpu.sh                    # results.json + results.md in $OUT or bench/gpu-results/<date>
    bash bench/gpu.sh --cpu-logic        # the same logic on the CPU, a tiny tower and small images

Stages, in order; each is bounded by its own time budget (repeats stop being added once it is spent)
and by the run's global budget; a stage that fails records its error and the others still run:

- `full_hd`, `4k` (parity + forward): the full 27-layer kimi-k2.5-vision tower + projector, seeded
  random weights. Parity: the bf16 fast forward against the fp32 eager reference (tests/reference.py)
  on the same weights and pixels: per-token cosine mean/min, rel L2, max abs error; the reference
  itself in bf16 is scored too, as the control. Forward time: fast bf16, reference bf16 and reference
  fp32, each timed with CUDA events around the forward (GPU timeline, gaps included).
- `syncs`: host-blocking device syncs in one fast forward. Counted with PyTorch's sync debug mode
  (`torch.cuda.set_sync_debug_mode("warn")`): every synchronising CUDA call made through PyTorch
  (stream/device synchronize, blocking copies, .item(), nonzero, ...) raises a warning, recorded with
  the Python line that made it. Cross-check: the profiler's count of synchronising CUDA runtime calls
  and of device-to-host copies in the same forward. Target 0.
- `attention`: a pack of several images in one batch. Which path ran (calls of `varlen_attn` and of
  SDPA counted around a forward; varlen is taken when there is one call per layer), the attention op
  alone (varlen vs the module's per-item SDPA fallback, same q/k/v), and the whole forward either way.
- `copy`: the encoder's output copy (pinned buffer, non_blocking copy on a side stream, an event)
  against a plain `.cpu()` of the same 4K output; and two 4K items through `Encoder.forward` (the
  copy of the first overlaps the second forward) against forward + `.cpu()` one after the other.
- `before_after`: one 4K JPEG, wall time per stage, all on one thread. before = PIL decode + PIL
  BICUBIC resize on the CPU + pad/patchify/normalise on the CPU + the eager reference forward (bf16
  on the GPU; fp32 as a second row) + `.cpu()` + json+base64 body. after = today's path: mm_hash,
  decode, torch resize on the device (Encoder.prepare_media), the fast model + pinned async copy
  (Encoder.forward), wire v1 (msgpack + raw + zstd, the worker's defaults).
- `engine`: the language model the engines serve, on the device. The generated random-weight
  Kimi-K2.5 checkpoints (`engines.tiny_checkpoint`, presets `tiny` and `small`, written into a
  temporary directory), loaded with `LanguageModel.load(..., device="cuda", dtype=bf16 | fp32)` and
  run with the engine's own calls (`embed`, then `forward` with a transformers KV cache, as
  `Engine.prefill` and `Engine.step` make them; no prefix store). Per preset, dtype and prompt
  length (seeded token ids): prefill ms (wall, device synchronised before and after) and decode
  tokens/s (32 greedy steps after a prefill, wall). Then the greedy check: 32 greedy tokens for one
  prompt, fp32 on the device against fp32 on the CPU (same checkpoint); equal, or the first step
  where they differ with the CPU's top-2 logit margin there (a near tie is rounding, a wide margin
  a bug). Needs transformers >= 5.24 (the `engine` extra).

Exit status: 0 all stages ran (the checks in results.json say what was met); 1 a stage failed;
2 no CUDA device (and not --cpu-logic).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import platform
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

_THREADS = torch.get_num_threads()
import reference  # noqa: E402  (tests/reference.py: the independent fp32 eager reference)
import stats  # noqa: E402
from conftest import random_model, ref_cfg  # noqa: E402  (it caps torch threads at 2; restored below)
from media_factory import image_bytes, natural_image  # noqa: E402

from mm_encoder import Encoder, get_spec, wire  # noqa: E402
from mm_encoder.kernels import attention as attn_mod  # noqa: E402
from mm_encoder.kernels.attention import block_diagonal_attention  # noqa: E402
from mm_encoder.model import media  # noqa: E402
from mm_encoder.model.preprocess import padded_grid, preprocess_frames, resize_target  # noqa: E402

torch.set_num_threads(_THREADS)

SCHEMA = 1
MODEL = "kimi-k2.5-vision"
REFERENCE_STACK = {"before_ms": 1040, "after_ms": 510, "speedup": 2.0,
                   "what": "per 4K image, on the reference stack's GPU"}
PARITY_GATE = 0.9994  # mean per-token cosine, bf16 fast vs fp32 reference (docs: a realistic production gate)
STAGE_KEYS = ("hash", "decode", "preprocess", "forward", "pack")  # before/after stages, as bench/encoder.py
# CUDA runtime/driver calls that block the host until the device (or a stream, or an event) is done.
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpy2D", "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize")

MODES: dict[str, dict[str, Any]] = {
    # Budgets in seconds; ~3.5 min of stages on an H200 (the engine stage ~1 min), bounded at `global_s`.
    "gpu": {
        "tower": None,
        "projector": None,
        "sizes": {"full_hd": (1920, 1080), "4k": (3840, 2160)},
        "pack": [(448, 448), (1280, 720), (640, 480), (1024, 768), (800, 1200), (336, 336)],
        "global_s": 390.0,
        "budget": {"fast": 6.0, "ref_fp32": 12.0, "ref_bf16": 8.0, "attention": 4.0, "copy": 3.0, "e2e": 12.0,
                   "engine": 1.5},
        "min_n": {"fast": 5, "ref": 3, "attention": 5, "copy": 5, "e2e": 3, "engine": 3},
        "max_n": 50,
        "engine": {"presets": ["tiny", "small"], "lengths": [128, 2048, 8192], "decode": 32, "check_len": 512},
    },
    # The whole logic on the CPU in seconds: a head_dim-72 tower of 2 layers, small images.
    "cpu-logic": {
        "tower": {"hidden_size": 144, "intermediate_size": 256, "num_heads": 2, "num_layers": 2},
        "projector": {"out_dim": 256},
        "sizes": {"full_hd": (192, 108), "4k": (384, 216)},
        "pack": [(56, 56), (112, 84), (140, 112)],
        "global_s": 180.0,
        "budget": {"fast": 0.2, "ref_fp32": 0.2, "ref_bf16": 0.2, "attention": 0.2, "copy": 0.1, "e2e": 0.3,
                   "engine": 0.1},
        "min_n": {"fast": 1, "ref": 1, "attention": 1, "copy": 1, "e2e": 1, "engine": 1},
        "max_n": 2,
        "engine": {"presets": ["tiny"], "lengths": [64, 256], "decode": 4, "check_len": 64},
    },
}


def log(msg: str) -> None:
    print(msg, flush=True)


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# --- timing -------------------------------------------------------------------------------------------


class Bench:
    """Timers and bounded repeats. On CUDA, `device_ms` is CUDA-event time around the work (the GPU
    timeline from the first to the last enqueued op, idle gaps included); `wall_ms` is host time with
    the device synchronised before and after."""

    def __init__(self, device: torch.device, global_s: float, max_n: int):
        self.device = device
        self.cuda = device.type == "cuda"
        self.deadline = time.perf_counter() + global_s
        self.max_n = max_n

    def over(self) -> bool:
        return time.perf_counter() > self.deadline

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def device_ms(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            return self.wall_ms(fn)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def wall_ms(self, fn: Callable[[], object]) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - t0) * 1e3

    def repeat(self, measure: Callable[[], float], *, budget_s: float, min_n: int, warmup: int = 1) -> dict:
        """stats.summary of `measure()` repeated: at least once; then until `min_n` and `budget_s` are
        both reached, `max_n` is, the next repeat would end past twice the budget, or the run's time is up."""
        for _ in range(warmup):
            measure()
        values: list[float] = []
        t0 = time.perf_counter()
        while True:
            values.append(measure())
            n, spent = len(values), time.perf_counter() - t0
            if (n >= self.max_n or self.over() or (n >= min_n and spent >= budget_s)
                    or spent + spent / n > 2 * budget_s):
                break
        return stats.summary(values)


# --- helpers ------------------------------------------------------------------------------------------


def compare(x: torch.Tensor, ref: torch.Tensor) -> dict:
    """Per-token cosine mean/min, relative L2 and max abs error of `x` against `ref`, in float64."""
    a, b = x.double(), ref.double()
    cos = F.cosine_similarity(a, b, dim=-1)
    return {"tokens": int(a.shape[0]), "cos_mean": float(cos.mean()), "cos_min": float(cos.min()),
            "rel_l2": float((a - b).norm() / b.norm()), "max_abs": float((a - b).abs().max())}


@contextlib.contextmanager
def reference_on(device: torch.device):
    """tests/reference.py builds its RoPE table and time embedding on the CPU; moved to `device` here so
    the unchanged reference math runs on the GPU (a no-op on the CPU or once they are built there)."""
    rope, time_emb = reference.rope_table, reference.time_embedding
    reference.rope_table = lambda *a: rope(*a).to(device)
    reference.time_embedding = lambda *a: time_emb(*a).to(device)
    try:
        yield
    finally:
        reference.rope_table, reference.time_embedding = rope, time_emb


@contextlib.contextmanager
def attention_calls():
    """Counts of varlen_attn and SDPA calls made while the block runs."""
    counts = {"varlen": 0, "sdpa": 0}
    varlen, sdpa = attn_mod._varlen_attn, F.scaled_dot_product_attention

    def counted_varlen(*a, **k):
        counts["varlen"] += 1
        return varlen(*a, **k)

    def counted_sdpa(*a, **k):
        counts["sdpa"] += 1
        return sdpa(*a, **k)

    if varlen is not None:
        attn_mod._varlen_attn = counted_varlen
    F.scaled_dot_product_attention = counted_sdpa
    try:
        yield counts
    finally:
        attn_mod._varlen_attn = varlen
        F.scaled_dot_product_attention = sdpa


@contextlib.contextmanager
def per_item_sdpa():
    """The attention module's own CPU/fp32 path (SDPA per item) on any device and dtype."""
    use = attn_mod._use_varlen
    attn_mod._use_varlen = lambda q: False
    try:
        yield
    finally:
        attn_mod._use_varlen = use


def _site(filename: str, lineno: int) -> str:
    with contextlib.suppress(ValueError):
        filename = str(Path(filename).resolve().relative_to(ROOT))
    return f"{filename}:{lineno}"


def count_syncs(fn: Callable[[], object], cuda: bool) -> dict:
    """Synchronising CUDA calls that `fn` makes, from PyTorch's sync debug mode (warn), by call site.
    The mode is off again before anything here synchronises (torch.cuda.synchronize counts too)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prev = torch.cuda.get_sync_debug_mode() if cuda else 0
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(prev)
    hits = [w for w in caught if "synchroniz" in str(w.message).lower()]
    sites = Counter(_site(w.filename, w.lineno) for w in hits)
    return {"syncs": len(hits), "sites": dict(sites.most_common())}


def profile_syncs(fn: Callable[[], object], cuda: bool) -> dict:
    """The profiler's view of `fn`: synchronising CUDA runtime calls and memcpy kinds."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
    names = Counter(e.name for e in prof.events())
    sync_calls = {n: c for n, c in names.items() if n in SYNC_CALLS}
    memcpy = {n: c for n, c in names.items() if n.startswith("Memcpy")}
    dtoh = sum(c for n, c in memcpy.items() if "DtoH" in n or "Device -> P" in n)
    return {"sync_calls": sync_calls, "sync_calls_total": sum(sync_calls.values()), "memcpy": memcpy,
            "dtoh_copies": dtoh, "events": len(prof.events())}


def cpu_pixels(img: Image.Image, cfg, patch: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The old CPU path after PIL's resize: pad bottom/right to whole 2x2 merge units, patchify
    row-major, normalise; fp32 [h*w, 3, P, P] on the CPU."""
    x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)  # [3, H, W]
    _, height, width = x.shape
    gh, gw = padded_grid(width, height, patch)
    x = F.pad(x, (0, gw * patch - width, 0, gh * patch - height), value=0)
    x = x.reshape(3, gh, patch, gw, patch).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, patch, patch)
    mean = torch.tensor(cfg.image_mean).view(1, 3, 1, 1) * 255
    std = torch.tensor(cfg.image_std).view(1, 3, 1, 1) * 255
    return (x.float() - mean) / std, (1, gh, gw)


def worker_wire() -> dict:
    """The worker's wire defaults (dtype, byte planes, zstd level); wire.encode's own when the
    service settings cannot be imported (pydantic-settings is not needed for this benchmark)."""
    try:
        from mm_encoder.encode_worker.settings import WorkerSettings

        f = WorkerSettings.model_fields
        # unset, the worker packs the dtype its model runs in: bf16 here (fast_dtype)
        return {"dtype": f["wire_dtype"].default or "bfloat16", "byte_planes": f["wire_byte_planes"].default,
                "level": f["zstd_level"].default}
    except Exception:
        return {"dtype": "bfloat16", "byte_planes": True, "level": wire.DEFAULT_LEVEL}


def engine_prompt(vocab: int, n: int, seed: int) -> list[int]:
    """`n` seeded token ids (the cost of a prefill does not depend on which)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@torch.inference_mode()
def greedy(lm, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """`steps` greedy tokens after `ids`, as the engine makes them (prefill, then one step per token
    with the KV cache), and the top-2 logit margin at each."""
    logits, cache = lm.forward(lm.embed(ids))
    tokens, margins = [], []
    for i in range(steps):
        top = logits.float().topk(2)
        tokens.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        if i < steps - 1:
            logits, cache = lm.forward(lm.embed([tokens[-1]]), cache)
    return tokens, margins


def greedy_check(cpu: tuple[list[int], list[float]], dev: tuple[list[int], list[float]]) -> dict:
    """Equal tokens, or the first step where they differ and the CPU's top-2 margin there."""
    (a, margins), (b, _) = cpu, dev
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    return {"tokens": len(a), "equal": first is None, "first_divergence": first,
            "cpu_margin": None if first is None else margins[first], "cpu_tokens": a, "device_tokens": b,
            "min_cpu_margin": min(margins)}


# --- the run ------------------------------------------------------------------------------------------


class Run:
    def __init__(self, mode: str, out: Path, device: torch.device):
        self.mode, self.out, self.device = mode, out, device
        self.m = MODES[mode]
        self.cuda = device.type == "cuda"
        self.bench = Bench(device, self.m["global_s"], self.m["max_n"])
        self.t_start = time.perf_counter()
        self.results: dict[str, Any] = {
            "schema": SCHEMA, "mode": mode, "started": now(), "finished": None, "elapsed_s": None,
            "machine": self.machine(), "config": {}, "parity": {}, "forward": {}, "syncs": {}, "attention": {},
            "copy": {}, "before_after": {}, "engine": {}, "checks": {}, "stage_s": {}, "errors": {},
        }

    def machine(self) -> dict:
        m = stats.machine()
        m["torch_cuda"] = torch.version.cuda
        m["platform"] = platform.platform()
        if self.cuda:
            p = torch.cuda.get_device_properties(self.device)
            m.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}",
                     sms=p.multi_processor_count)
        return m

    def save(self) -> None:
        self.results["elapsed_s"] = round(time.perf_counter() - self.t_start, 1)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=2, default=str))
        tmp.replace(self.out / "results.json")

    def stage(self, name: str, fn: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        if self.bench.over():
            self.results["errors"][name] = "skipped: the run's time budget was spent"
            log(f"[{name}] skipped: the run's time budget was spent")
        else:
            log(f"[{name}] ...")
            try:
                fn()
            except Exception as e:
                self.results["errors"][name] = f"{type(e).__name__}: {e}"
                log(f"[{name}] FAILED: {type(e).__name__}: {e}")
                traceback.print_exc()
        self.results["stage_s"][name] = round(time.perf_counter() - t0, 1)
        if self.cuda:
            torch.cuda.empty_cache()
        self.save()

    # --- set-up ---

    def setup(self) -> None:
        m, dev = self.m, self.device
        spec = get_spec(MODEL)
        if m["tower"]:
            spec = spec.model_copy(update={"tower": spec.tower.model_copy(update=m["tower"])})
        if m["projector"]:
            spec = spec.model_copy(update={"projector": spec.projector.model_copy(update=m["projector"])})
        self.spec, self.patch = spec, spec.tower.patch_size
        t0 = time.perf_counter()
        model = random_model(spec, seed=0)  # fp32 on the CPU, as the tests make it
        self.sd32 = {k: v.detach().to(dev, copy=True) for k, v in model.state_dict().items()}
        self.sd16 = {k: v.to(torch.bfloat16) for k, v in self.sd32.items()}
        self.model = model.to(device=dev, dtype=torch.bfloat16).eval()
        self.enc = Encoder(spec, self.model, device=dev, dtype=torch.bfloat16)
        self.rcfg = ref_cfg(spec)
        init_s = time.perf_counter() - t0
        self.varlen_error = self.probe_varlen()
        t0 = time.perf_counter()
        self.images = {k: image_bytes(natural_image(w, h, seed=1), "JPEG", quality=90)
                       for k, (w, h) in m["sizes"].items()}
        self.pack_images = [image_bytes(natural_image(w, h, seed=10 + i), "JPEG", quality=90)
                            for i, (w, h) in enumerate(m["pack"])]
        t = spec.tower
        self.results["config"] = {
            "model": spec.name, "layers": t.num_layers, "hidden": t.hidden_size, "heads": t.num_heads,
            "head_dim": t.head_dim, "out_dim": spec.projector.out_dim,
            "params": sum(v.numel() for v in self.sd32.values()), "seed": 0,
            "weights": "random (init_random, std 0.02)",
            "fast_dtype": "bfloat16", "reference": "tests/reference.py", "device": str(dev),
            "sizes": {k: list(v) for k, v in m["sizes"].items()}, "pack_sizes": [list(s) for s in m["pack"]],
            "jpeg_bytes": {k: len(v) for k, v in self.images.items()}, "budgets_s": m["budget"],
            "global_budget_s": m["global_s"], "min_repeats": m["min_n"], "max_repeats": m["max_n"],
            "allow_tf32": torch.backends.cuda.matmul.allow_tf32, "threads": torch.get_num_threads(),
            "wire": worker_wire(), "model_init_s": round(init_s, 1), "images_s": round(time.perf_counter() - t0, 1),
        }
        log(f"model {spec.name}: {t.num_layers} layers x {t.hidden_size}, "
            f"{self.results['config']['params'] / 1e6:.1f} M params, on {dev} in {init_s:.1f} s")

    @torch.inference_mode()
    def probe_varlen(self) -> str | None:
        """One small varlen call as the model makes it. If it raises (an API this torch lacks), the run
        goes on with the module's per-item SDPA path, and the attention stage reports the error."""
        if not (self.cuda and attn_mod._varlen_attn is not None):
            return None
        t = self.spec.tower
        q = torch.randn(96, t.num_heads, t.head_dim, device=self.device, dtype=torch.bfloat16)
        cu = torch.tensor([0, 32, 96], dtype=torch.int32, device=self.device)
        try:
            block_diagonal_attention(q, q, q, [32, 64], cu, 64)
            self.bench.sync()
        except Exception as e:
            attn_mod._use_varlen = lambda q: False
            log(f"varlen attention failed ({type(e).__name__}: {e}); the run uses per-item SDPA")
            return f"{type(e).__name__}: {e}"
        return None

    def pixels(self, data: bytes) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """fp32 pixel_values on the device, as Encoder.preprocess makes them before its dtype cast."""
        rgb = media.decode_image(data, self.enc.limits)
        return preprocess_frames(rgb, self.spec.preprocess, self.patch, device=self.device, dtype=torch.float32)

    # --- stages ---

    @torch.inference_mode()
    def parity_forward(self, size: str) -> None:
        b, m = self.bench, self.m
        px32, grid = self.pixels(self.images[size])
        px16, grids = px32.to(torch.bfloat16), [grid]
        fast = self.model(px16, grids)  # also the warm-up
        fast_ms = b.repeat(lambda: b.device_ms(lambda: self.model(px16, grids)), budget_s=m["budget"]["fast"],
                           min_n=m["min_n"]["fast"])

        def ref32_fwd():
            return reference.reference_forward(self.sd32, self.rcfg, px32, grids)[0]

        def ref16_fwd():
            return reference.reference_forward(self.sd16, self.rcfg, px16, grids)[0]

        with reference_on(self.device):
            ref32 = ref32_fwd()  # the parity output, and the reference's warm-up
            ref32_ms = b.repeat(lambda: b.device_ms(ref32_fwd), budget_s=m["budget"]["ref_fp32"],
                                min_n=m["min_n"]["ref"], warmup=0)
            ref16 = ref16_fwd()
            ref16_ms = b.repeat(lambda: b.device_ms(ref16_fwd), budget_s=m["budget"]["ref_bf16"],
                                min_n=m["min_n"]["ref"], warmup=0)
        w, h = m["sizes"][size]
        parity = compare(fast, ref32)
        parity.update(image=f"{w}x{h}", grid=list(grid), patches=grid[1] * grid[2],
                      reference_bf16=compare(ref16, ref32), gate=PARITY_GATE, met=parity["cos_mean"] >= PARITY_GATE)
        self.results["parity"][size] = parity
        self.results["forward"][size] = {
            "image": f"{w}x{h}", "patches": grid[1] * grid[2], "tokens": parity["tokens"], "timer": "cuda events"
            if self.cuda else "perf_counter", "fast_bf16_ms": fast_ms, "reference_bf16_ms": ref16_ms,
            "reference_fp32_ms": ref32_ms, "fp32_reference_over_fast": stats.ratio(ref32_ms, fast_ms),
            "bf16_reference_over_fast": stats.ratio(ref16_ms, fast_ms),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(self.device) / 2**30, 1) if self.cuda else None,
        }
        log(f"  {size} {w}x{h}: {parity['tokens']} tokens, cos mean {parity['cos_mean']:.6f} "
            f"min {parity['cos_min']:.6f} "
            f"rel L2 {parity['rel_l2']:.2e}; fast {stats.fmt(fast_ms)} ms, ref bf16 {stats.fmt(ref16_ms)} ms, "
            f"ref fp32 {stats.fmt(ref32_ms)} ms")

    @torch.inference_mode()
    def syncs(self) -> None:
        size = "4k"
        px32, grid = self.pixels(self.images[size])
        px16, grids = px32.to(torch.bfloat16), [grid]
        self.model(px16, grids)  # warm: first-call work (allocator, kernel choice) is not the forward's
        self.bench.sync()
        fwd = count_syncs(lambda: self.model(px16, grids), self.cuda)
        self.bench.sync()
        prepared = self.enc.prepare(self.images[size])
        self.bench.sync()
        enc_fwd = count_syncs(lambda: self.enc.forward([prepared]), self.cuda)
        self.bench.sync()
        try:
            prof = profile_syncs(lambda: self.model(px16, grids), self.cuda)
        except Exception as e:  # the profiler is a cross-check; its absence is not the stage's failure
            prof = {"error": f"{type(e).__name__}: {e}"}
        self.bench.sync()
        self.results["syncs"] = {
            "image": size, "method": "torch.cuda.set_sync_debug_mode('warn') around one warm fast forward "
            "(model(pixels, grids): batch plan, 27 layers, merger, projector); each synchronising call "
            "PyTorch makes is a warning, recorded with the Python line that made it"
            if self.cuda else "not measurable on the CPU (no CUDA sync debug mode): the code path only",
            "fast_forward": fwd, "encoder_forward": {**enc_fwd, "note": "Encoder.forward: the fast forward, the "
                                                      "pinned side-stream copy and its final event wait"},
            "profiler": prof, "target": 0, "met": fwd["syncs"] == 0,
        }
        log(f"  fast forward: {fwd['syncs']} syncs {fwd['sites']}; Encoder.forward: {enc_fwd['syncs']}; "
            f"profiler: {prof.get('sync_calls', prof.get('error'))}")

    @torch.inference_mode()
    def attention(self) -> None:
        b, m = self.bench, self.m
        prepared = [self.enc.prepare(d) for d in self.pack_images]
        pixels = torch.cat([p.pixel_values for p in prepared])
        grids = [p.grid for p in prepared]
        plan = self.model.plan(grids, self.device)
        self.model(pixels, grids)
        with attention_calls() as calls:
            self.model(pixels, grids)
        layers = self.spec.tower.num_layers
        t = self.spec.tower
        q, k, v = (torch.randn(sum(plan.seqlens), t.num_heads, t.head_dim, device=self.device, dtype=torch.bfloat16)
                   for _ in range(3))

        def op():
            return block_diagonal_attention(q, k, v, plan.seqlens, plan.cu_seqlens, plan.max_seqlen)

        budget, min_n = m["budget"]["attention"], m["min_n"]["attention"]
        out_default = op()
        op_default = b.repeat(lambda: b.device_ms(op), budget_s=budget, min_n=min_n)
        fwd_default = b.repeat(lambda: b.device_ms(lambda: self.model(pixels, grids)), budget_s=budget, min_n=min_n)
        with per_item_sdpa():
            out_sdpa = op()
            op_sdpa = b.repeat(lambda: b.device_ms(op), budget_s=budget, min_n=min_n)
            fwd_sdpa = b.repeat(lambda: b.device_ms(lambda: self.model(pixels, grids)), budget_s=budget, min_n=min_n)
        agree = compare(out_default.flatten(1).float(), out_sdpa.flatten(1).float())
        self.results["attention"] = {
            "varlen_available": attn_mod._varlen_attn is not None, "varlen_error": self.varlen_error,
            "varlen_taken": calls["varlen"] == layers,
            "varlen_calls": calls["varlen"], "sdpa_calls": calls["sdpa"], "expected_varlen_calls": layers,
            "items": len(grids), "seqlens": plan.seqlens, "tokens": sum(plan.seqlens), "max_seqlen": plan.max_seqlen,
            "op_default_ms": op_default, "op_per_item_sdpa_ms": op_sdpa,
            "op_sdpa_over_default": stats.ratio(op_sdpa, op_default),
            "forward_default_ms": fwd_default, "forward_per_item_sdpa_ms": fwd_sdpa,
            "forward_sdpa_over_default": stats.ratio(fwd_sdpa, fwd_default),
            "default_vs_sdpa": {"cos_min": agree["cos_min"], "max_abs": agree["max_abs"]},
        }
        log(f"  {len(grids)} items, {sum(plan.seqlens)} tokens: varlen calls {calls['varlen']}/{layers}, sdpa calls "
            f"{calls['sdpa']}; op {stats.fmt(op_default, 3)} vs per-item SDPA {stats.fmt(op_sdpa, 3)} ms; forward "
            f"{stats.fmt(fwd_default)} vs {stats.fmt(fwd_sdpa)} ms")

    @torch.inference_mode()
    def copy(self) -> None:
        b, m, enc = self.bench, self.m, self.enc
        budget, min_n = m["budget"]["copy"], m["min_n"]["copy"]
        item = enc.prepare(self.images["4k"])
        out = self.model(item.pixel_values, [item.grid])
        b.sync()

        def side_stream_copy():
            host, event = enc._to_host(out)  # the encoder's own copy path
            if event is not None:
                event.synchronize()
            return host

        pinned = side_stream_copy()
        plain = out.cpu()
        plain_ms = b.repeat(lambda: b.wall_ms(out.cpu), budget_s=budget, min_n=min_n)
        pinned_ms = b.repeat(lambda: b.wall_ms(side_stream_copy), budget_s=budget, min_n=min_n)

        def sequential():
            for p in (item, item):
                self.model(p.pixel_values, [p.grid]).cpu()

        two_seq = b.repeat(lambda: b.wall_ms(sequential), budget_s=budget, min_n=min_n)
        two_enc = b.repeat(lambda: b.wall_ms(lambda: enc.forward([item, item])), budget_s=budget, min_n=min_n)
        nbytes = out.numel() * out.element_size()
        self.results["copy"] = {
            "image": "4k", "shape": list(out.shape), "dtype": str(out.dtype).removeprefix("torch."), "bytes": nbytes,
            "pinned": bool(pinned.is_pinned()) if self.cuda else False, "equal": bool(torch.equal(pinned, plain)),
            "plain_cpu_ms": plain_ms, "pinned_side_stream_ms": pinned_ms,
            "plain_gb_s": nbytes / plain_ms["median"] / 1e6, "pinned_gb_s": nbytes / pinned_ms["median"] / 1e6,
            "plain_over_pinned": stats.ratio(plain_ms, pinned_ms),
            "batches_per_forward": len(enc._batches([item, item])),
            "two_items_sequential_ms": two_seq, "two_items_encoder_forward_ms": two_enc,
            "two_items_sequential_over_encoder": stats.ratio(two_seq, two_enc),
        }
        log(f"  {nbytes / 1e6:.1f} MB: .cpu() {stats.fmt(plain_ms, 2)} ms, "
            f"pinned side stream {stats.fmt(pinned_ms, 2)} ms; "
            f"two items sequential {stats.fmt(two_seq)} vs Encoder.forward {stats.fmt(two_enc)} ms")

    @torch.inference_mode()
    def before_pass(self, data: bytes, sd: dict) -> tuple[dict[str, float], int]:
        enc, cfg, dev = self.enc, self.spec.preprocess, self.device
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        _, h = enc.identify(data)
        times["hash"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        img = Image.open(io.BytesIO(data)).convert("RGB")
        times["decode"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        new = resize_target(*img.size, cfg.in_patch_limit, cfg, self.patch)
        if new != img.size:
            img = img.resize(new, Image.BICUBIC)
        pixels, grid = cpu_pixels(img, cfg, self.patch)
        dtype = next(iter(sd.values())).dtype
        pixels = pixels.to(dev).to(dtype)
        times["preprocess"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        out = reference.reference_forward(sd, self.rcfg, pixels, [grid])[0].cpu()
        times["forward"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        body = wire.encode_json(mm_hash=h, model=self.spec.name, modality="image", embeds=out, grid_thws=[grid],
                                dtype=self.results["config"]["wire"]["dtype"])
        times["pack"] = (time.perf_counter() - t0) * 1e3
        return times, len(body)

    @torch.inference_mode()
    def after_pass(self, data: bytes) -> tuple[dict[str, float], int]:
        enc, w = self.enc, self.results["config"]["wire"]
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        identified = enc.identify(data)
        times["hash"] = (time.perf_counter() - t0) * 1e3
        prepared = enc.prepare_media(data, identified=identified)
        t0 = time.perf_counter()
        self.bench.sync()  # the device resize it enqueued counts as preprocess, not as forward
        times["decode"] = prepared[0].timings_ms["decode"]
        times["preprocess"] = prepared[0].timings_ms["preprocess"] + (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        outputs, _ = enc.forward(prepared)  # until the output is in (pinned) host memory
        times["forward"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        body = wire.encode(mm_hash=identified[1], model=self.spec.name, modality="image", embeds=outputs[0],
                           grid_thws=[prepared[0].grid], dtype=w["dtype"], byte_planes=w["byte_planes"],
                           level=w["level"])
        times["pack"] = (time.perf_counter() - t0) * 1e3
        return times, len(body)

    def before_after(self) -> None:
        b, m = self.bench, self.m
        data = self.images["4k"]
        budget = m["budget"]["e2e"]
        rows: dict[str, dict] = {}
        with reference_on(self.device):
            paths = (("after", lambda: self.after_pass(data)), ("before", lambda: self.before_pass(data, self.sd16)),
                     ("before_fp32", lambda: self.before_pass(data, self.sd32)))
            for name, fn in paths:
                samples: list[dict[str, float]] = []
                body = [0]

                def once(fn=fn, samples=samples, body=body) -> float:
                    b.sync()
                    t0 = time.perf_counter()
                    times, body[0] = fn()
                    wall = (time.perf_counter() - t0) * 1e3
                    samples.append({**times, "wall": wall})
                    return wall

                once()  # warm-up
                samples.clear()
                b.repeat(once, budget_s=budget, min_n=m["min_n"]["e2e"], warmup=0)
                row = {k: stats.summary(s[k] for s in samples) for k in STAGE_KEYS}
                row["total"] = stats.summary(sum(s[k] for k in STAGE_KEYS) for s in samples)
                row["wall"] = stats.summary(s["wall"] for s in samples)
                row["body_bytes"] = body[0]
                rows[name] = row
                log(f"  {name}: {stats.fmt(row['total'])} ms (" + ", ".join(
                    f"{k} {stats.fmt(row[k], spread=False)}" for k in STAGE_KEYS) + ")")
        w, h = m["sizes"]["4k"]
        px_grid = self.pixels(data)[1]
        self.results["before_after"] = {
            "image": f"{w}x{h} JPEG q90", "tokens": px_grid[1] * px_grid[2] // 4, "stages": list(STAGE_KEYS),
            "before_what": "PIL decode + PIL BICUBIC resize + pad/patchify/normalise on the CPU, eager reference "
                           "forward in bf16 on the device, .cpu(), json+base64 body; one thread",
            "before_fp32_what": "the same with the reference forward in fp32",
            "after_what": "mm_hash, decode, torch resize on the device (Encoder.prepare_media), fast bf16 model + "
                          "pinned side-stream copy (Encoder.forward), wire v1 msgpack+raw+zstd "
                          f"(byte planes {self.results['config']['wire']['byte_planes']}, level "
                          f"{self.results['config']['wire']['level']})",
            **rows, "speedup": stats.ratio(rows["before"]["total"], rows["after"]["total"]),
            "speedup_vs_fp32_before": stats.ratio(rows["before_fp32"]["total"], rows["after"]["total"]),
            "reference_stack": REFERENCE_STACK,
        }
        log(f"  before/after: {self.results['before_after']['speedup']:.2f}x (reference stack "
            f"{REFERENCE_STACK['before_ms']} -> {REFERENCE_STACK['after_ms']} ms, {REFERENCE_STACK['speedup']}x)")

    # --- the engine's language model ---

    def engine(self) -> None:
        import tempfile

        import transformers

        from mm_encoder.engines.llm import LanguageModel
        from mm_encoder.engines.tiny_checkpoint import write_checkpoint

        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        if (major, minor) < (5, 24):
            raise RuntimeError(f"transformers {transformers.__version__} is too old for the engine (>= 5.24 needed: "
                               "Kimi-K2.5's classes)")
        b, e = self.bench, self.m["engine"]
        out: dict[str, Any] = {"decode_tokens": e["decode"], "lengths": e["lengths"], "check_len": e["check_len"],
                               "timer": "wall, device synchronised", "transformers": transformers.__version__,
                               "allow_tf32": torch.backends.cuda.matmul.allow_tf32, "presets": {}}
        self.results["engine"] = out
        with tempfile.TemporaryDirectory(prefix="mm-gpu-engine-") as tmp:
            for preset in e["presets"]:
                if b.over():
                    out["skipped"] = f"{preset} and after: the run's time budget was spent"
                    log(f"  {out['skipped']}")
                    break
                t0 = time.perf_counter()
                ckpt = write_checkpoint(Path(tmp) / f"kimi-k2.5-{preset}", preset)
                p: dict[str, Any] = {"checkpoint": ckpt.name, "write_s": round(time.perf_counter() - t0, 1),
                                     "rows": [], "greedy": None}
                out["presets"][preset] = p
                for dname, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
                    lm = LanguageModel.load(ckpt, device=self.device, dtype=dtype)
                    p["params"] = sum(t.numel() for t in lm.lm.parameters())
                    for n in e["lengths"]:
                        ids = engine_prompt(lm.vocab_size, n, seed=n)
                        row = {"dtype": dname, "prompt_tokens": n, **self.prefill_decode(lm, ids, e["decode"])}
                        p["rows"].append(row)
                        log(f"  {preset} {dname} {n} tokens: prefill {stats.fmt(row['prefill_ms'])} ms, decode "
                            f"{stats.fmt(row['decode_tok_s'])} tok/s")
                    if dname == "fp32":
                        ids = engine_prompt(lm.vocab_size, e["check_len"], seed=1)
                        cpu = LanguageModel.load(ckpt, device="cpu", dtype=torch.float32)
                        p["greedy"] = greedy_check(greedy(cpu, ids, e["decode"]), greedy(lm, ids, e["decode"]))
                        p["greedy"]["prompt_tokens"] = e["check_len"]
                        g = p["greedy"]
                        log(f"  {preset} greedy, {self.device.type} fp32 vs cpu fp32: "
                            + ("equal" if g["equal"] else f"differ from step {g['first_divergence']} (cpu margin "
                               f"{g['cpu_margin']:.3g})") + f" over {g['tokens']} tokens")
                        del cpu
                    del lm
                    if self.cuda:
                        torch.cuda.empty_cache()

    @torch.inference_mode()
    def prefill_decode(self, lm, ids: list[int], steps: int) -> dict:
        """Prefill ms of `ids`; decode tokens/s over `steps` greedy steps after it (the prefill untimed)."""
        b, m = self.bench, self.m

        def prefill():
            return lm.forward(lm.embed(ids))

        def decode() -> float:
            logits, cache = prefill()
            b.sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                logits, cache = lm.forward(lm.embed([int(logits.argmax())]), cache)
            b.sync()
            return steps / (time.perf_counter() - t0)

        kw = {"budget_s": m["budget"]["engine"], "min_n": m["min_n"]["engine"]}
        return {"prefill_ms": b.repeat(lambda: b.wall_ms(prefill), **kw), "decode_tok_s": b.repeat(decode, **kw)}

    # --- checks and the summary ---

    def checks(self) -> None:
        r, c = self.results, {}
        for size, p in r["parity"].items():
            c[f"parity_{size}_cos_mean"] = {"ok": p["met"], "value": p["cos_mean"], "target": f">= {PARITY_GATE}"}
        if r["syncs"]:
            c["syncs_fast_forward"] = {"ok": r["syncs"]["met"], "value": r["syncs"]["fast_forward"]["syncs"],
                                       "target": "0"}
        if r["attention"]:
            a = r["attention"]
            c["varlen_taken"] = {"ok": a["varlen_taken"], "value": f"{a['varlen_calls']}/{a['expected_varlen_calls']}",
                                 "target": "one varlen call per layer"}
            c["varlen_faster_than_per_item_sdpa"] = {"ok": a["op_sdpa_over_default"] > 1.0,
                                                     "value": a["op_sdpa_over_default"], "target": "> 1"}
        if r["copy"]:
            c["pinned_copy_faster"] = {"ok": r["copy"]["plain_over_pinned"] > 1.0,
                                       "value": r["copy"]["plain_over_pinned"], "target": "> 1"}
        if r["before_after"]:
            c["after_faster_than_before"] = {"ok": r["before_after"]["speedup"] > 1.0,
                                             "value": r["before_after"]["speedup"], "target": "> 1"}
        if r["engine"].get("presets"):
            greedy = {k: p["greedy"] for k, p in r["engine"]["presets"].items() if p.get("greedy")}
            c["engine_greedy_device_fp32_equals_cpu_fp32"] = {
                "ok": bool(greedy) and all(g["equal"] for g in greedy.values()),
                "value": ", ".join(f"{k}: " + ("equal" if g["equal"] else f"differ at step {g['first_divergence']}")
                                   for k, g in greedy.items()) or "not run",
                "target": "the same greedy tokens"}
        if self.mode != "gpu":
            for v in c.values():
                v["note"] = "cpu-logic: not a measurement"
        r["checks"] = c

    def finish(self) -> int:
        self.checks()
        self.results["finished"] = now()
        self.save()
        (self.out / "results.md").write_text(render_md(self.results))
        log(f"results: {self.out / 'results.json'} and results.md ({self.results['elapsed_s']} s)")
        return 1 if self.results["errors"] else 0


# --- results.md ---------------------------------------------------------------------------------------


def render_md(r: dict) -> str:
    f = stats.fmt
    m, c = r["machine"], r["config"]
    lines = [f"# GPU benchmark ({r['mode']}), {r['started']}", ""]
    if r["mode"] != "gpu":
        lines += ["**cpu-logic mode: a tiny tower and small images on the CPU, to exercise the code. "
                  "Not a measurement.**", ""]
    where = "GPU" if r["mode"] == "gpu" else "CPU"
    gpu = (f"{m['gpu']} ({m['gpu_memory_gib']} GiB, capability {m['capability']}, {m['sms']} SMs)" if "gpu" in m
           else "no GPU")
    lines += [
        f"Machine: {gpu}, CPU {m.get('cpu')} x{m.get('cores')}; torch {m.get('torch')} "
        f"(CUDA {m.get('torch_cuda')}), Python {m.get('python')}. Run took {r['elapsed_s']} s.",
        f"Model: {c.get('model')} ({c.get('layers')} layers x {c.get('hidden')}, head_dim {c.get('head_dim')}, "
        f"-> {c.get('out_dim')}), {c.get('params', 0) / 1e6:.1f} M params, {c.get('weights')}, seed {c.get('seed')}. "
        "Figures are medians (min-max) over the repeats each stage's time budget allowed.", ""]
    if r["parity"]:
        lines += ["## Parity: bf16 fast vs fp32 reference (tests/reference.py), same weights and pixels", "",
                  "| image | tokens | cos mean | cos min | rel L2 | max abs | reference bf16: cos mean / min | "
                  f"gate (mean >= {PARITY_GATE}) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
        for p in r["parity"].values():
            rb = p["reference_bf16"]
            lines.append(f"| {p['image']} | {p['tokens']} | {p['cos_mean']:.6f} | {p['cos_min']:.6f} | "
                         f"{p['rel_l2']:.2e} | {p['max_abs']:.3g} | {rb['cos_mean']:.6f} / {rb['cos_min']:.6f} | "
                         f"{'met' if p['met'] else 'MISSED'} |")
        lines.append("")
    if r["forward"]:
        timer = next(iter(r["forward"].values()))["timer"]
        lines += [f"## Forward time, ms ({timer})", "",
                  "| image | patches | fast bf16 | reference bf16 | reference fp32 | ref bf16 / fast "
                  "| ref fp32 / fast |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for x in r["forward"].values():
            lines.append(f"| {x['image']} | {x['patches']} | {f(x['fast_bf16_ms'])} | {f(x['reference_bf16_ms'])} | "
                         f"{f(x['reference_fp32_ms'])} | {x['bf16_reference_over_fast']:.1f}x | "
                         f"{x['fp32_reference_over_fast']:.1f}x |")
        lines.append("")
    if r["syncs"]:
        s = r["syncs"]
        ff, ef = s["fast_forward"], s["encoder_forward"]
        prof = s["profiler"]
        lines += ["## Device syncs in the fast forward (target 0)", "", f"Method: {s['method']}.", "",
                  f"- fast forward ({s['image']}): **{ff['syncs']}** synchronising calls"
                  + (": " + ", ".join(f"`{k}` x{v}" for k, v in ff["sites"].items()) if ff["sites"] else ""),
                  f"- Encoder.forward (with its copy and final wait): {ef['syncs']}"
                  + (": " + ", ".join(f"`{k}` x{v}" for k, v in ef["sites"].items()) if ef["sites"] else ""),
                  "- profiler cross-check: " + (f"error {prof['error']}" if "error" in prof else
                                                f"{prof['sync_calls_total']} synchronising runtime calls "
                                                f"{prof['sync_calls']}, {prof['dtoh_copies']} device-to-host copies, "
                                                f"memcpys {prof['memcpy']}"), ""]
    if r["attention"]:
        a = r["attention"]
        lines += ["## Attention: varlen vs per-item SDPA", "",
                  f"{a['items']} items packed in one batch ({a['tokens']} tokens, longest {a['max_seqlen']}). "
                  f"varlen path taken: **{'yes' if a['varlen_taken'] else 'NO'}** ({a['varlen_calls']} varlen calls "
                  f"for {a['expected_varlen_calls']} layers, {a['sdpa_calls']} SDPA calls; varlen available: "
                  f"{a['varlen_available']}" + (f"; it failed: {a['varlen_error']}" if a["varlen_error"] else "")
                  + ").", "",
                  "| what | default path (ms) | per-item SDPA (ms) | SDPA / default |", "|---|---:|---:|---:|",
                  f"| attention op, one layer | {f(a['op_default_ms'], 3)} | {f(a['op_per_item_sdpa_ms'], 3)} | "
                  f"{a['op_sdpa_over_default']:.2f}x |",
                  f"| whole forward | {f(a['forward_default_ms'])} | {f(a['forward_per_item_sdpa_ms'])} | "
                  f"{a['forward_sdpa_over_default']:.2f}x |", "",
                  f"Outputs agree: min cosine {a['default_vs_sdpa']['cos_min']:.6f}, max abs "
                  f"{a['default_vs_sdpa']['max_abs']:.3g}.", ""]
    if r["copy"]:
        x = r["copy"]
        lines += ["## Output copy: pinned buffer + side stream vs plain .cpu()", "",
                  f"4K output {x['shape']} {x['dtype']} ({x['bytes'] / 1e6:.1f} MB), pinned: {x['pinned']}.", "",
                  "| what | ms | GB/s |", "|---|---:|---:|",
                  f"| plain `.cpu()` | {f(x['plain_cpu_ms'], 2)} | {x['plain_gb_s']:.1f} |",
                  "| Encoder._to_host (pinned, non_blocking, side stream, event wait) "
                  f"| {f(x['pinned_side_stream_ms'], 2)} | {x['pinned_gb_s']:.1f} |",
                  "| two 4K items: forward + `.cpu()` each, one after the other "
                  f"| {f(x['two_items_sequential_ms'])} | |",
                  f"| two 4K items: Encoder.forward ({x['batches_per_forward']} batches, the copy overlaps the next "
                  f"forward) | {f(x['two_items_encoder_forward_ms'])} | |", ""]
    if r["before_after"]:
        ba = r["before_after"]
        keys = ba["stages"]
        ref = ba["reference_stack"]
        lines += [f"## Before vs after, one {ba['image']} ({ba['tokens']} tokens), ms", "",
                  "Stages are wall time on one thread, with the device synchronised between them; total = their "
                  "sum.", "",
                  f"- before: {ba['before_what']}.", f"- before fp32: {ba['before_fp32_what']}.",
                  f"- after: {ba['after_what']}.", "",
                  "| row | " + " | ".join(keys) + " | total | before / after | body MB |",
                  "|---|" + "---:|" * (len(keys) + 3)]
        for name in ("before", "before_fp32", "after"):
            row = ba[name]
            speed = f"{row['total']['median'] / ba['after']['total']['median']:.2f}x" if name != "after" else ""
            lines.append(f"| {name} ({where}) | " + " | ".join(f(row[k], spread=False) for k in keys)
                         + f" | {f(row['total'])} | {speed} | {row['body_bytes'] / 1e6:.1f} |")
        lines += ["| reference stack (GPU) | " + " | ".join("" for _ in keys)
                  + f" | {ref['before_ms']} -> {ref['after_ms']} | {ref['speedup']:.1f}x | |", ""]
    if r.get("engine", {}).get("presets"):
        e = r["engine"]
        lines += [f"## Engine: the language model on the {where} (generated Kimi-K2.5, random weights)", "",
                  f"`LanguageModel.load` of each preset's checkpoint, the engine's own calls (prefill, then one step "
                  f"per token with the KV cache); prefill ms and decode tokens/s over {e['decode_tokens']} greedy "
                  f"steps, {e['timer']}; transformers {e['transformers']}.", "",
                  "| preset | dtype | prompt tokens | prefill ms | decode tok/s |", "|---|---|---:|---:|---:|"]
        for preset, p in e["presets"].items():
            for row in p["rows"]:
                lines.append(f"| {preset} | {row['dtype']} | {row['prompt_tokens']:,} | {f(row['prefill_ms'])} | "
                             f"{f(row['decode_tok_s'])} |")
        lines.append("")
        for preset, p in e["presets"].items():
            g = p.get("greedy")
            if g is None:
                continue
            lines.append(f"- {preset} ({p.get('params', 0) / 1e6:.1f} M parameters), greedy tokens for one "
                         f"{g['prompt_tokens']}-token prompt, {where} fp32 vs CPU fp32: "
                         + (f"**equal** over {g['tokens']} tokens (smallest CPU top-2 margin "
                            f"{g['min_cpu_margin']:.3g})." if g["equal"] else
                            f"**differ from step {g['first_divergence']}** of {g['tokens']} (CPU top-2 margin "
                            f"there {g['cpu_margin']:.3g}; CPU {g['cpu_tokens']}, device {g['device_tokens']})."))
        lines.append("")
    if r["checks"]:
        lines += ["## Checks", "", "| check | result | value | target |", "|---|---|---|---|"]
        for k, v in r["checks"].items():
            val = v["value"]
            val = f"{val:.6g}" if isinstance(val, float) else val
            res = ("ok" if v["ok"] else "NOT MET") + (" (cpu-logic)" if "note" in v else "")
            lines.append(f"| {k} | {res} | {val} | {v['target']} |")
        lines.append("")
    if r["errors"]:
        lines += ["## Errors", ""] + [f"- {k}: {v}" for k, v in r["errors"].items()] + [""]
    lines += ["Stage times (s): " + ", ".join(f"{k} {v}" for k, v in r["stage_s"].items()) + ".", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="results folder (results.json, results.md)")
    p.add_argument("--cpu-logic", "--dry-run", dest="cpu_logic", action="store_true",
                   help="run the whole logic on the CPU with a tiny tower and small images")
    p.add_argument("--budget-s", type=float, help="the run's global time budget (default: the mode's)")
    args = p.parse_args(argv)
    mode = "cpu-logic" if args.cpu_logic else "gpu"
    if mode == "gpu" and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        print(f"no CUDA device: torch {torch.__version__} (CUDA build {torch.version.cuda}) sees none"
              + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""), file=sys.stderr)
        return 2
    device = torch.device("cuda" if mode == "gpu" else "cpu")
    if args.budget_s:
        MODES[mode]["global_s"] = args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", module="PIL")
    torch.manual_seed(0)
    run = Run(mode, args.out, device)
    log(f"bench/gpu.py {mode} on {run.results['machine'].get('gpu', device)}, torch {torch.__version__}; "
        f"results in {args.out}")
    run.stage("setup", run.setup)
    if "setup" in run.results["errors"]:
        return run.finish()
    for size in MODES[mode]["sizes"]:
        run.stage(size, lambda s=size: run.parity_forward(s))
    run.stage("syncs", run.syncs)
    run.stage("attention", run.attention)
    run.stage("copy", run.copy)
    run.stage("before_after", run.before_after)
    run.stage("engine", run.engine)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
