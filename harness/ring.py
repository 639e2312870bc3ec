"""The shard router's ring (`mm_encoder.cache_tiers.ring.HashRing`) read key by key, as nginx walks
it for one request: the scalar lookups the capacity model's vectorized `indices_of_hashes` is checked
against, and where a key goes while shards are down (a down shard passes the request to the next
point's shard). Only tests/test_capacity.py reads a ring this way; the model never takes a shard down.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from mm_encoder.cache_tiers.ring import HashRing


def point_of(ring: HashRing, key_hash: int) -> int:
    """Index of the first point >= key_hash (wrapping to 0 past the last)."""
    return bisect.bisect_left(ring.hashes, key_hash) % len(ring.hashes)


def index_of(ring: HashRing, key: str | bytes, down: Iterable[int] = ()) -> int:
    """The shard index for `key`; shards in `down` pass it on to the next point's shard."""
    skip = set(down)
    if len(skip) >= len(ring.servers):
        raise ValueError("every shard is down")
    at = point_of(ring, ring.key_hash(key))
    while ring.owners[at] in skip:
        at = (at + 1) % len(ring.hashes)
    return ring.owners[at]


def server_of(ring: HashRing, key: str | bytes, down: Iterable[str] = ()) -> str:
    """The shard's name for `key`, as the router's `X-Cache-Shard` reports it."""
    gone = {ring.servers.index(s) for s in down}
    return ring.servers[index_of(ring, key, gone)]
