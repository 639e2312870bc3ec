"""The engines' one front door: what every engine does with this project's `EngineRequest` before
and around generating, written once for the transformers engine and the vLLM adapter.

`FrontDoor.generate` is the Dynamo handler for our protocol. Per request it parses the message
(`EngineRequest.from_dict`: each handle checked once), checks that prompt + `max_tokens` fits the
engine's context before any fetch, fetches every body by handle and decodes each once, checked
against its handle (`engines.inputs`), times the fetch, the decode and the prefill, turns a refusal
into the one `{"error": ...}` item (`core.engine_reply.refusal`), puts the request's `Usage` on the
first item and paces the stream (`engines.stream`). An engine implements only what differs:
`sampling` (the request's sampling fields as its own, refusing what it cannot apply), `inputs` (the
decoded media -> what its model takes) and `tokens` (generate from them).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..client import HandleResolver
from ..core.context import check_fits
from ..core.engine_reply import TokenBatch, Usage, refusal
from ..core.engine_request import EngineRequest
from ..core.errors import MMEncoderError
from ..core.timing import ms_since
from ..runtime import tracing
from .inputs import Media, decode_media, fetch_bodies
from .stream import batched, pacing

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)
Inputs = TypeVar("Inputs")
Sampling = TypeVar("Sampling")


class FrontDoor(ABC, Generic[Inputs, Sampling]):
    """The request path every engine shares; subclasses say how to run the model."""

    resolver: HandleResolver
    stream_interval_s: float = 0.0  # the tokens ready within this of the last item go out as one
    context_name = "the context length"  # how a refusal names the limit

    @property
    @abstractmethod
    def context_length(self) -> int: ...

    @abstractmethod
    def sampling(self, req: EngineRequest) -> Sampling:
        """The request's sampling as this engine applies it; a field it cannot apply is refused by
        name (BadRequest). Called before any fetch."""

    @abstractmethod
    async def inputs(self, req: EngineRequest, media: list[Media]) -> Inputs:
        """The request's decoded media as this engine's model input (refusing what it cannot take)."""

    @abstractmethod
    def tokens(self, req: EngineRequest, inputs: Inputs, sampling: Sampling,
               context: Any) -> AsyncIterator[tuple[TokenBatch, int]]:
        """Generate: each batch of new tokens with how many prompt tokens were reused (read from
        the first)."""

    async def generate(self, request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        """Our frontend's request, answered as `core.engine_reply` items; traced as one span over its
        steps' spans, a child of the frontend's engine call (the request's `trace`), else of the trace
        Dynamo's request context carries."""
        timings: dict[str, float] = {}
        try:
            req = EngineRequest.from_dict(request)
        except MMEncoderError as e:  # not a request of ours: nothing to trace
            yield refusal(e)
            return
        # our frontend's trace (the request's `trace`), else Dynamo's; Dynamo's own spans of the call linked
        dynamo = tracing.from_dynamo(context)
        with tracing.Stretch("mm_engine.generate", tracing.extract(req.trace) if req.trace else dynamo,
                             kind="server", links=(dynamo,) if req.trace else ()) as root:
            try:
                root.set_attributes({"mm_engine.request_id": req.request_id, "mm_engine.prompt_tokens":
                                     len(req.token_ids), "mm_engine.media": len(req.media)})
                with tracing.within(root):  # no yield inside: the fetch's spans (and log lines) are the request's
                    log.debug("request %s: %d prompt tokens, %d media", req.request_id, len(req.token_ids),
                              len(req.media))
                    sampling = self.sampling(req)
                    inputs = await self.prepare(req, timings)
            except MMEncoderError as e:
                root.set_attribute("mm_engine.refused", e.code)
                yield refusal(e)
                return
            async for batch in batched(self._with_usage(req, inputs, sampling, timings, context, root),
                                       *pacing(req.stream, self.stream_interval_s)):
                yield batch.to_dict()

    async def prepare(self, req: EngineRequest, timings: dict[str, float]) -> Inputs:
        """Checked, fetched and decoded, before any model work: the context first (no fetch for a
        request that cannot fit), then every body, then the engine's input. `req.token_ids` is
        the prompt the engine runs from here on."""
        self.check_fits(len(req.token_ids), req.max_tokens)
        t0 = time.perf_counter()
        with tracing.span("handle_fetch", attributes={"mm_engine.media": len(req.media)}) as span:
            bodies = await fetch_bodies(req, self.resolver)
            span.set_attribute("mm_engine.bytes", sum(len(b) for b in bodies))
        t1 = time.perf_counter()
        with tracing.span("handle_decode"):  # each body decoded once and checked against its handle
            inputs = await self.inputs(req, await decode_media(req, bodies))
        timings["fetch"], timings["decode"] = (t1 - t0) * 1e3, ms_since(t1)
        return inputs

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        check_fits(prompt_tokens, max_tokens, self.context_length, self.context_name)

    async def _with_usage(self, req: EngineRequest, inputs: Inputs, sampling: Sampling, timings: dict[str, float],
                          context: Any, root: Span) -> AsyncIterator[TokenBatch]:
        """The engine's batches, the first carrying the request's `Usage` (the frontend's /mm/stats);
        traced as a `prefill` span (to the first batch) and a `decode` span (the rest)."""
        t0 = time.perf_counter()
        parent = tracing.context_of(root)
        first, tokens, finish = True, 0, None
        steps = tracing.Stretch("prefill", parent, attributes={"mm_engine.prompt_tokens": len(req.token_ids)})
        with steps:  # prefill, then decode: whichever is open when the stream ends is ended, an error recorded
            try:
                async for batch, reused in self.tokens(req, inputs, sampling, context):
                    tokens += len(batch.token_ids)
                    finish = batch.finish_reason or finish
                    if first:
                        batch.usage = Usage(len(req.token_ids), reused, {**timings, "prefill": ms_since(t0)})
                        first = False
                        steps.span.set_attribute("mm_engine.reused_tokens", reused)
                        steps.then("decode", parent)
                    yield batch
            finally:
                if not first:
                    steps.span.set_attributes({"mm_engine.completion_tokens": tokens,
                                               "mm_engine.finish_reason": finish or ""})
