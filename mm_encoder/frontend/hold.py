"""What a request holds of its processor while in flight, and the counts of it.

`Capacity` is the processor's room: requests in flight (bounded by `--max-inflight-requests`),
media slots (`--max-inflight-media`) and the requests sent to an engine that has not answered yet.
Only a `Hold` changes it: each request takes one, and `release` gives back everything it took
exactly once, however the request ends (answered, refused, failed or cancelled).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Capacity:
    """The processor's room, read by the processor and its metrics, changed by holds only."""

    def __init__(self, max_media: int):
        self._inflight = 0
        self._waiting = 0
        self._media_slots = asyncio.Semaphore(max_media)

    @property
    def inflight(self) -> int:
        """Requests in flight, any kind."""
        return self._inflight

    @property
    def waiting(self) -> int:
        """Requests an engine has and has not answered yet."""
        return self._waiting


class Hold:
    """One request's hold: a place among the requests in flight, a media slot while it has media
    and no answer yet, a count among those waiting for an engine's first item, and a place in the
    KV router's books (`free` gives it back)."""

    def __init__(self, capacity: Capacity, rid: str, free: Callable[[str], None]):
        self.capacity, self.rid, self._free = capacity, rid, free
        self.slot = self.routed = self.waiting = False
        self.held = True
        capacity._inflight += 1

    async def take_media_slot(self) -> None:
        await self.capacity._media_slots.acquire()
        self.slot = True

    def sent(self) -> None:
        """An engine has the request: counted until its first item."""
        self.capacity._waiting += 1
        self.waiting = True

    def first_item(self) -> None:
        """The engine answered: the media slot and the wait go back."""
        if self.waiting:
            self.capacity._waiting -= 1
            self.waiting = False
        if self.slot:
            self.capacity._media_slots.release()
            self.slot = False

    def release(self) -> None:
        self.first_item()
        if self.routed:
            self._free(self.rid)
            self.routed = False
        if self.held:
            self.capacity._inflight -= 1
            self.held = False
