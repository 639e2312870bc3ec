"""Issue 43, finding 6: a planner that bad data cannot freeze or steer, and an executor that can
never take the graph down. No process and no Dynamo runtime: the planner's parts and its loop over
fake load clients and a fake connector, serve's supervisor over a fleet without processes.

- bad load data (NaN, inf, negatives, non-numbers) is refused by field, dropped and counted; a
  capacity under the floor is unmeasured; a counter that goes backwards is a reset;
- a silent worker is left out (counted as not running) instead of freezing the fleet; only with
  no worker answering does the planner hold, and it says why;
- any decision (0, -1, 10**9, not an int) is clamped or refused by serve's executor, never raised;
- a drain's 503s (`draining`) are not overload.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mm_encoder.graph.schema import load_graph
from mm_encoder.planner.policy import Policy
from mm_encoder.planner.service import EncodePlanner
from mm_encoder.planner.settings import PlannerSettings
from mm_encoder.planner.signals import Fleet, Snapshot, SnapshotError
from mm_encoder.serve import scaler as scaler_module
from mm_encoder.serve.runner import GraphRunner, scaling_bounds
from mm_encoder.serve.scaler import Scaler, executable

ROOT = Path(__file__).resolve().parents[2]
BUCKETS = (0.01, 0.1, 1.0, math.inf)


def planner_settings(**kw: Any) -> PlannerSettings:
    base = {"min_replicas": 1, "max_replicas": 3, "target_utilization": 0.5, "queue_wait_sla_s": 2.0,
            "interval_s": 2, "window_s": 10, "stale_after_s": 5, "scale_up_cooldown_s": 10,
            "scale_down_cooldown_s": 30, "scale_down_margin": 0.8, "settle_timeout_s": 20}
    return PlannerSettings(**{**base, **kw})


def doc(admitted: float = 0.0, *, encoded: float | None = None, forward: float = 0.0, cap: float | None = 1000.0,
        rejected: dict[str, float] | None = None, waits: tuple[float, ...] = (0, 0, 0, 0), depth: int = 0,
        draining: bool = False) -> dict[str, Any]:
    """A load snapshot as an encode worker answers it (`ServiceMetrics.load`)."""
    return {"forward_seconds": forward, "patches_admitted": admitted,
            "patches_encoded": admitted if encoded is None else encoded,
            "rejected": rejected if rejected is not None else {"overloaded": 0.0, "draining": 0.0},
            "queue_depth": depth, "queue_wait_buckets": [[le, n] for le, n in zip(BUCKETS, waits, strict=True)],
            "capacity_pps": cap, "draining": draining}


# --- the planner's loop over fakes --------------------------------------------------------------


class FakeLoad:
    """Dynamo's client of `<namespace>.mm_encoder.load`: per instance, what it answers this round
    (a map, anything else, or an exception it raises)."""

    def __init__(self) -> None:
        self.answers: dict[int, Callable[[], Any]] = {}

    def instance_ids(self) -> list[int]:
        return list(self.answers)

    async def direct(self, request: Any, instance: int) -> Any:
        answer = self.answers[instance]()
        if isinstance(answer, BaseException):
            raise answer

        async def stream() -> Any:
            yield answer

        return stream()


class FakeConnector:
    def __init__(self) -> None:
        self.targets: list[int] = []

    async def set_component_replicas(self, targets: list[Any], blocking: bool) -> None:
        self.targets.append(targets[0].desired_replicas)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def planner(**kw: Any) -> tuple[EncodePlanner, FakeLoad, FakeConnector, Clock]:
    load, connector, clock = FakeLoad(), FakeConnector(), Clock()
    return EncodePlanner(planner_settings(**kw), load, connector, clock), load, connector, clock


def dropped(p: EncodePlanner, reason: str) -> float:
    return p.metrics.own.get_sample_value("dynamo_planner_encode_snapshots_dropped_total", {"reason": reason}) or 0.0


def rising(step: float, **kw: Any) -> Callable[[], dict[str, Any]]:
    """A healthy worker: `step` more patches admitted (and encoded) every round."""
    count = iter(range(10**6))
    return lambda: doc(next(count) * step, **kw)


# --- 1. bad values are refused at ingestion -----------------------------------------------------


@pytest.mark.parametrize("field", ["forward_seconds", "patches_admitted", "patches_encoded", "queue_depth",
                                   "capacity_pps", "rejected.overloaded", "queue_wait_buckets"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1, "7", True, 2.0**60])
def test_a_value_that_is_not_a_finite_non_negative_number_is_refused_by_field(field, value):
    d = doc(100)
    if field == "rejected.overloaded":
        d["rejected"] = {"overloaded": value}
    elif field == "queue_wait_buckets":
        d["queue_wait_buckets"] = [[0.01, 0], [0.1, value], [math.inf, 5]]
    else:
        d[field] = value
    with pytest.raises(SnapshotError, match=f"load snapshot field {field}") as e:
        Snapshot.parse(0, d)
    assert e.value.field == field and isinstance(e.value, ValueError)


def test_a_malformed_snapshot_is_refused_naming_what_is_wrong():
    with pytest.raises(SnapshotError, match="patches_admitted: missing"):
        Snapshot.parse(0, {k: v for k, v in doc().items() if k != "patches_admitted"})
    with pytest.raises(SnapshotError, match=r"^load snapshot: a map, not list"):
        Snapshot.parse(0, [1, 2])
    with pytest.raises(SnapshotError, match="not a cumulative histogram"):
        Snapshot.parse(0, {**doc(), "queue_wait_buckets": [[0.1, 5], [1.0, 3]]})
    with pytest.raises(SnapshotError, match="rejected: not a map"):
        Snapshot.parse(0, {**doc(), "rejected": 3})
    # the worker's own: unmeasured capacity (None) and the +Inf bucket are fine
    s = Snapshot.parse(0, doc(cap=None))
    assert math.isnan(s.capacity_pps) and s.buckets[-1] == (math.inf, 0.0)


async def test_a_nan_snapshot_is_dropped_and_counted_and_the_fleet_still_decides():
    """Before: NaN demand parsed, `ceil(nan)` raised in every round, and the fleet froze."""
    p, load, connector, clock = planner()
    load.answers = {1: rising(3000), 2: lambda: doc(math.nan)}  # 1500 patches/s on worker 1
    await p.tick()
    clock.now = 2.0
    d = await p.tick()
    assert dropped(p, "invalid") == 2 and dropped(p, "no_answer") == 0
    # 1500 / (1000 x 0.5) = 3 answering workers; worker 2 (listed 2 s ago) not silent yet
    assert (d.action, d.current, d.replicas) == ("up", 2, 3) and connector.targets == [3]
    assert p.signals is not None and p.signals.demand_pps == 1500.0


def test_a_capacity_under_the_floor_is_unmeasured_and_cannot_drive_the_fleet_to_its_maximum():
    """Before: 1e-6 patches/s per worker asked for max_replicas; with another worker, it halved the mean."""
    s = planner_settings()
    assert s.min_capacity_pps == 10.0
    fleet = Fleet(s.window_s, s.stale_after_s, s.min_capacity_pps)
    for at, n in ((0, 0), (2, 1000)):
        fleet.observe("a", Snapshot.parse(at, doc(n, cap=1e-6)))
    sig = fleet.signals(2, {"a"})
    assert math.isnan(sig.capacity_pps) and sig.demand_pps == 500.0
    d = Policy(s).decide(2, 1, sig)
    assert (d.action, d.replicas) == ("hold", 1)
    assert d.reason == "no worker has measured a capacity of at least 10 patches/s yet"
    for at, n in ((0, 0), (2, 1000)):
        fleet.observe("b", Snapshot.parse(at, doc(n, cap=800.0)))
    assert fleet.signals(2, {"a", "b"}).capacity_pps == 800.0  # the floor leaves a's out


def test_a_counter_that_goes_backwards_is_a_reset_not_a_negative_rate():
    """Before: 500 after 3000 (a restarted worker's counters) gave -125 patches/s."""
    fleet = Fleet(window_s=10, stale_after_s=5)
    fleet.observe("a", Snapshot.parse(0, doc(1000, forward=1.0, rejected={"overloaded": 4}, waits=(0, 2, 2, 2))))
    fleet.observe("a", Snapshot.parse(2, doc(3000, forward=2.0, rejected={"overloaded": 6}, waits=(0, 2, 4, 4))))
    fleet.observe("a", Snapshot.parse(4, doc(500, forward=0.5, rejected={"overloaded": 1}, waits=(0, 0, 1, 1))))
    s = fleet.signals(4, {"a"})
    assert s.demand_pps == (2000 + 500) / 4 and s.encoded_pps == s.demand_pps
    assert s.busy == (1.0 + 0.5) / 4 and s.rejected_per_s == (2 + 1) / 4
    # the histogram too: 2 waits in (0.1, 1] before the restart, 1 after it (before: a negative count, no p95)
    assert s.queue_wait_p95_s == pytest.approx(0.1 + 0.9 * (0.95 * 3) / 3)


# --- 2. a silent worker is left out; only with none answering does the planner hold --------------


def test_a_silent_worker_is_left_out_and_counted_as_not_running():
    """Before: worker b's silence made all data stale and the planner held, whatever a said."""
    s = planner_settings()
    fleet = Fleet(s.window_s, s.stale_after_s)
    for at in (0, 2, 4, 6, 8):
        fleet.observe("a", Snapshot.parse(at, doc(300 * at)))
        if at <= 2:
            fleet.observe("b", Snapshot.parse(at, doc(100 * at)))
    sig = fleet.signals(8, {"a", "b"})  # b last heard at 2: 6 s > 5 s ago
    assert (sig.stale, sig.silent, sig.reporting) == ([], ["b"], 1)
    assert sig.demand_pps == 300.0  # a's alone
    # 300 / (1000 x 0.5): one answering worker is enough, plus the silent one the executor still runs
    d = Policy(s).decide(8, 2, sig)
    assert (d.action, d.replicas) == ("hold", 2) and "1 silent: not counted as running" in d.reason
    # 600 patches/s needs 2 answering: with b silent, 3 in all
    fleet.observe("a", Snapshot.parse(10, doc(300 * 8 + 2 * 1800)))
    d = Policy(s).decide(10, 2, fleet.signals(10, {"a", "b"}))
    assert (d.action, d.replicas) == ("up", 3) and d.reason.endswith("needs 3")


def test_only_with_no_worker_answering_does_the_planner_hold_and_it_says_why():
    s = planner_settings()
    fleet = Fleet(s.window_s, s.stale_after_s)
    for at in (0, 2):
        fleet.observe("a", Snapshot.parse(at, doc(1000 * at)))
        fleet.observe("b", Snapshot.parse(at, doc(1000 * at)))
    sig = fleet.signals(8, {"a", "b"})
    assert sig.stale == ["no encode worker has answered in the last 5s (a, b)"] and sig.silent == ["a", "b"]
    d = Policy(s).decide(8, 2, sig)
    assert (d.action, d.replicas) == ("hold", 2)
    assert d.reason == "stale data: no encode worker has answered in the last 5s (a, b)"
    # a worker just listed is given stale_after_s to answer before it counts as silent
    fleet.observe("a", Snapshot.parse(10, doc(5000)))
    assert fleet.signals(10, {"a", "b", "c"}).silent == ["b"]
    assert fleet.signals(16, {"a", "b", "c"}).silent == ["a", "b", "c"]


async def test_a_worker_that_stops_answering_does_not_freeze_the_planner():
    """Before: from the round worker 2 went silent, every decision was "stale data": hold."""
    p, load, connector, clock = planner()
    # 200 patches/s each; from t=4 worker 2 answers nothing and worker 1 takes 600 patches/s
    load.answers = {1: lambda: doc(200 * clock.now if clock.now <= 4 else 800 + 600 * (clock.now - 4)),
                    2: lambda: doc(200 * clock.now) if clock.now <= 4 else asyncio.TimeoutError()}
    decisions = []
    for now in range(0, 14, 2):
        clock.now = float(now)
        decisions.append(await p.tick())
    assert decisions[0].reason.startswith("stale data: one load snapshot so far")
    assert all(d.action == "hold" and not d.reason.startswith("stale") for d in decisions[1:6])
    assert "1 silent: not counted as running" in decisions[5].reason  # t=10: 6 s since worker 2 answered
    # t=12: 520 patches/s on worker 1 needs 2 answering workers, plus the silent one
    assert (decisions[6].action, decisions[6].current, decisions[6].replicas) == ("up", 2, 3)
    assert connector.targets == [3] and dropped(p, "no_answer") == 4
    assert p.metrics.own.get_sample_value("dynamo_planner_encode_replicas", {"state": "silent"}) == 1
    assert p.status()["signals"]["silent"] == ["2"]


async def test_with_every_worker_silent_the_planner_holds_and_says_why():
    p, load, connector, clock = planner()
    load.answers = {1: rising(1000)}
    for now in (0.0, 2.0):
        clock.now = now
        await p.tick()
    load.answers = {1: lambda: RuntimeError("connection reset")}
    clock.now = 8.0
    d = await p.tick()
    assert (d.action, d.replicas) == ("hold", 1) and connector.targets == []
    assert d.reason == "stale data: no encode worker has answered in the last 5s (1)"
    assert p.metrics.own.get_sample_value("dynamo_planner_encode_holding_stale") == 1


# --- 4. a drain's 503s are not overload ---------------------------------------------------------


def test_a_drains_503s_are_not_overload():
    """Before: a draining worker's 503s were summed with the overload ones: the planner read a scale-down
    (or a rolling update) as overload and asked for one more encoder."""
    from harness.metric_exports import service_metrics

    m = service_metrics()  # one overloaded refusal already counted
    for _ in range(50):
        m.refused("http", "draining")
    loaded = m.load(draining=True)
    assert loaded["rejected"] == {"overloaded": 1.0, "draining": 50.0}
    assert Snapshot.parse(0, loaded).rejected == 1.0
    s = planner_settings()
    fleet = Fleet(s.window_s, s.stale_after_s)
    fleet.observe("a", Snapshot.parse(0, doc(0, rejected={"overloaded": 3, "draining": 0})))
    fleet.observe("a", Snapshot.parse(2, doc(200, rejected={"overloaded": 3, "draining": 40, "shutting_down": 9},
                                           draining=True)))
    sig = fleet.signals(2, {"a"})
    assert sig.rejected_per_s == 0.0
    d = Policy(s).decide(2, 2, sig)
    assert d.action == "hold" and "refusals" not in d.reason
    fleet.observe("a", Snapshot.parse(4, doc(400, rejected={"overloaded": 7, "draining": 80})))
    assert fleet.signals(4, {"a"}).rejected_per_s == 1.0  # (7 - 3) / 4 s: overload still counts


# --- the fuzz: whatever the workers answer -------------------------------------------------------

WEIRD = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**70, 2**70), st.none(),
                  st.booleans(), st.text(max_size=3), st.just([]), st.just({}), st.just([[0.1, 1], [0.01, 2]]))


@st.composite
def answers(draw: st.DrawFn) -> Any:
    """One round's answer of a worker that may misbehave: a valid map, one with a field replaced or
    missing, something else, or an exception (no answer)."""
    kind = draw(st.sampled_from(["valid", "field", "missing", "other", "error"]))
    d = doc(draw(st.floats(0, 1e12)), forward=draw(st.floats(0, 1e6)),
            cap=draw(st.one_of(st.none(), st.floats(0, 1e9))),
            rejected={draw(st.sampled_from(["overloaded", "draining", "x"])): draw(st.floats(0, 1e6))},
            depth=draw(st.integers(0, 10**6)))
    if kind == "field":
        d[draw(st.sampled_from(sorted(d)))] = draw(WEIRD)
    elif kind == "missing":
        del d[draw(st.sampled_from(sorted(d)))]
    elif kind == "other":
        return draw(WEIRD)
    elif kind == "error":
        return draw(st.sampled_from([asyncio.TimeoutError(), RuntimeError("reset"), ValueError("no answer")]))
    return d


@st.composite
def a_good_worker(draw: st.DrawFn, rounds: int) -> list[dict[str, Any]]:
    """Valid snapshots: counters rising by any amount (mostly around what one device does, sometimes
    far past it) and sometimes reset (a restart), any capacity, items waiting any time."""
    out, admitted, forward, waits = [], 0.0, 0.0, [0, 0, 0, 0]
    for _ in range(rounds):
        if draw(st.integers(0, 7)) == 0:
            admitted, forward, waits = draw(st.floats(0, 1e6)), 0.0, [0, 0, 0, 0]
        admitted += draw(st.one_of(st.floats(0, 1e4), st.floats(0, 1e12)))
        forward += draw(st.floats(0, 4))
        for i in range(draw(st.integers(0, 3)), 4):  # new waits in one bucket: every bound above it counts them
            waits[i] += draw(st.integers(0, 50)) if i == 0 else 0
        cumulative = [sum(waits[: i + 1]) for i in range(4)]
        out.append(doc(admitted, forward=forward, cap=draw(st.one_of(st.floats(1, 1e4), st.floats(1, 1e8))),
                       rejected={"overloaded": draw(st.floats(0, 10)), "draining": draw(st.floats(0, 1e3))},
                       waits=tuple(cumulative)))
    return out


ROUNDS = 10


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(good=a_good_worker(ROUNDS), others=st.lists(st.lists(answers(), min_size=ROUNDS, max_size=ROUNDS),
                                                   max_size=3),
       bounds=st.sampled_from([(1, 1), (1, 3), (2, 5)]))
def test_fuzz_the_planner_never_raises_stays_in_bounds_and_decides_while_a_worker_answers(good, others, bounds):
    """Each round every worker answers anything; serve carries out each change at once (discovery lists
    the first n workers). The planner's round never raises, every count it asks for and every
    decision is within [min, max], rates are finite and never negative, and from the second round
    the data is never stale: worker 1 always answers."""
    low, high = bounds
    p, load, connector, clock = planner(min_replicas=low, max_replicas=high, scale_up_cooldown_s=0,
                                        scale_down_cooldown_s=0)
    behaviours = [iter(good), *(iter(o) for o in others)]
    spare = iter(range(10**6))

    def listed(n: int) -> dict[int, Callable[[], Any]]:  # a worker beyond the drawn ones answers well
        return {i + 1: (lambda b=behaviours[i]: next(b)) if i < len(behaviours) else rising(next(spare) + 1)
                for i in range(n)}

    async def rounds() -> None:
        load.answers = listed(max(len(behaviours), low))
        for r in range(ROUNDS):
            clock.now = 2.0 * r
            d = await p.tick()
            assert low <= d.replicas <= high, d  # `current`: what runs, which may start outside
            sig = p.signals
            assert sig is not None
            figures = (sig.demand_pps, sig.encoded_pps, sig.busy, sig.rejected_per_s)
            assert all(math.isfinite(x) and x >= 0 for x in figures), sig
            assert math.isnan(sig.capacity_pps) or sig.capacity_pps >= p.s.min_capacity_pps
            if r >= 1:
                assert sig.stale == [] and not d.reason.startswith("stale"), d
            if connector.targets and len(load.answers) != connector.targets[-1]:
                load.answers = listed(connector.targets[-1])
        assert all(low <= n <= high for n in connector.targets)

    asyncio.run(rounds())


@settings(max_examples=300, deadline=None, derandomize=True)
@given(answers())
def test_fuzz_a_snapshot_parses_to_finite_figures_or_is_refused_by_field(answer):
    if isinstance(answer, BaseException):
        return
    try:
        s = Snapshot.parse(0, answer)
    except SnapshotError as e:
        assert str(e).startswith("load snapshot") and e.field in str(e)
        return
    numbers = (s.forward_seconds, s.patches_admitted, s.patches_encoded, s.rejected, s.queue_depth)
    assert all(math.isfinite(x) and x >= 0 for x in numbers)
    assert math.isnan(s.capacity_pps) or 0 <= s.capacity_pps < math.inf


# --- 3. serve's executor: any decision, and the graph goes on -----------------------------------


class FakeEncoders:
    """The encoders' `Fleet` as `scale_to` uses it, without processes: growing and draining move names."""

    kind = name = "encoder"
    procs: tuple[Any, ...] = ()

    def __init__(self, running: int = 1, fail: Exception | None = None):
        self.names = [f"encoder-{i}" for i in range(running)]
        self.fail = fail

    @property
    def live(self) -> list[Any]:
        return [SimpleNamespace(name=n) for n in self.names]

    def check(self, restart: bool) -> list[str]:
        return []

    def grow(self, target: Any) -> tuple[list[str], str]:
        if self.fail is not None:
            raise self.fail
        new = [r.name for r in target.replicas if r.name not in self.names]
        self.names += new
        return new, ""

    def retiring(self, target: Any) -> list[Any]:
        keep = {r.name for r in target.replicas}
        return [SimpleNamespace(name=n) for n in sorted(self.names, reverse=True) if n not in keep]

    def drain(self, procs: list[Any]) -> None:
        gone = {p.name for p in procs}
        self.names = [n for n in self.names if n not in gone]


class Decisions:
    """The executor's thread as `supervise` reads it: each count once, then stop."""

    def __init__(self, counts: list[object], stop: threading.Event):
        self.todo = [(c, concurrent.futures.Future()) for c in counts]
        self.futures = [f for _, f in self.todo]
        self.stop = stop

    def pending(self) -> Any:
        if not self.todo:
            self.stop.set()
            return None
        return self.todo.pop(0)


class NoWait(threading.Event):
    """`supervise`'s pause between rounds, skipped: the rounds run back to back."""

    def wait(self, timeout: float | None = None) -> bool:
        return self.is_set()


@pytest.fixture
def runner(tmp_path):
    graph = load_graph(ROOT / "graphs" / "epd-autoscale.yaml")  # its planner: --min-replicas 1 --max-replicas 3
    r = GraphRunner(graph, tmp_path / "run")
    r.run_dir.mkdir(parents=True)
    return r


def test_the_executors_bounds_are_the_planners_as_its_process_reads_them():
    graph = load_graph(ROOT / "graphs" / "epd-autoscale.yaml")
    assert scaling_bounds(graph) == (1, 3)
    assert scaling_bounds(load_graph(ROOT / "graphs" / "epd.yaml")) == (1, 64)  # no planner
    name, planner = graph.planner
    env = {"MM_PLANNER_MIN_REPLICAS": "2", "MM_PLANNER_MAX_REPLICAS": "5"}
    i = planner.args.index("--max-replicas")  # then its env's max, and its args' min over its env's
    changed = planner.model_copy(update={"env": env, "args": [*planner.args[:i], *planner.args[i + 2:]]})
    assert scaling_bounds(graph.model_copy(update={"components": {**graph.components, name: changed}})) == (1, 5)


@pytest.mark.parametrize("count, expected", [
    (2, (2, "")),
    (0, (1, "asked for 0 encoders, below the planner's minimum: carrying out 1")),
    (-1, (1, "asked for -1 encoders, below the planner's minimum: carrying out 1")),
    (10**9, (3, "asked for 1000000000 encoders, above the planner's maximum: carrying out 3")),
    ("2", (None, "refused: '2' is not an encoder count")),
    (2.0, (None, "refused: 2.0 is not an encoder count")),
    (None, (None, "refused: None is not an encoder count")),
    (True, (None, "refused: True is not an encoder count")),
])
def test_a_decision_outside_the_bounds_is_clamped_and_one_that_is_no_count_refused(count, expected):
    assert executable(count, (1, 3)) == expected


def test_no_decision_stops_the_graph(runner, capsys):
    """Before: a 0 raised out of `supervise` (the whole graph stopped) and 10**9 planned a billion workers."""
    fleet = FakeEncoders(running=1)
    runner.fleets = [fleet]
    stop = NoWait()
    decisions = Decisions([0, -1, 10**9, "2", 2.5, None, True, 2, 1], stop)
    runner.supervise(decisions, stop=stop)  # returns: nothing raised
    outcomes = [f.result(timeout=0) for f in decisions.futures]
    assert [n for _, n in outcomes] == [1, 1, 3, 3, 3, 3, 3, 2, 1]
    assert outcomes[0] == ("encoder: asked for 0 encoders, below the planner's minimum: carrying out 1", 1)
    assert outcomes[2] == ("encoder: asked for 1000000000 encoders, above the planner's maximum: carrying out 3; "
                           "encoder: 3 running (started encoder-1, encoder-2)", 3)
    assert outcomes[3] == ("encoder: refused: '2' is not an encoder count", 3)
    assert outcomes[8] == ("encoder: 1 running (drained encoder-1)", 1)
    assert fleet.names == ["encoder-0"] and runner.scaling["wanted"] == 1
    assert "carrying out 3" in capsys.readouterr().out  # serve's log says what it did instead


def test_an_unforeseen_error_while_scaling_is_reported_and_the_graph_goes_on(runner):
    runner.fleets = [FakeEncoders(running=1, fail=RuntimeError("no more ports"))]
    stop = NoWait()
    decisions = Decisions([3], stop)
    runner.supervise(decisions, stop=stop)
    assert decisions.futures[0].result(timeout=0) == ("scaling to 3 failed: RuntimeError: no more ports", 1)


def test_the_executors_thread_hands_any_count_on_and_outlives_a_failed_read(monkeypatch):
    """Before: a count that was not an int raised TypeError in the thread (`count < 0`), and so did a
    failed read of the decision: the thread ended and no later decision was ever carried out."""
    completed: list[tuple[int, object]] = []

    class Coordinator:
        def __init__(self) -> None:
            self.reads = iter([(0, -1), RuntimeError("etcd unreachable"), (1, "x"), (1, "x"), (2, 10**9), (3, 2)])
            self.current = (0, -1)

        async def wait(self) -> None:
            return None

        async def get(self) -> Any:
            read = next(self.reads, self.current)
            if isinstance(read, Exception):
                raise read
            self.current = read
            return SimpleNamespace(decision_id=read[0], num_prefill_workers=read[1])

        async def complete(self, decision: Any) -> None:
            completed.append((decision.decision_id, decision.num_prefill_workers))

    runtime = SimpleNamespace(shutdown=lambda: None)
    monkeypatch.setattr("mm_encoder.runtime.dynamo.make_runtime", lambda loop: runtime)
    monkeypatch.setattr("mm_encoder.runtime.dynamo.scaling_client", lambda rt, ns: Coordinator())
    monkeypatch.setattr(scaler_module, "POLL_S", 0.01)
    s = Scaler("mm", {}, running=1)
    s.start(timeout_s=10)
    try:
        handed = []
        for running in (1, 3, 2):
            count, done = s._in.get(timeout=10)  # what supervise reads with pending(), waited for here
            handed.append(count)
            done.set_result(("", running))
        assert handed == ["x", 10**9, 2]  # -1 (no decision yet) is not handed on; "x" once
    finally:
        s.stop()
    assert completed == [(1, "x"), (2, 10**9), (3, 2)] and s.running == 2 and s.error is None
