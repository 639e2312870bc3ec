"""`Admission`: what one encode worker takes on at once, in one place, owned by its `EncodeService`.

Every bound is taken on the event loop before work is handed to a thread pool, so a request that
waits for room waits as a coroutine: it never holds one of the CPU workers, and a small image is
not queued behind a large one that cannot start yet.

- `receiving`: bytes of request bodies being read (announced sizes), refused at once beyond
  `--max-receiving-bytes` (aiohttp's client_max_size bounds one body, not many concurrent ones);
- `pending`: items past the caches (fetching, decoding, queued, in a forward), refused at once
  beyond `--max-pending`;
- `decoding`: pixels being decoded (a frame's pixels times the frames a video chunk holds), and
  `prepared`: patches prepared for the forward and not yet encoded. A request waits up to
  `--decode-wait-s` for room, then gets 503 `overloaded`; one that could never fit is refused at
  once with the media's own code (413).

Releases may come from pool threads (`release_soon`): the counts themselves change on the loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator

from ..core.errors import MediaError, Overloaded
from ..core.spec import MediaLimits


class Quota:
    """Units held at once, refused at once beyond `capacity` (`refusal(held, n)` says why)."""

    def __init__(self, capacity: int, refusal: Callable[[int, int], str]):
        self.capacity = capacity
        self._refusal = refusal
        self.in_use = 0

    @contextlib.contextmanager
    def hold(self, n: int = 1) -> Iterator[None]:
        if n and self.in_use + n > self.capacity:
            raise Overloaded(self._refusal(self.in_use, n))
        self.in_use += n
        try:
            yield
        finally:
            self.in_use -= n


class Budget:
    """Units held at once up to `capacity`; a request waits `wait_s` for room (as a coroutine), then
    is refused with 503; one that could never fit is refused at once with `code`."""

    def __init__(self, unit: str, capacity: int, code: str, wait_s: float):
        self.unit, self.capacity, self.code, self.wait_s = unit, capacity, code, wait_s
        self.in_use = 0
        self.high_water = 0  # the most ever held at once (metrics and tests)
        self._waiters: list[asyncio.Future[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def acquire(self, n: int) -> None:
        if n > self.capacity:
            raise MediaError(self.code, f"this needs {n} {self.unit} at once; the budget is {self.capacity}")
        self._loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.wait_s
        while self.in_use + n > self.capacity:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Overloaded(f"{self.in_use} {self.unit} are held (budget {self.capacity}); retry later")
            waiter = self._loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except asyncio.TimeoutError:
                pass
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.in_use += n
        self.high_water = max(self.high_water, self.in_use)

    def release(self, n: int) -> None:
        """On the loop: give `n` back and let every waiter look again."""
        self.in_use -= n
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def release_soon(self, n: int) -> None:
        """From any thread (a pool future's done callback): `release` on the loop."""
        if self._loop is None or self._loop.is_closed():
            self.in_use -= n
        else:
            self._loop.call_soon_threadsafe(self.release, n)


class Admission:
    """One worker instance's bounds (see the module doc); `EncodeService.admission`."""

    def __init__(self, *, max_receiving_bytes: int, max_pending: int, retry_after_s: int, limits: MediaLimits):
        self.receiving = Quota(max_receiving_bytes, lambda held, n: (
            f"the worker is receiving {held} bytes of request bodies; {n} more would pass --max-receiving-bytes "
            f"{max_receiving_bytes}"))
        self.pending = Quota(max_pending, lambda held, n: (
            f"the encode queue is full ({max_pending} items); retry after {retry_after_s} s or on another replica"))
        self.decoding = Budget("pixels being decoded", limits.decoding_capacity, "too_many_pixels",
                               limits.decode_wait_s)
        self.prepared = Budget("prepared patches", limits.prepared_capacity, "too_large", limits.decode_wait_s)
