"""Block-diagonal attention over packed items: each item attends only to its own tokens.

CUDA with bf16/fp16: one `torch.nn.attention.varlen.varlen_attn` call over the whole pack
(flash attention on cu_seqlens; no padding, no mask). Elsewhere (CPU, fp32): SDPA per item,
which on CPU runs PyTorch's fused flash kernel and never materialises the L x L matrix.
`seqlens`/`max_seqlen` are host ints, so nothing here syncs with the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # PyTorch >= 2.9
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None


def _use_varlen(q: torch.Tensor) -> bool:
    return _varlen_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def block_diagonal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens: list[int],
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """q, k, v: [N, heads, head_dim] -> [N, heads, head_dim]."""
    scale = q.shape[-1] ** -0.5
    if _use_varlen(q) and cu_seqlens is not None:
        m = max_seqlen if max_seqlen is not None else max(seqlens)
        return _varlen_attn(q, k, v, cu_seqlens, cu_seqlens, m, m, scale=scale)
    # [heads, N, head_dim] views; slicing along N keeps each item's block.
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))
    if len(seqlens) == 1:
        out = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], scale=scale)[0]
        return out.transpose(0, 1)
    out = torch.empty_like(qh)
    start = 0
    for n in seqlens:
        end = start + n
        out[:, start:end] = F.scaled_dot_product_attention(
            qh[None, :, start:end], kh[None, :, start:end], vh[None, :, start:end], scale=scale
        )[0]
        start = end
    return out.transpose(0, 1)
