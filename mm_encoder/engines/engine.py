"""The engine: a checkpoint's own language model serving `<namespace>.engine.generate`.

One request's way through it, each step owned here once:
- `generate` (this project's frontend: `core.requests.EngineRequest`, media by handle) or
  `generate_dynamo` (Dynamo's stock frontend: a preprocessed request whose one-placeholder media
  items are expanded here from the Encode worker's handles, `engines.dynamo_request`), or, in the
  aggregated baseline, the rendered prompt plus media URLs (`engines.inline`: fetched, preprocessed
  and run through the model's own vision tower here);
- the media rows: each body fetched by handle and checked (`engines.inputs`);
- `prefill` on the engine thread: the longest stored prefix of the prompt's blocks is reused
  (`engines.prefix_cache`), the rest embedded with the media rows written over their placeholder
  positions and run through the model (`engines.llm`); KV events tell the router what is held;
- `decode`: one token per step with the KV cache, sampled (`engines.sampling`), streamed, until a
  stop, `max_tokens` or the caller cancels.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..client import HandleResolver
from ..core.context import check_fits, room
from ..core.engine_request import EngineRequest
from ..core.errors import BadRequest, MMEncoderError
from ..core.prompt import Splicer
from ..core.sampling import SamplingParams
from ..core.timing import ms_since
from ..routing import MediaSpan, block_hashes, block_mm_infos
from .dynamo_request import chunk as dynamo_chunk
from .dynamo_request import from_preprocessed
from .inputs import fetch_bodies, media_rows
from .llm import LanguageModel
from .prefix_cache import PrefixCache
from .sampling import Sampler, Step, token_logprobs
from .stream import batched, pacing

log = logging.getLogger(__name__)


@dataclass
class Placed:
    """One media item in a prompt: what routing, KV events and M-RoPE positions need of it."""

    mm_hash: str
    modality: str
    spans: list[tuple[int, int]]  # (offset, rows) per image or video chunk
    grids: list[list[int]]  # (t, h, w) per image or chunk, in patches before the 2x2 merge


@dataclass
class Prompt:
    token_ids: list[int]
    rows: list[tuple[int, torch.Tensor]]  # (offset, rows) to write over the placeholder embeddings
    media: list[Placed] = field(default_factory=list)


class Engine:
    """The model, its prefix store and KV-event bookkeeping; `respond` is the Dynamo handler."""

    def __init__(self, lm: LanguageModel, *, splicer: Splicer, block_size: int = 16, publisher=None,
                 resolver: HandleResolver | None = None, prefix_tokens: int = 1 << 16, inline=None,
                 stream_interval_s: float = 0.0):
        self.lm = lm
        self.splicer = splicer
        self.block_size = block_size
        self.publisher = publisher
        self.stream_interval_s = stream_interval_s  # our frontend's requests: tokens per item (engines.stream)
        self.metrics = None  # Dynamo's WorkerMetricsPublisher, when serving: the load the KV router reads
        self._active: dict[object, int] = {}  # request -> prompt + max_tokens
        self.resolver = resolver or HandleResolver()
        self.prefix = PrefixCache(block_size, prefix_tokens)
        self.inline = inline  # engines.inline.InlineMedia: the aggregated baseline encodes media itself
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mm-engine")
        self.requests = 0

    @property
    def context_length(self) -> int:
        return self.lm.context_length

    # --- model work (engine thread) ----------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, prompt: Prompt) -> tuple[torch.Tensor, Any, torch.Tensor | None, int]:
        """The prompt's last logits, its KV cache, its next M-RoPE position (None: plain RoPE) and
        how many of its tokens came from the prefix store."""
        ids = prompt.token_ids
        hashes, infos = self._block_hashes(prompt)
        reuse = self.prefix.match(hashes, len(ids))
        start = reuse.tokens
        x = self.lm.embed(ids[start:]).clone()
        for offset, rows in prompt.rows:
            lo = max(offset, start)
            if lo < offset + rows.shape[0]:
                x[lo - start : offset + rows.shape[0] - start] = rows[lo - offset :].to(x.dtype)
        positions = self.lm.positions(ids, [(m.modality, m.spans, m.grids) for m in prompt.media])
        logits, cache = self.lm.forward(x, reuse.cache, None if positions is None else positions[:, start:])
        stored, removed = self.prefix.add(hashes, cache)
        self._publish(ids, hashes, infos, stored, removed)
        nxt = None if positions is None else positions.max() + 1
        return logits, cache, nxt, start

    @torch.inference_mode()
    def step(self, token: int, cache, position: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        x = self.lm.embed([token])
        pos = None if position is None else position.reshape(1, 1).expand(3, 1)
        return self.lm.forward(x, cache, pos)

    # --- KV events: what the prefix store holds, hashed as the router hashes ----------------

    def _block_hashes(self, prompt: Prompt) -> tuple[list[int], list | None]:
        n_full = len(prompt.token_ids) // self.block_size
        if n_full == 0:
            return [], None
        n = n_full * self.block_size
        spans = [_clip(MediaSpan(m.mm_hash, tuple(tuple(s) for s in m.spans)), n) for m in prompt.media]
        infos = block_mm_infos(n, self.block_size, spans)
        return block_hashes(prompt.token_ids[:n], self.block_size, infos), infos

    def _publish(self, ids: list[int], hashes: list[int], infos, stored: list[int], removed: list[int]) -> None:
        if self.publisher is None:
            return
        if stored:
            n = len(hashes) * self.block_size
            self.publisher.publish_stored(ids[:n], [self.block_size] * len(hashes), hashes, None, infos)
        if removed:
            self.publisher.publish_removed(removed)

    # --- the handler -------------------------------------------------------------------------

    def respond(self, request: Any, context=None) -> AsyncIterator[dict[str, Any]]:
        """Dynamo's preprocessed request (it has `stop_conditions`; from the stock frontend) or ours
        (`EngineRequest`), told apart by shape, so either frontend can serve it."""
        if isinstance(request, dict) and "stop_conditions" in request:
            return self.generate_dynamo(request, context)
        return self.generate(request, context)

    def generate(self, request: dict[str, Any], context=None) -> AsyncIterator[dict[str, Any]]:
        """Our frontend's `EngineRequest`: the tokens ready within `stream_interval_s` of the last
        item go out in one item (`engines.stream`). A refusal before the first token is one
        `{"error": ...}` item with the error's code and status."""
        return batched(self._items(request, context), *pacing(request, self.stream_interval_s))

    async def _items(self, request: dict[str, Any], context=None) -> AsyncIterator[dict[str, Any]]:
        timings: dict[str, float] = {}
        try:
            req = EngineRequest.from_dict(request)
            params = SamplingParams.from_dict(req.sampling)
            if req.prompt is not None:  # the aggregated baseline: media by URL, encoded here
                if self.inline is None:
                    raise BadRequest("this engine does not encode media; start it with --encode-inline")
                prompt = await self.inline.prompt(req, self.splicer, self._pool, timings)
                req.token_ids = prompt.token_ids
                req.max_tokens = min(req.max_tokens, self._room(len(prompt.token_ids)))
            else:
                self.check_fits(len(req.token_ids), req.max_tokens)  # before any fetch
                prompt = await self.media_prompt(req, timings)
        except MMEncoderError as e:
            yield e.to_dict(status=True)
            return
        first = True
        t0 = time.perf_counter()
        async for step, reused in self.decode(prompt, req.max_tokens, params, req.eos_token_ids, context):
            item = {"token_ids": [step.token], "finish_reason": step.finish, **step.fields(self.splicer.tok)}
            if first:  # what this engine spent before the first token: the frontend's /mm/stats
                item["prompt_tokens"] = len(prompt.token_ids)
                item["reused_tokens"] = reused
                item["timings_ms"] = {**timings, "prefill": ms_since(t0)}
                first = False
            yield item

    async def media_prompt(self, req: EngineRequest, timings: dict[str, float]) -> Prompt:
        """Every item's body fetched by handle and checked, then its rows decoded (engine thread)."""
        t0 = time.perf_counter()
        bodies = await fetch_bodies(req, self.resolver)
        t1 = time.perf_counter()
        rows = await asyncio.get_running_loop().run_in_executor(self._pool, media_rows, req, bodies,
                                                                self.lm.hidden_size)
        timings["fetch"], timings["decode"] = (t1 - t0) * 1e3, ms_since(t1)
        placed = [Placed(item.mm_hash, item.handle.header.modality, list(item.spans),
                         [list(g) for g in item.handle.header.grid_thws]) for item in req.media]
        return Prompt(req.token_ids, rows, placed)

    async def generate_dynamo(self, request: dict[str, Any], context=None) -> AsyncIterator[dict[str, Any]]:
        """Dynamo's preprocessed request from the stock frontend: Dynamo's output chunks, the last
        with the expanded prompt's length as `completion_usage.prompt_tokens`."""
        from ..runtime.dynamo import worker_error

        try:
            req = from_preprocessed(request, self.splicer, self.context_length,
                                    context.id() if context is not None else None)
            self.check_fits(len(req.token_ids), req.max_tokens)
            prompt = await self.media_prompt(req, {})
        except MMEncoderError as e:
            raise worker_error(e) from None
        params = SamplingParams.from_dict(req.sampling)
        n = 0
        async for step, _ in self.decode(prompt, req.max_tokens, params, req.eos_token_ids, context):
            n += 1
            yield {**dynamo_chunk(step.token, step.finish, len(prompt.token_ids), n), **step.fields(self.splicer.tok)}

    def _room(self, prompt_tokens: int) -> int:
        return room(prompt_tokens, self.context_length)

    def check_fits(self, prompt: int, max_tokens: int) -> None:
        check_fits(prompt, max_tokens, self.context_length)

    async def decode(self, prompt: Prompt, max_tokens: int, params: SamplingParams, eos_token_ids: list[int],
                     context=None) -> AsyncIterator[tuple[Step, int]]:
        """Prefill, then one step per token until a stop, max_tokens or the caller stops; each
        step with how many prompt tokens the prefix store supplied."""
        loop = asyncio.get_running_loop()
        self.requests += 1
        key = object()
        self._active[key] = len(prompt.token_ids) + max_tokens  # what its KV may grow to
        self._publish_load()
        try:
            logits, cache, position, reused = await loop.run_in_executor(self._pool, self.prefill, prompt)
            prompt.rows = []  # the rows are in the cache now
            sampler = Sampler(params, eos_token_ids)
            for i in range(max_tokens):
                token = sampler.next(logits)
                finish = sampler.stop_reason(token) or ("length" if i == max_tokens - 1 else None)
                lp = token_logprobs(logits, token, params.top_logprobs) if params.logprobs else (None, None)
                yield Step(token, finish, *lp), reused
                if finish is not None or (context is not None and context.is_stopped()):
                    return
                logits, cache = await loop.run_in_executor(self._pool, self.step, token, cache, position)
                position = None if position is None else position + 1
        finally:
            del self._active[key]
            self._publish_load()

    def _publish_load(self) -> None:
        """The load Dynamo's KV router reads (its `WorkerMetricsPublisher`): the blocks the requests in
        flight hold or will (prompt + max_tokens), and those plus the prefix store's, on every
        admission and finish."""
        if self.metrics is None:
            return
        active = sum(-(-n // self.block_size) for n in self._active.values())
        try:
            self.metrics.publish(active_decode_blocks=active,
                                 kv_used_blocks=active + self.prefix.tokens // self.block_size)
        except Exception as e:  # load reports are advisory: never fail a request over one
            log.debug("load not published: %s", e)


def _clip(span: MediaSpan, n: int) -> MediaSpan:
    """Media spans limited to the first n tokens (the full blocks)."""
    kept = tuple((o, min(l_, n - o)) for o, l_ in span.spans if o < n)
    return MediaSpan(span.mm_hash, kept)
