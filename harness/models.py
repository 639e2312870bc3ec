"""Models with deterministic random weights (CPU), and the reference implementation's config for a spec."""

from __future__ import annotations

import torch

from mm_encoder import ModelSpec
from mm_encoder.model.checkpoint import VisionModel, build_empty, init_random


def ref_cfg(spec: ModelSpec) -> dict:
    """The reference implementation's config dict for a spec."""
    t, p = spec.tower, spec.projector
    return {
        "hidden": t.hidden_size,
        "heads": t.num_heads,
        "intermediate": t.intermediate_size,
        "layers": t.num_layers,
        "patch": t.patch_size,
        "pos_h": t.pos_emb_height,
        "pos_w": t.pos_emb_width,
        "pos_t": t.pos_emb_time,
        "merge": list(t.merge_kernel),
        "rope_theta": t.rope_theta,
        "ln_eps": t.ln_eps,
        "projector": p.type,
        "projector_ln_eps": p.ln_eps,
        "text_hidden": p.out_dim,
    }


def random_model(spec: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32) -> VisionModel:
    return init_random(build_empty(spec), seed, torch.device("cpu"), dtype)
