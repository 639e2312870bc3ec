"""The cache hierarchy over a synthetic trace, in event order, with no clock: hit ratio per tier,
the encodes that reach the fleet, and how many encode workers they need.

Per media item (the frontend's one lookup per item; the engine's fetch that follows it finds the
entry that lookup wrote, so it changes no count here: docs/capacity.md):

    its cluster's tier (LRU by bytes) -> the router's ring (`ring.HashRing`, nginx's own placement)
    -> that shard (LRU by bytes) -> an encode worker, round robin per shard (nginx's default)
    -> that worker's mm_hash body LRU -> an encode on a miss

Every cache is a cachetools `LRUCache` bounded by bytes (`getsizeof`), as the worker's `BodyCache`
is; an entry bigger than its cache is not stored, as `BodyCache.put` does. A tier's entry is the
body plus what nginx stores with it (the response headers and its own header, ~1 KiB), rounded up
to 4 KiB pages (nginx counts a cache's size in its filesystem's blocks; tmpfs: pages). A miss fills
every level it passed through at once: no encode time, so identical concurrent misses (which
`proxy_cache_lock` and the worker's single-flight collapse) count once, as they do there.
"""

from __future__ import annotations

import hashlib
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import cachetools
import numpy as np
import numpy.typing as npt

from ..cache_tiers.ring import HashRing
from .traffic import SizeClass, Trace, Traffic, make_trace, size_classes

TIER_ENTRY_OVERHEAD = 1024  # the stored response headers (X-MM-Meta, ...) and nginx's entry header
PAGE = 4096


def _lru(max_bytes: int) -> cachetools.LRUCache[int, int]:
    """item -> its bytes, at most max_bytes of them (an entry's size is its value: `int`, a builtin)."""
    return cachetools.LRUCache(max(max_bytes, 1), getsizeof=int)


def synthetic_key(rank: int, seed: int) -> str:
    """A catalogue item's tier key in the frontend's form (64 hex digits of sha256)."""
    return hashlib.sha256(f"mm-encoder-capacity:{seed}:{rank}".encode()).hexdigest()


@dataclass
class Level:
    """One level's counts, summed over its caches, and its largest cache's peak bytes."""

    lookups: int = 0
    hits: int = 0
    peak_bytes: int = 0
    caches: int = 0
    bytes_each: int = 0

    @property
    def hit_ratio(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None

    def as_dict(self) -> dict[str, Any]:
        return {"caches": self.caches, "bytes_each": self.bytes_each, "lookups": self.lookups, "hits": self.hits,
                "hit_ratio": self.hit_ratio, "peak_bytes_busiest": self.peak_bytes}


@dataclass
class Result:
    traffic: Traffic
    classes: list[SizeClass]
    items: int
    unique: int
    working_set_bytes: int
    cluster: Level
    shared: Level
    encoder: Level
    shard_lookups: list[int]
    shard_keys: list[int]
    ring_shares: list[float]
    encodes: int
    encoded_patches: int
    encoders: int
    encoders_needed: int | None
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def encodes_per_unique(self) -> float:
        return self.encodes / self.unique

    @property
    def encodes_per_second(self) -> float:
        return self.encodes / self.traffic.duration_s

    @property
    def patches_per_second(self) -> float:
        return self.encoded_patches / self.traffic.duration_s

    @property
    def busiest_shard_share(self) -> float:
        total = sum(self.shard_lookups)
        return max(self.shard_lookups) / total if total else 0.0

    def as_dict(self) -> dict[str, Any]:
        t = self.traffic
        return {
            "traffic": t.model_dump(mode="json"),
            "image_classes": [vars(c) for c in self.classes],
            "trace": {"requests": t.requests, "items": self.items, "unique_items": self.unique,
                      "duration_s": t.duration_s, "working_set_bytes": self.working_set_bytes},
            "tiers": {"cluster": self.cluster.as_dict(), "shared": self.shared.as_dict(),
                      "encoder_cache": self.encoder.as_dict()},
            "shards": {"names": t.ring_names(), "lookups": self.shard_lookups, "keys": self.shard_keys,
                       "ring_shares": self.ring_shares, "busiest_share": self.busiest_shard_share},
            "fleet": {"encodes": self.encodes, "encodes_per_unique_item": self.encodes_per_unique,
                      "encodes_per_second": self.encodes_per_second, "patches_per_second": self.patches_per_second,
                      "capacity_pps": t.capacity_pps, "target_utilization": t.target_utilization,
                      "encoders_simulated": self.encoders, "encoders_needed": self.encoders_needed},
            "simulation_seconds": self.seconds,
            **self.extra,
        }


def encoders_needed(patches_per_second: float, capacity_pps: float | None, utilization: float) -> int | None:
    """ceil(patches per second / (one worker's patches per second x target utilization)), at least 1."""
    if capacity_pps is None:
        return None
    return max(1, math.ceil(patches_per_second / (capacity_pps * utilization) - 1e-9))


def key_hashes_for(ranks: npt.NDArray[np.int64], seed: int) -> npt.NDArray[np.uint32]:
    """crc32 of each catalogue item's synthetic key: what the router hashes."""
    return np.fromiter((zlib.crc32(synthetic_key(int(r), seed).encode()) for r in ranks), dtype=np.uint32,
                       count=len(ranks))


@dataclass
class Prepared:
    """What every run of one trace shares (the plot runs it at several cache sizes): per arrival its
    unique item and cluster; per unique item its shard, tier entry bytes, body bytes and patches."""

    classes: list[SizeClass]
    ring: HashRing
    items: list[int]
    clusters: list[int]
    shard_of: list[int]
    tier_bytes: list[int]
    bodies: list[int]
    patches: list[int]
    working_set: int


def prepare(traffic: Traffic, trace: Trace | None = None, key_hashes: dict[int, int] | None = None) -> Prepared:
    """`trace` (made from `traffic` when not given) indexed by unique item. `key_hashes`: rank -> crc32
    of its real key (default: each item's synthetic key)."""
    classes = size_classes(traffic)
    if trace is None:
        trace = make_trace(traffic, classes)
    uniq, inverse = np.unique(trace.ranks, return_inverse=True)
    if key_hashes is None:
        hashes = key_hashes_for(uniq, traffic.seed)
    else:
        hashes = np.array([key_hashes[int(r)] for r in uniq], dtype=np.uint32)
    ring = HashRing(traffic.ring_names())
    first = np.zeros(len(uniq), dtype=np.int64)
    first[inverse[::-1]] = np.arange(len(inverse))[::-1]  # each unique item's first arrival
    item_class = trace.classes[first]
    body = np.array([c.body_bytes for c in classes], dtype=np.int64)[item_class]
    patches = np.array([c.patches for c in classes], dtype=np.int64)[item_class]
    tier_bytes = -(-(body + TIER_ENTRY_OVERHEAD) // PAGE) * PAGE
    return Prepared(classes, ring, inverse.tolist(), trace.clusters.tolist(), ring.indices_of_hashes(hashes).tolist(),
                    tier_bytes.tolist(), body.tolist(), patches.tolist(), int(body.sum()))


def simulate(traffic: Traffic, trace: Trace | None = None, key_hashes: dict[int, int] | None = None,
             scale: float = 1.0, prepared: Prepared | None = None) -> Result:
    """Runs `trace` (made from `traffic` when not given; or `prepared`) through the hierarchy.
    `key_hashes`: rank -> crc32 of its real key. `scale` multiplies every cache's size (the plot)."""
    t0 = time.perf_counter()
    p = prepared or prepare(traffic, trace, key_hashes)
    cluster, shared, shard_lookups, missed = _tiers(p, traffic, scale)
    shards = len(p.ring.servers)
    level, encodes, work, n_enc = _fleet(p, traffic, missed, shards, int(traffic.encoder_cache_bytes * scale))
    keys_per_shard = np.bincount(np.array(p.shard_of, dtype=np.int64), minlength=shards).tolist()
    return Result(traffic, p.classes, len(p.items), len(p.shard_of), p.working_set, cluster, shared, level,
                  shard_lookups, keys_per_shard, p.ring.shares(), encodes, work, n_enc,
                  encoders_needed(work / traffic.duration_s, traffic.capacity_pps, traffic.target_utilization),
                  time.perf_counter() - t0)


def _tiers(p: Prepared, traffic: Traffic, scale: float) -> tuple[Level, Level, list[int], list[int]]:
    """Every request through its cluster tier, then its shard: the two levels, each shard's lookups,
    and the unique ids that reached the encoders, in order."""
    cluster_cap = int(traffic.cluster_tier_bytes * scale)
    shard_cap = int(traffic.shard_bytes * scale)
    clusters = [_lru(cluster_cap) for _ in range(traffic.clusters)]
    shards = [_lru(shard_cap) for _ in range(len(p.ring.servers))]
    shard_lookups = [0] * len(shards)
    missed: list[int] = []
    tb, so = p.tier_bytes, p.shard_of
    cluster_hits = shard_hits = cluster_peak = shard_peak = 0
    for u, c in zip(p.items, p.clusters, strict=True):
        ct = clusters[c]
        if ct.get(u) is not None:
            cluster_hits += 1
            continue
        size = tb[u]
        if size <= cluster_cap:
            ct[u] = size
            cluster_peak = max(cluster_peak, int(ct.currsize))
        s = so[u]
        shard_lookups[s] += 1
        st = shards[s]
        if st.get(u) is not None:
            shard_hits += 1
            continue
        if size <= shard_cap:
            st[u] = size
            shard_peak = max(shard_peak, int(st.currsize))
        missed.append(u)
    cluster = Level(caches=len(clusters), bytes_each=cluster_cap, lookups=len(p.items), hits=cluster_hits,
                    peak_bytes=cluster_peak)
    shared = Level(caches=len(shards), bytes_each=shard_cap, lookups=sum(shard_lookups), hits=shard_hits,
                   peak_bytes=shard_peak)
    return cluster, shared, shard_lookups, missed


def _fleet(p: Prepared, traffic: Traffic, missed: list[int], shards: int,
           encoder_cap: int) -> tuple[Level, int, int, int]:
    """The encoders' level, encodes, work and count: `traffic.encoders`, else the count the work needs."""
    duration, cap, util = traffic.duration_s, traffic.capacity_pps, traffic.target_utilization
    so, bodies, costs = p.shard_of, p.bodies, p.patches
    if traffic.encoders is not None:
        return (*_encoders(missed, so, bodies, costs, traffic.encoders, shards, encoder_cap), traffic.encoders)
    # the worker count is the answer, and the workers' caches depend on it: from the most (every
    # shard miss encoded), down while fewer workers still carry what they then encode
    n_enc = encoders_needed(sum(costs[u] for u in missed) / duration, cap, util) or 1
    for _ in range(8):
        level, encodes, work = _encoders(missed, so, bodies, costs, n_enc, shards, encoder_cap)
        again = encoders_needed(work / duration, cap, util) or 1
        if again >= n_enc:
            if again > n_enc:
                n_enc = again
                level, encodes, work = _encoders(missed, so, bodies, costs, n_enc, shards, encoder_cap)
            break
        n_enc = again
    return level, encodes, work, n_enc


def _encoders(missed: list[int], shard_of: list[int], bodies: list[int], costs: list[int], workers: int,
              shards: int, cap: int) -> tuple[Level, int, int]:
    """The encode workers behind the shards: each shard round-robins its misses over the workers
    (its own turn, as each nginx shard keeps its own), each worker's body LRU; -> (level, encodes, patches)."""
    caches = [_lru(cap) for _ in range(workers)]
    turn = [s % workers for s in range(shards)]
    hits = encodes = work = peak = 0
    for u in missed:
        s = shard_of[u]
        w = turn[s]
        turn[s] = (w + 1) % workers
        cache = caches[w]
        if cache.get(u) is not None:
            hits += 1
            continue
        encodes += 1
        work += costs[u]
        if bodies[u] <= cap:
            cache[u] = bodies[u]
            if cache.currsize > peak:
                peak = int(cache.currsize)
    return Level(len(missed), hits, int(peak), workers, cap), encodes, work


def sweep(traffic: Traffic, scales: list[float], done: Result | None = None,
          prepared: Prepared | None = None) -> list[Result]:
    """The same trace at each scale of every cache's size (the plot's x axis); `done`: the run at
    scale 1, reused."""
    p = prepared or prepare(traffic)
    return [done if done is not None and s == 1.0 else simulate(traffic, scale=s, prepared=p) for s in scales]
