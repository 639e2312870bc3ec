"""The encode planner's parts without processes: its options (refused by name), the fleet's
signals from load snapshots (rates, the p95 from histogram buckets, stale data) and the policy
(synthetic signals -> decisions: utilization, the queue-wait SLA, cooldowns, hysteresis, bounds,
holding on stale data)."""

from __future__ import annotations

import math

import pytest

from mm_encoder.core.errors import GraphError
from mm_encoder.core.quantiles import from_buckets as quantile
from mm_encoder.graph.schema import Graph
from mm_encoder.planner.policy import Policy
from mm_encoder.planner.settings import PlannerSettings, check_args
from mm_encoder.planner.signals import Fleet, FleetSignals, Snapshot

BOUNDS = [(0.0005, 0), (0.1, 0), (1.0, 0), (math.inf, 0)]


def settings(**kw) -> PlannerSettings:
    base = {"min_replicas": 1, "max_replicas": 3, "target_utilization": 0.5, "queue_wait_sla_s": 2.0,
            "scale_up_cooldown_s": 10, "scale_down_cooldown_s": 30, "scale_down_margin": 0.8}
    return PlannerSettings(**{**base, **kw})


def signals(demand: float, *, capacity: float = 1000.0, wait: float | None = None, rejected: float = 0.0,
            stale: list[str] | None = None) -> FleetSignals:
    return FleetSignals(1, stale or [], demand, demand, demand / capacity, capacity, 0, wait, rejected, 10.0)


@pytest.mark.parametrize("args, message", [
    (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas (3) is above --max-replicas (2)"),
    (["--min-replicas", "0"], "--min-replicas: Input should be greater than or equal to 1"),
    (["--max-replicas", "-1"], "--max-replicas: Input should be greater than or equal to 1"),
    (["--target-utilization", "0"], "--target-utilization: Input should be greater than 0"),
    (["--target-utilization", "1.5"], "--target-utilization: Input should be less than or equal to 1"),
    (["--connector", "etcd"], "--connector: Input should be 'virtual' or 'kubernetes'"),
    (["--queue-wait-sla-s", "0"], "--queue-wait-sla-s: Input should be greater than 0"),
])
def test_bad_options_are_refused_by_name(args, message):
    with pytest.raises(ValueError) as e:
        check_args(args)
    assert message in str(e.value)


def test_a_graph_with_a_bad_planner_is_refused_before_anything_starts():
    def graph(planner_args, encoder_replicas=1, **extra):
        return {"name": "g", "components": {
            "encoder": {"kind": "encoder", "replicas": encoder_replicas}, "engine": {"kind": "engine"},
            "frontend": {"kind": "frontend"}, "planner": {"kind": "planner", "args": planner_args}, **extra}}

    with pytest.raises(ValueError, match=r"components\.planner\.args: --target-utilization"):
        Graph.model_validate(graph(["--target-utilization", "2"]))
    with pytest.raises(ValueError, match=r"components\.encoder\.replicas \(4\) is outside the planner's bounds"):
        Graph.model_validate(graph(["--max-replicas", "3"], encoder_replicas=4))
    with pytest.raises(ValueError, match="at most one planner"):
        Graph.model_validate(graph([], other={"kind": "planner"}))
    assert Graph.model_validate(graph(["--max-replicas", "3"])).planner is not None


def test_serve_refuses_a_planner_without_etcd():
    from mm_encoder.serve.cli import check_local

    g = Graph.model_validate({"name": "g", "components": {
        "encoder": {"kind": "encoder"}, "engine": {"kind": "engine"}, "frontend": {"kind": "frontend"},
        "planner": {"kind": "planner"}}})
    with pytest.raises(GraphError, match=r"runtime: \{discovery: etcd\}"):
        check_local(g)


def snap(at, admitted, encoded, forward, waits, *, cap=1000.0, depth=0, rejected=0.0):
    cumulative, n = [], 0
    for (le, _), count in zip(BOUNDS, waits, strict=True):
        n += count
        cumulative.append([le, n])
    return Snapshot.parse(at, {"forward_seconds": forward, "patches_admitted": admitted, "patches_encoded": encoded,
                               "rejected": {"overloaded": rejected}, "queue_depth": depth,
                               "queue_wait_buckets": cumulative, "capacity_pps": cap})


def test_fleet_rates_and_p95_over_the_window():
    fleet = Fleet(window_s=10, stale_after_s=5)
    fleet.observe("a", snap(0, 0, 0, 0, [0, 0, 0, 0], cap=800))
    fleet.observe("b", snap(0, 100, 100, 1, [5, 0, 0, 0], cap=1200))
    fleet.observe("a", snap(4, 4000, 2000, 2, [0, 10, 0, 0], cap=800, depth=3))
    fleet.observe("b", snap(4, 2100, 1100, 3, [5, 0, 10, 0], cap=1200, depth=1, rejected=8))
    s = fleet.signals(4, {"a", "b"})
    assert s.stale == [] and s.reporting == 2 and s.span_s == 4
    assert s.demand_pps == 1000 + 500 and s.encoded_pps == 500 + 250 and s.busy == 0.5 + 0.5
    assert s.capacity_pps == 1000 and s.queue_depth == 4 and s.rejected_per_s == 2
    # the window's waits: 10 in (0.0005, 0.1], 10 in (0.1, 1]: the 19th of 20 lies 0.9 into the second bucket
    assert s.queue_wait_p95_s == pytest.approx(0.1 + 0.9 * 0.9)
    # past the window, the oldest snapshot beyond its start goes
    fleet.observe("a", snap(20, 4000, 2000, 2, [0, 10, 0, 0]))
    assert fleet.signals(20, {"a"}).demand_pps == 0


def test_missing_or_stale_workers_make_the_data_stale_only_when_none_answers():
    """A worker unheard from is left out as silent (tests/reliability/test_planner_hardening.py); the
    data is stale only without a worker, without any answering, or before a rate."""
    fleet = Fleet(window_s=10, stale_after_s=5)
    assert fleet.signals(0, set()).stale == ["no encode worker in discovery"]
    fleet.observe("a", snap(0, 0, 0, 0, [0, 0, 0, 0]))
    assert fleet.signals(0, {"a"}).stale == ["one load snapshot so far: no rate yet"]
    fleet.observe("a", snap(1, 10, 10, 0, [0, 0, 0, 0]))
    s = fleet.signals(1, {"a", "b"})  # b just listed: not heard from yet, not waited for either
    assert (s.stale, s.silent, s.reporting) == ([], [], 1)
    assert fleet.signals(7, {"a", "b"}).stale == ["no encode worker has answered in the last 5s (a, b)"]
    fleet.forget_except({"b"})
    assert fleet.signals(7, {"a"}).stale == ["no encode worker has answered in the last 5s (a)"]


def test_quantile_matches_prometheus_interpolation():
    assert quantile([], 0.95) is None and quantile([(1.0, 0)], 0.5) is None
    assert quantile([(1.0, 10), (2.0, 20)], 0.5) == 1.0
    assert quantile([(1.0, 0), (3.0, 10), (math.inf, 10)], 0.5) == 2.0
    assert quantile([(1.0, 0), (math.inf, 10)], 0.5) == 1.0  # above the last finite bound


def test_scales_up_at_once_to_what_the_demand_needs():
    p = Policy(settings())
    d = p.decide(0, 1, signals(1200))  # 1200 / (1000 x 0.5) -> 3
    assert (d.action, d.replicas) == ("up", 3) and "needs 3" in d.reason
    assert p.decide(1, 3, signals(5000)).replicas == 3  # max_replicas bounds it


def test_queue_wait_over_the_sla_and_refusals_add_one():
    p = Policy(settings())
    d = p.decide(0, 1, signals(100, wait=3.0))
    assert (d.action, d.replicas) == ("up", 2) and "p95 queue wait 3.00s over the 2s SLA" in d.reason
    d = Policy(settings()).decide(0, 1, signals(100, rejected=0.5))
    assert (d.action, d.replicas) == ("up", 2) and "refusals" in d.reason


def test_scale_up_cooldown():
    p = Policy(settings())
    assert p.decide(0, 1, signals(600)).replicas == 2
    d = p.decide(5, 2, signals(1200))
    assert (d.action, d.replicas) == ("hold", 2) and "cooldown" in d.reason
    assert p.decide(10, 2, signals(1200)).replicas == 3


def test_scales_down_slowly_one_at_a_time_with_hysteresis():
    p = Policy(settings())
    p.last_change = -100.0
    # 2 -> 1 would leave 450 patches/s on one worker: over 0.8 x 500 = 400 (hysteresis): hold
    assert p.decide(0, 2, signals(450)).action == "hold"
    # 300 < 400: low, but only after 30 s of it
    assert p.decide(1, 2, signals(300)).action == "hold"
    d = p.decide(20, 2, signals(300))
    assert d.action == "hold" and "low for 19s" in d.reason
    d = p.decide(31, 2, signals(300))
    assert (d.action, d.replicas) == ("down", 1)
    # 3 -> 2 next: the cooldown from that change applies
    assert p.decide(40, 3, signals(10)).action == "hold"
    # a burst resets the low period
    q = Policy(settings())
    q.last_change = -100.0
    q.decide(0, 2, signals(100))
    q.decide(20, 2, signals(900))
    assert q.decide(31, 2, signals(100)).action == "hold"


def test_no_scale_down_while_the_queue_wait_is_near_the_sla():
    p = Policy(settings())
    p.last_change = -100.0
    p.decide(0, 2, signals(10, wait=1.8))
    assert p.decide(40, 2, signals(10, wait=1.8)).action == "hold"  # 1.8 > 0.8 x 2


def test_stale_or_unmeasured_data_holds_and_bounds_hold_always():
    p = Policy(settings())
    d = p.decide(0, 2, signals(0, stale=["no recent load from worker(s) a"]))
    assert (d.action, d.replicas) == ("hold", 2) and d.reason == "stale data: no recent load from worker(s) a"
    d = p.decide(0, 2, signals(5000, capacity=math.nan))
    assert (d.action, d.replicas) == ("hold", 2) and "capacity" in d.reason
    # never below min, never above max, whatever the data
    assert p.decide(0, 0, signals(0, stale=["x"])).replicas == 1
    assert p.decide(0, 5, signals(0, stale=["x"])).replicas == 3
