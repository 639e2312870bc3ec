"""From the encode workers' load snapshots to one view of the fleet.

Each worker answers `<namespace>.mm_encoder.load` with its counters (`encode_worker.load.snapshot`:
the same numbers as its /metrics). The planner keeps each worker's recent snapshots, stamped with
the planner's own clock, and takes rates over a window: demand and throughput in patches per
second, device busy seconds per second, the 503s, and the p95 queue wait from the histogram's
bucket increments. Counters are per process: a restarted worker is a new instance."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..core.quantiles import from_buckets


@dataclass(frozen=True)
class Snapshot:
    at: float  # the planner's monotonic clock when it arrived
    forward_seconds: float
    patches_admitted: float
    patches_encoded: float
    rejected: float  # 503s, every reason together
    queue_depth: int
    capacity_pps: float  # NaN until measured
    buckets: tuple[tuple[float, float], ...]  # the queue wait histogram: (upper bound s, cumulative count)
    draining: bool = False

    @classmethod
    def parse(cls, at: float, doc: Any) -> Snapshot:
        """A worker's answer; a ValueError names what is wrong with it."""
        if not isinstance(doc, dict):
            raise ValueError(f"a load snapshot is a map, not {type(doc).__name__}")
        try:
            buckets = tuple((float(le), float(n)) for le, n in doc.get("queue_wait_buckets", ()))
            cap = doc.get("capacity_pps")
            return cls(at, float(doc["forward_seconds"]), float(doc["patches_admitted"]),
                       float(doc["patches_encoded"]), float(sum(dict(doc.get("rejected", {})).values())),
                       int(doc["queue_depth"]), math.nan if cap is None else float(cap), buckets,
                       bool(doc.get("draining", False)))
        except (KeyError, TypeError) as e:
            raise ValueError(f"a load snapshot without a valid {e}") from None


@dataclass(frozen=True)
class FleetSignals:
    """The fleet over the last window; `reporting` workers heard from within `stale_after_s`."""

    reporting: int
    stale: list[str]  # why the data cannot be trusted (empty: it can)
    demand_pps: float  # patches admitted per second, all workers
    encoded_pps: float
    busy: float  # forward seconds per second, all workers (1.0 = one device always busy)
    capacity_pps: float  # per worker: the mean of the workers' measured capacities (NaN: none measured)
    queue_depth: int
    queue_wait_p95_s: float | None  # None: no item waited in the window
    rejected_per_s: float
    span_s: float  # how many seconds the rates cover (the shortest worker history)

    def as_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in self.__dict__.items()}


@dataclass
class _History:
    snaps: deque[Snapshot] = field(default_factory=lambda: deque(maxlen=512))


class Fleet:
    """Per worker instance, its snapshots over the last `window_s`."""

    def __init__(self, window_s: float, stale_after_s: float):
        self.window_s, self.stale_after_s = window_s, stale_after_s
        self._workers: dict[str, _History] = {}

    def observe(self, worker: str, snap: Snapshot) -> None:
        h = self._workers.setdefault(worker, _History())
        h.snaps.append(snap)
        while len(h.snaps) > 2 and snap.at - h.snaps[1].at >= self.window_s:
            h.snaps.popleft()  # keep one snapshot at or before the window's start

    def forget_except(self, live: set[str]) -> None:
        """Workers no longer in discovery (drained, or dead: their lease went)."""
        for gone in set(self._workers) - live:
            del self._workers[gone]

    def signals(self, now: float, expected: set[str]) -> FleetSignals:
        """The fleet's signals; `expected`: the worker instances discovery lists now."""
        stale: list[str] = []
        if not expected:
            stale.append("no encode worker in discovery")
        fresh = {w: h for w, h in self._workers.items() if w in expected and h.snaps
                 and now - h.snaps[-1].at <= self.stale_after_s}
        if missing := sorted(expected - set(fresh)):
            stale.append(f"no recent load from worker(s) {', '.join(missing)}")
        demand = encoded = busy = rejected = 0.0
        depth, spans, caps = 0, [], []
        waits: dict[float, float] = {}
        for h in fresh.values():
            first, last = h.snaps[0], h.snaps[-1]
            depth += last.queue_depth
            if not math.isnan(last.capacity_pps):
                caps.append(last.capacity_pps)
            dt = last.at - first.at
            if dt <= 0:
                continue
            spans.append(dt)
            demand += (last.patches_admitted - first.patches_admitted) / dt
            encoded += (last.patches_encoded - first.patches_encoded) / dt
            busy += (last.forward_seconds - first.forward_seconds) / dt
            rejected += (last.rejected - first.rejected) / dt
            before = dict(first.buckets)
            for le, n in last.buckets:
                waits[le] = waits.get(le, 0.0) + n - before.get(le, 0.0)
        if fresh and not spans:
            stale.append("one load snapshot so far: no rate yet")
        return FleetSignals(len(fresh), stale, demand, encoded, busy, sum(caps) / len(caps) if caps else math.nan,
                            depth, from_buckets(sorted(waits.items()), 0.95), rejected, min(spans, default=0.0))
