"""Decode untrusted media bytes into RGB uint8 tensors, refusing bad input with typed errors.

Images (Pillow): the header is checked (size, pixel count, aspect ratio) before any pixel is
decoded; EXIF orientation is applied; every mode becomes RGB deterministically:
- alpha (RGBA, LA, PA, premultiplied RGBa/La, palette alpha, PNG colour-key tRNS) is composited
  over opaque white, so what a viewer sees on a white page is what the model sees (transparent
  pixels' hidden RGB never leaks in);
- 16/32-bit greyscale (I;16*, I) is scaled to 8 bits by rounding v * 255 / 65535; float (F) is
  clipped to 0..255; CMYK, YCbCr, LAB, HSV use Pillow's conversion (ICC profiles are ignored);
- animated images (GIF, APNG, WebP) and multi-page TIFFs use their first frame (other frames are
  never scanned: counting 10^6 GIF frames costs seconds).
JPEGs are checked against what their header claims before decoding (`jpeg.py`), so data cut short
is refused (`corrupt`) instead of silently filled with grey by libjpeg.
What an item will cost is known before its pixels are decoded (`open_image`'s header, a video's
`probe_video`), so a caller can bound the total across requests before the work starts (the encode
worker's `encode_worker.admission`); this module bounds each item on its own.
Videos (PyAV): frames are chosen and chunks stamped as Kimi-K2.5's released processor does
(`sample_indices`, `chunk_timestamp`; README's video paragraph says where transformers' port
differs), in chunks of `chunk` frames; a short last chunk keeps its real frames (t < chunk), as transformers' Kimi-K2.5
video processor passes it and vLLM's grids count it: padding it with repeats of its last frame
gives the same token count but other embeddings (the frame mean and time embedding change). The
work a video asks for (sampled frames x patches per frame) is checked against
`max_video_patches` before decoding (`probe_video`); `iter_video` decodes chunk by chunk, so memory
does not grow with the video's length.
"""

from __future__ import annotations

import contextlib
import io
import time
import warnings
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from ..core.errors import MediaError
from ..core.spec import MediaLimits, PreprocessConfig
from .jpeg import vet_jpeg
from .preprocess import padded_grid, resize_target

if TYPE_CHECKING:  # PyAV loads lazily (image-only users never pay for it); its types are for mypy
    from av.container import InputContainer
    from av.video.stream import VideoStream

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
    timestamp: float  # seconds: the chunk's first sampled frame index / the stream's frame rate
    index: int  # chunk number within its video
    source_hash: str | None = None  # content hash of the whole video (mm_hash input)

    @property
    def timestamp_str(self) -> str:
        return format_timestamp(self.timestamp)


def format_timestamp(seconds: float) -> str:
    """A chunk's time as its prompt writes it, exactly as Kimi-K2.5's released processor does:
    `%H:%M:%S` of the whole seconds, then the milliseconds *truncated* from the float remainder,
    `int(t % 1 * 1000)` (2.4 s prints `00:00:02.399`, 71/30 s `00:00:02.366`). Every digit is prompt
    text, so rounding instead changes the model's answer. Hours wrap at 24 as the released
    `strftime` does (a video that long is refused by `max_video_seconds` first)."""
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}"


def chunk_timestamp(first_index: int, fps: float) -> float:
    """A chunk's time in seconds as the released processor computes it: its first sampled frame's
    index over the stream's average frame rate (`VideoPlan.fps`), not the frame's own container time
    (which differs for variable frame rates and streams that do not start at 0)."""
    return first_index / fps


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
    if img.format in ("JPEG", "MPO"):
        strict = vet_jpeg(data)
        if strict is not None:
            img = Image.open(io.BytesIO(strict))
    return img


def image_to_rgb(img: Image.Image, limits: MediaLimits) -> torch.Tensor:
    """Decode (first frame), orient and convert to [H, W, 3] uint8. See module doc for modes."""
    check_dimensions(*img.size, limits)
    try:
        if img.tell() != 0:  # never `n_frames`: it walks every frame of the file
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


def _sample_count(n_frames: int, fps: float, target_fps: float) -> int:
    """How many frames `sample_indices` picks, without building the list: the released processor's
    `max(round(N * min(target, fps) / fps), 1)` (never more than N: min(target, fps) / fps <= 1)."""
    if n_frames <= 0:
        return 0
    return max(round(n_frames * min(target_fps, fps) / fps), 1)


def sample_indices(n_frames: int, fps: float, target_fps: float) -> list[int]:
    """The frames Kimi-K2.5's released processor samples from N frames at `fps` (the stream's
    average rate, `VideoPlan.fps`): n = `_sample_count` indices `np.linspace(0, N - 1, n).round()`,
    first and last frame included. (transformers 5.24's `Kimi_K25VideoProcessor` differs: it takes
    `arange` steps and never the last frame, [0, 5, 10, 15, 20] of 25 frames at 10 fps.)"""
    n = _sample_count(n_frames, fps, target_fps)
    return np.linspace(0, n_frames - 1, n).round().astype(int).tolist() if n else []


def frame_rate(stream: VideoStream, target_fps: float) -> float:
    """The one clock of a video: the stream's average frame rate (FFmpeg's avg_frame_rate, what the
    released processor reads), else FFmpeg's guess from the container's timing, else, for a stream
    that states no rate at all, the sampling rate itself (every frame is then sampled, each
    1 / target_fps s after the last). It picks the frames (`sample_indices`) and stamps the
    chunks (`chunk_timestamp`)."""
    rate = stream.average_rate or stream.guessed_rate
    return float(rate) if rate and rate > 0 else float(target_fps)


def _check_video_work(sampled: int, width: int, height: int, cfg: PreprocessConfig, limits: MediaLimits,
                      patch: int) -> int:
    """The patches a video's sampled frames make (padded: an upper bound), refused above
    `max_video_patches`: that, not bytes or seconds, is what decoding and the forward cost."""
    if width <= 0 or height <= 0 or sampled <= 0:
        return 0
    gh, gw = padded_grid(*resize_target(width, height, cfg.in_patch_limit_each_frame, cfg, patch), patch)
    if sampled * gh * gw > limits.max_video_patches:
        raise MediaError("too_large", f"video needs {sampled} sampled frames ({width}x{height}) x {gh * gw} patches "
                                      f"= {sampled * gh * gw} patches; the limit is {limits.max_video_patches}")
    return sampled * gh * gw


def _header_checks(container: InputContainer, stream: VideoStream, fps: float, cfg: PreprocessConfig,
                   limits: MediaLimits, patch: int) -> None:
    """What the container declares (duration, frame count, size), refused before any demuxing.
    A header may lie the other way; the frame count from demuxing is checked again after."""
    width, height = stream.codec_context.width, stream.codec_context.height
    if width or height:
        check_dimensions(width, height, limits, "video")
    if stream.frames > limits.max_video_frames:
        raise MediaError("too_large", f"video declares {stream.frames} frames; at most {limits.max_video_frames}")
    if stream.duration and stream.time_base:
        seconds = float(stream.duration * stream.time_base)
    else:
        seconds = container.duration / 1e6 if container.duration else 0.0
    if seconds > limits.max_video_seconds:
        raise MediaError("too_large", f"video declares {seconds:.1f} s; at most {limits.max_video_seconds:g} s")
    if seconds > 0:
        n = min(round(seconds * fps), limits.max_video_frames)
        _check_video_work(_sample_count(n, fps, cfg.video_fps), width, height, cfg, limits, patch)


@dataclass(frozen=True)
class VideoPlan:
    """What decoding a video will cost, known before any frame is decoded (`probe_video`)."""

    wanted: tuple[int, ...]  # the sampled frame indices
    fps: float  # the stream's frame rate (`frame_rate`): picks the frames and stamps the chunks
    width: int
    height: int
    chunk_frames: int  # frames a chunk holds (the last may hold fewer)
    patches: int  # prepared patches of all its chunks (an upper bound)

    @property
    def decoding_pixels(self) -> int:
        """Pixels held at once while decoding: one chunk of frames."""
        return self.width * self.height * min(self.chunk_frames, len(self.wanted))


def decode_video(data: bytes, cfg: PreprocessConfig, limits: MediaLimits, source_hash: str | None = None,
                 patch_size: int = 14) -> list[VideoChunk]:
    """All chunks at once (holds every sampled frame: prefer `iter_video` for long videos)."""
    with contextlib.closing(iter_video(data, cfg, limits, source_hash, patch_size)) as chunks:
        return list(chunks)


@contextlib.contextmanager
def _opened(data: bytes, limits: MediaLimits) -> Iterator[tuple[InputContainer, VideoStream]]:
    """(container, its first video stream); a failure inside that is not ours is `corrupt`."""
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
        yield container, stream
    except MediaError:
        raise
    except Exception as e:  # FFmpegError, UnicodeDecodeError, ... from damaged containers
        raise MediaError("corrupt", f"video cannot be decoded: {e}") from None
    finally:
        container.close()


def probe_video(data: bytes, cfg: PreprocessConfig, limits: MediaLimits, patch_size: int = 14) -> VideoPlan:
    """Pass 1: the header's claims, then the frame count by demuxing only (cheap, no decode), both
    bounded by the limits; the frame size from the header (or, where it has none, the first frame)."""
    with _opened(data, limits) as (container, stream):
        fps = frame_rate(stream, cfg.video_fps)
        _header_checks(container, stream, fps, cfg, limits, patch_size)
        n_frames = 0
        for packet in container.demux(stream):
            if packet.size:
                n_frames += 1
                if n_frames > limits.max_video_frames:
                    raise MediaError("too_large", f"video has more than {limits.max_video_frames} frames")
        if n_frames / fps > limits.max_video_seconds:
            raise MediaError(
                "too_large", f"video is {n_frames / fps:.1f} s long; at most {limits.max_video_seconds:g} s"
            )
        wanted = sample_indices(n_frames, fps, cfg.video_fps)
        width, height = stream.codec_context.width, stream.codec_context.height
        if not (width and height) and wanted:
            container.seek(0)
            first = next(iter(container.decode(stream)), None)
            width, height = (first.width, first.height) if first is not None else (0, 0)
        if not wanted or not (width and height):
            raise MediaError("no_frames", "the video has no decodable frames")
        check_dimensions(width, height, limits, "video")
        patches = _check_video_work(len(wanted), width, height, cfg, limits, patch_size)
        return VideoPlan(tuple(wanted), fps, width, height, cfg.video_chunk_frames, patches)


def iter_video(data: bytes, cfg: PreprocessConfig, limits: MediaLimits, source_hash: str | None = None,
               patch_size: int = 14, plan: VideoPlan | None = None) -> Generator[VideoChunk, None, None]:
    """Decode, sample and yield one chunk at a time: at most one chunk's frames are held here.
    `plan`: what `probe_video` found for these bytes, when the caller has it already."""
    plan = plan or probe_video(data, cfg, limits, patch_size)
    with _opened(data, limits) as (container, stream):
        yield from _decode_chunks(container, stream, plan, cfg, limits, source_hash, patch_size)


def _decode_chunks(container: InputContainer, stream: VideoStream, plan: VideoPlan, cfg: PreprocessConfig,
                   limits: MediaLimits, source_hash: str | None, patch: int) -> Generator[VideoChunk, None, None]:
    """Pass 2: decode, convert only the sampled frames, and yield every `k` of them as a chunk (the
    last one with what is left: 1 to k frames). Frames larger than the plan are refused: what was
    reserved for them would not hold them."""
    k, wanted, last = plan.chunk_frames, set(plan.wanted), plan.wanted[-1]
    container.seek(0)
    part: list[torch.Tensor] = []
    size = None
    first = index = 0
    for i, frame in enumerate(container.decode(stream)):
        if i > last:
            break
        if i not in wanted:
            continue
        check_dimensions(frame.width, frame.height, limits, "video frame")
        if size is None:  # the real frame size (the header's may be absent or wrong)
            if frame.width * frame.height > plan.width * plan.height:
                raise MediaError("corrupt", f"video frames are {frame.width}x{frame.height}, larger than the "
                                            f"{plan.width}x{plan.height} its header declares")
            _check_video_work(len(wanted), frame.width, frame.height, cfg, limits, patch)
            size = (frame.height, frame.width)
        elif (frame.height, frame.width) != size:
            raise MediaError("corrupt", "video frames change size mid-stream")
        first = i if not part else first
        part.append(torch.from_numpy(frame.to_ndarray(format="rgb24")))
        if len(part) == k:
            yield VideoChunk(torch.stack(part), chunk_timestamp(first, plan.fps), index, source_hash)
            part, index = [], index + 1
    if part:
        yield VideoChunk(torch.stack(part), chunk_timestamp(first, plan.fps), index, source_hash)
        index += 1
    if index == 0:
        raise MediaError("no_frames", "the video has no decodable frames")
