"""2D rotary position embedding, MoonViT convention.

head_dim d holds d/2 complex pairs (interleaved real dims 2k, 2k+1). Pair 2i rotates by
column * f_i and pair 2i+1 by row * f_i, with f_i = theta^(-4i/d). Angles are built once per
batch from host ints; applying them is a few elementwise ops in fp32.
"""

from __future__ import annotations

import torch


def rope_2d_angles(h: int, w: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """[h*w, head_dim/2] fp32 rotation angles for a row-major h x w patch grid."""
    n_freq = head_dim // 4
    freqs = theta ** (-4.0 * torch.arange(n_freq, device=device, dtype=torch.float32) / head_dim)
    rows = torch.arange(h, device=device, dtype=torch.float32).repeat_interleave(w)
    cols = torch.arange(w, device=device, dtype=torch.float32).repeat(h)
    # [h*w, n_freq, 2]: (column, row) per frequency, flattened to pair order 2i, 2i+1
    return torch.stack((cols[:, None] * freqs, rows[:, None] * freqs), dim=-1).flatten(1)


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, ..., head_dim] by cos/sin [N, head_dim/2] (broadcast over middle dims), in fp32."""
    shape = x.shape
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    extra = x.dim() - 2
    c = cos.view(cos.shape[0], *([1] * extra), cos.shape[1])
    s = sin.view(sin.shape[0], *([1] * extra), sin.shape[1])
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return out.view(shape).to(x.dtype)
