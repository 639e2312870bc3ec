"""The chat processor that runs inside Dynamo's HTTP frontend (one per served model).

Per request: parse messages -> render the checkpoint's chat template over them as given -> encode
every media item (concurrently, through the cache chain or RPC) -> expand each item's placeholder
to its rows, as the model's processor does -> recount and cap max_tokens ->
route on (tokens, [mm_hash]) with Dynamo's KvRouter -> send token ids + one handle per media item
(`core.handle`) to the chosen engine over our own Dynamo endpoint -> stream OpenAI chunks back.
The encoders answer this process with headers only and the engine fetches each body itself: no
embeddings pass through here, and an engine request is kilobytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..client.encoder import Encoded, EncoderClient
from ..core.context import room
from ..core.engine_reply import parse_item
from ..core.engine_request import EngineRequest, InlineRequest, MediaInput
from ..core.errors import (
    ContextOverflow,
    Draining,
    EngineUnavailable,
    MMEncoderError,
    Overloaded,
    RequestTooLarge,
)
from ..core.prompt import ChatTokenizer, Splicer
from ..core.requests import MediaRef
from ..core.sampling import SamplingParams
from ..core.spec import ModelSpec
from ..core.timing import ms_since
from ..routing import BlockMMInfo, MediaSpan, block_mm_infos
from ..runtime import tracing
from ..runtime.dynamo import TOO_LARGE_HINT, client_error, internal_error, is_too_large, payload
from ..security.tenants import Tenants
from . import chunks
from .chat import IncrementalDetokenizer, StopStrings, item_text, parse_messages, text_bytes
from .hold import Capacity, Hold
from .request import FrontendRequest, Routed

if TYPE_CHECKING:
    from ..runtime.dynamo import Context

log = logging.getLogger(__name__)
# Prompts with at most this much text are rendered and tokenized on the event loop (well under a
# millisecond); longer ones in a thread, so one long prompt does not stall every other request.
INLINE_TEXT_BYTES = 4096


@dataclass
class Stats:
    """Counters and the last requests' records (`FrontendRequest.record`), served at GET /mm/stats."""

    requests: int = 0
    media_items: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    routed: Counter[str] = field(default_factory=Counter)
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=256))
    live: dict[str, FrontendRequest] = field(default_factory=dict)  # routed and not ended: `in_flight`


@dataclass
class Limits:
    context_length: int
    default_max_tokens: int = 256
    max_media: int = 16
    # Requests with media between encoding and the engine's first item. Others wait before
    # encoding: this keeps engines from queueing more media prefills (each a body fetch and a long
    # prefill) than they can take before the RPC deadline. It bounds no memory here: handles are small.
    max_inflight_media: int = 8
    # Requests in flight at once (any kind); beyond: 503. About what the engines take in a few
    # seconds: a deeper queue only makes every request late.
    max_inflight_requests: int = 128


class Router(Protocol):
    """What the processor asks of Dynamo's KvRouter over the engines (`runtime.dynamo.kv_router`)."""

    async def best_worker(self, token_ids: list[int], *, block_mm_infos: list[BlockMMInfo | None] | None = None,
                          request_id: str | None = None, cache_namespace: str | None = None
                          ) -> tuple[int, int, int]: ...
    async def mark_prefill_complete(self, request_id: str, /) -> None: ...
    async def free(self, request_id: str, /) -> None: ...


class EngineClient(Protocol):
    """What the processor asks of Dynamo's client of the engines' generate endpoint."""

    async def direct(self, request: dict[str, Any], instance_id: int, /) -> AsyncIterator[Any]: ...
    def instance_ids(self) -> list[int]: ...


class MultimodalProcessor:
    def __init__(self, *, served_name: str, spec: ModelSpec, tokenizer: ChatTokenizer, encoder: EncoderClient | None,
                 router: Router, engine_client: EngineClient, block_size: int, eos_token_ids: list[int],
                 limits: Limits, inline_media: bool = False, trust_client_trace: bool = False,
                 tenants: Tenants | None = None) -> None:
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
        # how media reach the engines, chosen once: by handle, or (the aggregated baseline) by URL, the
        # engines fetching and encoding them themselves
        self._media_path = self._inline if inline_media else self._by_handle
        self.trust_client_trace = trust_client_trace  # continue a client's traceparent, or link it (`generate`)
        self.tenants = tenants or Tenants()  # the scope of each request's cache entries (`security.tenants`)
        self.stats = Stats()
        self.capacity = Capacity(limits.max_inflight_media)  # what requests in flight hold (`frontend.hold`)
        self._notes: set[asyncio.Future[None]] = set()  # router bookkeeping in flight (`_router_note`)
        self.draining = False  # set on SIGTERM: new requests get 503 while those in flight finish
        self.last_request = 0.0  # time.monotonic() of the latest request: when a drain may close connections

    def check_text_size(self, messages: list[dict[str, Any]]) -> int:
        """The text's size in bytes; refused, before rendering it, if it cannot fit: every token is
        at most `max_token_bytes` bytes, so more bytes than context x that is more tokens than the context."""
        size = text_bytes(messages)
        limit = self.limits.context_length * self.tok.max_token_bytes
        if size > limit:
            raise ContextOverflow(f"the prompt's text is {size} bytes: more than {self.limits.context_length} tokens "
                                  f"of at most {self.tok.max_token_bytes} bytes each, the model's context length")
        return size

    def max_tokens_for(self, params: SamplingParams, prompt_tokens: int) -> int:
        """Cap the completion so prompt + completion fits; refuse a prompt that alone does not."""
        return min(params.max_tokens or self.limits.default_max_tokens, room(prompt_tokens, self.limits.context_length))

    async def generate(self, request: dict[str, Any], context: Context | None = None) -> AsyncIterator[dict[str, Any]]:
        """One chat request: admitted (`_admit`), made ready and sent to an engine (`_dispatch`), its
        answer streamed back as OpenAI chunks (`_answer`). Once admitted, all of it is one
        `FrontendRequest` (its `Hold` of this processor, timings, spans and /mm/stats record), ended
        whichever way the request ends. Traced as one span over its steps' spans: the root of a new
        trace that links the client's (as Dynamo's request context carries it), or with
        `trust_client_trace` a child of the client's trace."""
        self.last_request = time.monotonic()
        rid = uuid.uuid4().hex
        parent, links = tracing.from_client(context, trust=self.trust_client_trace)
        with tracing.Stretch("mm_frontend.request", parent, kind="server", links=links,
                             attributes={"mm_frontend.model": self.served_name, "mm_frontend.request_id": rid}) as root:
            if root.is_recording() and context is not None:  # tracing off: no call into Dynamo's runtime for it
                root.set_attribute("dynamo.request_id", context.id())
            with tracing.within(root):
                self._admit()
            hold = Hold(self.capacity, rid, lambda rid: self._router_note(self.router.free, rid))
            with FrontendRequest(rid, hold, root, self.stats.recent, self.stats.live) as state:
                with tracing.within(root):  # no yield inside: the steps' spans are children of the request's
                    params, stream = await self._dispatch(request, state, context)
                async for chunk in self._answer(state, params, stream, context):
                    yield chunk

    def _admit(self) -> None:
        """Fewer than `max_inflight_requests` in flight, or a 503 at once: not a queue that grows
        until clients time out (measured: bench/soak.py)."""
        inflight = self.capacity.inflight
        if self.draining or inflight >= self.limits.max_inflight_requests:
            e = Draining("this frontend is shutting down; retry on another replica") if self.draining else \
                Overloaded(f"{inflight} requests are in flight (--max-inflight-requests); retry shortly")
            self.stats.errors[e.code] += 1
            raise client_error(e)

    async def _dispatch(self, request: dict[str, Any], state: FrontendRequest,
                        context: Context | None = None) -> tuple[SamplingParams, AsyncIterator[Any]]:
        """The tenant's scope (from the context's headers), then parse, render, encode the media,
        expand, route and send: the sampling asked for and the engine's stream. A refusal is raised
        as the client's error (a bug as a 500), counted and logged once."""
        rid = state.rid
        self.stats.requests += 1
        log.debug("request %s fields %s", rid, sorted(request))
        try:
            state.scope = self.tenants.scope(context)
            params = SamplingParams.from_openai(request)
            messages, media = parse_messages(request.get("messages"), self.limits.max_media, self.splicer.reserved)
            size = self.check_text_size(messages)
            # rendering and tokenizing a long prompt takes seconds: off the loop, so others are not
            # blocked; a short one takes less than the hop to a thread and back
            short = size <= INLINE_TEXT_BYTES
            with tracing.span("template", attributes={"mm_frontend.text_bytes": size}):
                text = self.tok.render(messages) if short else await asyncio.to_thread(self.tok.render, messages)
            stream = await self._media_path(state, params, text, media, self._interim(request, params), short)
            state.hold.sent()
            return params, stream
        except MMEncoderError as e:
            self.stats.errors[e.code] += 1
            log.warning("request %s refused: [%s] %s", rid, e.code, e.message)
            raise client_error(e) from None
        except Exception as e:
            self.stats.errors["internal"] += 1
            log.exception("request %s failed before the engine", rid)
            raise internal_error(e) from None

    async def _by_handle(self, state: FrontendRequest, params: SamplingParams, text: str, media: list[MediaRef],
                         interim: bool, short: bool) -> AsyncIterator[Any]:
        """Every item encoded (its header and handle), the prompt expanded, routed on (tokens,
        [mm_hash]) and sent by handle: the engine's stream."""
        timings = state.timings
        if media:
            with tracing.span("admission", attributes={"mm_frontend.media_waiting": self.capacity.waiting}):
                await state.hold.take_media_slot()
        t_enc = time.perf_counter()
        encoded: list[Encoded] = []
        if media:
            assert self.encoder is not None  # the provider makes one unless inline_media
            encoded = await self.encoder.embed_all(media, state.scope)
        timings["encode_ms"] = ms_since(t_enc)
        self.stats.media_items += len(media)
        grids = [(e.handle.header.modality, e.handle.num_tokens, e.handle.header.timestamps) for e in encoded]
        with tracing.span("splice+tokenize") as span:
            spliced = (self.splicer.expand_text(text, grids) if short and not encoded
                       else await asyncio.to_thread(self.splicer.expand_text, text, grids))
            span.set_attribute("mm_frontend.prompt_tokens", len(spliced.token_ids))
        # each item's one record from here on: its handle, its spans in the prompt (and its body,
        # in the body transport); routing, the stats and the engine request all read it
        items = [MediaInput(e.handle, list(spans), e.body)
                 for e, spans in zip(encoded, spliced.spans, strict=True)]
        prompt_tokens = len(spliced.token_ids)
        max_tokens = self.max_tokens_for(params, prompt_tokens)
        t_route = time.perf_counter()
        with tracing.span("route") as span:
            infos = block_mm_infos(prompt_tokens, self.block_size,
                                   [MediaSpan(m.mm_hash, tuple(m.spans)) for m in items])
            worker_id, overlap = await self._route(state.hold, spliced.token_ids, infos, state.scope)
            span.set_attributes({"mm_frontend.worker_id": str(worker_id), "mm_frontend.overlap_blocks": overlap})
        timings["route_ms"] = ms_since(t_route)
        state.route(Routed(worker_id, overlap, prompt_tokens, [m.mm_hash for m in items]))
        req = EngineRequest(state.rid, spliced.token_ids, max_tokens, self.eos_token_ids, items,
                            sampling=params.to_dict(), stream=interim, cache_salt=state.scope)
        return await self._send(req, state)

    async def _route(self, hold: Hold, token_ids: list[int], infos: list[BlockMMInfo | None] | None = None,
                     scope: str = "") -> tuple[int, int]:
        """(engine, overlapping blocks) from Dynamo's KV router, which from then on counts the
        request on that engine until `Hold.release` frees it. A tenant's `scope` is the router's cache
        namespace: its blocks overlap only its own."""
        try:
            worker_id, _, overlap = await self.router.best_worker(token_ids, block_mm_infos=infos, request_id=hold.rid,
                                                                  cache_namespace=scope or None)
        except Exception as e:  # Dynamo raises a plain Exception when no engine is registered
            raise EngineUnavailable(f"no engine to route to: {e}") from None
        hold.routed = True
        self.stats.routed[str(worker_id)] += 1
        return worker_id, overlap

    async def _answer(self, state: FrontendRequest, params: SamplingParams, stream: AsyncIterator[Any],
                      context: Context | None = None) -> AsyncIterator[dict[str, Any]]:
        """The engine's items as OpenAI chunks, one per item (the tokens the engine had ready, even
        when they decode to no text yet), with exact stop-string semantics over batched items."""
        assert state.engine is not None  # `_send` started the engine call's span
        rid, created = state.rid, int(time.time())
        finish: str | None = None
        detok = IncrementalDetokenizer(self.tok)
        stops = StopStrings(params.stop)
        prompt_tokens, first = 0, True  # the prompt's length: known at the engine's first item
        try:
            with state.engine as span:  # ends with the stream, the engine's failure recorded as it came
                try:
                    async for item in _engine_items(stream):
                        try:
                            data = parse_item(item)  # a refusal before the first token is raised here
                        except MMEncoderError as e:
                            self.stats.errors[e.code] += 1
                            log.warning("request %s refused by the engine: [%s] %s", rid, e.code, e.message)
                            raise client_error(e) from None
                        finish = data.finish_reason
                        if first:
                            first = False
                            prompt_tokens = state.first_item(data.usage)
                            if not finish:  # else the router's free, at the end, does it in one call
                                self._router_note(self.router.mark_prefill_complete, rid)
                        delta, used, matched = item_text(detok, stops, data.token_ids, bool(finish))
                        if matched:  # a stop string: the text ends before it, and so does generation
                            finish = "stop"
                            data = data.first(used)
                        lp = chunks.logprobs(self.tok, data, params.top_logprobs) if params.logprobs else None
                        out = chunks.chunk(rid, created, self.served_name, {"role": "assistant", "content": delta},
                                           finish, prompt_tokens, len(detok.ids), lp)
                        if finish:  # the record is complete: at /mm/stats before the client has the last chunk
                            state.record()
                        yield out
                        if finish or (context is not None and context.is_stopped()):
                            break
                finally:
                    span.set_attributes({"mm_frontend.finish_reason": finish or "",
                                         "mm_frontend.completion_tokens": len(detok.ids)})
        except EngineUnavailable as e:  # the engine died mid-stream: a retryable 5xx, not the client's fault
            self.stats.errors[e.code] += 1
            log.warning("request %s: [%s] %s", rid, e.code, e.message)
            raise client_error(e) from None

    @staticmethod
    def _interim(request: dict[str, Any], params: SamplingParams) -> bool:
        """Whether the engine sends tokens as they come (`EngineRequest.stream`): not for a client
        that reads the answer at once, unless stop strings may end it early (the engine knows none:
        this processor finds them, and stops the engine by leaving)."""
        return bool(request.get("stream")) or bool(params.stop)

    def _router_note(self, call: Callable[[str], Awaitable[None]], rid: str) -> None:
        """The router's bookkeeping for a request, not waited for: it only updates the router's load
        figures, and waiting would cost a crossing into Dynamo's runtime and back per call. Dynamo's
        call is already a running future (no task is made); its failure (an engine that died took its
        half of the books along: "Request ... not found") must not fail this request or later ones."""
        def done(fut: asyncio.Future[None]) -> None:
            self._notes.discard(fut)
            if not fut.cancelled() and fut.exception() is not None:
                log.debug("request %s: router bookkeeping: %s", rid, fut.exception())

        try:
            fut = asyncio.ensure_future(call(rid))
        except Exception as e:  # Dynamo raises plain Exceptions here
            log.debug("request %s: router bookkeeping: %s", rid, e)
            return
        self._notes.add(fut)
        fut.add_done_callback(done)

    async def _inline(self, state: FrontendRequest, params: SamplingParams, text: str, media: list[MediaRef],
                      interim: bool, short: bool) -> AsyncIterator[Any]:
        """Aggregated baseline: route on the prompt's tokens (one placeholder per item) and let the
        engine fetch, encode and expand; the engine's stream (the engine counts the prompt)."""
        flat = await asyncio.to_thread(self.tok.encode, text)
        asked = params.max_tokens or self.limits.default_max_tokens
        worker_id, overlap = await self._route(state.hold, flat)
        self.stats.media_items += len(media)
        state.route(Routed(worker_id, overlap, None, [m.url[:64] for m in media]))
        req = InlineRequest(state.rid, [], int(asked), self.eos_token_ids, sampling=params.to_dict(), stream=interim,
                            prompt=text, media_refs=[{"url": m.url, "modality": m.modality} for m in media])
        return await self._send(req, state)

    async def _send(self, req: EngineRequest, state: FrontendRequest) -> AsyncIterator[Any]:
        """Send to the routed engine; if it is unreachable (a crashed engine stays in file discovery
        for a while), try once more on another registered instance. The engine's request carries
        this call's trace (`EngineRequest.trace`): Dynamo's request plane does not carry a Python
        caller's. The call's span goes on over the engine's stream, which `_answer` reads."""
        assert state.routed is not None  # routed before it is sent
        worker_id = state.routed.worker_id
        state.engine = call = tracing.Stretch("engine", kind="client",
                                              attributes={"mm_frontend.worker_id": str(worker_id)})
        tracing.inject(req.trace, tracing.context_of(call.span))  # the engine's spans continue this one
        with call.on_error():
            return await self._direct(req.to_dict(), worker_id)

    async def _direct(self, payload: dict[str, Any], worker_id: int) -> AsyncIterator[Any]:
        """The routed engine's stream, else another instance's once."""
        try:
            return await self.engine_client.direct(payload, worker_id)
        except Exception as e:
            if is_too_large(e):
                raise RequestTooLarge(
                    f"the engine request is above the request plane's message limit; {TOO_LARGE_HINT}") from None
            others = [i for i in self.engine_client.instance_ids() if i != worker_id]
            if not others:
                raise EngineUnavailable(f"engine {worker_id} unreachable: {e}") from None
            log.warning("engine %s unreachable (%s); retrying on %s", worker_id, e, others[0])
        try:
            return await self.engine_client.direct(payload, others[0])
        except Exception as e:
            raise EngineUnavailable(f"no engine reachable: {e}") from None

    @property
    def inflight(self) -> int:
        return self.capacity.inflight

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        return {
            "model": self.served_name,
            "requests": s.requests,
            "media_items": s.media_items,
            "encoder_calls": self.encoder.calls if self.encoder else 0,
            "encoder_fallbacks": self.encoder.fallbacks if self.encoder else 0,
            "encoder_body_bytes": self.encoder.body_bytes if self.encoder else 0,
            "errors": dict(s.errors),
            "routed": dict(s.routed),
            "media_requests_in_flight": self.capacity.waiting,
            "recent": list(s.recent),
            "in_flight": [r.in_flight() for r in s.live.values()],
        }


async def _engine_items(stream: AsyncIterator[Any]) -> AsyncIterator[object]:
    """The engine's items as they came (maps: `core.engine_reply.parse_item` reads each). A stream
    that breaks off (the engine died: Dynamo raises a plain ValueError, "Stream ended before
    generation completed") is EngineUnavailable, a 503."""
    try:
        async for item in stream:
            yield payload(item)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        raise EngineUnavailable(f"the engine's stream broke off: {e}") from None
