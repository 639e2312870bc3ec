"""Build the vision model and fill it: from a Hugging Face style checkpoint, or seeded random weights.

A real Kimi-K2.5 checkpoint is 554 GB in 64 shards, with the tower and projector in the last two.
The loader reads `model.safetensors.index.json`, keeps only names under the tower/projector
prefixes, and opens only the shards that hold them. Every mismatch (missing, unexpected,
mis-shaped, absent shard) is collected and reported in one `CheckpointError`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..core.errors import CheckpointError
from ..core.registry import get_spec
from ..core.spec import HF_MODEL_TYPES, Grid, ModelSpec, file_revision, spec_from_hf_config
from .projectors import Projector, build_projector
from .tower import BatchPlan, MoonViT

log = logging.getLogger("mm_encoder.checkpoint")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Projector prefixes seen in the wild; all map onto our `mm_projector.` module.
PROJECTOR_PREFIXES = ("mm_projector.", "multi_modal_projector.")


class VisionModel(nn.Module):
    """Tower + projector; `state_dict()` names are the Kimi-K2.5 checkpoint names."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.vision_tower = MoonViT(spec.tower)
        self.mm_projector: Projector = build_projector(spec.tower, spec.projector)

    def plan(self, grids: list[Grid], device: torch.device | None = None) -> BatchPlan:
        return BatchPlan.build(grids, self.spec.tower, device or self.vision_tower.patch_embed.proj.weight.device)

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid] | BatchPlan) -> torch.Tensor:
        plan = grids if isinstance(grids, BatchPlan) else self.plan(grids, pixel_values.device)
        return self.mm_projector(self.vision_tower(pixel_values, plan))


def build_empty(spec: ModelSpec) -> VisionModel:
    """The model on the meta device: shapes only, no memory, no init cost."""
    with torch.device("meta"):
        return VisionModel(spec)


def _is_norm_weight(name: str) -> bool:
    last = name.rsplit(".", 2)
    return name.endswith(".weight") and "norm" in last[-2]


def init_random(model: VisionModel, seed: int, device: torch.device, dtype: torch.dtype) -> VisionModel:
    """Deterministic random weights (std 0.02; norm weights around 1), same on every machine."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in sorted(model.state_dict().items()):
        t = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
        if _is_norm_weight(name):
            t += 1.0
        tensors[name] = t.to(device=device, dtype=dtype)
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.eval()


@dataclass
class LoadReport:
    shards_opened: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0


def _our_name(name: str, spec: ModelSpec, renames: dict[str, str]) -> str | None:
    """Checkpoint name -> our state_dict name, or None for tensors that are not ours (the LLM)."""
    if name.startswith(spec.weights.tower):
        return "vision_tower." + name[len(spec.weights.tower) :]
    for prefix in {spec.weights.projector, *PROJECTOR_PREFIXES}:
        if name.startswith(prefix):
            rest = name[len(prefix) :]
            for theirs, ours in renames.items():
                if rest.startswith(theirs):
                    rest = ours + rest[len(theirs) :]
            return "mm_projector." + rest
    return None


def checkpoint_files(ckpt: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index or the single-file checkpoint."""
    if (ckpt / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((ckpt / INDEX_FILE).read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{ckpt / INDEX_FILE}: not a safetensors index ({e})") from None
        return dict(weight_map)
    if (ckpt / SINGLE_FILE).is_file():
        with safe_open(ckpt / SINGLE_FILE, framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)
    raise CheckpointError(f"{ckpt}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


def load_checkpoint(model: VisionModel, ckpt: Path, device: torch.device, dtype: torch.dtype) -> LoadReport:
    spec = model.spec
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    by_shard: dict[str, list[tuple[str, str]]] = {}
    for name, shard in checkpoint_files(ckpt).items():
        ours = _our_name(name, spec, model.mm_projector.checkpoint_renames)
        if ours is not None:
            by_shard.setdefault(shard, []).append((name, ours))

    problems: list[str] = []
    tensors: dict[str, torch.Tensor] = {}
    accounted: set[str] = set()  # expected names already reported or loaded
    report = LoadReport()
    for shard, names in sorted(by_shard.items()):
        path = ckpt / shard
        if not path.is_file():
            problems.append(f"shard {shard} (holds {len(names)} vision tensors) is missing")
            accounted.update(ours for _, ours in names)
            continue
        report.shards_opened.append(shard)
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name, ours in names:
                    if ours not in expected:
                        problems.append(f"unexpected tensor {name}")
                        continue
                    accounted.add(ours)
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != expected[ours]:
                        problems.append(f"tensor {name} has shape {list(shape)}, expected {list(expected[ours])}")
                        continue
                    t = f.get_tensor(name).to(dtype)
                    tensors[ours] = t
                    report.bytes += t.numel() * t.element_size()
        except Exception as e:  # safetensors raises several types for a bad file
            problems.append(f"shard {shard} cannot be read: {e}")
            accounted.update(ours for _, ours in names)
    missing = sorted(set(expected) - accounted)
    problems += [f"missing tensor {_checkpoint_name(m, spec)}" for m in missing]
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} does not match model {spec.name}:\n  " + "\n  ".join(problems))
    model.load_state_dict({k: v.to(device) for k, v in tensors.items()}, strict=True, assign=True)
    report.tensors = len(tensors)
    log.info("loaded %d tensors (%.1f MB) from %s, shards %s", report.tensors, report.bytes / 1e6, ckpt,
             report.shards_opened)
    return report


def _checkpoint_name(ours: str, spec: ModelSpec) -> str:
    head, rest = ours.split(".", 1)
    return (spec.weights.tower if head == "vision_tower" else spec.weights.projector) + rest


# --- which spec a checkpoint directory defines -------------------------------------------


def spec_for_checkpoint(ckpt: Path, named: ModelSpec | None) -> ModelSpec:
    """Registry spec overlaid with the checkpoint's config.json; checks they agree when both given."""
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint directory {ckpt} does not exist")
    config_path = ckpt / "config.json"
    if not config_path.is_file():
        if named is None:
            raise CheckpointError(f"{ckpt}: no config.json, so the model is unknown; pass a model name too")
        return named.model_copy(update={"revision": file_revision(_index_bytes(ckpt))})
    raw = config_path.read_bytes()
    config = json.loads(raw)
    base = named
    if base is None:
        model_type = config.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise CheckpointError(
                f"{config_path}: model_type {model_type!r} is not known ({sorted(HF_MODEL_TYPES)}); pass a model name"
            )
        base = get_spec(HF_MODEL_TYPES[model_type])
    spec = spec_from_hf_config(config, base, file_revision(raw, _index_bytes(ckpt)))
    if named is not None and (spec.tower, spec.projector) != (named.tower, named.projector):
        raise CheckpointError(
            f"{config_path}: its vision config does not match model {named.name}: "
            f"tower {spec.tower} / projector {spec.projector} vs {named.tower} / {named.projector}"
        )
    return spec


def _index_bytes(ckpt: Path) -> bytes:
    if (ckpt / INDEX_FILE).is_file():
        return (ckpt / INDEX_FILE).read_bytes()
    single = ckpt / SINGLE_FILE
    if single.is_file():
        with single.open("rb") as f:  # the safetensors header: names, dtypes, shapes, offsets
            n = int.from_bytes(f.read(8), "little")
            return f.read(min(n, 100_000_000))
    return b""
