"""The bottom two cache levels of the hierarchy, and single-flight.

- `AliasCache`: (scope, URL, processor identity) -> mm_hash, with a TTL because URLs are mutable.
  A hit skips the download; scopes (tenants) never see each other's entries.
- `BodyCache`: (scope, mm_hash) -> packed response body with its header (`wire.Packed`), capped in body
  bytes (not entries: a 4K image's body is ~1000x a thumbnail's). A hit skips decode, preprocess
  and forward. It remembers the last `FORGOTTEN` mm_hashes it dropped (evicted, cleared, or too big
  to keep), so a body put back for one of them counts as a refill: a re-encode of an image this
  worker had encoded before (forwards minus refills: the unique images, for the fleet dashboard).
  Its key is `body_key(scope, mm_hash)`: the mm_hash alone without a scope, so with tenants off
  nothing changes; with them on, one tenant never reads (or times) another's body.
- `SingleFlight`: concurrent identical work runs once; errors are returned to the waiters of
  that flight only, never stored.

The LRUs are cachetools' (`TTLCache`, `LRUCache` with `getsizeof=len`), counting what they evict
and expire for /metrics. Not thread-safe: used from the event loop only.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import cachetools

from ..core.wire import Packed

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")
_AliasKey = tuple[str, str, bytes]  # (scope, url, processor identity)
FORGOTTEN = 1 << 16  # dropped mm_hashes a BodyCache remembers (about 12 MB of keys at most)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expirations: int = 0
    refills: int = 0  # puts of a key the cache had dropped before (BodyCache)


class _CountsEvictions(cachetools.Cache[K, V]):
    """Counts the entries a cachetools cache evicts to stay within its cap."""

    stats: CacheStats

    def popitem(self) -> tuple[K, V]:
        item = super().popitem()
        self.stats.evictions += 1
        return item


class _Forgotten:
    """The last `size` keys a cache dropped, oldest first out."""

    def __init__(self, size: int = FORGOTTEN):
        self.size = size
        self._keys: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.size:
            self._keys.popitem(last=False)

    def take(self, key: str) -> bool:
        """Whether `key` was dropped before (and forget that it was)."""
        if key not in self._keys:
            return False
        del self._keys[key]
        return True


class _LRU(_CountsEvictions[str, Packed], cachetools.LRUCache[str, Packed]):
    forgotten: _Forgotten

    def popitem(self) -> tuple[str, Packed]:
        item = super().popitem()
        self.forgotten.add(item[0])
        return item


class _TTL(_CountsEvictions[_AliasKey, str], cachetools.TTLCache[_AliasKey, str, float]):
    def expire(self, time: float | None = None) -> list[tuple[_AliasKey, str]]:
        expired = super().expire(time)
        self.stats.expirations += len(expired)
        return expired


class AliasCache:
    """LRU of (scope, url, identity) -> mm_hash; entries expire `ttl_s` after they were written."""

    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.enabled = max_entries > 0 and ttl_s > 0
        self.stats = CacheStats()
        self._entries = _TTL(max(max_entries, 1), max(ttl_s, 1e-9), timer=clock)
        self._entries.stats = self.stats

    def get(self, scope: str, url: str, identity: bytes) -> str | None:
        self._entries.expire()
        mm_hash = self._entries.get((scope, url, identity))
        if mm_hash is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        return mm_hash

    def put(self, scope: str, url: str, identity: bytes, mm_hash: str) -> None:
        if self.enabled:
            self._entries[(scope, url, identity)] = mm_hash

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def _body_size(entry: Packed) -> int:
    return len(entry.body)


def body_key(scope: str, mm_hash: str) -> str:
    """The mm_hash LRU's (and its single-flight's) key: the mm_hash, prefixed by the request's scope
    when it has one (the frontend's keyed hash of a tenant, `security.tenants`)."""
    return f"{scope}/{mm_hash}" if scope else mm_hash


class BodyCache:
    """LRU of `body_key(scope, mm_hash)` -> body and header, holding at most `max_bytes` of bodies."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.stats = CacheStats()
        self._entries = _LRU(max(max_bytes, 1), getsizeof=_body_size)
        self._entries.stats = self.stats
        self._entries.forgotten = self._forgotten = _Forgotten()

    @property
    def bytes(self) -> int:
        return int(self._entries.currsize)  # a sum of body lengths

    def get(self, mm_hash: str) -> Packed | None:
        entry = self._entries.get(mm_hash)
        if entry is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        return entry

    def put(self, mm_hash: str, entry: Packed) -> None:
        if self._forgotten.take(mm_hash):
            self.stats.refills += 1
        if len(entry.body) <= self.max_bytes:  # a bigger one would evict everything and still not fit
            self._entries[mm_hash] = entry
        else:
            self._forgotten.add(mm_hash)

    def clear(self) -> None:
        for mm_hash in list(self._entries):
            self._forgotten.add(mm_hash)
        self._entries.clear()

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


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
