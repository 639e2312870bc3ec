"""Build the vision model and fill it: from a Hugging Face style checkpoint, or seeded random weights.

A real Kimi-K2.5 checkpoint is 554 GB in 64 shards, with the tower and projector in the last two.
The loader reads `model.safetensors.index.json`, keeps only names under the tower/projector
prefixes, and opens only the shards that hold them. Every mismatch (missing, unexpected,
mis-shaped, absent shard) is collected and reported in one `CheckpointError`, each tensor named as
the checkpoint names it (or would: a missing tensor gets the checkpoint's own naming scheme).

Three spellings of the MoonViT tower load into the same weights (`HF_SAVED`, `HF_NATIVE`): the
release's, what transformers' `save_pretrained` writes, and transformers' in-memory names, whose
split q/k/v are fused back into `wqkv` with its RoPE row permutation undone.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn

from .. import families
from ..core.errors import CheckpointError
from ..core.registry import get_spec
from ..core.revision import index_bytes, json_object
from ..core.spec import Grid, ModelSpec, file_revision
from .hf_config import preprocess_from_hf, spec_from_hf_config
from .projectors import Projector, build_projector
from .tower import BatchPlan, MoonViT

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PREPROCESSOR_FILE = "preprocessor_config.json"


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
    model.eval()
    return model


@dataclass
class LoadReport:
    shards_opened: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0


# Where checkpoints keep vision tensors (MoonViT, Kimi projectors, transformers' `model.vision_tower.*`,
# GLM-4.xV's `model.visual.*`): a tensor under one of these that we do not load is reported by name, never dropped.
VISION_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.", "model.vision_tower.",
                   "model.mm_projector.", "model.visual.", "visual.")


class _Rule:
    """Our name prefix <-> a checkpoint's (`{i}`: a block index); `part` k of 3: a slice of our fused wqkv."""

    def __init__(self, ours: str, theirs: str, part: int | None = None):
        self.ours, self.theirs, self.part = ours, theirs, part
        self._re = {s: re.compile(re.escape(s).replace(r"\{i\}", r"(\d+)")) for s in (ours, theirs)}

    def apply(self, name: str, backwards: bool = False) -> str | None:
        src, dst = (self.ours, self.theirs) if backwards else (self.theirs, self.ours)
        m = self._re[src].match(name)
        return None if m is None else (dst.replace("{i}", m[1]) if m.groups() else dst) + name[m.end() :]


_BLOCK, _LAYER = "vision_tower.encoder.blocks.{i}.", "model.vision_tower.layers.{i}."
# What `Kimi_K25ForConditionalGeneration.save_pretrained` (transformers 5.24) writes: the release's names,
# except two its reverse renames miss: `encoder.` in front of the patch conv, `model.` in front of pre_norm.
HF_SAVED = (_Rule("vision_tower.patch_embed.proj.", "vision_tower.encoder.patch_embed.proj."),
            _Rule("mm_projector.pre_norm.", "model.mm_projector.pre_norm."))
# transformers' in-memory names (`model.state_dict()`): renamed modules, q/k/v split, q/k rows permuted.
HF_NATIVE = (
    _Rule("vision_tower.patch_embed.pos_emb.weight", "model.vision_tower.patch_embed.pos_emb.position_embeddings"),
    _Rule("vision_tower.patch_embed.", "model.vision_tower.patch_embed."),
    *(_Rule(_BLOCK + o, _LAYER + t) for o, t in [("norm0.", "norm1."), ("norm1.", "norm2."), ("wo.", "attn.proj."),
                                                   ("mlp.fc0.", "mlp.fc1."), ("mlp.fc1.", "mlp.fc2.")]),
    *(_Rule(_BLOCK + "wqkv.", _LAYER + f"attn.{x}_proj.", k) for k, x in enumerate("qkv")),
    _Rule("vision_tower.encoder.final_layernorm.", "model.vision_tower.final_layernorm."),
)
_HEADS = {rules: tuple({r.theirs.split("{")[0] for r in rules}) for rules in (HF_NATIVE, HF_SAVED)}  # cheap pre-test


def unpermute_rope(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo transformers' `PermuteForRope` on q or k rows: per head it moves the two rows of each RoPE
    pair (2i, 2i+1) to i and half + i (rotate-half layout); our RoPE rotates interleaved pairs, the
    release's order."""
    return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


@dataclass
class _Naming:
    """How one checkpoint spells our state_dict names, in both directions."""

    tower: str
    projectors: dict[str, dict[str, str]]  # checkpoint prefix -> suffix renames (theirs -> ours)
    stacked: dict[str, tuple[str, ...]]
    projector: str  # the prefix used to name tensors the checkpoint lacks
    layout: tuple[_Rule, ...] = ()  # the tower's spelling, to name tensors the checkpoint lacks

    @classmethod
    def of(cls, model: VisionModel, names: list[str]) -> _Naming:
        spec, proj = model.spec, model.mm_projector
        prefixes = {spec.weights.projector: {}, **proj.checkpoint_names}
        prefixes = dict(sorted(prefixes.items(), key=lambda kv: -len(kv[0])))  # longest prefix first
        counts = {p: sum(n.startswith(p) for n in names) for p in prefixes}
        used = max(prefixes, key=counts.__getitem__) if any(counts.values()) else spec.weights.projector
        layout = next((rules for rules, heads in _HEADS.items() if any(n.startswith(heads) for n in names)), ())
        return cls(spec.weights.tower, prefixes, dict(proj.stacked), used, layout)

    def ours(self, name: str) -> list[str] | tuple[str, int] | None:
        """Checkpoint name -> our names (several for a stacked tensor), (our name, part) for a piece of
        a fused one, or None when not ours."""
        for rules, heads in _HEADS.items():
            for rule in rules if name.startswith(heads) else ():
                if (mine := rule.apply(name)) is not None:
                    return [mine] if rule.part is None else (mine, rule.part)
        if name.startswith(self.tower):
            return ["vision_tower." + name[len(self.tower) :]]
        for prefix, renames in self.projectors.items():
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix) :]
            for stacked, parts in self.stacked.items():
                if rest.startswith(stacked):
                    return ["mm_projector." + part + rest[len(stacked) :] for part in parts]
            for theirs, ours in renames.items():
                if rest.startswith(theirs):
                    rest = ours + rest[len(theirs) :]
                    break
            return ["mm_projector." + rest]
        return None

    def theirs(self, ours: str) -> list[str]:
        """Our name -> the name(s) this checkpoint would give it (for tensors it lacks): one per part."""
        found = [(r.part, t) for r in self.layout if (t := r.apply(ours, backwards=True)) is not None]
        if found:
            return [t for k, t in found if k is not None] or [found[0][1]]
        head, rest = ours.split(".", 1)
        if head == "vision_tower":
            return [self.tower + rest]
        for theirs, mine in self.projectors[self.projector].items():
            if rest.startswith(mine):
                return [self.projector + theirs + rest[len(mine) :]]
        return [self.projector + rest]


_Entry = tuple[str, "list[str] | tuple[str, int]"]  # (checkpoint name, what it maps onto: see _Naming.ours)
_Parts = dict[str, dict[int, tuple[str, "torch.Tensor | None"]]]  # fused name -> part -> (source, tensor)


class _Slice(Protocol):
    def get_shape(self) -> list[int]: ...


class _Shard(Protocol):
    """What is read from an open safetensors file (`safe_open`, whose stub leaves these untyped)."""

    def get_slice(self, name: str) -> _Slice: ...

    def get_tensor(self, name: str) -> torch.Tensor: ...


def _plan(names: dict[str, str], naming: _Naming, problems: list[str]) -> dict[str, list[_Entry]]:
    """Shard -> [(checkpoint name, our names)]; vision tensors that map to nothing are problems."""
    by_shard: dict[str, list[_Entry]] = {}
    for name, shard in names.items():
        ours = naming.ours(name)
        if ours is not None:
            by_shard.setdefault(shard, []).append((name, ours))
        elif name.startswith(VISION_PREFIXES):
            problems.append(f"unexpected tensor {name}")
    return by_shard


def _read(f: _Shard, name: str, ours: list[str], expected: dict[str, tuple[int, ...]], dtype: torch.dtype,
          problems: list[str], part: int | None = None) -> dict[str, torch.Tensor]:
    """One checkpoint tensor -> our tensors (split when stacked; a third of ours when a `part`); a
    mismatch names the checkpoint's tensor."""
    if any(o not in expected for o in ours):
        problems.append(f"unexpected tensor {name}")
        return {}
    shapes = [expected[o] for o in ours]
    want = (sum(s[0] for s in shapes), *shapes[0][1:]) if len(ours) > 1 else shapes[0]
    want = want if part is None else (want[0] // 3, *want[1:])
    shape = tuple(f.get_slice(name).get_shape())
    if shape != want:
        problems.append(f"tensor {name} has shape {list(shape)}, expected {list(want)}")
        return {}
    t = f.get_tensor(name).to(dtype)
    return dict(zip(ours, t.split([s[0] for s in shapes]), strict=True)) if len(ours) > 1 else {ours[0]: t}


def _targets(entries: list[_Entry], parts: _Parts | None = None) -> list[str]:
    """Our names the entries map onto; with `parts`, their fused parts are marked as reported (unread)."""
    if parts is not None:
        for name, ours in entries:
            if isinstance(ours, tuple):
                parts.setdefault(ours[0], {}).setdefault(ours[1], (name, None))
    return [o for _, ours in entries for o in ([ours[0]] if isinstance(ours, tuple) else ours)]


def _read_part(f: _Shard, name: str, target: tuple[str, int], expected: dict[str, tuple[int, ...]],
               dtype: torch.dtype, problems: list[str], parts: _Parts, heads: int) -> None:
    """One of transformers' q/k/v tensors: checked against a third of our wqkv; q and k lose their RoPE
    permutation (exact: rows are only reordered)."""
    o, k = target
    if k in parts.setdefault(o, {}):
        problems.append(f"tensors {parts[o][k][0]} and {name} are the same weight ({o}, part {k})")
    t = _read(f, name, [o], expected, dtype, problems, part=k).get(o)
    parts[o][k] = (name, None if t is None else unpermute_rope(t, heads) if k < 2 else t)


def _fuse(parts: _Parts, tensors: dict[str, torch.Tensor], source: dict[str, str], naming: _Naming,
          problems: list[str]) -> None:
    """Concatenate each fused tensor's parts ([q | k | v] rows); a part the checkpoint lacks is named."""
    for o, got in parts.items():
        if o in source:
            problems.append(f"tensors {source[o]} and {got[min(got)][0]} are the same weight ({o})")
        problems += [f"missing tensor {naming.theirs(o)[k]}" for k in range(3) if k not in got]
        if len(got) == 3 and all(t is not None for _, t in got.values()):
            tensors[o] = torch.cat([got[k][1] for k in range(3)])
            source[o] = got[0][0]


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
    names = checkpoint_files(ckpt)
    naming = _Naming.of(model, list(names))
    problems: list[str] = []
    by_shard = _plan(names, naming, problems)
    tensors: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}  # our name -> the checkpoint tensor it came from
    accounted: set[str] = set()  # expected names already reported or loaded
    parts: _Parts = {}
    report = LoadReport()
    for shard, entries in sorted(by_shard.items()):
        path = ckpt / shard
        if not path.is_file():
            problems.append(f"shard {shard} (holds {len(entries)} vision tensors) is missing")
            accounted.update(_targets(entries, parts))
            continue
        report.shards_opened.append(shard)
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name, ours in entries:
                    accounted.update(o for o in _targets([(name, ours)]) if o in expected)
                    if isinstance(ours, tuple):  # a part of a fused tensor: q, k or v of wqkv
                        _read_part(f, name, ours, expected, dtype, problems, parts, spec.tower.num_heads)
                        continue
                    for o, t in _read(f, name, ours, expected, dtype, problems).items():
                        if o in source:
                            problems.append(f"tensors {source[o]} and {name} are the same weight ({o})")
                        source[o] = name
                        tensors[o] = t
        except Exception as e:  # safetensors raises several types for a bad file
            problems.append(f"shard {shard} cannot be read: {e}")
            accounted.update(_targets(entries, parts))
    _fuse(parts, tensors, source, naming, problems)
    report.bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    problems += [f"missing tensor {t}" for m in sorted(set(expected) - accounted) for t in naming.theirs(m)]
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} does not match model {spec.name}:\n  " + "\n  ".join(problems))
    model.load_state_dict({k: v.to(device) for k, v in tensors.items()}, strict=True, assign=True)
    report.tensors = len(tensors)
    log.info("loaded %d tensors (%.1f MB) from %s, shards %s", report.tensors, report.bytes / 1e6, ckpt,
             report.shards_opened)
    return report


# --- which spec a checkpoint directory defines -------------------------------------------


def spec_for_checkpoint(ckpt: Path, named: ModelSpec | None) -> ModelSpec:
    """Registry spec overlaid with the checkpoint's config.json (tower, projector) and its
    preprocessor_config.json (the preprocessing policy, limits, mean/std); checks that the vision
    config agrees with `named` when both are given."""
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint directory {ckpt} does not exist")
    config_path = ckpt / "config.json"
    if not config_path.is_file():
        if named is None:
            raise CheckpointError(f"{ckpt}: no config.json, so the model is unknown; pass a model name too")
        spec = named.model_copy(update={"revision": file_revision(index_bytes(ckpt))})
        return _with_processor(spec, ckpt)
    raw = config_path.read_bytes()
    config = json.loads(raw)
    base = named
    if base is None:
        model_type = config.get("model_type")
        spec_names = families.spec_names()
        if model_type not in spec_names:
            raise CheckpointError(
                f"{config_path}: model_type {model_type!r} is not known ({sorted(spec_names)}); pass a model name"
            )
        base = get_spec(spec_names[model_type])
    try:
        spec = spec_from_hf_config(config, base, file_revision(raw, index_bytes(ckpt)))
    except CheckpointError as e:
        raise CheckpointError(f"{config_path}: {e.message}") from None
    if named is not None and (spec.tower, spec.projector) != (named.tower, named.projector):
        raise CheckpointError(
            f"{config_path}: its vision config does not match model {named.name}: "
            f"tower {spec.tower} / projector {spec.projector} vs {named.tower} / {named.projector}"
        )
    return _with_processor(spec, ckpt)


def _with_processor(spec: ModelSpec, ckpt: Path) -> ModelSpec:
    """The checkpoint's own preprocessing, when it ships a preprocessor_config.json."""
    path = ckpt / PREPROCESSOR_FILE
    if not path.is_file():
        return spec
    doc = json_object(path, CheckpointError)
    try:
        return spec.model_copy(update={"preprocess": preprocess_from_hf(doc, spec.preprocess, spec.tower)})
    except CheckpointError as e:
        raise CheckpointError(f"{ckpt}: {e.message}") from None
