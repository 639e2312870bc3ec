"""`Encoder`, the library: media items -> LLM-space embeddings, with mm_hash and a timing breakdown.

    enc = Encoder.from_pretrained("tiny")                 # model/loading.py
    enc.encode([image_bytes, pil_image, video_chunk])     # -> list[EncodedMedia]
    enc.encode_file(image_or_video_bytes)
    enc.steps.spec.name, enc.steps.dtype                  # what it is: its `EncodeSteps`

A thin layer over the two parts it is made of: `model/loading.py` loads the model (a registry name or
a checkpoint directory, device, dtype) and `EncodeSteps` (model/steps.py) runs it, step by step
(identify, plan, decode, forward), as the encode worker does on separate executors. Here the steps run
in a row: `preprocess_item` / `preprocess_file` -> `forward` -> one `EncodedMedia` per image or
video chunk.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from ..core.errors import MediaError
from ..core.registry import DEFAULT_MODEL
from ..core.spec import Grid, MediaLimits, ModelSpec, PreprocessConfig
from ..core.timing import ms_since
from . import media
from .checkpoint import LoadReport, VisionModel
from .hashing import mm_hash
from .loading import load
from .media import VideoChunk
from .steps import BATCH_MAX_PATCHES, EncodeSteps, Plan, Prepared

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


class Encoder:
    """A loaded model plus its preprocessing; thread-compatible, not thread-safe. What it is (spec,
    model, device, dtype, limits, batch cap) is read from `steps`, the `EncodeSteps` it runs: one
    place for each fact."""

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
        self.steps = EncodeSteps(spec, model, device=device, dtype=dtype, limits=limits,
                                 batch_max_patches=batch_max_patches)
        self.load_report = load_report

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str | Path = DEFAULT_MODEL,
        *,
        checkpoint: str | Path | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        seed: int | None = None,
        **kwargs: Any,
    ) -> Encoder:
        """A registry name (random weights unless `checkpoint`), or a checkpoint directory
        (`loading.load`). `kwargs` go to the constructor (`limits`, `batch_max_patches`)."""
        loaded = load(path_or_name, checkpoint=checkpoint, device=device, dtype=dtype, seed=seed)
        return cls(loaded.spec, loaded.model, device=loaded.device, dtype=loaded.dtype, load_report=loaded.report,
                   **kwargs)

    def configured(self, *, limits: MediaLimits | None = None, batch_max_patches: int | None = None) -> Encoder:
        """This encoder (the same weights, not a copy of them) with other limits or batch cap."""
        steps = self.steps.configured(limits=limits, batch_max_patches=batch_max_patches)
        if steps is self.steps:
            return self
        other = copy.copy(self)
        other.steps = steps
        return other

    def identity(self, processor: PreprocessConfig | None = None) -> bytes:
        return self.steps.identity(processor)

    def identify(self, data: bytes, processor: PreprocessConfig | None = None) -> tuple[str, str]:
        """(modality, mm_hash) of image or video bytes."""
        return self.steps.identify(data, processor)

    def plan(self, data: bytes, processor: PreprocessConfig | None = None, *,
             identified: tuple[str, str] | None = None) -> Plan:
        """What preprocessing these bytes will cost (no pixel decoded); refuses what the limits do."""
        return self.steps.plan(data, processor, identified=identified)

    # --- preprocessing --------------------------------------------------------------------------

    def preprocess(
        self, image: bytes | Image.Image | torch.Tensor, processor: PreprocessConfig | None = None
    ) -> tuple[torch.Tensor, Grid]:
        """One image (bytes, PIL, or uint8 [H, W, 3]) -> (pixel_values [h*w, 3, P, P], (1, h, w))."""
        if isinstance(image, (bytes, bytearray, memoryview)):
            rgb = media.decode_image(bytes(image), self.steps.limits)
        elif isinstance(image, Image.Image):
            rgb = media.image_to_rgb(image, self.steps.limits)
        elif isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.dim() == 3:
            media.check_dimensions(image.shape[1], image.shape[0], self.steps.limits)
            rgb = image
        else:
            raise MediaError("bad_input", f"cannot preprocess {type(image).__name__} as an image")
        return self.steps.patchify(rgb, processor or self.steps.spec.preprocess, video=False)

    def decode_video(
        self, data: bytes, processor: PreprocessConfig | None = None, *, video_hash: str | None = None
    ) -> list[VideoChunk]:
        """Video bytes -> chunks, each an `encode` item; their mm_hashes derive from the video's."""
        cfg = processor or self.steps.spec.preprocess
        video_hash = video_hash or mm_hash(self.identity(cfg), "video", data)
        return media.decode_video(bytes(data), cfg, self.steps.limits, video_hash, self.steps.spec.tower.patch_size)

    def preprocess_item(self, item: Item, processor: PreprocessConfig | None = None) -> Prepared:
        """Decode, hash and preprocess one image or video chunk (CPU work; no model state)."""
        cfg = processor or self.steps.spec.preprocess
        if isinstance(item, VideoChunk):
            return self.steps.preprocess_chunk(item, cfg)
        if isinstance(item, (bytes, bytearray, memoryview)):
            data = bytes(item)
            identified = ("image", mm_hash(self.identity(cfg), "image", data))  # bytes here are an image
            (prepared,) = self.preprocess_file(data, cfg, identified=identified)
            return prepared
        if isinstance(item, Image.Image):
            t0 = time.perf_counter()
            media.check_dimensions(*item.size, self.steps.limits)
            h = mm_hash(self.identity(cfg), "image", f"{item.mode}:{item.size}".encode() + item.tobytes())
            return self.steps.preprocess_rgb(media.image_to_rgb(item, self.steps.limits), cfg, h, "image", None,
                                             ms_since(t0))
        kind = type(item).__name__
        raise MediaError("bad_input", f"cannot encode a {kind}: pass bytes, a PIL image or a VideoChunk")

    def preprocess_file(
        self, data: bytes, processor: PreprocessConfig | None = None, *, identified: tuple[str, str] | None = None
    ) -> list[Prepared]:
        """Image or video bytes -> one Prepared per image or per video chunk (`plan`, then `decode`).
        `identified` is what `identify` returned for these bytes, when the caller has it already."""
        cfg = processor or self.steps.spec.preprocess
        return self.steps.decode(data, self.steps.plan(data, cfg, identified=identified), cfg)

    # --- encoding -------------------------------------------------------------------------------

    def encode(self, items: Sequence[Item] | Item, processor: PreprocessConfig | None = None) -> list[EncodedMedia]:
        """Encode media items (image bytes, PIL images, video chunks); results in input order."""
        if isinstance(items, (bytes, bytearray, memoryview, Image.Image, VideoChunk)):
            items = [items]
        elif not isinstance(items, (list, tuple)):
            raise MediaError("bad_input", f"encode takes a list of items, not a {type(items).__name__}")
        with torch.inference_mode():
            prepared = [self.preprocess_item(item, processor) for item in items]
            return _results(prepared, *self.forward(prepared))

    def encode_file(self, data: bytes, processor: PreprocessConfig | None = None) -> list[EncodedMedia]:
        """Image or video bytes (sniffed) -> one result per image or per video chunk."""
        prepared = self.preprocess_file(data, processor)
        return _results(prepared, *self.forward(prepared))

    def forward(self, prepared: Sequence[Prepared]) -> tuple[list[torch.Tensor], float]:
        """Forward passes of at most `batch_max_patches` patches each: one host tensor
        [num_tokens, out_dim] per item (input order), and the forward time in ms."""
        return self.steps.forward(prepared)


def _results(prepared: Sequence[Prepared], outputs: Sequence[torch.Tensor], forward_ms: float) -> list[EncodedMedia]:
    results = []
    for p, out in zip(prepared, outputs, strict=True):
        timings = {**p.timings_ms, "forward": forward_ms}
        timings["total"] = sum(timings.values())
        results.append(EncodedMedia(out, p.grid, p.num_tokens, p.mm_hash, p.modality, p.timestamp, timings))
    return results
