"""The encode planner under a load ramp: `graphs/epd-autoscale.yaml` with the planner live against
the same graph with a fixed single encoder, one after the other in one invocation.

    python -m bench.autoscale [--quick] [--json PATH] [--clients N] [--side PX]

Each run is `mm-encoder serve graphs/epd-autoscale.yaml` (the generated tiny Kimi-K2.5 checkpoint)
and one ramp of cold images (`harness.autoscale.Load`: every request a new `side` x `side` JPEG,
streamed, so each 200 has its time to first token):

1. warm: 1 client for `warm_s`;
2. saturating: `clients` clients for `sat_s` (on a 2-core machine one encoder is then busy all
   the time: the planner's demand is above `target_utilization` x its measured capacity);
3. idle: 0 clients until the planner is back at `min` encoders (its scale-down cooldown is the
   graph's 30 s), at most `idle_max_s`, at least `idle_min_s`.

The fixed single encoder is the same graph with `MM_PLANNER_DRY_RUN=true`: the planner reads the
same signals and decides (its decisions are recorded) but changes nothing. The planner's
`GET /status` is sampled every second; serve's `scaled (the encode planner's decision): ...` lines
say when an encoder started serving (after it is healthy and the tiers' upstreams name it) or was
drained. Saturation is the start of the saturating phase (the same instant in both runs); the first
sample where demand > target x capacity x running is reported too. A request without an answer (a
lost one) fails the run: the JSON is written, then the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import stats
from harness.autoscale import Answer, Load
from harness.serve_fixtures import Served
from harness.topology import free_port
from mm_encoder.core.quantiles import nearest_rank

GRAPH = "graphs/epd-autoscale.yaml"
SCALED = re.compile(r"scaled \(the encode planner's decision\): \S+: (\d+) running \((.*)\)")


@dataclass(frozen=True)
class Ramp:
    warm_s: float = 20.0
    warm_clients: int = 1
    sat_s: float = 75.0
    clients: int = 8
    side: int = 672
    idle_min_s: float = 10.0
    idle_max_s: float = 150.0
    max_tokens: int = 4


QUICK = Ramp(warm_s=6.0, sat_s=30.0, idle_min_s=5.0, idle_max_s=60.0)
RUNS = {"planner": {}, "fixed": {"MM_PLANNER_DRY_RUN": "true"}}  # name -> serve's extra environment


class Sampler:
    """The planner's GET /status every `every_s` seconds, in a thread, stamped with seconds since `t0`."""

    def __init__(self, url: str, t0: float, every_s: float = 1.0):
        self.url, self.t0, self.every_s = url, t0, every_s
        self.samples: list[dict] = []
        self.config: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            at = time.monotonic() - self.t0
            try:
                with urllib.request.urlopen(f"{self.url}/status", timeout=5) as r:
                    st = json.loads(r.read())
                self.samples.append(sample(at, st))
                self.config = self.config or {k: st.get(k) for k in ("min", "max", "target_utilization",
                                                                     "queue_wait_sla_s", "dry_run")}
            except (OSError, ValueError) as e:
                self.samples.append({"t": round(at, 2), "error": f"{type(e).__name__}: {e}"})
            self._stop.wait(max(0.0, self.every_s - (time.monotonic() - self.t0 - at)))

    def latest(self) -> dict:
        return next((s for s in reversed(self.samples) if "error" not in s), {})

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(10)
        return self.samples


def sample(at: float, st: dict) -> dict:
    """One /status answer, reduced to what the report and the plot use."""
    sig, last = st.get("signals") or {}, st.get("last_decision") or {}
    return {"t": round(at, 2), "wanted": st.get("wanted"), "running": st.get("running"),
            "demand_pps": sig.get("demand_pps"), "capacity_pps": sig.get("capacity_pps"), "busy": sig.get("busy"),
            "queue_wait_p95_s": sig.get("queue_wait_p95_s"), "queue_depth": sig.get("queue_depth"),
            "rejected_per_s": sig.get("rejected_per_s"), "stale": bool(sig.get("stale")),
            "decision": {k: last.get(k) for k in ("action", "replicas", "from", "reason", "at")} if last else None}


def scale_events(served: Served, t0: float) -> list[dict]:
    """serve's `scaled ...` lines: when (seconds since `t0`, as serve printed it), how many run, what changed."""
    out = []
    for line, when in zip(list(served.proc.lines), list(served.proc.times), strict=False):
        if m := SCALED.search(line):
            out.append({"t": round(when - t0, 2), "running": int(m.group(1)), "what": m.group(2)})
    return out


def drive(served: Served, ramp: Ramp, url: str) -> dict:
    """The ramp against one served graph: answers, samples, scale events and phase times (seconds since
    the load started)."""
    load = Load(served.port, clients=ramp.clients, side=ramp.side, stream=True, max_tokens=ramp.max_tokens,
                active=ramp.warm_clients, max_requests=20_000, max_s=ramp.warm_s + ramp.sat_s + ramp.idle_max_s + 60)
    t0, wall0 = load.started, time.time()
    sampler = Sampler(url, t0)
    try:
        time.sleep(ramp.warm_s)
        load.set_clients(ramp.clients)
        sat_start = time.monotonic() - t0
        time.sleep(ramp.sat_s)
        load.set_clients(0)
        load_end = time.monotonic() - t0
        idle_end = load_end + ramp.idle_max_s
        while time.monotonic() - t0 < idle_end:
            time.sleep(1.0)
            at_min = _at_min(served, t0, sampler)
            if at_min and time.monotonic() - t0 >= load_end + ramp.idle_min_s:
                break
        ended = time.monotonic() - t0
    finally:
        answers = load.stop()
        samples = sampler.stop()
    return {"phases": {"sat_start": round(sat_start, 2), "load_end": round(load_end, 2), "end": round(ended, 2)},
            "answers": answers, "samples": samples, "events": scale_events(served, t0), "wall0": wall0,
            "config": sampler.config}


def _at_min(served: Served, t0: float, sampler: Sampler) -> bool:
    """The fleet is back at the planner's `min`: serve runs that many and the planner sees that many."""
    low = sampler.config.get("min") or 1
    events = scale_events(served, t0)
    latest = sampler.latest()
    return (not events or events[-1]["running"] == low) and latest.get("running") == low \
        and latest.get("wanted") in (None, low)


def ttft(answers: list[Answer], lo: float, hi: float) -> dict:
    """TTFT of the 200s sent in [lo, hi): p50, p95 (seconds) and how many."""
    v = [a.ttft_s for a in answers if a.status == 200 and a.ttft_s is not None and lo <= a.at < hi]
    return {"p50_s": nearest_rank(v, 0.5), "p95_s": nearest_rank(v, 0.95), "n": len(v)}


def decisions(samples: list[dict], wall0: float) -> list[dict]:
    """The planner's distinct non-hold decisions, in order, at seconds since the load started."""
    seen, out = set(), []
    for s in samples:
        d = s.get("decision")
        if d and d.get("action") != "hold" and d.get("at") not in seen:
            seen.add(d["at"])
            out.append({**d, "t": round(d["at"] - wall0, 2)})
    return out


def first(samples: list[dict], after: float, test) -> float | None:
    return next((s["t"] for s in samples if "error" not in s and s["t"] >= after and test(s)), None)


def summarize(run: dict) -> dict:
    """One run's figures (seconds since the load started, or durations) from what `drive` recorded."""
    ph, answers, samples, events = run["phases"], run["answers"], run["samples"], run["events"]
    target = run["config"].get("target_utilization") or 0.7
    low = run["config"].get("min") or 1
    sat, end = ph["sat_start"], ph["load_end"]
    over = first(samples, sat, lambda s: (s["demand_pps"] or 0) > target * (s["capacity_pps"] or math.inf)
                 * max(1, s["running"] or 1))
    second = next((e["t"] for e in events if e["running"] >= 2 and e["t"] >= sat), None)
    ups = [d for d in decisions(samples, run["wall0"]) if d["action"] == "up" and d["t"] >= sat]
    back = next((e["t"] for e in reversed(events) if e["running"] == low and e["t"] >= end), None)
    scaled_up = any(e["running"] > low for e in events)
    statuses: dict[str, int] = {}
    for a in answers:
        statuses[str(a.status)] = statuses.get(str(a.status), 0) + 1
    refused = [a for a in answers if a.status == 503]
    tail = max(sat, end - 30.0)
    return {
        "sent": len(answers), "ok": statuses.get("200", 0), "refused": len(refused),
        "refused_without_retry_after": sum(1 for a in refused if not a.retry_after),
        "lost": statuses.get("None", 0), "statuses": statuses,
        "lost_errors": [a.error for a in answers if a.status is None][:5],
        "ttft_ramp": ttft(answers, 0.0, math.inf), "ttft_saturating": ttft(answers, sat, end),
        "ttft_saturating_last_30s": ttft(answers, tail, end), "ttft_warm": ttft(answers, 0.0, sat),
        "first_over_target_s": None if over is None else round(over - sat, 2),
        "first_up_decision_s": round(ups[0]["t"] - sat, 2) if ups else None,
        "second_encoder_serving_s": None if second is None else round(second - sat, 2),
        "max_replicas": max([e["running"] for e in events] + [s["running"] or 0 for s in samples if "running" in s]
                            + [low]),
        "back_to_min_s": (round(back - end, 2) if back is not None else None) if scaled_up else 0.0,
        "back_to_min": back is not None or not scaled_up,
        "requests_after_load_end": sum(1 for a in answers if a.at >= end),
    }


def one_run(name: str, env: dict[str, str], ramp: Ramp, keep: bool) -> dict:
    """serve the graph (`env` added), drive the ramp, stop it; the run's figures and its time series."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"mm-autoscale-{name}-")) / "run"
    served = Served(GRAPH, run_dir, free_port(), env=env, unset=() if env else ("MM_PLANNER_DRY_RUN",))
    ok = False
    try:
        served.wait_for("ready: OpenAI base URL", 300)
        url = served.component("planner")["url"]
        print(f"{name}: serving on {served.port}, planner {url}; ramp {asdict(ramp)}", flush=True)
        load_before = os.getloadavg()
        run = drive(served, ramp, url)
        figures = summarize(run)
        ok = True
    finally:
        served.stop(check=ok)
        if ok and not keep:
            shutil.rmtree(run_dir.parent, ignore_errors=True)
        else:
            print(f"{name}: run directory kept: {run_dir}", flush=True)
    answers = [{"at": round(a.at, 3), "status": a.status, "ttft_s": None if a.ttft_s is None else round(a.ttft_s, 4),
                "latency_s": round(a.latency_s, 4)} for a in run["answers"]]
    return {"env": env, "figures": figures, "phases": run["phases"], "planner": run["config"],
            "events": run["events"], "decisions": decisions(run["samples"], run["wall0"]), "samples": run["samples"],
            "answers": answers, "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"a short ramp: {asdict(QUICK)}")
    p.add_argument("--clients", type=int, help="clients in the saturating phase")
    p.add_argument("--side", type=int, help="image side, pixels")
    p.add_argument("--only", choices=list(RUNS), help="one of the two runs")
    p.add_argument("--keep", action="store_true", help="keep the run directories (logs, planner.log)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    ramp = QUICK if args.quick else Ramp()
    ramp = Ramp(**{**asdict(ramp), **{k: v for k, v in (("clients", args.clients), ("side", args.side)) if v}})
    measured = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result: dict = {"graph": GRAPH, "ramp": asdict(ramp), "quick": args.quick, "measured": measured, "runs": {}}
    for name, env in RUNS.items():
        if args.only in (None, name):
            result["runs"][name] = one_run(name, env, ramp, args.keep)
            print(f"{name}: {json.dumps(result['runs'][name]['figures'])}", flush=True)
    stats.emit(result, args.json, "autoscale")
    lost = {name: r["figures"]["lost"] for name, r in result["runs"].items() if r["figures"]["lost"]}
    if lost:
        print(f"FAILED: requests lost (no answer): {lost}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
