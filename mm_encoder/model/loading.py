"""Loading a vision model: which spec (a registry name, or a checkpoint directory's config files over
its registry entry), which device and dtype, and which weights (a checkpoint's, deterministic random
ones, or none at all for a process that only preprocesses). `Encoder.from_pretrained` (the library)
and the encode worker both load through `load`.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.dtypes import torch_name
from ..core.registry import DEFAULT_MODEL, get_spec
from ..core.spec import ModelSpec
from ..core.timing import ms_since
from .checkpoint import LoadReport, VisionModel, build_empty, init_random, load_checkpoint, spec_for_checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loaded:
    """A model on its device, and what loading it read."""

    spec: ModelSpec
    model: VisionModel
    device: torch.device
    dtype: torch.dtype
    report: LoadReport | None = None  # a checkpoint's shards and tensors; None for random or no weights


def load(
    path_or_name: str | Path = DEFAULT_MODEL,
    *,
    checkpoint: str | Path | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    seed: int | None = None,
) -> Loaded:
    """A registry name (random weights unless `checkpoint`), or a checkpoint directory.

    A directory's `config.json` (`model_type`) picks the registry entry that supplies the
    preprocessing and prompt; its `vision_config` gives the tower and projector shapes.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    ckpt = Path(checkpoint) if checkpoint is not None else None
    if ckpt is None and Path(path_or_name).is_dir():
        ckpt = Path(path_or_name)
        spec = spec_for_checkpoint(ckpt, None)
    else:
        named = get_spec(str(path_or_name))
        if ckpt is not None:
            spec = spec_for_checkpoint(ckpt, named)
        elif seed is not None:
            spec = named.model_copy(update={"seed": seed, "revision": f"{named.revision}-seed{seed}"})
        else:
            spec = named
    model = build_empty(spec)
    report = None
    t0 = time.perf_counter()
    if ckpt is not None:
        report = load_checkpoint(model, ckpt, dev, dt)
        model.eval()
    else:
        init_random(model, spec.seed, dev, dt)
        log.warning(
            "model %s: no checkpoint given, using deterministic RANDOM weights (seed %d); "
            "embeddings are meaningless to a real LLM",
            spec.name,
            spec.seed,
        )
    log.info("model %s ready on %s/%s in %.0f ms", spec.name, dev, str(dt).removeprefix("torch."), ms_since(t0))
    return Loaded(spec, model, dev, dt, report)


def load_without_weights(checkpoint: str | Path, *, device: str | torch.device | None = None,
                         dtype: str | torch.dtype | None = None) -> Loaded:
    """A checkpoint's preprocessing, identity and limits with no weights read (the model stays on
    the meta device, so no forward can run): for a process whose vision tower is another's, as the
    aggregated engine runs the model's own."""
    dev = resolve_device(device)
    spec = spec_for_checkpoint(Path(checkpoint), None)
    return Loaded(spec, build_empty(spec), dev, resolve_dtype(dtype, dev))


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device asked for, else `default_device()`."""
    return torch.device(device) if device is not None else default_device()


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The dtype asked for (a name `parse_dtype` knows, or a torch dtype), else the device's default."""
    return parse_dtype(dtype) if dtype is not None else default_dtype(device)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA, and on CPUs with native bf16 matmuls (AVX-512 BF16 or AMX: 1.4-2.9x faster than
    fp32 on the full-width tower at per-token cosine 0.99994, BENCHMARKS.md); fp32 elsewhere, where
    bf16 is emulated and slower."""
    native = device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())
    return torch.bfloat16 if native else torch.float32


@functools.cache
def cpu_has_native_bf16() -> bool:
    """The CPU's own flags (Linux /proc/cpuinfo): `avx512_bf16` or `amx_bf16`. torch reports only
    its kernels' ISA level, which says AVX-512 on CPUs that emulate bf16."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def parse_dtype(d: str | torch.dtype) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    dtype: torch.dtype = getattr(torch, torch_name(d))  # core.dtypes: the one vocabulary
    return dtype
