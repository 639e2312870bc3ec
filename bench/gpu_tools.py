"""bench/gpu.py's settings and instruments: the modes and their budgets, a repeat timer bounded by them,
parity figures, counters of attention calls and device syncs, the engine's greedy check."""

from __future__ import annotations

import contextlib
import datetime as dt
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from bench import stats
from harness import reference  # the independent fp32 eager reference
from mm_encoder import wire
from mm_encoder.kernels import attention as attn_mod
from mm_encoder.model.preprocess import padded_grid

ROOT = Path(__file__).resolve().parents[1]
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


def compare(x: torch.Tensor, ref: torch.Tensor) -> dict:
    """Per-token cosine mean/min, relative L2 and max abs error of `x` against `ref`, in float64."""
    a, b = x.double(), ref.double()
    cos = F.cosine_similarity(a, b, dim=-1)
    return {"tokens": int(a.shape[0]), "cos_mean": float(cos.mean()), "cos_min": float(cos.min()),
            "rel_l2": float((a - b).norm() / b.norm()), "max_abs": float((a - b).abs().max())}


@contextlib.contextmanager
def reference_on(device: torch.device):
    """harness/reference.py builds its RoPE table and time embedding on the CPU; moved to `device` here so
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
