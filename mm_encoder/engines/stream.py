"""Engine output items, batched: every token that is ready goes in one item, at most one item per
interval after the first.

Each item an engine yields crosses Dynamo's Rust stream into the frontend's Python and back out as
a chunk; per token that crossing costs more than all the frontend's own work on it. Merging the
tokens produced within `interval_s` of the last item into one item divides that cost by the tokens
per item, and adds at most the interval to a token's delivery. The first `IMMEDIATE` items are never
held (a byte-level token often holds part of a character, so the first visible text may need the
second token), nor is the last. vLLM's `--stream-interval` makes the same trade.

A client that reads the whole answer at once (a non-streamed request: `EngineRequest.stream` False)
gets nothing from interim items: then only the first goes alone (the frontend's router learns that
the prefill is done) and every later token waits for the finish, two items per answer.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator

from ..core.engine_reply import TokenBatch

IMMEDIATE = 2  # items sent as they come before the interval applies: the time to first text is not held
# The engines' default interval: an item costs the frontend about what 5 tokens cost Dynamo's stock
# frontend (BENCHMARKS.md), so at ~100 tokens/s per request 40 ms keeps a streamed answer within
# its cost; a reader sees text 25 times a second.
STREAM_INTERVAL_MS = 40.0


def pacing(stream: bool, interval_s: float) -> tuple[float, int]:
    """(interval, items sent unheld) for one of our frontend's requests: a non-streamed one's
    (`EngineRequest.stream` False) tokens wait for the finish after the first item."""
    if not stream:
        return math.inf, 1
    return interval_s, IMMEDIATE


async def batched(items: AsyncIterator[TokenBatch], interval_s: float,
                  immediate: int = IMMEDIATE) -> AsyncIterator[TokenBatch]:
    """`items` merged (`TokenBatch.extend`) so that, after the first `immediate`, an item goes out
    only once `interval_s` has passed since the last one, or at the finish. 0: as they come;
    infinite: at the finish."""
    if interval_s <= 0:
        async for item in items:
            yield item
        return
    pending: TokenBatch | None = None
    last, sent = 0.0, 0
    async for item in items:
        if pending is None:
            pending = item
        else:
            pending.extend(item)
        now = time.monotonic()
        if sent < immediate or pending.finish_reason or now - last >= interval_s:
            yield pending
            pending, last, sent = None, now, sent + 1
    if pending is not None:
        yield pending
