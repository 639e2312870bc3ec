"""Shared fixtures. Everything here runs on CPU with deterministic random weights."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mm_encoder import Encoder, ModelSpec
from mm_encoder.model.checkpoint import VisionModel, build_empty, init_random

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

# tests/vllm/ runs on vLLM's code, in vLLM's own virtualenv (`make test-vllm`); the project's venv has no vLLM.
# (tests/ is on sys.path: tests/vllm/ itself would be found as a namespace package, which has no origin)
_vllm = importlib.util.find_spec("vllm")
collect_ignore = [] if _vllm is not None and _vllm.origin is not None else ["vllm"]


@pytest.fixture(scope="session")
def tiny() -> Encoder:
    return Encoder.from_pretrained("tiny")


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


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """The tiny random Kimi-K2.5 checkpoint the package generates (`make up` serves the same one):
    transformers' config format, sharded safetensors in the released layout, tokenizer, chat template."""
    from mm_encoder.engines.tiny_checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "kimi-k2.5-tiny", "tiny")


@pytest.fixture(scope="session")
def ckpt_encoder(checkpoint) -> Encoder:
    """The checkpoint's vision tower and projector, as the encode worker loads them (fp32)."""
    return Encoder.from_pretrained(checkpoint, dtype="fp32")
