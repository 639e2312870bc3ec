"""`Encoder`: media items -> LLM-space embeddings, with mm_hash and a timing breakdown.

`encode` decodes and hashes each item, preprocesses it (on the model's device), packs items into
forward passes of at most `max_batch_patches` patches (block-diagonal attention keeps them
independent), and splits the projector output per item. On CUDA each batch's output is copied
to pinned host memory on a side stream, so the next forward is not blocked by the copy.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

from . import media
from .checkpoint import INDEX_FILE, SINGLE_FILE, LoadReport, VisionModel, build_empty, init_random, load_checkpoint
from .errors import CheckpointError, MediaError
from .hashing import content_hash, mm_hash
from .media import VideoChunk
from .preprocess import preprocess_frames
from .registry import DEFAULT_MODEL, get_spec
from .spec import HF_MODEL_TYPES, MediaLimits, ModelSpec, PreprocessConfig, file_revision, spec_from_hf_config
from .tower import Grid

log = logging.getLogger("mm_encoder")

Item = bytes | bytearray | memoryview | Image.Image | VideoChunk


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
        return self.grid[1] * self.grid[2] // 4  # 2x2 merge; sd2_tpool pools time away


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


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
        max_batch_patches: int = 32768,
        load_report: LoadReport | None = None,
    ):
        self.spec = spec
        self.model = model
        self.device = device
        self.dtype = dtype
        self.limits = limits or MediaLimits()
        self.max_batch_patches = max_batch_patches
        self.load_report = load_report
        self._identity = {}
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
        """
        dev = torch.device(device) if device is not None else default_device()
        dt = _dtype(dtype) if dtype is not None else default_dtype(dev)
        path = Path(path_or_name)
        if checkpoint is None and path.is_dir():
            checkpoint, spec = path, None
        else:
            spec = get_spec(str(path_or_name))
        if checkpoint is not None:
            spec = _spec_for_checkpoint(Path(checkpoint), spec)
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
        log.info("model %s ready on %s/%s in %.0f ms", spec.name, dev, str(dt).removeprefix("torch."), _ms(t0))
        return cls(spec, model, device=dev, dtype=dt, load_report=report, **kwargs)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def out_dim(self) -> int:
        return self.spec.projector.out_dim

    def identity(self, processor: PreprocessConfig | None = None) -> bytes:
        key = processor or self.spec.preprocess
        if key not in self._identity:
            self._identity[key] = self.spec.identity(key)
        return self._identity[key]

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

    def decode_video(self, data: bytes, processor: PreprocessConfig | None = None) -> list[VideoChunk]:
        """Video bytes -> chunks, each an `encode` item; their mm_hashes derive from the bytes."""
        cfg = processor or self.spec.preprocess
        return media.decode_video(bytes(data), cfg, self.limits, source_hash=content_hash(data))

    def prepare(self, item: Item, processor: PreprocessConfig | None = None) -> Prepared:
        """Decode, hash and preprocess one item (CPU-pool work; no model state is touched)."""
        return self._prepare(item, processor or self.spec.preprocess)

    def prepare_media(self, data: bytes, processor: PreprocessConfig | None = None) -> list[Prepared]:
        """Image or video bytes (sniffed) -> one Prepared per image or per video chunk."""
        if media.sniff_modality(data) != "video":
            return [self.prepare(data, processor)]
        t0 = time.perf_counter()
        chunks = self.decode_video(data, processor)
        share = _ms(t0) / len(chunks)  # the video's decode time, split over its chunks
        prepared = [self.prepare(c, processor) for c in chunks]
        for p in prepared:
            p.timings_ms["decode"] += share
        return prepared

    def _prepare(self, item: Item, cfg: PreprocessConfig) -> Prepared:
        identity = self.identity(cfg)
        t0 = time.perf_counter()
        timestamp = None
        if isinstance(item, VideoChunk):
            modality = "video"
            frames = item.frames
            if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
                raise MediaError("bad_input", "a VideoChunk needs uint8 frames [t, H, W, 3]")
            if not 1 <= frames.shape[0] <= self.spec.tower.pos_emb_time:
                raise MediaError("bad_input", f"a video chunk has 1 to {self.spec.tower.pos_emb_time} frames")
            media.check_dimensions(frames.shape[2], frames.shape[1], self.limits, "video frame")
            source = item.source_hash or content_hash(frames.contiguous().numpy().tobytes())
            h = mm_hash(identity, modality, source.encode(), chunk=item.index)
            rgb, timestamp = frames, item.timestamp_str
        elif isinstance(item, (bytes, bytearray, memoryview)):
            modality = "image"
            data = bytes(item)
            img = media.open_image(data, self.limits)
            h = mm_hash(identity, modality, data)
            rgb = media.image_to_rgb(img, self.limits)
        elif isinstance(item, Image.Image):
            modality = "image"
            media.check_dimensions(*item.size, self.limits)
            h = mm_hash(identity, modality, f"{item.mode}:{item.size}".encode() + item.tobytes())
            rgb = media.image_to_rgb(item, self.limits)
        else:
            kind = type(item).__name__
            raise MediaError("bad_input", f"cannot encode a {kind}: pass bytes, a PIL image or a VideoChunk")
        decode_ms = _ms(t0)
        t1 = time.perf_counter()
        pixel_values, grid = self._preprocess_rgb(rgb, cfg, video=modality == "video")
        timings = {"decode": decode_ms, "preprocess": _ms(t1)}
        return Prepared(pixel_values, grid, h, modality, timestamp, timings)

    # --- encoding ---------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, items: Sequence[Item] | Item, processor: PreprocessConfig | None = None) -> list[EncodedMedia]:
        """Encode media items; the result list is in input order."""
        if isinstance(items, (bytes, bytearray, memoryview, Image.Image, VideoChunk)):
            items = [items]
        elif not isinstance(items, (list, tuple)):
            raise MediaError("bad_input", f"encode takes a list of items, not a {type(items).__name__}")
        cfg = processor or self.spec.preprocess
        prepared = [self._prepare(item, cfg) for item in items]
        return self.finish(prepared, *self.forward(prepared))

    @torch.inference_mode()
    def forward(self, prepared: Sequence[Prepared]) -> tuple[list[torch.Tensor], float]:
        """Device work: forward passes of at most `max_batch_patches` patches each.

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
        return outputs, _ms(t0)

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
            n = p.pixel_values.shape[0]
            if batches and size + n <= self.max_batch_patches:
                batches[-1].append(p)
                size += n
            else:
                batches.append([p])
                size = n
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

    def encode_file(self, data: bytes, processor: PreprocessConfig | None = None) -> list[EncodedMedia]:
        """Image or video bytes (sniffed) -> one result per image or per video chunk."""
        prepared = self.prepare_media(data, processor)
        return self.finish(prepared, *self.forward(prepared))


def _dtype(d: str | torch.dtype) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}
    try:
        return names[d.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {d!r}; use one of {sorted(names)}") from None


def _spec_for_checkpoint(ckpt: Path, named: ModelSpec | None) -> ModelSpec:
    """Registry spec overlaid with the checkpoint's config.json; checks they agree when both given."""
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint directory {ckpt} does not exist")
    config_path = ckpt / "config.json"
    if not config_path.is_file():
        if named is None:
            raise CheckpointError(f"{ckpt}: no config.json, so the model is unknown; pass a model name too")
        return named.model_copy(update={"revision": file_revision(_index_bytes(ckpt))})
    raw = config_path.read_bytes()
    config = json.loads(raw)
    base = named
    if base is None:
        model_type = config.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise CheckpointError(
                f"{config_path}: model_type {model_type!r} is not known ({sorted(HF_MODEL_TYPES)}); pass a model name"
            )
        base = get_spec(HF_MODEL_TYPES[model_type])
    spec = spec_from_hf_config(config, base, file_revision(raw, _index_bytes(ckpt)))
    if named is not None and (spec.tower, spec.projector) != (named.tower, named.projector):
        raise CheckpointError(
            f"{config_path}: its vision config does not match model {named.name}: "
            f"tower {spec.tower} / projector {spec.projector} vs {named.tower} / {named.projector}"
        )
    return spec


def _index_bytes(ckpt: Path) -> bytes:
    if (ckpt / INDEX_FILE).is_file():
        return (ckpt / INDEX_FILE).read_bytes()
    single = ckpt / SINGLE_FILE
    if single.is_file():
        with single.open("rb") as f:  # the safetensors header: names, dtypes, shapes, offsets
            n = int.from_bytes(f.read(8), "little")
            return f.read(min(n, 100_000_000))
    return b""
