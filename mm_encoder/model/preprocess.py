"""Each model's preprocessing in torch (so it runs on the GPU when there is one).

resize (bicubic with antialias, close to PIL BICUBIC: see `resize_uint8`) -> round to uint8 levels
-> zero-pad bottom/right to a multiple of patch*merge (black, so -1 once normalised), or center-crop
to whole patches -> patchify row-major into [t*h*w, 3, P, P] -> normalise (mean/std).

The resize rule is the spec's `PreprocessConfig.policy`, one per model family, stated in its module
(`families/`: `PreprocessRule`): "kimi-k2.5" (`families.kimi_k25`: scale to the patch limit and the
side cap, always padded) and "kimi-vl" (`families.kimi_vl`: KimiVLImageProcessor's, a size the
model cannot take refused). Either way the new size is int(W*s) x int(H*s).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..core.spec import Grid, PreprocessConfig, tokens_for_grid
from ..families import preprocess_rule


def resize_target(width: int, height: int, patch_limit: int, cfg: PreprocessConfig, patch: int) -> tuple[int, int]:
    """New (width, height) under the spec's policy. Under kimi-vl a size the model cannot take is
    refused here (MediaError), so callers that know the size from a header refuse before decoding."""
    rule = preprocess_rule(cfg.policy)
    size = rule.target(width, height, patch_limit, cfg, patch)
    if rule.check is not None:
        rule.check(width, height, *patch_grid(*size, cfg, patch), cfg)
    return size


def resize_uint8(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Bicubic + antialias resize of uint8 [t, 3, H, W], close to PIL BICUBIC: at most 2 grey levels
    apart, and more than 1 on under 1 value in 10^5.

    Measured over tests/test_fidelity.py's table of down- and up-scales (8000x300 to both Kimi
    targets, 4K, 16376-tall, 10x up, ...): 1 level on most sizes; 2 on 15 of 7.7M values for
    1200x3000 -> 1015x2539 and 1 of 1.9M for 97x61 -> 1000x629. Two separable float passes,
    horizontal first, each rounded and clamped to 0..255 as PIL does between its passes; PIL itself
    sums in fixed point, hence the odd level. One float pass is off by up to ~10 levels on sharp
    edges, and PyTorch's uint8 kernel (4x faster on CPU) by more.
    """
    y = x.float()
    for size in ((y.shape[2], width), (height, width)):
        if tuple(y.shape[2:]) != size:
            y = F.interpolate(y, size=size, mode="bicubic", align_corners=False, antialias=True).round_().clamp_(0, 255)
    return y.to(torch.uint8)


def padded_grid(width: int, height: int, patch: int, merge: int = 2) -> tuple[int, int]:
    """Patches (h, w) after zero-padding to a multiple of patch*merge."""
    unit = patch * merge
    return math.ceil(height / unit) * merge, math.ceil(width / unit) * merge


def patch_grid(width: int, height: int, cfg: PreprocessConfig, patch: int) -> tuple[int, int]:
    """Patches (h, w) of an already resized image: padded, or (kimi-vl without pad_input)
    center-cropped down to whole patches."""
    if cfg.pad_input:
        return padded_grid(width, height, patch)
    return height // patch, width // patch


def _limit(cfg: PreprocessConfig, video: bool) -> int:
    return cfg.in_patch_limit_each_frame if video else cfg.in_patch_limit


def frame_grid(width: int, height: int, cfg: PreprocessConfig, patch: int, video: bool = False) -> tuple[int, int]:
    """Patches (h, w) of an image (or each frame of a video chunk) of this size, without decoding
    it; raises the MediaError that preprocessing would."""
    w, h = resize_target(width, height, _limit(cfg, video), cfg, patch)
    return patch_grid(w, h, cfg, patch)


def num_tokens(width: int, height: int, cfg: PreprocessConfig, patch: int, video: bool = False) -> int:
    """LLM tokens for an image (or one video chunk) of this size, without decoding it."""
    return tokens_for_grid((1, *frame_grid(width, height, cfg, patch, video)))


def _pad_or_crop(x: torch.Tensor, gh: int, gw: int, patch: int, pad: bool) -> torch.Tensor:
    """uint8 [t, 3, H, W] -> [t, 3, gh*P, gw*P]: black bottom/right pad, or a center crop placed as
    torchvision's center_crop places it (offset round((size - crop) / 2))."""
    height, width = x.shape[2:]
    if pad:
        return F.pad(x, (0, gw * patch - width, 0, gh * patch - height), value=0)
    top, left = round((height - gh * patch) / 2), round((width - gw * patch) / 2)
    return x[:, :, top : top + gh * patch, left : left + gw * patch]


def preprocess_frames(
    frames: torch.Tensor,
    cfg: PreprocessConfig,
    patch: int,
    *,
    video: bool = False,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, Grid]:
    """uint8 [H, W, 3] (image) or [t, H, W, 3] (video chunk) -> (pixel_values, (t, h, w)).

    A video chunk's frames each go through the image rule with the per-frame limit."""
    if frames.dim() == 3:
        frames = frames[None]
    t, height, width, _ = frames.shape
    new_w, new_h = resize_target(width, height, _limit(cfg, video), cfg, patch)
    x = frames.to(device=device, non_blocking=True).permute(0, 3, 1, 2)  # uint8 [t, 3, H, W] view
    if (new_w, new_h) != (width, height):
        x = resize_uint8(x, new_h, new_w)
    gh, gw = patch_grid(new_w, new_h, cfg, patch)
    x = _pad_or_crop(x, gh, gw, patch, cfg.pad_input)  # black pad, before normalising
    # Patchify while still uint8 (4x less memory traffic): [t, 3, gh*P, gw*P] -> [t*gh*gw, 3, P, P]
    x = x.reshape(t, 3, gh, patch, gw, patch).permute(0, 2, 4, 1, 3, 5).reshape(t * gh * gw, 3, patch, patch)
    mean = torch.tensor(cfg.image_mean, device=x.device).view(1, 3, 1, 1) * 255
    std = torch.tensor(cfg.image_std, device=x.device).view(1, 3, 1, 1) * 255
    x = x.float().sub_(mean).div_(std)
    return x.to(dtype), (t, gh, gw)
