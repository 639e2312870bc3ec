"""Kimi-K2.5's released processor, written here from its rules, for the expected side of equality tests.

Nothing of mm_encoder's is used: frames are decoded with PyAV, images with Pillow, pixels go through
transformers' own `rescale` and `normalize` (numpy), and the frame choice, chunking and timestamps
are the released code's rules (the model's own processor, which vLLM runs), written out:
- a video of N frames at its average rate `fps` keeps n = max(round(N * min(2, fps) / fps), 1) frames,
  at `np.linspace(0, N - 1, n).round()`;
- every 4 kept frames are one chunk (the last keeps what is left), stamped with its first kept frame's
  index / fps as `%H:%M:%S` + `.{int(t % 1 * 1000):03d}` (milliseconds truncated);
- a chunk's prompt is `{stamp}<|media_begin|>video<|media_content|>` + one video placeholder per
  row + `<|media_end|>`; an image's `<|media_pad|>` repeats once per row.
transformers 5.24's `Kimi_K25VideoProcessor` samples other frames (`arange`, never the last one), so
it is not used. Resizing is not written out: every size used with it needs none (checked), which
leaves padding to a multiple of 28 with zeros before normalising (pad value -1 after it).
"""

from __future__ import annotations

import io
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

PATCH, MERGE, CHUNK, SAMPLE_FPS = 14, 2, 4, 2.0
IMAGE_PATCHES, FRAME_PATCHES, SIDE_PATCHES = 16384, 4096, 512
IMAGE_PAD, VIDEO_PAD = "<|media_pad|>", "<|kimi_k25_video_placeholder|>"


@dataclass
class Item:
    """One image, or one video chunk: the model's pixel rows, its grid and its prompt rows."""

    pixel_values: torch.Tensor  # [t * gh * gw, 3, 14, 14] fp32
    grid: tuple[int, int, int]
    stamp: str | None = None  # video chunks

    @property
    def rows(self) -> int:
        return self.grid[1] * self.grid[2] // MERGE**2


def kept_frames(n_frames: int, fps: float) -> list[int]:
    n = max(round(n_frames * min(SAMPLE_FPS, fps) / fps), 1)
    return np.linspace(0, n_frames - 1, n).round().astype(int).tolist()


def stamp(seconds: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}"


def _pixels(frames: np.ndarray, budget: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[t, H, W, 3] uint8 -> patch rows (t, then patch rows, then patch columns) and the grid."""
    from transformers.image_transforms import normalize, rescale

    t, h, w, _ = frames.shape
    scale = min(1.0, math.sqrt(budget / (max(1, h // PATCH) * max(1, w // PATCH))),
                SIDE_PATCHES * PATCH / h, SIDE_PATCHES * PATCH / w)
    assert scale == 1.0, f"{w}x{h} would be resized: this reference does not resize"
    unit = PATCH * MERGE
    ph, pw = -(-h // unit) * unit, -(-w // unit) * unit
    padded = np.zeros((t, ph, pw, 3), dtype=np.uint8)
    padded[:, :h, :w] = frames
    x = np.stack([normalize(rescale(f, 1 / 255, dtype=np.float32), 0.5, 0.5) for f in padded])
    gh, gw = ph // PATCH, pw // PATCH
    x = torch.from_numpy(x).view(t, gh, PATCH, gw, PATCH, 3).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(t * gh * gw, 3, PATCH, PATCH).contiguous(), (t, gh, gw)


def image(data: bytes) -> Item:
    from PIL import Image

    rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    return Item(*_pixels(rgb[None], IMAGE_PATCHES))


def video(data: bytes) -> list[Item]:
    """The clip's chunks, each with its pixels, grid and timestamp."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    kept = kept_frames(len(frames), fps)
    out = []
    for c in range(0, len(kept), CHUNK):
        idx = kept[c : c + CHUNK]
        pixels, grid = _pixels(np.stack([frames[i] for i in idx]), FRAME_PATCHES)
        out.append(Item(pixels, grid, stamp(idx[0] / fps)))
    return out


def expand(text: str, images: list[Item], videos: list[list[Item]]) -> str:
    """The chat template's text with each image's placeholder repeated per row and each video's one
    placeholder replaced by its chunks' prompts."""
    head, *rest = text.split(IMAGE_PAD)
    assert len(rest) == len(images), (len(rest), len(images))
    text = head + "".join(IMAGE_PAD * im.rows + r for im, r in zip(images, rest, strict=True))
    head, *rest = text.split(VIDEO_PAD)
    assert len(rest) == len(videos), (len(rest), len(videos))
    chunks = ["".join(f"{c.stamp}<|media_begin|>video<|media_content|>{VIDEO_PAD * c.rows}<|media_end|>"
                      for c in v) for v in videos]
    return head + "".join(c + r for c, r in zip(chunks, rest, strict=True))


def model_inputs(images: list[Item], videos: list[list[Item]]) -> dict[str, torch.Tensor]:
    """transformers' `generate` keywords for the pixels."""
    out = {}
    if images:
        out |= {"pixel_values": torch.cat([i.pixel_values for i in images]),
                "image_grid_thw": torch.tensor([list(i.grid) for i in images])}
    chunks = [c for v in videos for c in v]
    if chunks:
        out |= {"pixel_values_videos": torch.cat([c.pixel_values for c in chunks]),
                "video_grid_thw": torch.tensor([list(c.grid) for c in chunks])}
    return out
