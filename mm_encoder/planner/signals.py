"""From the encode workers' load snapshots to one view of the fleet.

Each worker answers `<namespace>.mm_encoder.load` with its counters (`encode_worker.load.snapshot`:
the same numbers as its /metrics). The planner keeps each worker's recent snapshots, stamped with
the planner's own clock, and takes rates over a window: demand and throughput in patches per
second, device busy seconds per second, the 503s, and the p95 queue wait from the histogram's
bucket increments. Counters are per process: a restarted worker is a new instance.

Bad data cannot freeze or steer the fleet: a snapshot with a value that is not a finite,
non-negative number (or is past any counter's reach) is refused whole (`SnapshotError`, naming the
field), a counter that goes backwards is a reset (what it counts since is its increase, as
Prometheus' `rate()` takes it), a measured capacity under the floor counts as unmeasured, and a
worker unheard from for `stale_after_s` is left out as silent instead of making all data stale."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from ..core.quantiles import from_buckets

# Past 2**53 a float no longer counts by ones: no real counter gets there (2**53 patches is 285 years
# at a million a second), and anything below it keeps every rate finite.
MAX_VALUE = float(2**53)
MAX_BUCKETS = 256  # the worker's histogram has about twenty
# 503s a worker gives for its own lifecycle (leaving, or not yet started), not for load: a drain
# (scale-down, rolling update) must not read as overload and scale the fleet back up
LIFECYCLE_REASONS = frozenset({"draining", "shutting_down", "starting"})


class SnapshotError(ValueError):
    """A load snapshot the planner refuses whole; `field` names what is wrong with it ("": the whole)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"load snapshot field {field}: {problem}" if field else f"load snapshot: {problem}")
        self.field = field


def _number(field: str, value: Any) -> float:
    """A counter or gauge as the planner takes it: a finite number in [0, MAX_VALUE]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SnapshotError(field, f"{value!r} is not a number")
    if math.isnan(value) or value < 0 or value > MAX_VALUE:
        raise SnapshotError(field, f"{value!r} is not a finite number in [0, 2**53]")
    return float(value)


def _buckets(value: Any) -> tuple[tuple[float, float], ...]:
    """The queue wait histogram: (upper bound s, cumulative count) pairs, bounds increasing (the last
    may be +Inf) and counts never decreasing."""
    name = "queue_wait_buckets"
    if not isinstance(value, (list, tuple)) or len(value) > MAX_BUCKETS:
        raise SnapshotError(name, f"not a list of at most {MAX_BUCKETS} [upper bound, count] pairs")
    out: list[tuple[float, float]] = []
    for pair in value:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise SnapshotError(name, f"{pair!r} is not an [upper bound, count] pair")
        le, n = pair
        le = math.inf if le == math.inf else _number(name, le)
        n = _number(name, n)
        if out and (le <= out[-1][0] or n < out[-1][1]):
            raise SnapshotError(name, "not a cumulative histogram (bounds increasing, counts never decreasing)")
        out.append((le, n))
    return tuple(out)


def overload_rejections(rejected: Any) -> float:
    """The 503s that say the worker is full: every reason's count but its lifecycle's (`draining`)."""
    if not isinstance(rejected, dict):
        raise SnapshotError("rejected", "not a map of reason to count")
    total = 0.0
    for reason, count in rejected.items():
        n = _number(f"rejected.{reason}", count)
        if reason not in LIFECYCLE_REASONS:
            total += n
    return total


@dataclass(frozen=True)
class Snapshot:
    at: float  # the planner's monotonic clock when it arrived
    forward_seconds: float
    patches_admitted: float
    patches_encoded: float
    rejected: float  # overload 503s, every reason but the lifecycle's (LIFECYCLE_REASONS) together
    queue_depth: int
    capacity_pps: float  # NaN until measured
    buckets: tuple[tuple[float, float], ...]  # the queue wait histogram: (upper bound s, cumulative count)
    draining: bool = False

    @classmethod
    def parse(cls, at: float, doc: Any) -> Snapshot:
        """A worker's answer; a `SnapshotError` (a ValueError) names the field that is wrong with it."""
        if not isinstance(doc, dict):
            raise SnapshotError("", f"a map, not {type(doc).__name__}")
        missing = [k for k in ("forward_seconds", "patches_admitted", "patches_encoded", "queue_depth") if k not in doc]
        if missing:
            raise SnapshotError(missing[0], "missing")
        cap = doc.get("capacity_pps")
        return cls(at, _number("forward_seconds", doc["forward_seconds"]),
                   _number("patches_admitted", doc["patches_admitted"]),
                   _number("patches_encoded", doc["patches_encoded"]),
                   overload_rejections(doc.get("rejected", {})),
                   int(_number("queue_depth", doc["queue_depth"])),
                   math.nan if cap is None else _number("capacity_pps", cap),
                   _buckets(doc.get("queue_wait_buckets", ())), bool(doc.get("draining", False)))


def increase(values: Iterable[float]) -> float:
    """A counter's increase over consecutive readings. A reading below the one before is a reset (its
    process counted from zero again): what it reads then is its increase since, so a restarted
    worker never makes a rate negative."""
    return sum(b - a if b >= a else b for a, b in pairwise(values))


@dataclass(frozen=True)
class FleetSignals:
    """The fleet over the last window; `reporting` workers heard from within `stale_after_s`, `silent`
    ones listed in discovery but unheard from that long (left out of every figure)."""

    reporting: int
    stale: list[str]  # why the data cannot be trusted (empty: it can)
    demand_pps: float  # patches admitted per second, all workers
    encoded_pps: float
    busy: float  # forward seconds per second, all workers (1.0 = one device always busy)
    capacity_pps: float  # per worker: the median of the measured capacities (NaN: none measured)
    queue_depth: int
    queue_wait_p95_s: float | None  # None: no item waited in the window
    rejected_per_s: float  # overload 503s per second (a drain's are not counted)
    span_s: float  # how many seconds the rates cover (the shortest worker history)
    silent: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in self.__dict__.items()}


@dataclass
class _History:
    snaps: deque[Snapshot] = field(default_factory=lambda: deque(maxlen=512))


class Fleet:
    """Per worker instance, its snapshots over the last `window_s`; a capacity under
    `min_capacity_pps` is taken as unmeasured (a broken measurement, not a device that serves)."""

    def __init__(self, window_s: float, stale_after_s: float, min_capacity_pps: float = 0.0):
        self.window_s, self.stale_after_s, self.min_capacity_pps = window_s, stale_after_s, min_capacity_pps
        self._workers: dict[str, _History] = {}
        self._seen: dict[str, float] = {}  # when discovery first listed each worker: its grace to answer

    def observe(self, worker: str, snap: Snapshot) -> None:
        h = self._workers.setdefault(worker, _History())
        h.snaps.append(snap)
        while len(h.snaps) > 2 and snap.at - h.snaps[1].at >= self.window_s:
            h.snaps.popleft()  # keep one snapshot at or before the window's start

    def forget_except(self, live: set[str]) -> None:
        """Workers no longer in discovery (drained, or dead: their lease went)."""
        for gone in set(self._workers) - live:
            del self._workers[gone]
        for gone in set(self._seen) - live:
            del self._seen[gone]

    def _heard(self, worker: str) -> float:
        h = self._workers.get(worker)
        return h.snaps[-1].at if h is not None and h.snaps else self._seen[worker]

    def signals(self, now: float, expected: set[str]) -> FleetSignals:
        """The fleet's signals; `expected`: the worker instances discovery lists now. A worker unheard
        from for `stale_after_s` (since its last snapshot, or since discovery first listed it) is
        silent: left out, not waited for. Only when no worker answers is the data stale."""
        for w in expected:
            self._seen.setdefault(w, now)
        stale: list[str] = []
        fresh = {w: h for w, h in self._workers.items() if w in expected and h.snaps
                 and now - h.snaps[-1].at <= self.stale_after_s}
        silent = sorted(w for w in expected - set(fresh) if now - self._heard(w) > self.stale_after_s)
        if not expected:
            stale.append("no encode worker in discovery")
        elif not fresh:
            stale.append(f"no encode worker has answered in the last {self.stale_after_s:g}s "
                         f"({', '.join(sorted(expected))})")
        demand = encoded = busy = rejected = 0.0
        depth, spans, caps = 0, [], []
        waits: dict[float, float] = {}
        for h in fresh.values():
            snaps: Sequence[Snapshot] = h.snaps
            first, last = snaps[0], snaps[-1]
            depth += last.queue_depth
            if last.capacity_pps >= self.min_capacity_pps and last.capacity_pps > 0:  # False for NaN
                caps.append(last.capacity_pps)
            dt = last.at - first.at
            if dt <= 0:
                continue
            spans.append(dt)
            demand += increase(s.patches_admitted for s in snaps) / dt
            encoded += increase(s.patches_encoded for s in snaps) / dt
            busy += increase(s.forward_seconds for s in snaps) / dt
            rejected += increase(s.rejected for s in snaps) / dt
            counts = [dict(s.buckets) for s in snaps]
            for le, _ in last.buckets:
                waits[le] = waits.get(le, 0.0) + increase(c.get(le, 0.0) for c in counts)
        if fresh and not spans:
            stale.append("one load snapshot so far: no rate yet")
        cumulative, top = [], 0.0
        for le, n in sorted(waits.items()):  # cumulative again, whatever the increments summed to
            top = max(top, n)
            cumulative.append((le, top))
        return FleetSignals(len(fresh), stale, demand, encoded, busy, statistics.median(caps) if caps else math.nan,
                            depth, from_buckets(cumulative, 0.95), rejected, min(spans, default=0.0), silent)
