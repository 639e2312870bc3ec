"""The encode planner's loop: read every encoder's load, decide, apply through Dynamo's connector.

Every `interval_s`: the encoders discovery lists (`<namespace>.mm_encoder.load`) each answer with
their counters; `signals.Fleet` turns them into rates, `policy.Policy` into a replica count, and a
change goes to Dynamo's planner connector as the encoder component's `TargetReplica`
(`runtime.dynamo.encoder_target`), without waiting for it to be carried out. While the fleet is
not yet at what was last asked for, the planner holds. Each decision is one log line, the
`dynamo_planner_encode_*` metrics and `GET /status` (what `mm-encoder status` shows).

A worker's answer that does not parse (`signals.SnapshotError`) or never comes is dropped, logged
and counted by reason (`..._snapshots_dropped_total`); that worker goes silent after
`stale_after_s` and the others still decide."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from ..core.prom import WithLabels
from ..runtime.dynamo import (
    ENCODER_COMPONENT,
    LOAD_ENDPOINT,
    NAMESPACE,
    PLANNER_COMPONENT,
    encoder_target,
    endpoint_path,
    payload,
)
from .policy import Decision, Policy
from .settings import PlannerSettings
from .signals import Fleet, FleetSignals, Snapshot, SnapshotError

if TYPE_CHECKING:
    from ..runtime.dynamo import Client

log = logging.getLogger(__name__)
PREFIX = "dynamo_planner_encode"


class PlannerMetrics:
    """`dynamo_planner_encode_*`: Dynamo's planner prefix (its own are `dynamo_planner_*`) and what this
    one plans; every sample labelled with the namespace it plans and its component (encode_planner)."""

    def __init__(self, namespace: str = NAMESPACE) -> None:
        self.own = r = CollectorRegistry(auto_describe=True)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(WithLabels(r, {"dynamo_namespace": namespace, "dynamo_component": PLANNER_COMPONENT}))
        p = PREFIX
        self.replicas = Gauge(f"{p}_replicas", "Encoders: wanted (the last decision), running (in discovery) "
                              "and silent (in discovery, no load snapshot for --stale-after-s)", ["state"], registry=r)
        self.decisions = Counter(f"{p}_decisions", "Decisions by action (up, down, hold)", ["action"], registry=r)
        self.errors = Counter(f"{p}_apply_errors", "Decisions the connector failed to apply", registry=r)
        self.dropped = Counter(f"{p}_snapshots_dropped", "Load snapshots dropped, by reason (no_answer: none came "
                               "in time; invalid: a value not a finite non-negative number, or malformed)",
                               ["reason"], registry=r)
        self.stale = Gauge(f"{p}_holding_stale", "1 while missing or stale load data holds the fleet", registry=r)
        self.demand = Gauge(f"{p}_demand_patches_per_second", "Patches admitted per second, all encoders",
                            registry=r)
        self.capacity = Gauge(f"{p}_capacity_patches_per_second", "Measured capacity per encoder", registry=r)
        self.busy = Gauge(f"{p}_busy_seconds_per_second", "Forward seconds per second, all encoders (the sum of "
                          "their busy fractions)", registry=r)
        self.wait_p95 = Gauge(f"{p}_queue_wait_p95_seconds", "p95 queue wait over the window (NaN: nothing "
                              "waited)", registry=r)

    def record(self, d: Decision, running: int, sig: FleetSignals) -> None:
        self.decisions.labels(d.action).inc()
        self.replicas.labels("wanted").set(d.replicas)
        self.replicas.labels("running").set(running)
        self.replicas.labels("silent").set(len(sig.silent))
        self.stale.set(1 if sig.stale else 0)
        self.demand.set(sig.demand_pps)
        self.capacity.set(sig.capacity_pps)
        self.busy.set(sig.busy)
        self.wait_p95.set(math.nan if sig.queue_wait_p95_s is None else sig.queue_wait_p95_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EncodePlanner:
    def __init__(self, s: PlannerSettings, load: Client, connector: Any, clock: Callable[[], float] = time.monotonic):
        self.s, self.load, self.connector, self.clock = s, load, connector, clock
        self.fleet = Fleet(s.window_s, s.stale_after_s, s.min_capacity_pps)
        self.policy = Policy(s)
        self.metrics = PlannerMetrics(s.namespace)
        self.wanted: int | None = None  # the last count asked for (None: take what is running)
        self.unsettled_since: float | None = None  # since when the running count differs from `wanted`
        self.running = 0
        self.last: dict[str, Any] | None = None
        self.signals: FleetSignals | None = None

    async def _read(self, instance: int) -> Any:
        stream = await self.load.direct({}, instance)
        async for item in stream:
            return payload(item)
        raise ValueError("no answer")

    async def observe(self) -> set[str]:
        """One round of load snapshots from every encoder in discovery; the instances listed."""
        ids = self.load.instance_ids()
        timeout = min(self.s.interval_s, self.s.stale_after_s)
        answers = await asyncio.gather(*(asyncio.wait_for(self._read(i), timeout) for i in ids),
                                       return_exceptions=True)
        now = self.clock()
        for instance, answer in zip(ids, answers, strict=True):
            # a dropped snapshot: that worker goes silent after stale_after_s; the others still count
            if isinstance(answer, BaseException):
                self.metrics.dropped.labels("no_answer").inc()
                log.warning("encoder %x: no load snapshot (%s: %s)", instance, type(answer).__name__, answer)
                continue
            try:
                self.fleet.observe(str(instance), Snapshot.parse(now, answer))
            except SnapshotError as e:
                self.metrics.dropped.labels("invalid").inc()
                log.warning("encoder %x: load snapshot dropped (%s)", instance, e)
        live = {str(i) for i in ids}
        self.fleet.forget_except(live)
        return live

    async def tick(self) -> Decision:
        live = await self.observe()
        now = self.clock()
        self.running = len(live)
        sig = self.signals = self.fleet.signals(now, live)
        if self.wanted is None:
            self.wanted = max(self.running, self.s.min_replicas) if self.running else None
        settled = self.wanted is None or self.running == self.wanted
        self.unsettled_since = None if settled else self.unsettled_since or now
        if self.wanted is None:
            d = Decision(0, 0, "hold", "no encode worker in discovery yet")
        elif self.unsettled_since is not None and now - self.unsettled_since > self.s.settle_timeout_s:
            d = Decision(self.running, self.running, "hold", f"{self.wanted} asked for {now - self.unsettled_since:.0f}"
                         f"s ago, {self.running} running: taking {self.running} as the fleet")
            self.wanted, self.unsettled_since = self.running, None
        elif self.unsettled_since is not None:
            d = Decision(self.wanted, self.wanted, "hold", f"waiting for {self.wanted} encoders ({self.running} "
                         "running)")
        else:
            d = self.policy.decide(now, self.wanted, sig)
        if d.changes and self.s.dry_run:
            d = Decision(d.replicas, d.current, d.action, f"{d.reason} (dry run: not applied)")
        elif d.changes:
            try:
                await self.connector.set_component_replicas([encoder_target(self.s.component, d.replicas)],
                                                            blocking=False)
                self.wanted = d.replicas
            except Exception as e:  # the fleet stays as it is; the next tick decides again
                self.metrics.errors.inc()
                log.error("could not apply %d encoders: %s", d.replicas, e)
                d = Decision(d.current, d.current, "hold", f"applying {d.replicas} failed: {e}")
        self.metrics.record(d, self.running, sig)
        self.last = {"action": d.action, "replicas": d.replicas, "from": d.current, "reason": d.reason,
                     "at": time.time()}
        log.info("decision: %s %d -> %d encoders (%d running): %s", d.action, d.current, d.replicas, self.running,
                 d.reason)
        return d

    def status(self) -> dict[str, Any]:
        s = self.s
        return {"component": s.component, "connector": s.connector, "dry_run": s.dry_run,
                "wanted": self.wanted, "running": self.running, "min": s.min_replicas, "max": s.max_replicas,
                "target_utilization": s.target_utilization, "queue_wait_sla_s": s.queue_wait_sla_s,
                "last_decision": self.last, "signals": self.signals.as_dict() if self.signals else None}

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = self.clock()
            try:
                await self.tick()
            except Exception:  # a bad round holds the fleet; the loop goes on
                log.exception("planner round failed; the fleet stays as it is")
            wait = max(0.0, self.s.interval_s - (self.clock() - started))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)


def load_path(namespace: str) -> str:
    return endpoint_path(namespace, ENCODER_COMPONENT, LOAD_ENDPOINT)
