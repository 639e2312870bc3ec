"""How many encoders: a pure function of the fleet's signals, the current count and the clock.

- Utilization: enough replicas that the demanded patches per second sit at `target_utilization`
  of the fleet's measured capacity (`ceil(demand / (capacity per worker x target))`).
- Queue wait: a p95 above the SLA asks for one more than now, whatever utilization says (the
  capacity figure may be stale, or the mix heavier than it was); so do 503 refusals.
- Up quickly: straight to what is needed, once `scale_up_cooldown_s` has passed since a change.
- Down slowly: one replica at a time, only when the smaller fleet would still sit below
  `scale_down_margin` of the target (hysteresis) with the queue wait under the SLA, for a whole
  `scale_down_cooldown_s`, and that long after the last change.
- Bounds: never above `max_replicas`, never below `min_replicas`; missing or stale data holds the
  count where it is (raised to `min_replicas` if below), and says so.
- Silent workers (listed in discovery, unheard from for `stale_after_s`) carry no load: the count
  is what the answering workers need plus the silent ones (their processes still count towards
  what the executor runs), so a hung worker is made up for instead of freezing the fleet.
- Whatever the signals hold, `decide` returns a count within the bounds and never raises: a
  capacity under `min_capacity_pps` is unmeasured, a non-finite figure holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .settings import PlannerSettings
from .signals import FleetSignals


@dataclass(frozen=True)
class Decision:
    replicas: int  # what the fleet should be
    current: int
    action: str  # "up", "down", "hold"
    reason: str

    @property
    def changes(self) -> bool:
        return self.replicas != self.current


class Policy:
    """The decision rule plus what it remembers: when the count last changed, since when demand has been low."""

    def __init__(self, s: PlannerSettings):
        self.s = s
        self.last_change: float | None = None
        self.low_since: float | None = None

    def _clamp(self, n: int) -> int:
        return max(self.s.min_replicas, min(self.s.max_replicas, n))

    def decide(self, now: float, current: int, sig: FleetSignals) -> Decision:
        s = self.s
        if current < s.min_replicas or current > s.max_replicas:
            return self._change(now, current, self._clamp(current), f"{current} is outside [{s.min_replicas}, "
                                f"{s.max_replicas}]")
        if sig.stale:
            self.low_since = None
            return Decision(current, current, "hold", "stale data: " + "; ".join(sig.stale))
        per = sig.capacity_pps * s.target_utilization  # patches per second one worker should carry
        if not (sig.capacity_pps >= s.min_capacity_pps and per > 0):  # NaN: unmeasured
            self.low_since = None
            return Decision(current, current, "hold", "no worker has measured a capacity of at least "
                            f"{s.min_capacity_pps:g} patches/s yet")
        wait = sig.queue_wait_p95_s
        figures = (sig.capacity_pps, sig.demand_pps, sig.rejected_per_s, 0.0 if wait is None else wait)
        if not all(math.isfinite(x) for x in figures):  # the signals refuse such data; never decide on it
            self.low_since = None
            return Decision(current, current, "hold", "a load signal is not a finite number")
        silent = min(len(sig.silent), current - 1)  # at least one worker answers, or the data is stale
        serving = current - silent
        ratio = sig.demand_pps / per
        need = s.max_replicas + 1 if ratio > s.max_replicas else max(1, math.ceil(ratio))  # answering workers
        why = f"demand {sig.demand_pps:.0f} patches/s over {sig.capacity_pps:.0f}/worker at {s.target_utilization:g}"
        over_sla = s.queue_wait_sla_s is not None and wait is not None and wait > s.queue_wait_sla_s
        if over_sla and need <= serving:
            need, why = serving + 1, f"p95 queue wait {wait:.2f}s over the {s.queue_wait_sla_s:g}s SLA"
        if sig.rejected_per_s > 0 and need <= serving:
            need, why = serving + 1, f"{sig.rejected_per_s:.2f} refusals/s (503)"
        if silent:
            why += f" ({silent} silent: not counted as running)"
        want = self._clamp(need + silent)
        if want > current:
            self.low_since = None
            if self.last_change is not None and now - self.last_change < s.scale_up_cooldown_s:
                return Decision(current, current, "hold", f"{why} needs {want}; in the scale-up cooldown")
            return self._change(now, current, want, f"{why} needs {need + silent}")
        # down: the fleet one smaller must sit under the margin, with the queue wait well under the SLA
        smaller = current - 1
        calm = wait is None or s.queue_wait_sla_s is None or wait <= s.queue_wait_sla_s * s.scale_down_margin
        if (smaller < s.min_replicas or smaller - silent < 1 or not calm
                or sig.demand_pps > (smaller - silent) * per * s.scale_down_margin):
            self.low_since = None
            return Decision(current, current, "hold", f"{why} needs {need + silent}; {current} running")
        self.low_since = now if self.low_since is None else self.low_since
        quiet = now - self.low_since
        if quiet < s.scale_down_cooldown_s or (self.last_change is not None
                                               and now - self.last_change < s.scale_down_cooldown_s):
            return Decision(current, current, "hold", f"{why} needs {need + silent}; low for {quiet:.0f}s, "
                            f"scaling down after {s.scale_down_cooldown_s:g}s")
        self.low_since = None
        return self._change(now, current, smaller, f"{why} needs {need + silent}: one fewer")

    def _change(self, now: float, current: int, want: int, why: str) -> Decision:
        self.last_change = now
        return Decision(want, current, "up" if want > current else "down", why)
