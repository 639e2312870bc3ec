"""`EncodeSteps`: a loaded model and its preprocessing, run one step at a time.

One item's way through it, each step done once and its result passed down:
`identify` (sniff the modality, hash what the model will see) -> `plan` (what the item will cost,
from its header: every per-item limit is checked here) -> `decode` (decode and preprocess, on the
model's device) -> `forward` (packs items into passes of at most `batch_max_patches` patches;
block-diagonal attention keeps them independent). The encode worker runs the steps on separate
executors (encode_worker/pipeline.py, batcher.py); the library's `Encoder` runs them in a row. On
CUDA each batch's output is copied to pinned host memory on a side stream, so the next forward is
not blocked by the copy.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from ..core.errors import MediaError
from ..core.spec import Grid, MediaLimits, ModelSpec, PreprocessConfig, tokens_for_grid
from ..core.timing import ms_since
from . import media
from .checkpoint import VisionModel
from .hashing import content_hash, mm_hash
from .media import VideoChunk, VideoPlan
from .preprocess import frame_grid, preprocess_frames

# Patches per forward pass, the one batch cap (the worker's --batch-max-patches): 8192 keeps a
# full-HD image (~10.8k patches) alone in its pass, so one big item never waits behind others.
BATCH_MAX_PATCHES = 8192
# Processor identities kept per encoder: requests may name any processor settings (each distinct
# `video_fps` is a new key), so an unbounded table grows with traffic. LRU, thread-safe.
IDENTITY_CACHE_SIZE = 64


@dataclass
class Plan:
    """One media item before any pixel is decoded: what it will cost (`pixels` decoded at once,
    `patches` prepared for the forward), so a caller can reserve both before the work starts."""

    modality: str
    mm_hash: str
    pixels: int
    patches: int
    plan_ms: float
    image: Image.Image | None = None  # opened, header checked; pixels not decoded
    video: VideoPlan | None = None


@dataclass
class Prepared:
    """One image or video chunk, preprocessed and ready for a forward pass."""

    pixel_values: torch.Tensor
    grid: Grid
    mm_hash: str
    modality: str
    timestamp: str | None
    timings_ms: dict[str, float]

    @property
    def num_patches(self) -> int:
        return int(self.pixel_values.shape[0])

    @property
    def num_tokens(self) -> int:
        return tokens_for_grid(self.grid)


class EncodeSteps:
    """A loaded model plus its preprocessing; thread-compatible, not thread-safe."""

    def __init__(
        self,
        spec: ModelSpec,
        model: VisionModel,
        *,
        device: torch.device,
        dtype: torch.dtype,
        limits: MediaLimits | None = None,
        batch_max_patches: int = BATCH_MAX_PATCHES,
    ):
        if batch_max_patches < 1:
            raise ValueError("batch_max_patches must be at least 1")
        self.spec = spec
        self.model = model
        self.device = device
        self.dtype = dtype
        self.limits = limits or MediaLimits()
        self.batch_max_patches = batch_max_patches
        self._identity = functools.lru_cache(maxsize=IDENTITY_CACHE_SIZE)(spec.identity)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def configured(self, *, limits: MediaLimits | None = None,
                   batch_max_patches: int | None = None) -> EncodeSteps:
        """These steps (the same weights, not a copy of them) with other limits or batch cap."""
        if (limits is None or limits == self.limits) and batch_max_patches in (None, self.batch_max_patches):
            return self
        other = copy.copy(self)
        other.limits = limits or self.limits
        other.batch_max_patches = batch_max_patches or self.batch_max_patches
        return other

    def identity(self, processor: PreprocessConfig | None = None) -> bytes:
        return self._identity(processor or self.spec.preprocess)

    # --- identify, plan, decode: CPU work, no model state ---------------------------------------

    def identify(self, data: bytes, processor: PreprocessConfig | None = None) -> tuple[str, str]:
        """(modality, mm_hash) of image or video bytes: the one place either is computed."""
        modality = media.sniff_modality(data)
        return modality, mm_hash(self.identity(processor), modality, data)

    def plan(self, data: bytes, processor: PreprocessConfig | None = None, *,
             identified: tuple[str, str] | None = None) -> Plan:
        """What decoding these bytes will cost, from the image header or the video container (no
        pixel decoded): every per-item limit is checked here. `identified` is what `identify`
        returned for these bytes, when the caller has it already."""
        t0 = time.perf_counter()
        cfg = processor or self.spec.preprocess
        modality, h = identified or self.identify(data, cfg)
        patch = self.spec.tower.patch_size
        if modality == "video":
            video = media.probe_video(bytes(data), cfg, self.limits, patch)
            return Plan(modality, h, video.decoding_pixels, video.patches, ms_since(t0), video=video)
        img = media.open_image(bytes(data), self.limits)
        gh, gw = frame_grid(*img.size, cfg, patch)  # a size the policy refuses, before decoding
        return Plan(modality, h, img.size[0] * img.size[1], gh * gw, ms_since(t0), image=img)

    def decode(self, data: bytes, plan: Plan, processor: PreprocessConfig | None = None) -> list[Prepared]:
        """Decode and preprocess what `plan` describes: one Prepared per image or per video chunk
        (CPU-pool work; the caller reserved its cost)."""
        cfg = processor or self.spec.preprocess
        if plan.image is not None:
            t0 = time.perf_counter()
            rgb = media.image_to_rgb(plan.image, self.limits)
            return [self.preprocess_rgb(rgb, cfg, plan.mm_hash, "image", None, plan.plan_ms + ms_since(t0))]
        # Chunk by chunk: each is preprocessed as soon as it is decoded, so what is held at once is
        # one chunk's RGB frames plus the (smaller, or on-device) pixel_values prepared so far.
        prepared: list[Prepared] = []
        decode_ms = plan.plan_ms
        chunks = media.iter_video(bytes(data), cfg, self.limits, plan.mm_hash, self.spec.tower.patch_size, plan.video)
        with contextlib.closing(chunks):
            while True:
                t0 = time.perf_counter()
                chunk = next(chunks, None)
                decode_ms += ms_since(t0)
                if chunk is None:
                    break
                prepared.append(self.preprocess_chunk(chunk, cfg))
                del chunk
        for p in prepared:
            p.timings_ms["decode"] += decode_ms / len(prepared)  # the video's decode time, split over its chunks
        return prepared

    def preprocess_chunk(self, chunk: VideoChunk, cfg: PreprocessConfig) -> Prepared:
        """One decoded video chunk (checked: uint8 frames [t, H, W, 3], t within the tower's table)."""
        t0 = time.perf_counter()
        frames = chunk.frames
        if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
            raise MediaError("bad_input", "a VideoChunk needs uint8 frames [t, H, W, 3]")
        if not 1 <= frames.shape[0] <= self.spec.tower.pos_emb_time:
            raise MediaError("bad_input", f"a video chunk has 1 to {self.spec.tower.pos_emb_time} frames")
        media.check_dimensions(frames.shape[2], frames.shape[1], self.limits, "video frame")
        source = chunk.source_hash or content_hash(frames.contiguous().numpy().tobytes())
        h = mm_hash(self.identity(cfg), "video", source.encode(), chunk=chunk.index)
        return self.preprocess_rgb(frames, cfg, h, "video", chunk.timestamp_str, ms_since(t0))

    def preprocess_rgb(self, rgb: torch.Tensor, cfg: PreprocessConfig, h: str, modality: str,
                       timestamp: str | None, decode_ms: float) -> Prepared:
        """Decoded uint8 RGB (an image [H, W, 3] or frames [t, H, W, 3]) -> a timed Prepared."""
        t0 = time.perf_counter()
        pixel_values, grid = self.patchify(rgb, cfg, video=modality == "video")
        return Prepared(pixel_values, grid, h, modality, timestamp, {"decode": decode_ms, "preprocess": ms_since(t0)})

    def patchify(self, rgb: torch.Tensor, cfg: PreprocessConfig, *, video: bool) -> tuple[torch.Tensor, Grid]:
        """Resize, normalise and cut into patches, on the model's device and in its dtype."""
        return preprocess_frames(
            rgb, cfg, self.spec.tower.patch_size, video=video, device=self.device, dtype=self.dtype
        )

    # --- forward: device work -------------------------------------------------------------------

    def forward(self, prepared: Sequence[Prepared]) -> tuple[list[torch.Tensor], float]:
        """Forward passes of at most `batch_max_patches` patches each (in inference mode).

        Returns one host tensor [num_tokens, out_dim] per item (input order) and the forward time
        in ms. On CUDA the copies to pinned memory run on a side stream, overlapping the next batch.
        """
        t0 = time.perf_counter()
        with torch.inference_mode():
            pending: list[tuple[list[Prepared], torch.Tensor, torch.cuda.Event | None]] = []
            for batch in self._batches(list(prepared)):
                pixels = batch[0].pixel_values if len(batch) == 1 else torch.cat([p.pixel_values for p in batch])
                out = self.model(pixels, [p.grid for p in batch])
                pending.append((batch, *self._to_host(out)))
            outputs: list[torch.Tensor] = []
            for batch, host, event in pending:
                if event is not None:
                    event.synchronize()
                outputs.extend(host.split([p.num_tokens for p in batch]))
        return outputs, ms_since(t0)

    def _batches(self, prepared: list[Prepared]) -> list[list[Prepared]]:
        """Greedy packing in input order; an item larger than the cap goes alone."""
        batches: list[list[Prepared]] = []
        size = 0
        for p in prepared:
            if batches and size + p.num_patches <= self.batch_max_patches:
                batches[-1].append(p)
                size += p.num_patches
            else:
                batches.append([p])
                size = p.num_patches
        return batches

    def _to_host(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if self._copy_stream is None:
            return out, None
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            host.copy_(out, non_blocking=True)
            out.record_stream(self._copy_stream)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        return host, event
