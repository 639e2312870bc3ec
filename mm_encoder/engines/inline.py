"""The aggregated baseline's media path: the engine does everything, as a monolithic server does.

The frontend sends the rendered chat template (one placeholder per media item) and the media
URLs; here each item is fetched (`fetch.Fetcher`, the same SSRF rules as the encode worker),
preprocessed by the checkpoint's own policy (this project's preprocessing: transformers' image
processors need torchvision), and run through the model's own vision tower and projector as
transformers loaded them (`Kimi_K25Model.get_image_features` / `get_video_features`, all images of
a request in one call as `generate` makes it). A family whose vision tower transformers does not
have (MoonViT under a GLM projector) runs this project's encoder in-process instead. The prompt is
then expanded by the same `Splicer` as the frontend's, so both graphs give the engine the same ids.
`InlineEngine` is the engine that does this, chosen at start-up (`--encode-inline`).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..core.context import room
from ..core.engine_request import EngineRequest, InlineRequest
from ..core.errors import BadRequest
from ..core.prompt import Splicer
from ..core.sampling import SamplingParams
from ..fetch import Fetcher
from ..runtime.aio import gather_or_cancel
from .engine import Engine, Placed, Prompt
from .llm import LanguageModel

if TYPE_CHECKING:
    from ..model.steps import Prepared

# One encoded item: (modality, rows per image or chunk, chunk timestamps, grids, mm_hash)
_Encoded = tuple[str, list[torch.Tensor], list[str] | None, list[list[int]], str]


class InlineMedia:
    def __init__(self, checkpoint: str | Path, lm: LanguageModel) -> None:
        from ..model.loading import load, load_without_weights
        from ..model.steps import EncodeSteps

        self.lm = lm
        self.own_tower = lm.monolithic is not None and hasattr(lm.monolithic.model, "vision_tower")
        if self.own_tower:  # transformers' tower: only the preprocessing is ours
            loaded = load_without_weights(checkpoint, device=lm.device, dtype=lm.dtype)
        else:
            loaded = load(checkpoint, device=lm.device, dtype=lm.dtype)
        self.encoder = EncodeSteps(loaded.spec, loaded.model, device=loaded.device, dtype=loaded.dtype)
        self.fetcher: Fetcher | None = None

    async def prompt(self, req: InlineRequest, splicer: Splicer, pool: Executor, timings: dict[str, float]) -> Prompt:
        self.fetcher = self.fetcher or Fetcher()  # bound to the serving loop
        t0 = time.perf_counter()
        fetched = await gather_or_cancel(self.fetcher.fetch(ref["url"]) for ref in req.media_refs)
        t1 = time.perf_counter()
        loop = asyncio.get_running_loop()
        items = await loop.run_in_executor(pool, self.encode, [f.data for f in fetched],
                                           [ref.get("modality") for ref in req.media_refs])
        t2 = time.perf_counter()
        spliced = await asyncio.to_thread(splicer.expand_text, req.prompt,
                                          [(m, [r.shape[0] for r in rows], stamps) for m, rows, stamps, _, _ in items])
        timings["fetch"], timings["encode"] = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        rows = [(off, r) for (_, item_rows, _, _, _), spans in zip(items, spliced.spans, strict=True)
                for (off, _), r in zip(spans, item_rows, strict=True)]
        placed = [Placed(h, m, list(spans), grids)
                  for (m, _, _, grids, h), spans in zip(items, spliced.spans, strict=True)]
        return Prompt(spliced.token_ids, rows, placed)

    def encode(self, datas: list[bytes], modalities: list[str | None]) -> list[_Encoded]:
        """Per item: (modality, rows per image or chunk, chunk timestamps, grids, mm_hash)."""
        with torch.inference_mode():
            prepared = []
            for data, claimed in zip(datas, modalities, strict=True):
                modality, h = self.encoder.identify(data)
                if claimed is not None and claimed != modality:
                    raise BadRequest(f"a {claimed} part holds {modality} data")
                plan = self.encoder.plan(data, identified=(modality, h))
                prepared.append((modality, h, self.encoder.decode(data, plan)))
            flat = [p for _, _, ps in prepared for p in ps]
            rows = iter(self._tower(flat))
            out: list[_Encoded] = []
            for modality, h, ps in prepared:
                # every video chunk has its timestamp (the encode worker's wire header keeps the same list)
                stamps = [p.timestamp for p in ps if p.timestamp is not None] if modality == "video" else None
                out.append((modality, [next(rows) for _ in ps], stamps, [list(p.grid) for p in ps], h))
            return out

    def _tower(self, prepared: list[Prepared]) -> list[torch.Tensor]:
        """Rows per image or chunk, in order: images in one call and video chunks in another."""
        if not self.own_tower:
            outputs, _ = self.encoder.forward(prepared)
            return list(outputs)
        assert self.lm.monolithic is not None  # own_tower: the whole transformers model is loaded
        model = self.lm.monolithic.model
        out: list[torch.Tensor | None] = [None] * len(prepared)
        for modality, features in (("image", model.get_image_features), ("video", model.get_video_features)):
            idx = [i for i, p in enumerate(prepared) if p.modality == modality]
            if not idx:
                continue
            pixels = torch.cat([prepared[i].pixel_values for i in idx]).to(self.lm.device, self.lm.dtype)
            grids = torch.tensor([list(prepared[i].grid) for i in idx], dtype=torch.long, device=self.lm.device)
            for i, rows in zip(idx, features(pixels, grids).pooler_output, strict=True):
                out[i] = rows
        return out


class InlineEngine(Engine):
    """The aggregated baseline's engine (`--encode-inline`, chosen at start-up): a request that
    carries the rendered prompt and media URLs is fetched, encoded and expanded here
    (`InlineMedia`); a request by handle takes the front door's way like any engine's."""

    def __init__(self, lm: LanguageModel, media: InlineMedia, **kw: Any):
        super().__init__(lm, **kw)
        self.media = media

    def sampling(self, req: EngineRequest) -> SamplingParams:
        return SamplingParams.from_dict(req.sampling)

    async def prepare(self, req: EngineRequest, timings: dict[str, float]) -> Prompt:
        if not isinstance(req, InlineRequest):
            return await super().prepare(req, timings)
        prompt = await self.media.prompt(req, self.splicer, self._pool, timings)
        req.token_ids = prompt.token_ids  # the prompt this engine expanded: its length is the usage's
        req.max_tokens = min(req.max_tokens, room(len(prompt.token_ids), self.context_length))
        return prompt
