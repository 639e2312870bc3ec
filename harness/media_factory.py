"""Deterministic synthetic media for tests and the bundled samples (no downloads anywhere)."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def natural_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """Photo-like content: smooth gradients, soft shapes, hard edges and mild texture."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    r = 128 + 100 * np.sin(x / max(width, 1) * 3.1 + seed)
    g = 128 + 100 * np.cos(y / max(height, 1) * 2.3)
    b = 128 + 80 * np.sin((x + y) / max(width + height, 1) * 5.0)
    base = np.stack([r, g, b], -1)
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        s = int(rng.integers(4, max(5, min(width, height) // 3)))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse([x0, y0, x0 + s, y0 + s], fill=color)
        else:
            draw.rectangle([x0, y0, x0 + s, y0 + s // 2], fill=color)
    img = img.filter(ImageFilter.GaussianBlur(0.8))
    noise = rng.normal(0, 4, (height, width, 3))
    return Image.fromarray(np.clip(np.asarray(img, np.float32) + noise, 0, 255).astype(np.uint8), "RGB")


def image_bytes(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def video_bytes(
    width: int = 160, height: int = 96, frames: int = 30, fps: int = 10, codec: str = "mpeg4", fmt: str = "mp4",
    still: bool = False, seed: int = 7, start: int = 0,
) -> bytes:
    """A clip whose frames differ visibly (a moving square over a gradient), or with `still` one
    frame repeated in a single GOP: a few hundred bytes per second, whatever the frame size.
    `start`: the first frame's presentation time, in frames (a stream that does not start at 0)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        if still:
            stream.codec_context.gop_size = 10_000
        base = np.asarray(natural_image(width, height, seed=seed))
        for i in range(frames):
            a = base.copy()
            if not still:
                x0 = (i * 7) % max(1, width - 16)
                a[8:24, x0 : x0 + 16] = (255, 32, 32)
            frame = av.VideoFrame.from_ndarray(a, format="rgb24")
            frame.pts = start + i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def k25_image_tokens(width: int, height: int, patch: int = 14, merge: int = 2, max_patches: int = 16384,
                     max_side_patches: int = 512) -> int:
    """An image's rows in a Kimi-K2.5 prompt, from its size alone (the released processor's policy,
    written out here so tests never read the count back from the code under test): scale by
    s = min(1, sqrt(max_patches / patches), side limit / H, side limit / W), patches counted as
    max(1, H // P) * max(1, W // P); truncate; pad each side up to a multiple of P * merge; one row
    per merge x merge block of patches."""
    import math

    patches = max(1, height // patch) * max(1, width // patch)
    side = max_side_patches * patch
    s = min(1.0, math.sqrt(max_patches / patches), side / height, side / width)
    h, w = min(max(1, int(height * s)), side), min(max(1, int(width * s)), side)
    unit = patch * merge
    return -(-h // unit) * -(-w // unit)


def sampled_video_chunks(frames: int, fps: float, rows: int) -> list[tuple[str, int]]:
    """A clip's chunks in a Kimi-K2.5 prompt, (timestamp, rows) each, by the released processor's
    rules (`released_processor`: its frames, chunks of 4, their stamps); each chunk costs one frame's
    `rows`."""
    from harness.released_processor import CHUNK, kept_frames, stamp

    return [(stamp(first / fps), rows) for first in kept_frames(frames, fps)[::CHUNK]]
