"""Slow, eager reference for the MoonViT vision tower and its projectors.

Written literally from ``docs/moonvit.md`` and kept independent of the fast
path it is compared against. Everything runs in the dtype of the inputs
(weights are cast to it), except RoPE, the softmax and RMSNorm, which run in
fp32. Items are processed one at a time in a python loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VT = "vision_tower."
MP = "mm_projector."


def _w(sd: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    """Fetch a weight and cast it to the compute dtype."""
    return sd[name].to(dtype)


def _linear(sd: dict[str, torch.Tensor], prefix: str, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """``x @ W^T + b`` with ``prefix.weight`` / ``prefix.bias``."""
    w = _w(sd, prefix + ".weight", x.dtype)
    b = _w(sd, prefix + ".bias", x.dtype) if bias else None
    return F.linear(x, w, b)


def _layer_norm(sd: dict[str, torch.Tensor], prefix: str, x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim with ``prefix.weight`` / ``prefix.bias``."""
    w = _w(sd, prefix + ".weight", x.dtype)
    b = _w(sd, prefix + ".bias", x.dtype)
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def time_embedding(t: int, dim: int) -> torch.Tensor:
    """Fixed 1-D sin/cos embedding of frames 0..t-1: ``[t, dim]`` fp32, sin half first."""
    half = dim // 2
    omega = 1.0 / 10000.0 ** (torch.arange(half, dtype=torch.float64) / half)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * omega[None, :]
    return torch.cat([torch.sin(ang), torch.cos(ang)], dim=-1).float()


def pos_embedding(
    sd: dict[str, torch.Tensor], cfg: dict, t: int, h: int, w: int, dtype: torch.dtype
) -> torch.Tensor:
    """Learned (maybe bicubic-resized) 2-D table plus time embedding: ``[t*h*w, D]``."""
    table = _w(sd, VT + "patch_embed.pos_emb.weight", dtype)  # [pos_h, pos_w, D]
    dim = table.shape[-1]
    if (h, w) == (cfg["pos_h"], cfg["pos_w"]):
        grid = table
    else:
        grid = F.interpolate(
            table.permute(2, 0, 1).unsqueeze(0),  # [1, D, pos_h, pos_w]
            size=(h, w),
            mode="bicubic",
            align_corners=False,
            antialias=False,
        )[0].permute(1, 2, 0)  # [h, w, D]
    pos = grid.reshape(h * w, dim)
    if t == 1:
        return pos
    if t > cfg["pos_t"]:
        raise ValueError(f"t={t} exceeds pos_t={cfg['pos_t']}")
    per_frame = pos.unsqueeze(0).expand(t, h * w, dim)
    time = time_embedding(t, dim).to(dtype).unsqueeze(1)  # [t, 1, D]
    return (per_frame + time).reshape(t * h * w, dim)


def rope_table(cfg: dict, t: int, h: int, w: int) -> torch.Tensor:
    """Complex rotations ``[t*h*w, head_dim/2]`` (complex64) for one item.

    Complex slot ``2i`` turns by ``col * f_i`` and slot ``2i+1`` by ``row * f_i``,
    with ``f_i = theta^(-4i/head_dim)``; every frame reuses the same table.
    """
    head_dim = cfg["hidden"] // cfg["heads"]
    if head_dim % 4:
        raise ValueError(f"head_dim={head_dim} is not divisible by 4")
    n = head_dim // 4
    freqs = cfg["rope_theta"] ** (-4.0 * torch.arange(n, dtype=torch.float64) / head_dim)
    idx = torch.arange(h * w)
    row = (idx // w).to(torch.float64)
    col = (idx % w).to(torch.float64)
    ang_col = col[:, None] * freqs[None, :]  # [h*w, n]
    ang_row = row[:, None] * freqs[None, :]
    angles = torch.stack([ang_col, ang_row], dim=-1).reshape(h * w, 2 * n)
    table = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    return table.repeat(t, 1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x [N, heads, head_dim]`` in fp32."""
    n, heads, head_dim = x.shape
    xc = torch.view_as_complex(x.float().reshape(n, heads, head_dim // 2, 2).contiguous())
    out = torch.view_as_real(xc * table[:, None, :]).reshape(n, heads, head_dim)
    return out.to(x.dtype)


def attention(
    sd: dict[str, torch.Tensor], prefix: str, cfg: dict, x: torch.Tensor, rope: torch.Tensor
) -> torch.Tensor:
    """Full self-attention over one item's tokens ``x [N, D]`` (before ``wo``)."""
    n, dim = x.shape
    heads = cfg["heads"]
    head_dim = dim // heads
    qkv = _linear(sd, prefix + "wqkv", x).view(n, 3, heads, head_dim)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    q = apply_rope(q, rope).transpose(0, 1)  # [heads, N, head_dim]
    k = apply_rope(k, rope).transpose(0, 1)
    v = v.transpose(0, 1)
    scores = (q @ k.transpose(1, 2)) * head_dim**-0.5  # [heads, N, N]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
    out = probs @ v  # [heads, N, head_dim]
    return out.transpose(0, 1).reshape(n, dim)


def block(
    sd: dict[str, torch.Tensor], i: int, cfg: dict, x: torch.Tensor, rope: torch.Tensor
) -> torch.Tensor:
    """One pre-norm encoder block."""
    p = f"{VT}encoder.blocks.{i}."
    eps = cfg["ln_eps"]
    a = attention(sd, p, cfg, _layer_norm(sd, p + "norm0", x, eps), rope)
    x = x + _linear(sd, p + "wo", a)
    hmid = _linear(sd, p + "mlp.fc0", _layer_norm(sd, p + "norm1", x, eps))
    x = x + _linear(sd, p + "mlp.fc1", F.gelu(hmid, approximate="tanh"))
    return x


def merge_sd2_tpool(x: torch.Tensor, t: int, h: int, w: int) -> torch.Tensor:
    """Mean over frames, then 2x2 groups (TL, TR, BL, BR): ``[h/2*w/2, 4, D]``."""
    dim = x.shape[-1]
    frame = x.view(t, h, w, dim).mean(dim=0)  # [h, w, D]
    g = frame.view(h // 2, 2, w // 2, 2, dim).permute(0, 2, 1, 3, 4)
    return g.reshape((h // 2) * (w // 2), 4, dim)


def _check_grids(pixel_values: torch.Tensor, grid_thws: list[tuple[int, int, int]]) -> None:
    total = 0
    for t, h, w in grid_thws:
        if t < 1 or h % 2 or w % 2:
            raise ValueError(f"bad grid {(t, h, w)}: need t >= 1 and even h, w")
        total += t * h * w
    if total != pixel_values.shape[0]:
        raise ValueError(f"grids cover {total} patches, pixel_values has {pixel_values.shape[0]}")


def reference_tower(
    state_dict: dict[str, torch.Tensor],
    cfg: dict,
    pixel_values: torch.Tensor,
    grid_thws: list[tuple[int, int, int]],
) -> list[torch.Tensor]:
    """Per item, tower output after final LayerNorm and merger: ``[h/2*w/2, 4, D]``."""
    _check_grids(pixel_values, grid_thws)
    sd = state_dict
    dtype = pixel_values.dtype
    patch = cfg["patch"]
    conv_w = _w(sd, VT + "patch_embed.proj.weight", dtype)
    conv_b = _w(sd, VT + "patch_embed.proj.bias", dtype)
    outs = []
    start = 0
    for t, h, w in grid_thws:
        n = t * h * w
        pix = pixel_values[start : start + n]
        start += n
        x = F.conv2d(pix, conv_w, conv_b, stride=patch)  # [n, D, 1, 1]
        x = x.reshape(n, -1)
        x = x + pos_embedding(sd, cfg, t, h, w, dtype)
        rope = rope_table(cfg, t, h, w)
        for i in range(cfg["layers"]):
            x = block(sd, i, cfg, x, rope)
        x = _layer_norm(sd, VT + "encoder.final_layernorm", x, cfg["ln_eps"])
        outs.append(merge_sd2_tpool(x, t, h, w))
    return outs


def reference_project(state_dict: dict[str, torch.Tensor], cfg: dict, merged: torch.Tensor) -> torch.Tensor:
    """Projector on merged tokens ``[M, 4, D]`` -> ``[M, text_hidden]``."""
    sd = state_dict
    kind = cfg["projector"]
    eps = cfg["projector_ln_eps"]
    m = merged.shape[0]
    if kind == "patchmerger":
        x = _layer_norm(sd, MP + "pre_norm", merged, eps).reshape(m, -1)
        x = F.gelu(_linear(sd, MP + "proj.0", x), approximate="none")
        return _linear(sd, MP + "proj.2", x)
    x = merged.reshape(m, -1)
    if kind == "patchmergerv2":
        x = F.gelu(_linear(sd, MP + "proj.0", x, bias=False), approximate="none")
        x = _linear(sd, MP + "proj.2", x, bias=False)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
        return (xf * sd[MP + "norm.weight"].float()).to(x.dtype)
    if kind == "glm":
        x = _linear(sd, MP + "proj", x, bias=False)
        x = F.gelu(_layer_norm(sd, MP + "post_projection_norm", x, eps), approximate="none")
        gate = _linear(sd, MP + "gate_proj", x, bias=False)
        up = _linear(sd, MP + "up_proj", x, bias=False)
        return _linear(sd, MP + "down_proj", F.silu(gate) * up, bias=False)
    raise ValueError(f"unknown projector {kind!r}")


def reference_forward(
    state_dict: dict[str, torch.Tensor],
    cfg: dict,
    pixel_values: torch.Tensor,
    grid_thws: list[tuple[int, int, int]],
) -> list[torch.Tensor]:
    """Tower + projector; per item ``[h/2*w/2, text_hidden]``."""
    merged = reference_tower(state_dict, cfg, pixel_values, grid_thws)
    return [reference_project(state_dict, cfg, m) for m in merged]


__all__ = [
    "apply_rope",
    "merge_sd2_tpool",
    "pos_embedding",
    "reference_forward",
    "reference_project",
    "reference_tower",
    "rope_table",
    "time_embedding",
]
