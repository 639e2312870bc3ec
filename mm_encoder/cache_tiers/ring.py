"""The shard router's ring: which shared-tier shard nginx's `hash $cache_key consistent` picks for a key.

Written here from what nginx's upstream hash module does (the router's configs/nginx/router.conf),
so the capacity model places keys exactly as the router does:

- each server contributes 160 points per unit of weight (the router gives every shard weight 1);
- a server's points come from its name *as written* in the config (`host:port`, or a name without
  a port): split at the last `:` when only digits follow it (a `unix:` path is all host), then
  base = crc32(host, a zero byte, port), and point j = crc32 of those same bytes followed by point
  j-1's value as 4 little-endian bytes (point -1 being 0): a chain, each point seeded by the last;
- all points sorted by value; of points with equal values only one stays (the first in sort order;
  with 32-bit values and a few thousand points a tie is rare, and which server keeps a tied point
  is then up to the C library's sort, which this model does not claim to match);
- a key's point is the first point whose value is >= crc32(key), past the last point wrapping to the
  first; the request goes to that point's server. A server that is down (or already tried) passes
  the request to the next point's server, and so on around the ring.

crc32 is zlib's (the IEEE polynomial, what nginx's `ngx_crc32_*` compute). A test starts the real
router and checks this ring's choice for every key it sends, and with a shard down
(tests/test_capacity.py, through `harness/ring.py`: the same ring read key by key).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

POINTS_PER_WEIGHT = 160


def _name_parts(server: str) -> tuple[bytes, bytes]:
    """(host, port) bytes of a server name as nginx splits it for the ring."""
    raw = server.encode()
    if raw[:5].lower() == b"unix:":
        return raw[5:], b""
    head, sep, tail = raw.rpartition(b":")
    if sep and tail.isdigit():
        return head, tail
    if sep and not tail:  # "host:" : the colon is the last byte, an empty port
        return head, b""
    return raw, b""


def server_points(server: str, weight: int = 1) -> list[int]:
    """The ring points one server contributes, in the order they are made."""
    host, port = _name_parts(server)
    base = host + b"\0" + port
    points, prev = [], 0
    for _ in range(POINTS_PER_WEIGHT * weight):
        prev = zlib.crc32(base + prev.to_bytes(4, "little"))
        points.append(prev)
    return points


class HashRing:
    """Shards by name (as the router's config writes them) -> the shard each key goes to."""

    def __init__(self, servers: Sequence[str], weights: Sequence[int] | None = None):
        if not servers:
            raise ValueError("a ring needs at least one server")
        weights = list(weights) if weights is not None else [1] * len(servers)
        if len(weights) != len(servers) or min(weights) < 1:
            raise ValueError("one weight >= 1 per server")
        self.servers = list(servers)
        made = sorted(((p, i) for i, (s, w) in enumerate(zip(self.servers, weights, strict=True))
                       for p in server_points(s, w)), key=lambda pi: pi[0])  # stable: the first-made of a tie
        kept: list[tuple[int, int]] = []
        for p, i in made:
            if not kept or kept[-1][0] != p:
                kept.append((p, i))
        self.hashes = [p for p, _ in kept]
        self.owners = [i for _, i in kept]
        self._hashes = np.array(self.hashes, dtype=np.uint32)
        self._owners = np.array(self.owners, dtype=np.int32)

    @staticmethod
    def key_hash(key: str | bytes) -> int:
        """crc32 of the key's bytes: what the router hashes (`$cache_key`)."""
        return zlib.crc32(key.encode() if isinstance(key, str) else key)

    def indices_of_hashes(self, key_hashes: npt.NDArray[np.uint32]) -> npt.NDArray[np.int32]:
        """Each key hash's shard index: its point is the first >= it (wrapping to the first past the
        last); no shard down."""
        at = np.searchsorted(self._hashes, key_hashes, side="left") % len(self._hashes)
        owners: npt.NDArray[np.int32] = self._owners[at]
        return owners

    def shares(self) -> list[float]:
        """Each shard's fraction of the 32-bit hash space: its expected share of uniformly hashed keys."""
        arc = np.diff(np.concatenate([[int(self._hashes[-1]) - (1 << 32)], self._hashes.astype(np.int64)]))
        return [float(arc[self._owners == i].sum()) / float(1 << 32) for i in range(len(self.servers))]
