"""Decode untrusted media bytes into RGB uint8 tensors, refusing bad input with typed errors.

Images (Pillow): the header is checked (size, pixel count, aspect ratio) before any pixel is
decoded; EXIF orientation is applied; every mode becomes RGB deterministically:
- alpha (RGBA, LA, PA, premultiplied RGBa/La, palette alpha, PNG colour-key tRNS) is composited
  over opaque white, so what a viewer sees on a white page is what the model sees (transparent
  pixels' hidden RGB never leaks in);
- 16/32-bit greyscale (I;16*, I) is scaled to 8 bits by rounding v * 255 / 65535; float (F) is
  clipped to 0..255; CMYK, YCbCr, LAB, HSV use Pillow's conversion (ICC profiles are ignored);
- animated images (GIF, APNG, WebP) use their first frame.
Videos (PyAV): sampled at min(fps, native fps) with evenly spaced frame indices, cut into chunks
of `chunk` frames; a short last chunk repeats its last frame so every chunk has t = chunk.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from ..core.errors import MediaError
from ..core.spec import MediaLimits, PreprocessConfig

# Pillow warns on damaged metadata (corrupt EXIF, ...) and on large images; we either raise a
# MediaError or carry on, so these warnings are noise in service logs. Filtered once, process-wide:
# `warnings.catch_warnings` per call is not thread-safe, and decoding runs in thread pools.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")

IMAGE_FORMATS = frozenset({"JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "MPO"})


@dataclass
class VideoChunk:
    """A decoded video chunk: one encoder item with t = frames.shape[0]."""

    frames: torch.Tensor  # [t, H, W, 3] uint8
    timestamp: float  # seconds, of the first frame
    index: int  # chunk number within its video
    source_hash: str | None = None  # content hash of the whole video (mm_hash input)

    @property
    def timestamp_str(self) -> str:
        ms = round(self.timestamp * 1000)
        return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}.{ms % 1000:03d}"


def check_dimensions(width: int, height: int, limits: MediaLimits, what: str = "image") -> None:
    if width <= 0 or height <= 0:
        raise MediaError("empty", f"{what} has a zero-size dimension ({width}x{height})")
    if width * height > limits.max_pixels:
        raise MediaError(
            "too_many_pixels",
            f"{what} is {width}x{height} = {width * height} pixels; the limit is {limits.max_pixels}",
        )
    ratio = max(width, height) / min(width, height)
    if ratio > limits.max_aspect_ratio:
        raise MediaError(
            "bad_aspect_ratio",
            f"{what} is {width}x{height} (aspect ratio {ratio:.0f}:1); at most {limits.max_aspect_ratio:g}:1",
        )


def _check_size(data: bytes, limits: MediaLimits) -> None:
    if not data:
        raise MediaError("empty", "media is empty (0 bytes)")
    if len(data) > limits.max_bytes:
        raise MediaError("too_large", f"media is {len(data)} bytes; the limit is {limits.max_bytes}")


def open_image(data: bytes, limits: MediaLimits) -> Image.Image:
    """Open (header only) and vet an image; pixels are not decoded yet."""
    _check_size(data, limits)
    try:
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise MediaError("too_many_pixels", str(e)) from None
    except UnidentifiedImageError:
        msg = "not a recognised image format (JPEG, PNG, WebP, GIF, BMP, TIFF)"
        raise MediaError("unsupported_format", msg) from None
    except Exception as e:  # Pillow's plugins raise many types on malformed headers
        raise MediaError("corrupt", f"image header cannot be read: {e}") from None
    if img.format not in IMAGE_FORMATS:
        raise MediaError("unsupported_format", f"image format {img.format} is not accepted")
    check_dimensions(*img.size, limits)
    return img


def image_to_rgb(img: Image.Image, limits: MediaLimits) -> torch.Tensor:
    """Decode (first frame), orient and convert to [H, W, 3] uint8. See module doc for modes."""
    check_dimensions(*img.size, limits)
    try:
        if getattr(img, "n_frames", 1) > 1:
            img.seek(0)
        img.load()
        img = ImageOps.exif_transpose(img)
        rgb = _to_rgb(img)
    except MediaError:
        raise
    except Image.DecompressionBombError as e:
        raise MediaError("too_many_pixels", str(e)) from None
    except Exception as e:  # OSError, SyntaxError, TypeError, ... depending on the plugin
        raise MediaError("corrupt", f"image data cannot be decoded (truncated or damaged?): {e}") from None
    return torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy())


def decode_image(data: bytes, limits: MediaLimits) -> torch.Tensor:
    return image_to_rgb(open_image(data, limits), limits)


def _over_white(rgba: Image.Image) -> Image.Image:
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def _to_rgb(img: Image.Image) -> Image.Image:
    mode = img.mode
    if mode in ("RGBa", "La"):  # premultiplied: colour + (1 - alpha) * white
        a = np.asarray(img).astype(np.int32)
        alpha = a[..., -1:]
        rgb = a[..., :-1] + ((255 - alpha) * 255 + 127) // 255
        rgb = np.clip(rgb, 0, 255).astype(np.uint8)
        return Image.fromarray(np.repeat(rgb, 3, axis=-1) if mode == "La" else rgb, "RGB")
    if "transparency" in img.info and mode in ("P", "RGB", "L", "1", "I", "I;16"):
        return _over_white(img.convert("RGBA"))  # palette alpha or a colour key (PNG tRNS)
    if mode == "RGB":
        return img
    if mode == "P":
        return img.convert("RGB")
    if mode in ("RGBA", "LA", "PA"):
        return _over_white(img.convert("RGBA"))
    if mode.startswith("I;16") or mode == "I":
        a = np.asarray(img).astype(np.int64)
        a = (np.clip(a, 0, 65535) * 255 + 32767) // 65535
        return Image.fromarray(a.astype(np.uint8), "L").convert("RGB")
    if mode == "F":
        a = np.clip(np.nan_to_num(np.asarray(img, dtype=np.float32)), 0, 255)
        return Image.fromarray(np.rint(a).astype(np.uint8), "L").convert("RGB")
    return img.convert("RGB")


# --- video -----------------------------------------------------------------------------------

# Container signatures we sniff to route bytes to the video decoder.
_VIDEO_MAGIC = (
    (4, b"ftyp"),  # MP4 / MOV / 3GP
    (0, b"\x1a\x45\xdf\xa3"),  # Matroska / WebM
    (0, b"\x00\x00\x01\xba"),  # MPEG-PS
    (0, b"FLV"),
    (0, b"OggS"),
)


def sniff_modality(data: bytes) -> str:
    """'video' for known container signatures (and AVI), else 'image'."""
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "video"
    for offset, magic in _VIDEO_MAGIC:
        if data[offset : offset + len(magic)] == magic:
            return "video"
    return "image"


def sample_indices(n_frames: int, native_fps: float, target_fps: float) -> list[int]:
    """Evenly spaced indices at min(target, native) fps over n_frames; at least one."""
    if n_frames <= 0:
        return []
    fps = min(target_fps, native_fps) if native_fps > 0 else target_fps
    duration = n_frames / native_fps if native_fps > 0 else n_frames / target_fps
    n = max(1, min(n_frames, round(duration * fps)))
    if n == 1:
        return [0]
    return sorted({round(i * (n_frames - 1) / (n - 1)) for i in range(n)})


def decode_video(
    data: bytes, cfg: PreprocessConfig, limits: MediaLimits, source_hash: str | None = None
) -> list[VideoChunk]:
    import av  # imported lazily: image-only users never pay for it

    _check_size(data, limits)
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="replace")
    except (av.FFmpegError, UnicodeDecodeError, ValueError) as e:
        raise MediaError("unsupported_format", f"not a decodable video container: {e}") from None
    try:
        if not container.streams.video:
            raise MediaError("no_frames", "the container has no video stream")
        stream = container.streams.video[0]
        if stream.codec_context is None:
            raise MediaError("unsupported_format", f"video codec {stream.codec_tag!r} is not supported")
        check_dimensions(stream.codec_context.width or 1, stream.codec_context.height or 1, limits, "video")
        rate = stream.average_rate or stream.guessed_rate
        native_fps = float(rate) if rate else 0.0
        # Pass 1: count frames by demuxing only (cheap, no decode), bounded by the limits.
        n_frames = 0
        for packet in container.demux(stream):
            if packet.size:
                n_frames += 1
                if n_frames > limits.max_video_frames:
                    raise MediaError("too_large", f"video has more than {limits.max_video_frames} frames")
        if native_fps > 0 and n_frames / native_fps > limits.max_video_seconds:
            raise MediaError(
                "too_large", f"video is {n_frames / native_fps:.1f} s long; at most {limits.max_video_seconds:g} s"
            )
        wanted = set(sample_indices(n_frames, native_fps, cfg.video_fps))
        # Pass 2: decode, converting only the sampled frames.
        container.seek(0)
        frames, stamps = [], []
        for i, frame in enumerate(container.decode(stream)):
            if i > max(wanted, default=-1):
                break
            if i in wanted:
                check_dimensions(frame.width, frame.height, limits, "video frame")
                frames.append(torch.from_numpy(frame.to_ndarray(format="rgb24")))
                t = frame.time if frame.time is not None else (i / native_fps if native_fps else 0.0)
                stamps.append(float(t))
    except MediaError:
        raise
    except Exception as e:  # FFmpegError, UnicodeDecodeError, ... from damaged containers
        raise MediaError("corrupt", f"video cannot be decoded: {e}") from None
    finally:
        container.close()
    if not frames:
        raise MediaError("no_frames", "the video has no decodable frames")
    if any(f.shape != frames[0].shape for f in frames):
        raise MediaError("corrupt", "video frames change size mid-stream")
    t0 = stamps[0]
    chunks = []
    k = cfg.video_chunk_frames
    for c in range(math.ceil(len(frames) / k)):
        part = frames[c * k : (c + 1) * k]
        part += [part[-1]] * (k - len(part))
        chunks.append(VideoChunk(torch.stack(part), stamps[c * k] - t0, c, source_hash))
    return chunks
