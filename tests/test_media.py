"""Untrusted media: typed refusals with stable codes, deterministic RGB conversion, video sampling, fuzzing.

All media is generated here (Pillow, numpy, PyAV); nothing is read from disk or the network.
"""

from __future__ import annotations

import functools
import io
import math
import struct
import time
import zlib

import av
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from harness.media_factory import image_bytes, natural_image, video_bytes
from mm_encoder import Encoder
from mm_encoder.core.errors import MediaError
from mm_encoder.core.spec import MediaLimits, PreprocessConfig
from mm_encoder.model.media import (
    VideoChunk,
    decode_image,
    decode_video,
    image_to_rgb,
    open_image,
    sample_indices,
    sniff_modality,
)

LIMITS = MediaLimits()
CFG = PreprocessConfig()
GARBAGE_MP4 = b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4
VIDEO_FAILURE_CODES = {"corrupt", "unsupported_format", "no_frames"}


def fuzz(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,  # the same examples every run: the suite stays deterministic
        database=None,  # no example database: failures are reproduced by derandomize
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


# --- helpers ---------------------------------------------------------------------------------


def media_error(fn, *args) -> MediaError:
    """Run fn(*args) and return the MediaError it raised; any other outcome fails the test."""
    with pytest.raises(MediaError) as info:
        fn(*args)
    assert info.value.code in MediaError.codes
    return info.value


def assert_rgb(t: torch.Tensor) -> None:
    assert isinstance(t, torch.Tensor)
    assert t.dtype == torch.uint8
    assert t.dim() == 3 and t.shape[2] == 3 and t.shape[0] > 0 and t.shape[1] > 0


def assert_chunks(chunks: list[VideoChunk], k: int = 4) -> None:
    """Every chunk has k frames but the last, which has 1 to k (its real frames, never padded)."""
    assert chunks
    for i, c in enumerate(chunks):
        assert c.frames.dtype == torch.uint8
        t = c.frames.shape[0]
        assert c.frames.dim() == 4 and (t == k or (i == len(chunks) - 1 and 1 <= t <= k)) and c.frames.shape[3] == 3
        assert c.index == i


def patch_png_size(png: bytes, width: int, height: int) -> bytes:
    """Rewrite the IHDR width/height of a PNG and fix the chunk's CRC (pixel data untouched)."""
    assert png[12:16] == b"IHDR"
    ihdr = bytearray(png[8:33])  # length(4) type(4) data(13) crc(4)
    ihdr[8:16] = struct.pack(">II", width, height)
    ihdr[21:25] = struct.pack(">I", zlib.crc32(bytes(ihdr[4:21])))
    return png[:8] + bytes(ihdr) + png[33:]


def patch_gif_size(gif: bytes, width: int, height: int) -> bytes:
    """Rewrite the logical screen size of a GIF."""
    assert gif[:6] in (b"GIF87a", b"GIF89a")
    return gif[:6] + struct.pack("<HH", width, height) + gif[10:]


def solid(mode: str, size: tuple[int, int], color) -> Image.Image:
    return Image.new(mode, size, color)


@functools.cache
def small_png() -> bytes:
    return image_bytes(natural_image(32, 24, seed=3))


@functools.cache
@functools.cache
def clip(frames: int = 30, fps: int = 10, fmt: str = "mp4", codec: str = "mpeg4", w: int = 160, h: int = 96) -> bytes:
    return video_bytes(w, h, frames, fps, codec=codec, fmt=fmt)


def mp4_boxes(data: bytes) -> dict[bytes, tuple[int, int]]:
    """Top-level MP4 boxes: type -> (offset, size)."""
    out, i = {}, 0
    while i + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[i : i + 8])
        out[kind] = (i, size)
        if size < 8:
            break
        i += size
    return out


# --- 1. bad input -> MediaError with a stable code ---------------------------------------------


def test_empty_bytes():
    assert media_error(decode_image, b"", LIMITS).code == "empty"
    assert media_error(decode_video, b"", CFG, LIMITS).code == "empty"


@pytest.mark.parametrize(
    "data",
    [
        b"this is certainly not an image, just some text" * 4,
        np.random.default_rng(0).integers(1, 256, 512, dtype=np.uint8).tobytes(),
        b"%PDF-1.4\n%...\n",
    ],
    ids=["text", "random", "pdf"],
)
def test_non_image_bytes_are_unsupported(data):
    assert media_error(decode_image, data, LIMITS).code == "unsupported_format"


@pytest.mark.parametrize(("fmt", "kw"), [("PNG", {}), ("JPEG", {"quality": 90})])
def test_truncated_image_is_corrupt(fmt, kw):
    data = image_bytes(natural_image(128, 96, seed=4), fmt, **kw)
    cut = data[: len(data) // 2]
    assert media_error(decode_image, cut, LIMITS).code == "corrupt"
    # The header is intact, so opening is fine (lazy); decoding the pixels is what fails.
    img = open_image(cut, LIMITS)
    assert img.size == (128, 96)
    assert media_error(image_to_rgb, img, LIMITS).code == "corrupt"


@pytest.mark.parametrize(
    ("width", "height"),
    [(100_000, 100_000), (9000, 9000)],  # beyond Pillow's own bomb limit / beyond only ours
)
def test_pixel_bomb_png_refused_from_header(width, height):
    bomb = patch_png_size(image_bytes(solid("RGB", (8, 8), (1, 2, 3))), width, height)
    t0 = time.perf_counter()
    err = media_error(decode_image, bomb, LIMITS)
    elapsed = time.perf_counter() - t0
    assert err.code == "too_many_pixels"
    assert elapsed < 0.5, f"took {elapsed:.3f} s: the header check must come before decoding"
    assert media_error(open_image, bomb, LIMITS).code == "too_many_pixels"


def test_pixel_bomb_gif_refused_from_header():
    bomb = patch_gif_size(image_bytes(solid("P", (8, 8), 1), "GIF"), 65535, 65535)
    t0 = time.perf_counter()
    assert media_error(decode_image, bomb, LIMITS).code == "too_many_pixels"
    assert time.perf_counter() - t0 < 0.5


def test_max_pixels_limit_is_configurable():
    data = image_bytes(solid("RGB", (40, 30), (9, 9, 9)))
    assert media_error(decode_image, data, MediaLimits(max_pixels=40 * 30 - 1)).code == "too_many_pixels"
    assert decode_image(data, MediaLimits(max_pixels=40 * 30)).shape == (30, 40, 3)


@pytest.mark.parametrize("size", [(1, 100_000), (100_000, 1)], ids=["tall", "wide"])
def test_extreme_aspect_ratio(size):
    data = image_bytes(solid("L", size, 0))
    assert media_error(decode_image, data, LIMITS).code == "bad_aspect_ratio"


def test_aspect_ratio_boundary():
    ok = image_bytes(solid("L", (400, 2), 0))  # exactly 200:1 is allowed
    assert decode_image(ok, LIMITS).shape == (2, 400, 3)
    bad = image_bytes(solid("L", (402, 2), 0))
    assert media_error(decode_image, bad, LIMITS).code == "bad_aspect_ratio"


def test_too_many_bytes():
    data = small_png()
    assert media_error(decode_image, data, MediaLimits(max_bytes=len(data) - 1)).code == "too_large"
    assert_rgb(decode_image(data, MediaLimits(max_bytes=len(data))))
    v = clip(8, 10)
    assert media_error(decode_video, v, CFG, MediaLimits(max_bytes=len(v) - 1)).code == "too_large"


@pytest.mark.parametrize("fmt", ["PPM", "ICO", "TGA", "PCX", "SGI", "QOI"])
def test_formats_pillow_opens_but_we_refuse(fmt):
    data = image_bytes(solid("RGB", (16, 16), (10, 20, 30)), fmt)
    assert Image.open(io.BytesIO(data)).format == fmt  # Pillow would happily decode it
    assert media_error(decode_image, data, LIMITS).code == "unsupported_format"


@pytest.mark.parametrize("item", [123, "abc", None, 1.5, ["nested"], {"a": 1}])
def test_encoder_bad_item_type(tiny, item):
    assert media_error(tiny.encode, [item]).code == "bad_input"


@pytest.mark.parametrize(
    "items",
    [
        "abc",
        "",
        123,
        None,
    ],
)
def test_encoder_bad_items_argument(tiny, items):
    assert media_error(tiny.encode, items).code == "bad_input"


def test_encoder_surfaces_media_errors(tiny):
    assert media_error(tiny.encode, [b""]).code == "empty"
    assert media_error(tiny.encode, [b"not an image at all"]).code == "unsupported_format"
    assert media_error(tiny.encode, [small_png()[:200]]).code == "corrupt"
    bomb = patch_png_size(image_bytes(solid("RGB", (8, 8), 0)), 100_000, 100_000)
    assert media_error(tiny.encode, [bomb]).code == "too_many_pixels"
    assert media_error(tiny.encode, [solid("RGB", (1, 500), 0)]).code == "bad_aspect_ratio"
    # a bad item anywhere fails the whole call with its code
    assert media_error(tiny.encode, [small_png(), b"\x00" * 64]).code == "unsupported_format"
    assert media_error(tiny.encode_file, b"").code == "empty"
    assert media_error(tiny.encode_file, GARBAGE_MP4).code in VIDEO_FAILURE_CODES
    assert media_error(tiny.encode_file, clip()[: len(clip()) // 2]).code in VIDEO_FAILURE_CODES


# --- 2. mode conversions -------------------------------------------------------------------------


def decode(img: Image.Image, fmt: str = "PNG", **kw) -> torch.Tensor:
    out = decode_image(image_bytes(img, fmt, **kw), LIMITS)
    assert_rgb(out)
    assert out.shape[:2] == (img.height, img.width)
    return out


def px(t: torch.Tensor, y: int, x: int) -> list[int]:
    return t[y, x].tolist()


def test_rgba_alpha_composited_over_white():
    a = np.zeros((4, 6, 4), np.uint8)
    a[..., 0] = 255  # hidden colour: red everywhere, alpha 0 ...
    a[0, 0] = (0, 0, 255, 255)  # ... except one opaque blue pixel
    a[1, 1] = (0, 0, 0, 128)  # half-transparent black
    a[2, 2] = (255, 0, 0, 128)  # half-transparent red
    img = Image.fromarray(a, "RGBA")
    for fmt, kw in [("PNG", {}), ("WEBP", {"lossless": True, "exact": True}), ("TIFF", {})]:
        out = decode(img, fmt, **kw)
        assert px(out, 3, 5) == [255, 255, 255], fmt  # transparent red -> white, no leak
        assert px(out, 0, 0) == [0, 0, 255], fmt
        assert all(abs(v - 128) <= 1 for v in px(out, 1, 1)), fmt
        r, g, b = px(out, 2, 2)
        assert r == 255 and abs(g - 128) <= 1 and abs(b - 128) <= 1, fmt


def test_la_alpha_composited_over_white():
    a = np.zeros((3, 3, 2), np.uint8)
    a[0, 0] = (0, 128)  # half-transparent black
    a[1, 1] = (40, 255)  # opaque dark grey
    a[2, 2] = (0, 0)  # fully transparent
    out = decode(Image.fromarray(a, "LA"))
    assert all(abs(v - 128) <= 1 for v in px(out, 0, 0))
    assert px(out, 1, 1) == [40, 40, 40]
    assert px(out, 2, 2) == [255, 255, 255]


def test_pa_and_rgba_premultiplied_in_memory():
    pa = Image.new("PA", (2, 2))
    pa.putpalette([200, 10, 10] + [0] * 765)
    pa.putdata([(0, 0), (0, 255), (0, 255), (0, 0)])
    out = image_to_rgb(pa, LIMITS)
    assert px(out, 0, 0) == [255, 255, 255] and px(out, 0, 1) == [200, 10, 10]
    out = image_to_rgb(Image.new("RGBa", (2, 2), (0, 0, 0, 0)), LIMITS)
    assert px(out, 1, 1) == [255, 255, 255]


def test_la_premultiplied_in_memory():
    out = image_to_rgb(Image.new("La", (2, 2), (0, 0)), LIMITS)
    assert px(out, 0, 0) == [255, 255, 255]


def _palette_image() -> Image.Image:
    img = Image.new("P", (4, 4), 0)
    img.putpalette([255, 0, 0, 0, 0, 255, 0, 200, 0] + [0] * (256 * 3 - 9))
    img.putpixel((1, 1), 1)
    img.putpixel((2, 2), 2)
    return img


@pytest.mark.parametrize("fmt", ["PNG", "GIF", "BMP", "TIFF"])
def test_palette_without_transparency(fmt):
    out = decode(_palette_image(), fmt)
    assert px(out, 0, 0) == [255, 0, 0]
    assert px(out, 1, 1) == [0, 0, 255]
    assert px(out, 2, 2) == [0, 200, 0]


@pytest.mark.parametrize("fmt", ["PNG", "GIF"])
def test_palette_with_transparency_index(fmt):
    data = image_bytes(_palette_image(), fmt, transparency=0)  # index 0 (red) is transparent
    assert "transparency" in Image.open(io.BytesIO(data)).info
    out = decode_image(data, LIMITS)
    assert px(out, 0, 0) == [255, 255, 255]  # hidden red does not leak
    assert px(out, 1, 1) == [0, 0, 255]
    assert px(out, 2, 2) == [0, 200, 0]


def test_palette_with_partial_alpha_png():
    img = _palette_image()
    data = image_bytes(img, "PNG", transparency=bytes([255, 0, 128]))  # per-index alpha (tRNS)
    out = decode_image(data, LIMITS)
    assert px(out, 0, 0) == [255, 0, 0]  # opaque red
    assert px(out, 1, 1) == [255, 255, 255]  # transparent blue
    r, g, b = px(out, 2, 2)  # half-transparent green over white
    assert abs(r - 127) <= 1 and abs(g - 227) <= 1 and abs(b - 127) <= 1


@pytest.mark.parametrize(
    ("img", "key"),
    [(Image.new("RGB", (4, 4), (255, 0, 0)), (255, 0, 0)), (Image.new("L", (4, 4), 10), 10)],
    ids=["RGB", "L"],
)
def test_colour_key_transparency(img, key):
    out = decode_image(image_bytes(img, "PNG", transparency=key), LIMITS)
    assert px(out, 0, 0) == [255, 255, 255]


@pytest.mark.parametrize(("fmt", "kw"), [("JPEG", {"quality": 95}), ("TIFF", {})])
def test_cmyk_matches_pillow(fmt, kw):
    data = image_bytes(natural_image(24, 16, seed=5).convert("CMYK"), fmt, **kw)
    opened = Image.open(io.BytesIO(data))
    assert opened.mode == "CMYK"
    expected = np.asarray(opened.convert("RGB"))
    out = decode_image(data, LIMITS)
    assert_rgb(out)
    assert np.array_equal(out.numpy(), expected)


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_16bit_greyscale_scaled_by_rounding(fmt):
    values = np.array([[65535, 0, 32896, 257, 128, 129]], dtype=np.uint16)
    data = image_bytes(Image.fromarray(values), fmt)
    assert Image.open(io.BytesIO(data)).mode.startswith("I;16")
    out = decode_image(data, LIMITS)
    assert_rgb(out)
    assert out[0, :, 0].tolist() == [255, 0, 128, 1, 0, 1]  # round(v * 255 / 65535)
    assert torch.equal(out[..., 0], out[..., 1]) and torch.equal(out[..., 0], out[..., 2])


def test_32bit_int_and_float_greyscale_in_memory():
    i32 = Image.fromarray(np.array([[65535, 0, 32896, 70_000, -5]], dtype=np.int32), "I")
    assert image_to_rgb(i32, LIMITS)[0, :, 1].tolist() == [255, 0, 128, 255, 0]
    f32 = Image.fromarray(np.array([[np.nan, -5.0, 300.0, 127.6, 0.4]], dtype=np.float32), "F")
    assert image_to_rgb(f32, LIMITS)[0, :, 2].tolist() == [0, 0, 255, 128, 0]


def test_32bit_int_tiff():
    data = image_bytes(Image.fromarray(np.array([[65535, 0, 32896]], dtype=np.int32), "I"), "TIFF")
    assert Image.open(io.BytesIO(data)).mode == "I"
    assert decode_image(data, LIMITS)[0, :, 0].tolist() == [255, 0, 128]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "BMP", "TIFF"])
def test_greyscale_becomes_three_equal_channels(fmt):
    grey = Image.fromarray(np.tile(np.arange(0, 256, 8, dtype=np.uint8), (4, 1)), "L")
    out = decode(grey, fmt)
    assert torch.equal(out[..., 0], out[..., 1]) and torch.equal(out[..., 0], out[..., 2])
    if fmt != "JPEG":
        assert np.array_equal(out[..., 0].numpy(), np.asarray(grey))


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "TIFF", "GIF"])
def test_one_bit_becomes_black_and_white(fmt):
    a = np.zeros((4, 8), bool)
    a[:, ::2] = True
    out = decode(Image.fromarray(a).convert("1"), fmt)
    assert set(out.unique().tolist()) == {0, 255}
    assert torch.equal(out[..., 0], out[..., 1]) and torch.equal(out[..., 0], out[..., 2])
    assert out[0, :, 0].tolist() == [255, 0] * 4


@pytest.mark.parametrize("mode", ["YCbCr", "HSV", "RGBX", "I;16B", "I;16L"])
def test_other_modes_in_memory_give_rgb(mode):
    out = image_to_rgb(Image.new(mode, (5, 3)), LIMITS)
    assert_rgb(out)
    assert out.shape == (3, 5, 3)


def test_output_is_a_fresh_writable_tensor():
    data = small_png()
    a, b = decode_image(data, LIMITS), decode_image(data, LIMITS)
    assert torch.equal(a, b)  # deterministic
    assert a.is_contiguous()
    a.zero_()  # writable, and shares no memory with the other result
    assert b.any()


# --- 3. EXIF orientation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("orientation", "shape", "corner"),
    [
        (1, (20, 40), (0, 0)),  # as stored
        (3, (20, 40), (-1, -1)),  # rotate 180
        (6, (40, 20), (0, -1)),  # rotate 90 CW: top-left goes top-right
        (8, (40, 20), (-1, 0)),  # rotate 90 CCW: top-left goes bottom-left
    ],
)
def test_exif_orientation_applied(orientation, shape, corner):
    img = Image.new("RGB", (40, 20), (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, 8, 8))  # red marks the stored top-left corner
    exif = img.getexif()
    exif[0x0112] = orientation
    data = image_bytes(img, "JPEG", exif=exif, quality=95)
    out = decode_image(data, LIMITS)
    assert_rgb(out)
    assert tuple(out.shape[:2]) == shape
    r, g, b = out[corner].tolist()
    assert r > 200 and g < 60 and b < 60, (orientation, out[corner])
    opposite = tuple(0 if c == -1 else -1 for c in corner)
    r, g, b = out[opposite].tolist()
    assert b > 200 and r < 60 and g < 60, (orientation, out[opposite])


def test_exif_orientation_png():
    img = Image.new("RGB", (30, 10), (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, 5, 5))
    exif = img.getexif()
    exif[0x0112] = 6
    out = decode_image(image_bytes(img, "PNG", exif=exif), LIMITS)
    assert out.shape == (30, 10, 3)
    assert px(out, 0, 9) == [255, 0, 0]


# --- 4. animated images use their first frame ----------------------------------------------------


COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]


@pytest.mark.parametrize(
    ("fmt", "kw"), [("GIF", {"duration": 100, "loop": 0}), ("PNG", {}), ("WEBP", {"lossless": True})]
)
def test_animated_first_frame(fmt, kw):
    frames = [Image.new("RGB", (8, 6), c) for c in COLOURS]
    data = image_bytes(frames[0], fmt, save_all=True, append_images=frames[1:], **kw)
    opened = Image.open(io.BytesIO(data))
    assert getattr(opened, "n_frames", 1) == 3
    out = decode_image(data, LIMITS)
    assert out.shape == (6, 8, 3)
    assert (out.reshape(-1, 3) == torch.tensor(COLOURS[0], dtype=torch.uint8)).all()
    opened.seek(2)  # even an image left on a later frame gives the first one
    assert px(image_to_rgb(opened, LIMITS), 0, 0) == list(COLOURS[0])


# --- 5. video ------------------------------------------------------------------------------------


def red_square_x(frame: torch.Tensor) -> int:
    """x of the 16-px red square that media_factory.video_bytes draws in rows 8..24."""
    f = frame.numpy().astype(int)[10:22]
    red = (f[..., 0] - (f[..., 1] + f[..., 2]) / 2).sum(0)
    return int(np.argmax(np.convolve(red, np.ones(16), "valid")))


def test_video_chunks_sampling_and_short_last_chunk():
    """A short last chunk keeps its real frames (t = 6 mod 4 = 2), as transformers' Kimi-K2.5 video
    processor passes it; it is not padded with repeats of its last frame."""
    chunks = decode_video(clip(30, 10), CFG, LIMITS)
    # 30 frames at 10 fps = 3 s; at 2 fps -> 6 sampled frames -> ceil(6 / 4) = 2 chunks
    assert len(chunks) == math.ceil(6 / 4) == 2
    assert_chunks(chunks)
    assert chunks[0].frames.shape == (4, 96, 160, 3)
    assert chunks[1].frames.shape == (2, 96, 160, 3)
    wanted = sample_indices(30, 10, 2)
    assert wanted == [0, 6, 12, 17, 23, 29]
    frames = torch.cat([c.frames for c in chunks])
    assert frames.shape[0] == len(wanted)
    xs = [red_square_x(f) for f in frames]
    assert all(abs(x - (i * 7) % 144) <= 2 for x, i in zip(xs, wanted, strict=True)), xs
    # timestamps: the chunk's first sampled frame index / the stream's rate, milliseconds truncated
    assert [c.timestamp for c in chunks] == [0 / 10, 23 / 10]
    assert chunks[0].timestamp_str == "00:00:00.000"
    assert chunks[1].timestamp_str == "00:00:02.299"  # 2.3 % 1 * 1000 = 299.99999999999983
    assert all(c.source_hash is None for c in chunks)


@pytest.mark.parametrize(("frames", "fps", "picked", "stamps"), [
    (25, 10, [0, 6, 12, 18, 24], ["00:00:00.000", "00:00:02.399"]),  # 24 / 10 = 2.4: 399.99.. ms, truncated
    (90, 30, [0, 18, 36, 53, 71, 89], ["00:00:00.000", "00:00:02.366"]),  # 71 / 30
    (7, 2, [0, 1, 2, 3, 4, 5, 6], ["00:00:00.000", "00:00:02.000"]),
    (61, 24, [0, 15, 30, 45, 60], ["00:00:00.000", "00:00:02.500"]),
])
def test_video_frames_and_stamps_are_the_released_processors(frames, fps, picked, stamps):
    """Kimi-K2.5's released processor, its rules written out here: n = max(round(N * min(2, fps) / fps), 1)
    frames at linspace(0, N - 1, n).round(); each chunk of 4 stamped with its first frame's index / fps,
    milliseconds truncated. The frames decoded are those (the red square's place names each frame)."""
    chunks = decode_video(clip(frames, fps), CFG, LIMITS)
    assert_frames(chunks, picked)
    assert [c.timestamp_str for c in chunks] == stamps


def assert_frames(chunks, picked: list[int]) -> None:
    """The chunks hold frames `picked`: video_bytes draws frame i's square at x = 7 i mod 144 (160 px wide)."""
    xs = [red_square_x(f) for c in chunks for f in c.frames]
    assert len(xs) == len(picked), (xs, picked)
    assert all(abs(x - i * 7 % 144) <= 2 for x, i in zip(xs, picked, strict=True)), (xs, picked)


def test_video_stamps_do_not_read_the_containers_clock():
    """A stream whose first frame is presented at 2.5 s is stamped from its frame indices, as the
    released processor does, not from the frames' own presentation times."""
    chunks = decode_video(video_bytes(160, 96, 25, 10, start=25), CFG, LIMITS)
    assert [c.timestamp_str for c in chunks] == ["00:00:00.000", "00:00:02.399"]
    assert_frames(chunks, [0, 6, 12, 18, 24])


def test_video_low_fps_keeps_native_rate():
    chunks = decode_video(clip(8, 1), CFG, LIMITS)  # 1 fps < 2 fps: every frame is kept
    assert len(chunks) == 2
    assert_chunks(chunks)
    frames = torch.cat([c.frames for c in chunks])
    xs = [red_square_x(f) for f in frames]
    assert all(abs(x - i * 7) <= 2 for i, x in enumerate(xs)), xs
    assert [c.timestamp for c in chunks] == [0.0, 4.0]

    chunks = decode_video(clip(5, 1), CFG, LIMITS)  # 5 frames -> chunks of 4 + 1
    assert [c.frames.shape[0] for c in chunks] == [4, 1]
    assert abs(red_square_x(chunks[1].frames[0]) - 4 * 7) <= 2  # the 5th frame itself


@pytest.mark.parametrize(("fmt", "codec"), [("matroska", "mpeg4"), ("webm", "libvpx"), ("avi", "mpeg4")])
def test_video_other_containers(fmt, codec):
    if codec not in av.codecs_available:
        pytest.skip(f"{codec} not available in this PyAV build")
    chunks = decode_video(clip(12, 10, fmt, codec, 64, 48), CFG, LIMITS)  # 1.2 s -> 2 sampled frames
    assert len(chunks) == 1
    assert_chunks(chunks)
    assert chunks[0].frames.shape[1:3] == (48, 64)


def test_video_chunk_size_follows_config():
    chunks = decode_video(clip(30, 10), PreprocessConfig(video_chunk_frames=2, video_fps=1.0), LIMITS)
    assert len(chunks) == 2  # 3 s at 1 fps -> 3 frames -> ceil(3 / 2)
    assert_chunks(chunks, k=2)
    assert [c.frames.shape[0] for c in chunks] == [2, 1]


def test_video_timestamps_increase():
    chunks = decode_video(clip(40, 10, w=64, h=48), CFG, LIMITS)  # 4 s -> 8 sampled -> 2 chunks
    stamps = [c.timestamp for c in chunks]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    strs = [c.timestamp_str for c in chunks]
    assert strs == sorted(strs)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "00:00:00.000"),
        (3725.5, "01:02:05.500"),
        (59.9996, "00:00:59.999"),  # truncated, never rounded up into the next second
        (0.001, "00:00:00.001"),
        (2.4, "00:00:02.399"),  # 2.4 % 1 * 1000 = 399.9999999999999
        (71 / 30, "00:00:02.366"),
        (86399.999, "23:59:59.998"),  # 998.9999999961583
        (360000.0, "04:00:00.000"),  # strftime's %H wraps at 24, as the released processor's does
    ],
)
def test_timestamp_str(seconds, text):
    chunk = VideoChunk(torch.zeros(1, 2, 2, 3, dtype=torch.uint8), seconds, 0)
    assert chunk.timestamp_str == text


@pytest.mark.parametrize(
    ("n", "native", "target", "expected"),
    [
        (30, 10, 2, [0, 6, 12, 17, 23, 29]),
        (5, 1, 2, [0, 1, 2, 3, 4]),
        (1, 30, 2, [0]),
        (3, 30, 2, [0]),  # 0.1 s clip: still one frame
        (0, 30, 2, []),
        (25, 10, 2, [0, 6, 12, 18, 24]),  # transformers 5.24's port takes [0, 5, 10, 15, 20]
        (90, 30, 2, [0, 18, 36, 53, 71, 89]),
        (10, 2, 2, list(range(10))),  # no rate: frame_rate gives the sampling rate, every frame
        (60, 30, 2, [0, 20, 39, 59]),  # 2 s -> 4 frames
        (61, 30, 2, [0, 20, 40, 60]),
        (7, 2, 2, list(range(7))),  # native == target: every frame
    ],
)
def test_sample_indices_cases(n, native, target, expected):
    assert sample_indices(n, native, target) == expected


@fuzz(200)
@given(
    n=st.integers(1, 5000),
    native=st.one_of(st.just(0.0), st.floats(0.05, 240)),
    target=st.floats(0.05, 30),
)
def test_sample_indices_properties(n, native, target):
    idx = sample_indices(n, native or target, target)
    fps = native or target  # a stream without a rate is taken at the sampling rate (media.frame_rate)
    count = max(round(n * min(target, fps) / fps), 1)  # the released processor's count
    assert len(idx) == count  # at least one, no duplicates lost
    assert idx == sorted(set(idx))
    assert idx[0] == 0 and 0 <= idx[-1] < n
    if count > 1:
        assert idx[-1] == n - 1  # first and last frames included
        step = (n - 1) / (count - 1)
        assert all(abs(j - i * step) <= 0.5 + 1e-9 for i, j in enumerate(idx))  # evenly spaced


def test_video_limits():
    v = clip(30, 10)
    assert media_error(decode_video, v, CFG, MediaLimits(max_video_frames=10)).code == "too_large"
    assert len(decode_video(v, CFG, MediaLimits(max_video_frames=30))) == 2
    assert media_error(decode_video, v, CFG, MediaLimits(max_video_seconds=2.5)).code == "too_large"
    assert media_error(decode_video, v, CFG, MediaLimits(max_pixels=160 * 96 - 1)).code == "too_many_pixels"
    assert media_error(decode_video, v, CFG, MediaLimits(max_aspect_ratio=1.5)).code == "bad_aspect_ratio"
    # the work counted is the 6 real sampled frames x 8 x 12 patches, not 8 frames padded to whole chunks
    assert len(decode_video(v, CFG, MediaLimits(max_video_patches=6 * 96))) == 2
    assert media_error(decode_video, v, CFG, MediaLimits(max_video_patches=6 * 96 - 1)).code == "too_large"


@pytest.mark.parametrize(
    "data",
    [
        GARBAGE_MP4,
        b"\x00\x00\x00\x18ftypmp42",
        b"\x1a\x45\xdf\xa3" + b"\x00" * 64,
        b"RIFF\x00\x00\x00\x00AVI LIST",
        b"not a video",
    ],
    ids=["garbage-mp4", "ftyp-only", "ebml-zeros", "avi-header", "text"],
)
def test_garbage_video(data):
    assert media_error(decode_video, data, CFG, LIMITS).code in VIDEO_FAILURE_CODES


@pytest.mark.parametrize("fmt", ["mp4", "matroska", "avi"])
@pytest.mark.parametrize("frac", [0.1, 0.5, 0.9])
def test_truncated_video(fmt, frac):
    data = clip(12, 10, fmt, "mpeg4", 64, 48)
    try:
        chunks = decode_video(data[: int(len(data) * frac)], CFG, LIMITS)
    except MediaError as e:
        assert e.code in VIDEO_FAILURE_CODES
    else:
        assert_chunks(chunks)  # a partial stream may still yield frames


def _audio_only(fmt: str, codec: str) -> bytes:
    if codec not in av.codecs_available:
        pytest.skip(f"{codec} not available in this PyAV build")
    buf = io.BytesIO()
    try:
        with av.open(buf, mode="w", format=fmt) as out:
            stream = out.add_stream(codec, rate=8000)
            stream.layout = "mono"
            ctx = stream.codec_context
            n = ctx.frame_size or 1024
            dtype = np.float32 if ctx.format.name.startswith("flt") else np.int16
            for i in range(3):
                frame = av.AudioFrame.from_ndarray(np.zeros((1, n), dtype), format=ctx.format.name, layout="mono")
                frame.sample_rate, frame.pts = 8000, i * n
                for packet in stream.encode(frame):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
    except av.FFmpegError as e:
        pytest.skip(f"cannot write {codec} in {fmt} here: {e}")
    return buf.getvalue()


@pytest.mark.parametrize(("fmt", "codec"), [("mp4", "aac"), ("wav", "pcm_s16le")])
def test_audio_only_container_has_no_frames(fmt, codec):
    data = _audio_only(fmt, codec)
    assert media_error(decode_video, data, CFG, LIMITS).code == "no_frames"


def test_audio_only_mp4_through_encoder(tiny):
    data = _audio_only("mp4", "aac")
    assert sniff_modality(data) == "video"
    assert media_error(tiny.encode_file, data).code == "no_frames"


def test_sniff_modality():
    for fmt, codec in [("mp4", "mpeg4"), ("mov", "mpeg4"), ("matroska", "mpeg4"), ("webm", "libvpx"), ("avi", "mpeg4")]:
        if codec in av.codecs_available:
            assert sniff_modality(clip(2, 10, fmt, codec, 32, 32)) == "video", fmt
    assert sniff_modality(GARBAGE_MP4) == "video"
    img = natural_image(16, 16)
    for fmt in ["PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP"]:  # WebP is RIFF too, but not AVI
        assert sniff_modality(image_bytes(img, fmt)) == "image", fmt
    assert sniff_modality(b"") == "image"
    assert sniff_modality(b"\x00\x00") == "image"


def test_encode_file_video(tiny):
    """6 sampled frames: a chunk of 4, then one of 2 whose grid carries its real t (as vLLM's grids do)
    and whose token count is the same (the merger averages over t)."""
    v = clip(30, 10)
    results = tiny.encode_file(v)
    assert [r.modality for r in results] == ["video", "video"]
    assert [r.timestamp for r in results] == ["00:00:00.000", "00:00:02.299"]
    assert results[0].mm_hash != results[1].mm_hash
    (t0, h, w), (t1, h1, w1) = results[0].grid_thw, results[1].grid_thw
    assert (t0, t1) == (4, 2) and (h1, w1) == (h, w) == (8, 12)
    assert results[0].num_tokens == results[1].num_tokens == h * w // 4 == results[1].embeds.shape[0]


def test_short_last_chunk_is_not_its_padded_version(tiny):
    """Encoding the real 2-frame chunk differs from encoding it padded to 4 (what the encoder did before):
    the frame mean and the time embedding see other frames."""
    last = decode_video(clip(30, 10), CFG, LIMITS)[1]
    padded = VideoChunk(torch.cat([last.frames, last.frames[-1:].expand(2, -1, -1, -1)]), last.timestamp, last.index)
    real, pad = tiny.encode([last, padded])
    assert real.grid_thw[0] == 2 and pad.grid_thw[0] == 4 and real.num_tokens == pad.num_tokens
    cos = torch.nn.functional.cosine_similarity(real.embeds.float(), pad.embeds.float(), dim=-1)
    assert cos.min() < 0.9999


# --- known crashes: non-MediaError exceptions escaping the decoders (deterministic repros) --------


def _tiff_with_empty_second_ifd() -> bytes:
    """A valid 1-page TIFF whose next-IFD pointer leads to an IFD with no entries."""
    data = image_bytes(Image.new("RGB", (8, 6), (0, 255, 0)), "TIFF")
    assert data[:4] == b"II*\x00"
    ifd = struct.unpack("<I", data[4:8])[0]
    entries = struct.unpack("<H", data[ifd : ifd + 2])[0]
    nxt = ifd + 2 + 12 * entries
    assert data[nxt : nxt + 4] == b"\x00\x00\x00\x00"
    return data[:nxt] + struct.pack("<I", len(data)) + data[nxt + 4 :] + struct.pack("<HI", 0, 0)


def _video_with_bad_utf8_metadata() -> bytes:
    v = clip(8, 10, "mp4", "mpeg4", 48, 32)
    i = v.find(b"Lavf")  # the encoder tag, read as container metadata
    assert i > 0
    return v[:i] + b"\xff" + v[i + 1 :]


def _avi_with_unknown_codec() -> bytes:
    v = clip(8, 10, "avi", "mpeg4", 48, 32)
    assert b"FMP4" in v
    return v.replace(b"FMP4", b"zzzz")


def _decodes_or_media_error_image(data: bytes) -> None:
    try:
        out = decode_image(data, LIMITS)
    except MediaError as e:
        assert e.code in MediaError.codes
    else:
        assert_rgb(out)


def _decodes_or_media_error_video(data: bytes) -> None:
    try:
        chunks = decode_video(data, CFG, LIMITS)
    except MediaError as e:
        assert e.code in MediaError.codes
    else:
        assert_chunks(chunks)


def test_tiff_with_broken_second_page():
    _decodes_or_media_error_image(_tiff_with_empty_second_ifd())


def test_video_with_invalid_utf8_metadata():
    _decodes_or_media_error_video(_video_with_bad_utf8_metadata())


def test_video_with_unknown_codec():
    _decodes_or_media_error_video(_avi_with_unknown_codec())


# --- 6. fuzzing ----------------------------------------------------------------------------------


@st.composite
def mutated(draw, seeds: dict[str, bytes], region=None):
    """A seed file with a few bytes overwritten, bit-flipped or spliced, maybe truncated.

    With `region` (data -> (lo, hi)) only bytes in [lo, hi) change and the length is kept.
    """
    name = draw(st.sampled_from(sorted(seeds)))
    data = bytearray(seeds[name])
    lo, hi = region(data) if region else (0, len(data))
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(lo, min(hi, len(data)) - 1))  # a splice may have shortened the data
        op = draw(st.sampled_from(["set", "flip"] if region else ["set", "flip", "splice"]))
        if op == "set":
            data[i] = draw(st.integers(0, 255))
        elif op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        else:
            data[i : i + draw(st.integers(0, 8))] = draw(st.binary(max_size=8))
    if not region and draw(st.booleans()):
        data = data[: draw(st.integers(1, len(data)))]
    return bytes(data)


@functools.cache
def image_seeds() -> dict[str, bytes]:
    nat = natural_image(24, 16, seed=11)
    exif = nat.getexif()
    exif[0x0112] = 6
    return {
        "png": image_bytes(nat),
        "png-rgba": image_bytes(nat.convert("RGBA")),
        "png-p": image_bytes(nat.convert("P"), transparency=0),
        "jpeg": image_bytes(nat, "JPEG", quality=80),
        "jpeg-exif": image_bytes(nat, "JPEG", exif=exif),
        "jpeg-progressive": image_bytes(nat, "JPEG", progressive=True),
        "gif": image_bytes(nat.convert("P"), "GIF"),
        "bmp": image_bytes(nat, "BMP"),
        "webp": image_bytes(nat, "WEBP"),
    }


@functools.cache
def video_seeds() -> dict[str, bytes]:
    return {"mp4": clip(12, 10, "mp4", "mpeg4", 48, 32), "mkv": clip(12, 10, "matroska", "mpeg4", 48, 32)}


@fuzz(300)
@given(data=st.binary(max_size=2048))
def test_fuzz_decode_image_arbitrary_bytes(data):
    _decodes_or_media_error_image(data)


@fuzz(400)
@given(data=mutated(image_seeds()))
def test_fuzz_decode_image_mutated(data):
    _decodes_or_media_error_image(data)


def _mp4_payload(data: bytearray) -> tuple[int, int]:
    off, size = mp4_boxes(bytes(data))[b"mdat"]
    return off + 8, off + size


@fuzz(150)
@given(data=mutated({"mp4": clip(12, 10, "mp4", "mpeg4", 48, 32)}, region=_mp4_payload))
def test_fuzz_decode_video_mutated_payload(data):
    """Damage in the coded frames: the decoder must refuse (or cope) with a MediaError only."""
    _decodes_or_media_error_video(data)


@fuzz(150)
@given(data=mutated(video_seeds()))
@example(data=_video_with_bad_utf8_metadata())
@example(data=_avi_with_unknown_codec())
def test_fuzz_decode_video_mutated_anywhere(data):
    _decodes_or_media_error_video(data)


# --- 7. the encoder survives all of the above -------------------------------------------------------


def test_encoder_still_works_after_failures(tiny: Encoder):
    for bad in ([b""], [GARBAGE_MP4], [small_png()[:100]], [123]):
        with pytest.raises(MediaError):
            tiny.encode(bad)
    with pytest.raises(MediaError):
        tiny.encode_file(GARBAGE_MP4)
    png = small_png()
    first = tiny.encode([png])
    assert len(first) == 1 and first[0].modality == "image"
    assert torch.isfinite(first[0].embeds).all()
    again = tiny.encode([png, png])
    assert len(again) == 2
    assert torch.allclose(again[0].embeds, first[0].embeds, atol=1e-5)
    assert again[0].mm_hash == again[1].mm_hash == first[0].mm_hash
