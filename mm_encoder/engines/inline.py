"""The aggregated baseline's media path: the engine does everything, as a monolithic server does.

The frontend sends the rendered chat template (one placeholder per media item) and the media
URLs; here each item is fetched (`fetch.Fetcher`, the same SSRF rules as the encode worker),
preprocessed by the checkpoint's own policy (this project's preprocessing: transformers' image
processors need torchvision), and run through the model's own vision tower and projector as
transformers loaded them (`Kimi_K25Model.get_image_features` / `get_video_features`, all images of
a request in one call as `generate` makes it). A family whose vision tower transformers does not
have (MoonViT under a GLM projector) runs this project's encoder in-process instead. The prompt is
then expanded by the same `Splicer` as the frontend's, so both graphs give the engine the same ids.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch

from ..core.engine_request import EngineRequest
from ..core.errors import BadRequest
from ..core.prompt import Splicer
from ..fetch import Fetcher
from ..runtime.aio import gather_or_cancel
from .engine import Placed, Prompt
from .llm import LanguageModel


class InlineMedia:
    def __init__(self, checkpoint: str | Path, lm: LanguageModel):
        from ..model.encoder import Encoder

        self.lm = lm
        self.own_tower = lm.monolithic is not None and hasattr(lm.monolithic.model, "vision_tower")
        if self.own_tower:  # transformers' tower: only the preprocessing is ours
            self.encoder = Encoder.without_weights(checkpoint, device=lm.device, dtype=lm.dtype)
        else:
            self.encoder = Encoder.from_pretrained(checkpoint, device=lm.device, dtype=lm.dtype)
        self.fetcher: Fetcher | None = None

    async def prompt(self, req: EngineRequest, splicer: Splicer, pool, timings: dict[str, float]) -> Prompt:
        self.fetcher = self.fetcher or Fetcher()  # bound to the serving loop
        t0 = time.perf_counter()
        fetched = await gather_or_cancel(self.fetcher.fetch(ref["url"]) for ref in req.media_refs)
        t1 = time.perf_counter()
        loop = asyncio.get_running_loop()
        items = await loop.run_in_executor(pool, self.encode, [f.data for f in fetched],
                                           [ref.get("modality") for ref in req.media_refs])
        t2 = time.perf_counter()
        spliced = await asyncio.to_thread(splicer.expand_text, req.prompt or "",
                                          [(m, [r.shape[0] for r in rows], stamps) for m, rows, stamps, _, _ in items])
        timings["fetch"], timings["encode"] = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        rows = [(off, r) for (_, item_rows, _, _, _), spans in zip(items, spliced.spans, strict=True)
                for (off, _), r in zip(spans, item_rows, strict=True)]
        placed = [Placed(h, m, list(spans), grids)
                  for (m, _, _, grids, h), spans in zip(items, spliced.spans, strict=True)]
        return Prompt(spliced.token_ids, rows, placed)

    @torch.inference_mode()
    def encode(self, datas: list[bytes], modalities: list[str | None]) -> list[tuple]:
        """Per item: (modality, rows per image or chunk, chunk timestamps, grids, mm_hash)."""
        prepared = []
        for data, claimed in zip(datas, modalities, strict=True):
            modality, h = self.encoder.identify(data)
            if claimed is not None and claimed != modality:
                raise BadRequest(f"a {claimed} part holds {modality} data")
            prepared.append((modality, h, self.encoder.prepare_media(data, identified=(modality, h))))
        flat = [p for _, _, ps in prepared for p in ps]
        rows = iter(self._tower(flat))
        out = []
        for modality, h, ps in prepared:
            stamps = [p.timestamp for p in ps] if modality == "video" else None
            out.append((modality, [next(rows) for _ in ps], stamps, [list(p.grid) for p in ps], h))
        return out

    def _tower(self, prepared: list) -> list[torch.Tensor]:
        """Rows per image or chunk, in order: images in one call and video chunks in another."""
        if not self.own_tower:
            outputs, _ = self.encoder.forward(prepared)
            return list(outputs)
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
        return out  # type: ignore[return-value]
