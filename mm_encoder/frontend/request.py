"""One chat request's state in the frontend, from admission to its last chunk (as vLLM v1 keeps one
state per request): what it holds of the processor (`Hold`), its timings, its spans and its record
at /mm/stats. The processor's steps read and write this one object; nothing of a request is kept
anywhere else, and its record is written once, complete, never changed after."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..core.engine_reply import Usage
from ..core.timing import ms_since
from ..runtime import tracing
from .hold import Hold

if TYPE_CHECKING:
    from opentelemetry.trace import Span


@dataclass(frozen=True)
class Routed:
    """Where the router sent the request and what it sent: its record's fields besides the timings."""

    worker_id: int
    overlap_blocks: int
    prompt_tokens: int | None  # None: the engine counts them (the aggregated baseline: timings' prompt_tokens)
    media: list[str]  # each item's mm_hash, or (the aggregated baseline) its URL's first 64 characters


class FrontendRequest:
    """One request's state; as a `with` block, ended (`close`) whichever way the request ends."""

    def __init__(self, rid: str, hold: Hold, root: Span, recent: deque[dict[str, Any]],
                 live: dict[str, FrontendRequest]) -> None:
        self.rid, self.hold, self.root = rid, hold, root  # root: the request's span (`generate`'s)
        self.t0 = time.perf_counter()  # admitted, before the dispatch: what first_token_ms counts from
        # encode_ms and route_ms (by handle), then the answer's: first_token_ms, the engine's
        # engine_<stage>_ms, reused_tokens and (the aggregated baseline) prompt_tokens
        self.timings: dict[str, float] = {}
        self.routed: Routed | None = None  # set once the router has chosen an engine
        self.scope = ""  # its tenant's cache scope (`security.tenants`); "" when tenants are off
        self.engine: tracing.Stretch | None = None  # the engine call's span: from the send to its stream's end
        self._recent = recent  # the processor's /mm/stats records
        self._live = live  # the processor's routed requests in flight, by id (/mm/stats `in_flight`)
        self._recorded = False

    def route(self, routed: Routed) -> None:
        """The router's choice: from now on the request is listed in flight (where it went) until it ends."""
        self.routed = routed
        self._live[self.rid] = self

    def in_flight(self) -> dict[str, Any]:
        """What /mm/stats says of it while the answer is on its way: where it went, not yet its timings."""
        assert self.routed is not None
        r = self.routed
        return {"request_id": self.rid, "trace_id": tracing.trace_id(self.root), "worker_id": r.worker_id,
                "prompt_tokens": r.prompt_tokens, "media": r.media, "ms": round(ms_since(self.t0), 3)}

    def first_item(self, usage: Usage | None) -> int:
        """The engine's first item: its time and the engine's figures (each stage's time, the
        prompt tokens its prefix store supplied) into the timings, the hold's wait and media slot
        given back. The prompt's length: ours, or the engine's count where it counts (the
        aggregated baseline, shown in the timings)."""
        t = self.timings
        t["first_token_ms"] = ms_since(self.t0)
        if self.engine is not None:
            self.engine.span.add_event("first_item")
        for stage, ms in (usage.timings_ms if usage else {}).items():  # fetch, decode, prefill
            t[f"engine_{stage}_ms"] = ms
        t["reused_tokens"] = usage.reused_tokens if usage else 0
        self.hold.first_item()
        ours = self.routed.prompt_tokens if self.routed is not None else None
        if ours is not None:
            return ours
        t["prompt_tokens"] = counted = usage.prompt_tokens if usage else 0
        return counted

    def record(self) -> None:
        """Write the request's record at /mm/stats, once and complete. The answer calls it when the
        finish is known, before the last chunk goes out (`mm-encoder status` and tests read
        /mm/stats as soon as an answer is complete); `close` for a request that ends otherwise
        (refused by the engine, failed or cancelled after routing). A request never routed has none."""
        if self.routed is None or self._recorded:
            return
        self._recorded = True
        r = self.routed
        self._recent.append({"request_id": self.rid, "trace_id": tracing.trace_id(self.root),
                             "worker_id": r.worker_id, "overlap_blocks": r.overlap_blocks,
                             "prompt_tokens": r.prompt_tokens, "media": r.media, "timings": dict(self.timings)})

    def close(self) -> None:
        """The request has ended, however: its record written if not yet, its hold given back."""
        self._live.pop(self.rid, None)
        try:
            self.record()
        finally:
            self.hold.release()

    def __enter__(self) -> FrontendRequest:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
