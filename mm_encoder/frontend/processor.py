"""The chat processor that runs inside Dynamo's HTTP frontend (one per served model).

Per request: parse messages -> render the chat template -> encode every media item (concurrently,
through the cache chain or RPC) -> splice placeholders by length -> recount and cap max_tokens ->
route on (tokens, [mm_hash]) with Dynamo's KvRouter -> send token ids + embedding bodies to the
chosen engine over our own Dynamo endpoint -> stream OpenAI chunks back. The engine's first item
means it has ingested the embeddings: from then on this processor holds no reference to them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..core.dynamo import TOO_LARGE_HINT, is_too_large
from ..core.errors import BadRequest, ContextOverflow, EngineUnavailable, MMEncoderError, RequestTooLarge
from ..core.prompt import ChatTokenizer, Splicer
from ..core.requests import EngineRequest, MediaInput
from ..core.spec import ModelSpec
from ..routing import MediaSpan, block_mm_infos
from .chat import IncrementalDetokenizer, parse_messages, prompt_segments
from .encoder_client import EncoderClient

log = logging.getLogger("mm_encoder.frontend")


@dataclass
class Stats:
    """Counters and the last routing decisions (served at GET /mm/stats)."""

    requests: int = 0
    media_items: int = 0
    errors: Counter = field(default_factory=Counter)
    routed: Counter = field(default_factory=Counter)
    recent: deque = field(default_factory=lambda: deque(maxlen=256))
    live_embedding_requests: int = 0  # requests whose embeddings this process still holds


@dataclass
class Limits:
    context_length: int
    default_max_tokens: int = 256
    max_media: int = 16
    # Requests that may hold embeddings at once (from encoding to the engine's first item). Others
    # wait before encoding, holding nothing: this bounds memory (a 4K image's body is ~40-60 MB)
    # and keeps engines from queueing more prefills than they can take before the RPC deadline.
    max_inflight_media: int = 8


class MultimodalProcessor:
    def __init__(self, *, served_name: str, spec: ModelSpec, tokenizer: ChatTokenizer, encoder: EncoderClient | None,
                 router, engine_client, block_size: int, eos_token_ids: list[int], limits: Limits,
                 inline_media: bool = False):
        self.served_name = served_name
        self.spec = spec
        self.tok = tokenizer
        self.splicer = Splicer(tokenizer, spec.prompt)
        self.encoder = encoder
        self.router = router
        self.engine_client = engine_client
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.limits = limits
        self.inline_media = inline_media  # the aggregated baseline: engines fetch and encode media themselves
        self.stats = Stats()
        self._media_slots = asyncio.Semaphore(limits.max_inflight_media)

    def max_tokens_for(self, request: dict[str, Any], prompt_tokens: int) -> int:
        """Cap the completion so prompt + completion fits; refuse a prompt that alone does not."""
        room = self.limits.context_length - prompt_tokens
        if room < 1:
            raise ContextOverflow(f"the prompt is {prompt_tokens} tokens after expanding its media; the model's "
                                  f"context length is {self.limits.context_length}")
        asked = request.get("max_completion_tokens") or request.get("max_tokens")
        if asked is not None and (not isinstance(asked, int) or asked < 1):
            raise BadRequest("max_tokens must be a positive integer")
        return min(asked or self.limits.default_max_tokens, room)

    async def generate(self, request: dict[str, Any], context=None) -> AsyncIterator[dict[str, Any]]:
        from dynamo.llm import HttpError

        rid = uuid.uuid4().hex
        self.stats.requests += 1
        log.debug("request %s fields %s", rid, sorted(request))
        routed = False
        slot = False
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        try:
            messages, media = parse_messages(request.get("messages"), self.limits.max_media)
            texts = prompt_segments(self.tok, messages, len(media))
            if self.inline_media:
                stream, prompt_tokens = await self._dispatch_inline(rid, request, texts, media)
                routed = True
                payload = None
            else:
                if media:
                    await self._media_slots.acquire()
                    slot = True
                t_enc = time.perf_counter()
                encoded = await self.encoder.embed_all(media) if media else []
                timings["encode_ms"] = (time.perf_counter() - t_enc) * 1e3
                self.stats.media_items += len(media)
                spliced = self.splicer.splice(
                    texts, [(e.header.modality, e.header.tokens_per_grid, e.header.timestamps) for e in encoded])
                prompt_tokens = len(spliced.token_ids)
                max_tokens = self.max_tokens_for(request, prompt_tokens)
                spans = [MediaSpan(e.header.mm_hash, tuple(s)) for e, s in zip(encoded, spliced.spans, strict=True)]
                infos = block_mm_infos(prompt_tokens, self.block_size, spans)
                t_route = time.perf_counter()
                try:
                    worker_id, _, overlap = await self.router.best_worker(spliced.token_ids, block_mm_infos=infos,
                                                                          request_id=rid)
                except Exception as e:  # Dynamo raises a plain Exception when no engine is registered
                    raise EngineUnavailable(f"no engine to route to: {e}") from None
                routed = True
                timings["route_ms"] = (time.perf_counter() - t_route) * 1e3
                self.stats.routed[str(worker_id)] += 1
                self.stats.recent.append({"request_id": rid, "worker_id": worker_id, "overlap_blocks": overlap,
                                          "prompt_tokens": prompt_tokens, "media": [s.mm_hash for s in spans],
                                          "timings": timings})
                payload = EngineRequest(rid, spliced.token_ids, max_tokens, self.eos_token_ids,
                                        [MediaInput(s.mm_hash, e.body, list(s.spans)) for e, s in zip(encoded, spans,
                                                                                                     strict=True)],
                                        ignore_eos=_ignore_eos(request)).to_dict()
                del encoded, spliced  # from here only `payload` holds the embedding bodies
                stream = await self._send(payload, worker_id)
                self.stats.live_embedding_requests += 1
        except BaseException as e:
            if slot:
                self._media_slots.release()
            if isinstance(e, MMEncoderError):
                await self._failed(rid, e.code, routed)
                log.warning("request %s refused: [%s] %s", rid, e.code, e.message)
                raise HttpError(e.http_status, f"[{e.code}] {e.message}") from None
            if isinstance(e, Exception):
                await self._failed(rid, "internal", routed)
                log.exception("request %s failed before the engine", rid)
                raise HttpError(500, f"internal error: {type(e).__name__}") from None
            if routed:  # cancelled: the client went away
                await self.router.free(rid)
            raise

        created = int(time.time())
        detok = IncrementalDetokenizer(self.tok)
        finish = None
        first = True
        try:
            async for item in stream:
                data = item.data() if hasattr(item, "data") else item
                if first:  # the engine has the embeddings: drop ours now, not at the end of the stream
                    timings["first_token_ms"] = (time.perf_counter() - t0) * 1e3
                    payload = None
                    self.stats.live_embedding_requests -= 1
                    first = False
                    if slot:
                        self._media_slots.release()
                        slot = False
                    await self.router.mark_prefill_complete(rid)
                if prompt_tokens is None:  # inline encoding: the engine counted the prompt
                    prompt_tokens = data.get("prompt_tokens", 0)
                finish = data.get("finish_reason")
                delta = detok.push(data.get("token_ids", []))
                if finish:
                    delta += detok.flush()
                # one chunk per engine step, even when the new tokens decode to no text yet
                yield self._chunk(rid, created, {"role": "assistant", "content": delta}, finish, prompt_tokens,
                                  len(detok.ids))
                if finish:
                    break
                if context is not None and context.is_stopped():
                    break
        finally:
            if first:
                payload = None
                self.stats.live_embedding_requests -= 1
            if slot:
                self._media_slots.release()
            await self.router.free(rid)

    async def _dispatch_inline(self, rid: str, request: dict[str, Any], texts: list[str], media) -> tuple:
        """Aggregated baseline: route on the text alone and let the engine fetch, encode and splice."""
        segments = [self.tok.encode(t) if t else [] for t in texts]
        flat = [t for seg in segments for t in seg]
        asked = request.get("max_completion_tokens") or request.get("max_tokens") or self.limits.default_max_tokens
        try:
            worker_id, _, overlap = await self.router.best_worker(flat, request_id=rid)
        except Exception as e:
            raise EngineUnavailable(f"no engine to route to: {e}") from None
        self.stats.routed[str(worker_id)] += 1
        self.stats.media_items += len(media)
        self.stats.recent.append({"request_id": rid, "worker_id": worker_id, "overlap_blocks": overlap,
                                  "prompt_tokens": None, "media": [m.url[:64] for m in media]})
        payload = EngineRequest(rid, [], int(asked), self.eos_token_ids, ignore_eos=_ignore_eos(request),
                                segments=segments, media_refs=[{"url": m.url, "modality": m.modality} for m in media])
        stream = await self._send(payload.to_dict(), worker_id)
        self.stats.live_embedding_requests += 1
        return stream, None

    async def _send(self, payload: dict[str, Any], worker_id: int):
        """Send to the routed engine; if it is unreachable (a crashed engine stays in file discovery
        for a while), try once more on another registered instance."""
        try:
            return await self.engine_client.direct(payload, worker_id)
        except Exception as e:
            if is_too_large(e):
                raise RequestTooLarge(
                    f"the engine request ({_payload_mb(payload):.0f} MB with embeddings) is above the request "
                    f"plane's message limit; {TOO_LARGE_HINT}") from None
            others = [i for i in self.engine_client.instance_ids() if i != worker_id]
            if not others:
                raise EngineUnavailable(f"engine {worker_id} unreachable: {e}") from None
            log.warning("engine %s unreachable (%s); retrying on %s", worker_id, e, others[0])
        try:
            return await self.engine_client.direct(payload, others[0])
        except Exception as e:
            raise EngineUnavailable(f"no engine reachable: {e}") from None

    async def _failed(self, rid: str, code: str, routed: bool) -> None:
        """Count the error (Dynamo's frontend shows clients only the status; the code is here and
        in the log) and release the router's bookkeeping for a request it had placed."""
        self.stats.errors[code] += 1
        if routed:
            await self.router.free(rid)

    def _chunk(self, rid: str, created: int, delta: dict, finish: str | None, prompt: int, completion: int) -> dict:
        chunk = {
            "id": f"chatcmpl-{rid}",
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.served_name,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        if finish:
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}
        return chunk

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        return {
            "model": self.served_name,
            "requests": s.requests,
            "media_items": s.media_items,
            "encoder_calls": self.encoder.calls if self.encoder else 0,
            "encoder_fallbacks": self.encoder.fallbacks if self.encoder else 0,
            "errors": dict(s.errors),
            "routed": dict(s.routed),
            "live_embedding_requests": s.live_embedding_requests,
            "recent": list(s.recent),
        }


def _payload_mb(payload: dict[str, Any]) -> float:
    return sum(len(m["body"]) for m in payload.get("media", [])) / 1e6


def _ignore_eos(request: dict[str, Any]) -> bool:
    """vLLM's `ignore_eos` extension, top level or under Dynamo's `nvext` (benchmarks use it)."""
    nvext = request.get("nvext") if isinstance(request.get("nvext"), dict) else {}
    return bool(request.get("ignore_eos") or nvext.get("ignore_eos"))
