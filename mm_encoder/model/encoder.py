"""`Encoder`: media items -> LLM-space embeddings, with mm_hash and a timing breakdown.

One item's way through it, each step done once and its result passed down:
`identify` (sniff the modality, hash what the model will see) -> `prepare_media` (decode and
preprocess, on the model's device) -> `forward` (packs items into passes of at most
`batch_max_patches` patches; block-diagonal attention keeps them independent) -> `finish` (one
result per image or video chunk). `encode` and `encode_file` run all of it; the encode worker runs
the steps on separate executors. On CUDA each batch's output is copied to pinned host memory on a
side stream, so the next forward is not blocked by the copy.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

from ..core.errors import MediaError
from ..core.registry import DEFAULT_MODEL, get_spec
from ..core.spec import Grid, MediaLimits, ModelSpec, PreprocessConfig, tokens_for_grid
from ..core.timing import ms_since
from . import media
from .checkpoint import LoadReport, VisionModel, build_empty, init_random, load_checkpoint, spec_for_checkpoint
from .hashing import content_hash, mm_hash
from .media import VideoChunk, VideoPlan
from .preprocess import frame_grid, preprocess_frames

log = logging.getLogger(__name__)

Item = bytes | bytearray | memoryview | Image.Image | VideoChunk
# Patches per forward pass, the one batch cap (the worker's --batch-max-patches): 8192 keeps a
# full-HD image (~10.8k patches) alone in its pass, so one big item never waits behind others.
BATCH_MAX_PATCHES = 8192
# Processor identities kept per encoder: requests may name any processor settings (each distinct
# `video_fps` is a new key), so an unbounded table grows with traffic. LRU, thread-safe.
IDENTITY_CACHE_SIZE = 64


@dataclass
class EncodedMedia:
    embeds: torch.Tensor  # [num_tokens, d_text]
    grid_thw: Grid  # (t, h, w) in patches, before merging
    num_tokens: int
    mm_hash: str
    modality: str = "image"
    timestamp: str | None = None  # video chunks: hh:mm:ss.fff of the first frame
    timings_ms: dict[str, float] = field(default_factory=dict)


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
        return self.pixel_values.shape[0]

    @property
    def num_tokens(self) -> int:
        return tokens_for_grid(self.grid)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA, and on CPUs with native bf16 matmuls (AVX-512 BF16 or AMX: 1.4-2.9x faster than
    fp32 on the full-width tower at per-token cosine 0.99994, BENCHMARKS.md); fp32 elsewhere, where
    bf16 is emulated and slower."""
    native = device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())
    return torch.bfloat16 if native else torch.float32


@functools.cache
def cpu_has_native_bf16() -> bool:
    """The CPU's own flags (Linux /proc/cpuinfo): `avx512_bf16` or `amx_bf16`. torch reports only
    its kernels' ISA level, which says AVX-512 on CPUs that emulate bf16."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class Encoder:
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
        load_report: LoadReport | None = None,
    ):
        if batch_max_patches < 1:
            raise ValueError("batch_max_patches must be at least 1")
        self.spec = spec
        self.model = model
        self.device = device
        self.dtype = dtype
        self.limits = limits or MediaLimits()
        self.batch_max_patches = batch_max_patches
        self.load_report = load_report
        self._identity = functools.lru_cache(maxsize=IDENTITY_CACHE_SIZE)(spec.identity)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # --- construction -----------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str | Path = DEFAULT_MODEL,
        *,
        checkpoint: str | Path | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        seed: int | None = None,
        **kwargs,
    ) -> Encoder:
        """A registry name (random weights unless `checkpoint`), or a checkpoint directory.

        A directory's `config.json` (`model_type`) picks the registry entry that supplies the
        preprocessing and prompt; its `vision_config` gives the tower and projector shapes.
        `kwargs` go to the constructor (`limits`, `batch_max_patches`).
        """
        dev = torch.device(device) if device is not None else default_device()
        dt = parse_dtype(dtype) if dtype is not None else default_dtype(dev)
        path = Path(path_or_name)
        if checkpoint is None and path.is_dir():
            checkpoint, spec = path, None
        else:
            spec = get_spec(str(path_or_name))
        if checkpoint is not None:
            spec = spec_for_checkpoint(Path(checkpoint), spec)
        elif seed is not None:
            spec = spec.model_copy(update={"seed": seed, "revision": f"{spec.revision}-seed{seed}"})
        model = build_empty(spec)
        report = None
        t0 = time.perf_counter()
        if checkpoint is not None:
            report = load_checkpoint(model, Path(checkpoint), dev, dt)
            model.eval()
        else:
            init_random(model, spec.seed, dev, dt)
            log.warning(
                "model %s: no checkpoint given, using deterministic RANDOM weights (seed %d); "
                "embeddings are meaningless to a real LLM",
                spec.name,
                spec.seed,
            )
        log.info("model %s ready on %s/%s in %.0f ms", spec.name, dev, str(dt).removeprefix("torch."), ms_since(t0))
        return cls(spec, model, device=dev, dtype=dt, load_report=report, **kwargs)

    @classmethod
    def without_weights(cls, checkpoint: str | Path, *, device: str | torch.device | None = None,
                        dtype: str | torch.dtype | None = None, **kwargs) -> Encoder:
        """A checkpoint's preprocessing, identity and limits with no weights read (the model stays on
        the meta device, so `forward` cannot run): for a process whose vision tower is another's,
        as the aggregated engine runs the model's own."""
        dev = torch.device(device) if device is not None else default_device()
        dt = parse_dtype(dtype) if dtype is not None else default_dtype(dev)
        spec = spec_for_checkpoint(Path(checkpoint), None)
        return cls(spec, build_empty(spec), device=dev, dtype=dt, **kwargs)

    def configured(self, *, limits: MediaLimits | None = None, batch_max_patches: int | None = None) -> Encoder:
        """This encoder (the same weights, not a copy of them) with other limits or batch cap."""
        if (limits is None or limits == self.limits) and batch_max_patches in (None, self.batch_max_patches):
            return self
        other = copy.copy(self)
        other.limits = limits or self.limits
        other.batch_max_patches = batch_max_patches or self.batch_max_patches
        return other

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def out_dim(self) -> int:
        return self.spec.projector.out_dim

    def identity(self, processor: PreprocessConfig | None = None) -> bytes:
        return self._identity(processor or self.spec.preprocess)

    # --- what an item is ----------------------------------------------------------------------

    def identify(self, data: bytes, processor: PreprocessConfig | None = None) -> tuple[str, str]:
        """(modality, mm_hash) of image or video bytes: the one place either is computed."""
        modality = media.sniff_modality(data)
        return modality, mm_hash(self.identity(processor), modality, data)

    # --- preprocessing ----------------------------------------------------------------------

    def preprocess(
        self, image: bytes | Image.Image | torch.Tensor, processor: PreprocessConfig | None = None
    ) -> tuple[torch.Tensor, Grid]:
        """One image (bytes, PIL, or uint8 [H, W, 3]) -> (pixel_values [h*w, 3, P, P], (1, h, w))."""
        if isinstance(image, (bytes, bytearray, memoryview)):
            rgb = media.decode_image(bytes(image), self.limits)
        elif isinstance(image, Image.Image):
            rgb = media.image_to_rgb(image, self.limits)
        elif isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.dim() == 3:
            media.check_dimensions(image.shape[1], image.shape[0], self.limits)
            rgb = image
        else:
            raise MediaError("bad_input", f"cannot preprocess {type(image).__name__} as an image")
        return self._preprocess_rgb(rgb, processor or self.spec.preprocess, video=False)

    def _preprocess_rgb(self, rgb: torch.Tensor, cfg: PreprocessConfig, video: bool) -> tuple[torch.Tensor, Grid]:
        return preprocess_frames(
            rgb, cfg, self.spec.tower.patch_size, video=video, device=self.device, dtype=self.dtype
        )

    def decode_video(
        self, data: bytes, processor: PreprocessConfig | None = None, *, video_hash: str | None = None
    ) -> list[VideoChunk]:
        """Video bytes -> chunks, each an `encode` item; their mm_hashes derive from the video's."""
        cfg = processor or self.spec.preprocess
        video_hash = video_hash or mm_hash(self.identity(cfg), "video", data)
        return media.decode_video(bytes(data), cfg, self.limits, video_hash, self.spec.tower.patch_size)

    def prepare(self, item: Item, processor: PreprocessConfig | None = None) -> Prepared:
        """Decode, hash and preprocess one image or video chunk (CPU-pool work; no model state)."""
        cfg = processor or self.spec.preprocess
        if isinstance(item, VideoChunk):
            return self._prepare_chunk(item, cfg)
        if isinstance(item, (bytes, bytearray, memoryview)):
            data = bytes(item)
            identified = ("image", mm_hash(self.identity(cfg), "image", data))  # bytes here are an image
            (prepared,) = self.prepare_media(data, cfg, identified=identified)
            return prepared
        if isinstance(item, Image.Image):
            return self._prepare_pil(item, cfg)
        kind = type(item).__name__
        raise MediaError("bad_input", f"cannot encode a {kind}: pass bytes, a PIL image or a VideoChunk")

    def prepare_media(
        self, data: bytes, processor: PreprocessConfig | None = None, *, identified: tuple[str, str] | None = None
    ) -> list[Prepared]:
        """Image or video bytes -> one Prepared per image or per video chunk. `identified` is what
        `identify` returned for these bytes, when the caller has it already."""
        cfg = processor or self.spec.preprocess
        return self.prepare_planned(data, self.plan(data, cfg, identified=identified), cfg)

    def plan(self, data: bytes, processor: PreprocessConfig | None = None, *,
             identified: tuple[str, str] | None = None) -> Plan:
        """What preparing these bytes will cost, from the image header or the video container (no
        pixel decoded): every per-item limit is checked here."""
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

    def prepare_planned(self, data: bytes, plan: Plan, processor: PreprocessConfig | None = None) -> list[Prepared]:
        """Decode and preprocess what `plan` describes (CPU-pool work; the caller reserved its cost)."""
        cfg = processor or self.spec.preprocess
        if plan.image is not None:
            t0 = time.perf_counter()
            rgb = media.image_to_rgb(plan.image, self.limits)
            return [self._prepared(rgb, cfg, plan.mm_hash, "image", None, plan.plan_ms + ms_since(t0))]
        # Chunk by chunk: each is preprocessed as soon as it is decoded, so what is held at once is
        # one chunk's RGB frames plus the (smaller, or on-device) pixel_values prepared so far.
        prepared, decode_ms = [], plan.plan_ms
        chunks = media.iter_video(bytes(data), cfg, self.limits, plan.mm_hash, self.spec.tower.patch_size, plan.video)
        with contextlib.closing(chunks):
            while True:
                t0 = time.perf_counter()
                chunk = next(chunks, None)
                decode_ms += ms_since(t0)
                if chunk is None:
                    break
                prepared.append(self._prepare_chunk(chunk, cfg))
                del chunk
        for p in prepared:
            p.timings_ms["decode"] += decode_ms / len(prepared)  # the video's decode time, split over its chunks
        return prepared

    def _prepare_pil(self, img: Image.Image, cfg: PreprocessConfig) -> Prepared:
        t0 = time.perf_counter()
        media.check_dimensions(*img.size, self.limits)
        h = mm_hash(self.identity(cfg), "image", f"{img.mode}:{img.size}".encode() + img.tobytes())
        return self._prepared(media.image_to_rgb(img, self.limits), cfg, h, "image", None, ms_since(t0))

    def _prepare_chunk(self, chunk: VideoChunk, cfg: PreprocessConfig) -> Prepared:
        t0 = time.perf_counter()
        frames = chunk.frames
        if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
            raise MediaError("bad_input", "a VideoChunk needs uint8 frames [t, H, W, 3]")
        if not 1 <= frames.shape[0] <= self.spec.tower.pos_emb_time:
            raise MediaError("bad_input", f"a video chunk has 1 to {self.spec.tower.pos_emb_time} frames")
        media.check_dimensions(frames.shape[2], frames.shape[1], self.limits, "video frame")
        source = chunk.source_hash or content_hash(frames.contiguous().numpy().tobytes())
        h = mm_hash(self.identity(cfg), "video", source.encode(), chunk=chunk.index)
        return self._prepared(frames, cfg, h, "video", chunk.timestamp_str, ms_since(t0))

    def _prepared(self, rgb: torch.Tensor, cfg: PreprocessConfig, h: str, modality: str, timestamp: str | None,
                  decode_ms: float) -> Prepared:
        t0 = time.perf_counter()
        pixel_values, grid = self._preprocess_rgb(rgb, cfg, video=modality == "video")
        return Prepared(pixel_values, grid, h, modality, timestamp, {"decode": decode_ms, "preprocess": ms_since(t0)})

    # --- encoding ---------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, items: Sequence[Item] | Item, processor: PreprocessConfig | None = None) -> list[EncodedMedia]:
        """Encode media items (image bytes, PIL images, video chunks); results in input order."""
        if isinstance(items, (bytes, bytearray, memoryview, Image.Image, VideoChunk)):
            items = [items]
        elif not isinstance(items, (list, tuple)):
            raise MediaError("bad_input", f"encode takes a list of items, not a {type(items).__name__}")
        prepared = [self.prepare(item, processor) for item in items]
        return self.finish(prepared, *self.forward(prepared))

    def encode_file(self, data: bytes, processor: PreprocessConfig | None = None) -> list[EncodedMedia]:
        """Image or video bytes (sniffed) -> one result per image or per video chunk."""
        prepared = self.prepare_media(data, processor)
        return self.finish(prepared, *self.forward(prepared))

    @torch.inference_mode()
    def forward(self, prepared: Sequence[Prepared]) -> tuple[list[torch.Tensor], float]:
        """Device work: forward passes of at most `batch_max_patches` patches each.

        Returns one host tensor [num_tokens, out_dim] per item (input order) and the forward time
        in ms. On CUDA the copies to pinned memory run on a side stream, overlapping the next batch.
        """
        t0 = time.perf_counter()
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

    @staticmethod
    def finish(prepared: Sequence[Prepared], outputs: Sequence[torch.Tensor], forward_ms: float) -> list[EncodedMedia]:
        results = []
        for p, out in zip(prepared, outputs, strict=True):
            timings = {**p.timings_ms, "forward": forward_ms}
            timings["total"] = sum(timings.values())
            results.append(EncodedMedia(out, p.grid, p.num_tokens, p.mm_hash, p.modality, p.timestamp, timings))
        return results

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


def parse_dtype(d: str | torch.dtype) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}
    try:
        return names[d.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {d!r}; use one of {sorted(names)}") from None
