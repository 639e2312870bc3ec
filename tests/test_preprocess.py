"""Kimi-K2.5 preprocessing: the resize policy table, PIL parity, padding and patch order."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from harness.media_factory import image_bytes, natural_image
from mm_encoder.core.spec import PreprocessConfig
from mm_encoder.model.preprocess import num_tokens, preprocess_frames, resize_target, resize_uint8

CFG = PreprocessConfig()

# (W, H) -> (W', H', grid h, grid w, tokens), worked by hand from
# s = min(1, sqrt(16384 / (max(1, W//14) * max(1, H//14))), 7168/W, 7168/H); pad to 28.
POLICY = [
    ((1, 1), (1, 1, 2, 2, 1)),  # tiny: padded up to one 28x28 merge unit
    ((27, 29), (27, 29, 4, 2, 2)),
    ((448, 448), (448, 448, 32, 32, 256)),
    ((1920, 1080), (1920, 1080, 78, 138, 2691)),  # 137*77 = 10549 patches <= 16384: no resize
    ((3840, 2160), (2392, 1345, 98, 172, 4214)),  # s = sqrt(16384 / (274*154))
    ((7000, 7000), (1792, 1792, 128, 128, 4096)),
    ((14336, 100), (7168, 50, 4, 512, 512)),  # side limit 512 patches: s = 7168/14336
    ((100, 14336), (50, 7168, 512, 4, 512)),
    ((20000, 120), (7168, 43, 4, 512, 512)),
    ((1000, 5), (1000, 5, 2, 72, 36)),
]


@pytest.mark.parametrize(("size", "expected"), POLICY)
def test_resize_policy_table(size, expected):
    w, h = size
    nw, nh, gh, gw, tokens = expected
    assert resize_target(w, h, CFG.in_patch_limit, CFG, 14) == (nw, nh)
    assert num_tokens(w, h, CFG, 14) == tokens == gh * gw // 4
    frames = torch.zeros((1, 1, 1, 3), dtype=torch.uint8).expand(1, h, w, 3) if w * h < 4e6 else None
    if frames is not None:
        pv, grid = preprocess_frames(frames[0], CFG, 14)
        assert grid == (1, gh, gw) and pv.shape == (gh * gw, 3, 14, 14)


def test_policy_formula_matches_independent_computation():
    rng = np.random.default_rng(0)
    for _ in range(300):
        w, h = (int(x) for x in rng.integers(1, 30000, 2))
        s = min(1.0, math.sqrt(16384 / (max(1, w // 14) * max(1, h // 14))), 7168 / w, 7168 / h)
        nw, nh = max(1, int(w * s)), max(1, int(h * s))
        assert resize_target(w, h, 16384, CFG, 14) == (nw, nh)
        assert nw <= 7168 and nh <= 7168
        assert num_tokens(w, h, CFG, 14) == math.ceil(nh / 28) * math.ceil(nw / 28)


def test_video_frames_use_the_per_frame_limit():
    assert num_tokens(1920, 1080, CFG, 14, video=True) < num_tokens(1920, 1080, CFG, 14)
    nw, nh = resize_target(1920, 1080, CFG.in_patch_limit_each_frame, CFG, 14)
    assert (nw // 14) * (nh // 14) <= 4096


@pytest.mark.parametrize(
    ("size", "tolerance"),
    [((3840, 2160), 1), ((2000, 2000), 1), ((594, 16376), 1), ((1857, 2182), 1), ((5000, 2500), 1),
     # Pillow 13 gives a result here that matches a vertical-first pass order; ours is
     # horizontal-first (Pillow's C order), so a few dozen pixels are 2 levels off.
     ((1200, 3000), 2)],
)
def test_torch_resize_close_to_pil(size, tolerance):
    w, h = size
    img = natural_image(w, h, seed=w)
    nw, nh = resize_target(w, h, CFG.in_patch_limit, CFG, 14)
    assert (nw, nh) != (w, h)
    ours = resize_uint8(torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)[None], nh, nw)
    pil = torch.from_numpy(np.asarray(img.resize((nw, nh), Image.BICUBIC)).copy()).permute(2, 0, 1)[None]
    diff = (ours.int() - pil.int()).abs()
    assert diff.max() <= tolerance, (size, diff.max())
    assert (diff > 1).float().mean() < 1e-4


def test_normalisation_padding_and_patch_order():
    """Patch (r, c) holds pixels [14r:14r+14, 14c:14c+14]; the pad is black, i.e. -1 after (x-0.5)/0.5."""
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (30, 45, 3), dtype=np.uint8)
    pv, (t, gh, gw) = preprocess_frames(torch.from_numpy(a), CFG, 14)
    assert (t, gh, gw) == (1, 4, 4)  # 30 -> 56, 45 -> 56
    img = pv.view(gh, gw, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, gh * 14, gw * 14)
    expected = torch.from_numpy(a).permute(2, 0, 1).float() / 127.5 - 1
    torch.testing.assert_close(img[:, :30, :45], expected)
    assert torch.all(img[:, 30:, :] == -1) and torch.all(img[:, :, 45:] == -1)
    torch.testing.assert_close(pv[gw + 1], expected[:, 14:28, 14:28])


def test_video_chunk_patches_are_frame_major():
    frames = torch.stack([torch.full((28, 56, 3), v, dtype=torch.uint8) for v in (0, 64, 128, 255)])
    pv, grid = preprocess_frames(frames, CFG, 14, video=True)
    assert grid == (4, 2, 4)
    per_frame = pv.view(4, 8, -1)
    for i, v in enumerate((0, 64, 128, 255)):
        assert torch.allclose(per_frame[i], torch.tensor(v / 127.5 - 1))


def test_encoder_preprocess_accepts_bytes_pil_and_tensor(tiny):
    img = natural_image(300, 200, seed=2)
    a, ga = tiny.preprocess(image_bytes(img))
    b, gb = tiny.preprocess(img)
    c, gc = tiny.preprocess(torch.from_numpy(np.asarray(img).copy()))
    assert ga == gb == gc == (1, 16, 22)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)
