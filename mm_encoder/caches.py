"""The bottom two cache levels of the hierarchy, and single-flight.

- `AliasCache`: (scope, URL, processor identity) -> mm_hash, with a TTL because URLs are mutable.
  A hit skips the download; scopes (tenants) never see each other's entries.
- `BodyCache`: mm_hash -> packed response body, capped in bytes (not entries: a 4K image's body
  is ~1000x a thumbnail's). A hit skips decode, preprocess and forward.
- `SingleFlight`: concurrent identical work runs once; errors are returned to the waiters of
  that flight only, never stored.

Hand-written rather than `cachetools`/`async-lru`: neither caps by bytes with eviction counters,
and both are ~30 lines here over an OrderedDict. Not thread-safe: used from the event loop only.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expirations: int = 0


class AliasCache:
    """LRU of (scope, url, identity) -> mm_hash; entries expire `ttl_s` after they were written."""

    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str, bytes], tuple[str, float]] = OrderedDict()
        self.stats = CacheStats()

    def get(self, scope: str, url: str, identity: bytes) -> str | None:
        key = (scope, url, identity)
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        mm_hash, expires = entry
        if self._clock() >= expires:
            del self._entries[key]
            self.stats.expirations += 1
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return mm_hash

    def put(self, scope: str, url: str, identity: bytes, mm_hash: str) -> None:
        if self.max_entries <= 0 or self.ttl_s <= 0:
            return
        key = (scope, url, identity)
        self._entries[key] = (mm_hash, self._clock() + self.ttl_s)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self.stats.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)


class BodyCache:
    """LRU of mm_hash -> response body, holding at most `max_bytes` of bodies."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self.stats = CacheStats()

    def get(self, mm_hash: str) -> bytes | None:
        body = self._entries.get(mm_hash)
        if body is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(mm_hash)
        self.stats.hits += 1
        return body

    def peek(self, mm_hash: str) -> bytes | None:
        """A lookup that neither counts nor refreshes (for a second look inside one request)."""
        return self._entries.get(mm_hash)

    def put(self, mm_hash: str, body: bytes) -> None:
        if len(body) > self.max_bytes:
            return  # would evict everything and still not fit
        old = self._entries.pop(mm_hash, None)
        if old is not None:
            self.bytes -= len(old)
        self._entries[mm_hash] = body
        self.bytes += len(body)
        while self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= len(evicted)
            self.stats.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)


class _Flight(Generic[T]):
    __slots__ = ("task", "waiters")

    def __init__(self, task: asyncio.Task[T]):
        self.task = task
        self.waiters = 0


class SingleFlight(Generic[T]):
    """`run(key, fn)`: the first caller starts `fn()`, concurrent callers with the same key await it.

    The work is cancelled only when every waiter has gone (one impatient client must not fail the
    others). The key is released as soon as the work ends, so a failure is never replayed.
    """

    def __init__(self) -> None:
        self._flights: dict[Hashable, _Flight[T]] = {}
        self.joined = 0  # callers that shared someone else's work

    def __contains__(self, key: Hashable) -> bool:
        return key in self._flights

    async def run(self, key: Hashable, fn: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """The result, and whether this caller joined an existing flight."""
        flight = self._flights.get(key)
        joined = flight is not None
        if flight is None:
            flight = _Flight(asyncio.ensure_future(self._work(key, fn)))
            flight.task.add_done_callback(_retrieve)  # no "exception never retrieved" if all waiters left
            self._flights[key] = flight
        else:
            self.joined += 1
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task), joined
        except asyncio.CancelledError:
            if not flight.task.done() and flight.waiters == 1:
                flight.task.cancel()
            raise
        finally:
            flight.waiters -= 1

    async def _work(self, key: Hashable, fn: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await fn()
        finally:
            self._flights.pop(key, None)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
