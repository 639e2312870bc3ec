"""Projectors from merged tower features [M, 4, D] to LLM embeddings [M, out_dim], by type.

Register a new one with `@register("name")`. `checkpoint_names` says how real checkpoints spell
our tensors: per checkpoint prefix, the suffix renames (theirs -> ours), e.g. Kimi-VL's
`multi_modal_projector.linear_1.` for our `proj.0.`; `stacked` names tensors that hold several of
ours concatenated along dim 0 (vLLM's `gate_up_proj`). The loader (model/checkpoint.py) maps both
ways, so its errors name tensors as the checkpoint does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core.spec import ProjectorConfig, TowerConfig

PROJECTORS: dict[str, type[Projector]] = {}


def register(name: str) -> Callable[[type[Projector]], type[Projector]]:
    def deco(cls: type[Projector]) -> type[Projector]:
        PROJECTORS[name] = cls
        return cls

    return deco


class Projector(nn.Module):
    # checkpoint prefix -> suffix renames under it (theirs -> ours); `mm_projector.` with none is ours
    checkpoint_names: ClassVar[dict[str, dict[str, str]]] = {"mm_projector.": {}}
    # a stacked suffix -> our suffixes, in the order their rows are concatenated
    stacked: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init__(self, tower: TowerConfig, cfg: ProjectorConfig):
        super().__init__()
        self.cfg = cfg


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 whatever the input dtype (bf16 sums of squares lose precision)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def build_projector(tower: TowerConfig, cfg: ProjectorConfig) -> Projector:
    try:
        cls = PROJECTORS[cfg.type]
    except KeyError:
        raise ValueError(f"unknown projector type {cfg.type!r}; known: {sorted(PROJECTORS)}") from None
    return cls(tower, cfg)


@register("patchmerger")
class PatchMerger(Projector):
    """LayerNorm per sub-patch -> Linear(4D, 4D) -> GELU(erf) -> Linear(4D, out)."""

    checkpoint_names: ClassVar[dict[str, dict[str, str]]] = {
        "mm_projector.": {},
        "multi_modal_projector.": {"linear_1.": "proj.0.", "linear_2.": "proj.2."},  # Kimi-VL
        "model.mm_projector.": {"in_proj.": "proj.0.", "out_proj.": "proj.2."},  # transformers' in memory
    }

    def __init__(self, tower: TowerConfig, cfg: ProjectorConfig):
        super().__init__(tower, cfg)
        d, m = tower.hidden_size, tower.merged_dim
        self.pre_norm = nn.LayerNorm(d, eps=cfg.ln_eps)
        self.proj = nn.Sequential(nn.Linear(m, m), nn.GELU(), nn.Linear(m, cfg.out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.pre_norm(x).flatten(1))


@register("patchmergerv2")
class PatchMergerV2(Projector):
    """No pre-norm, bias-free Linear(4D, 4D) -> GELU -> Linear(4D, out), then RMSNorm(out).

    Real checkpoints (and vLLM's Kimi-K2.5 loader) name the norm `post_norm`; `norm` is accepted too."""

    checkpoint_names: ClassVar[dict[str, dict[str, str]]] = {"mm_projector.": {"post_norm.": "norm."}}

    def __init__(self, tower: TowerConfig, cfg: ProjectorConfig):
        super().__init__(tower, cfg)
        m = tower.merged_dim
        self.proj = nn.Sequential(nn.Linear(m, m, bias=False), nn.GELU(), nn.Linear(m, cfg.out_dim, bias=False))
        self.norm = RMSNorm(cfg.out_dim, eps=cfg.ln_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x.flatten(1)))


@register("glm")
class GlmProjector(Projector):
    """GLM-style merger on the 2x2-merged features: Linear(4D, out) -> LayerNorm -> GELU -> SwiGLU.

    Our names are GLM-4.xV's (`model.visual.merger.{proj,post_projection_norm,gate_proj,up_proj,
    down_proj}`); vLLM stacks gate and up as `gate_up_proj` (gate rows first)."""

    checkpoint_names: ClassVar[dict[str, dict[str, str]]] = {
        "mm_projector.": {}, "model.visual.merger.": {}, "visual.merger.": {},
    }
    stacked: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up_proj.": ("gate_proj.", "up_proj.")}

    def __init__(self, tower: TowerConfig, cfg: ProjectorConfig):
        super().__init__(tower, cfg)
        out, ctx = cfg.out_dim, cfg.context_dim
        self.proj = nn.Linear(tower.merged_dim, out, bias=False)
        self.post_projection_norm = nn.LayerNorm(out, eps=cfg.ln_eps)
        self.gate_proj = nn.Linear(out, ctx, bias=False)
        self.up_proj = nn.Linear(out, ctx, bias=False)
        self.down_proj = nn.Linear(ctx, out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.post_projection_norm(self.proj(x.flatten(1))))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
