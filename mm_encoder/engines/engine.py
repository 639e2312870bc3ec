"""The engine: a checkpoint's own language model serving `<namespace>.engine.generate`.

One request's way through it, each step owned once:
- the front door (`engines.front_door`, shared with the vLLM adapter): this project's
  `core.engine_request.EngineRequest` parsed, its context checked, every body fetched by handle,
  decoded once and checked (`engines.inputs`), timed, refusals answered as one item; or
  `generate_dynamo` (Dynamo's stock frontend: a preprocessed request whose one-placeholder media
  items are expanded here from the Encode worker's handles, `engines.dynamo_request`); or, in the
  aggregated baseline, the rendered prompt plus media URLs (`engines.inline.InlineEngine`: fetched,
  preprocessed and run through the model's own vision tower here);
- `prefill` on the engine thread: the longest stored prefix of the prompt's blocks is reused
  (`engines.prefix_cache`), the rest embedded with the media rows written over their placeholder
  positions and run through the model (`engines.llm`); KV events tell the router what is held;
- `decode`: one token per step with the KV cache, sampled (`engines.sampling`), streamed
  (`core.engine_reply` items), until a stop, `max_tokens` or the caller cancels.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..client import HandleResolver
from ..core.engine_reply import TokenBatch
from ..core.engine_request import EngineRequest, InlineRequest, protocol_of
from ..core.errors import BadRequest, MMEncoderError
from ..core.prompt import Splicer
from ..core.sampling import SamplingParams
from ..routing import BlockMMInfo, MediaSpan, block_hashes, block_mm_infos
from ..runtime import tracing
from .dynamo_request import chunk as dynamo_chunk
from .dynamo_request import from_preprocessed
from .front_door import FrontDoor
from .inputs import Media, media_rows
from .llm import LanguageModel
from .prefix_cache import PrefixCache
from .sampling import Sampler, Step, token_logprobs

if TYPE_CHECKING:
    from transformers import Cache  # the model's KV cache (transformers is not analysed: Any to mypy)

    from ..runtime.dynamo import Context, KvEventPublisher, WorkerMetricsPublisher

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
    salt: str = ""  # the tenant's scope: its blocks hash apart from every other tenant's (`EngineRequest.cache_salt`)


class Engine(FrontDoor[Prompt, SamplingParams]):
    """The model, its prefix store and KV-event bookkeeping behind the engines' front door
    (`engines.front_door`); `respond` is the Dynamo handler."""

    def __init__(self, lm: LanguageModel, *, splicer: Splicer, block_size: int = 16,
                 publisher: KvEventPublisher | None = None, resolver: HandleResolver | None = None,
                 prefix_tokens: int = 1 << 16, stream_interval_s: float = 0.0) -> None:
        self.lm = lm
        self.splicer = splicer
        self.block_size = block_size
        self.publisher = publisher
        self.stream_interval_s = stream_interval_s  # our frontend's requests: tokens per item (engines.stream)
        self.metrics: WorkerMetricsPublisher | None = None  # when serving: the load the KV router reads
        self._active: dict[object, int] = {}  # request -> prompt + max_tokens
        self.resolver = resolver or HandleResolver()
        self.prefix = PrefixCache(block_size, prefix_tokens)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mm-engine")
        self.requests = 0

    @property
    def context_length(self) -> int:
        return self.lm.context_length

    # --- model work (engine thread) ----------------------------------------------------------

    def prefill(self, prompt: Prompt) -> tuple[torch.Tensor, Cache, torch.Tensor | None, int]:
        """The prompt's last logits, its KV cache, its next M-RoPE position (None: plain RoPE) and
        how many of its tokens came from the prefix store."""
        with torch.inference_mode():
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
            self._publish(ids, hashes, infos, stored, removed, prompt.salt)
            nxt = None if positions is None else positions.max() + 1
            return logits, cache, nxt, start

    def step(self, token: int, cache: Cache, position: torch.Tensor | None) -> tuple[torch.Tensor, Cache]:
        with torch.inference_mode():
            x = self.lm.embed([token])
            pos = None if position is None else position.reshape(1, 1).expand(3, 1)
            return self.lm.forward(x, cache, pos)

    # --- KV events: what the prefix store holds, hashed as the router hashes ----------------

    def _block_hashes(self, prompt: Prompt) -> tuple[list[int], list[BlockMMInfo | None] | None]:
        n_full = len(prompt.token_ids) // self.block_size
        if n_full == 0:
            return [], None
        n = n_full * self.block_size
        spans = [_clip(MediaSpan(m.mm_hash, tuple((o, k) for o, k in m.spans)), n) for m in prompt.media]
        infos = block_mm_infos(n, self.block_size, spans)
        return block_hashes(prompt.token_ids[:n], self.block_size, infos, prompt.salt), infos

    def _publish(self, ids: list[int], hashes: list[int], infos: list[BlockMMInfo | None] | None, stored: list[int],
                 removed: list[int], salt: str = "") -> None:
        if self.publisher is None:
            return
        if stored:
            n = len(hashes) * self.block_size
            # a tenant's salt: the router hashes these blocks as it hashes its queries' cache_namespace
            self.publisher.publish_stored(ids[:n], [self.block_size] * len(hashes), hashes, None, infos,
                                          cache_salt=salt or None)
        if removed:
            self.publisher.publish_removed(removed)

    # --- the handler: this project's requests through the front door, Dynamo's beside it ---

    def respond(self, request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        """The Dynamo handler: this project's `EngineRequest` (which declares its protocol) or
        Dynamo's preprocessed request from the stock frontend (`core.engine_request.protocol_of`)."""
        if protocol_of(request) == "dynamo":
            return self.generate_dynamo(request, context)
        return self.generate(request, context)

    def sampling(self, req: EngineRequest) -> SamplingParams:
        if isinstance(req, InlineRequest):
            raise BadRequest("this engine does not encode media; start it with --encode-inline")
        return SamplingParams.from_dict(req.sampling)

    async def inputs(self, req: EngineRequest, media: list[Media]) -> Prompt:
        placed = [Placed(m.mm_hash, m.modality, list(m.spans), [list(g) for g in m.grids]) for m in media]
        return Prompt(req.token_ids, media_rows(media, self.lm.hidden_size), placed, req.cache_salt)

    async def tokens(self, req: EngineRequest, prompt: Prompt, params: SamplingParams,
                     context: Any) -> AsyncIterator[tuple[TokenBatch, int]]:
        async for step, reused in self.decode(prompt, req.max_tokens, params, req.eos_token_ids, context):
            yield step.batch(self.splicer.tok), reused

    async def generate_dynamo(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        """Dynamo's preprocessed request from the stock frontend: Dynamo's output chunks, the last
        with the expanded prompt's length as `completion_usage.prompt_tokens`."""
        from ..runtime.dynamo import worker_error

        with tracing.Stretch("mm_engine.generate", tracing.from_dynamo(context), kind="server",
                             attributes={"mm_engine.protocol": "dynamo"}) as root:
            try:
                req = from_preprocessed(request, self.splicer, self.context_length,
                                        context.id() if context is not None else None)
                params = self.sampling(req)
                with tracing.within(root):
                    prompt = await self.prepare(req, {})
            except MMEncoderError as e:
                raise worker_error(e) from None
            n = 0
            async for batch, _ in self.tokens(req, prompt, params, context):
                n += 1
                yield {**dynamo_chunk(batch.token_ids[0], batch.finish_reason, len(prompt.token_ids), n),
                       **batch.logprob_fields()}

    async def decode(self, prompt: Prompt, max_tokens: int, params: SamplingParams, eos_token_ids: list[int],
                     context: Context | None = None) -> AsyncIterator[tuple[Step, int]]:
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
