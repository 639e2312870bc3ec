"""BENCHMARKS.md's section for bench/autoscale.py: its figures (the JSON it writes) as markdown and a plot."""

from __future__ import annotations

import math
from pathlib import Path

from bench import stats

NAMES = {"planner": "planner live", "fixed": "fixed single encoder (dry run)"}
COLORS = {"planner": "#4c72b0", "fixed": "#c44e52"}


def _s(v: float | None, digits: int = 1, none: str = "-") -> str:
    return none if v is None else f"{v:,.{digits}f}"


def _ms(t: dict) -> str:
    if t.get("p50_s") is None:
        return "-"
    return f"{t['p50_s'] * 1e3:,.0f} / {t['p95_s'] * 1e3:,.0f} (n={t['n']:,})"


def _rows(runs: dict) -> list[tuple[str, list[str]]]:
    f = {name: r["figures"] for name, r in runs.items()}
    never = {name: ("never (nothing changes)" if r["planner"].get("dry_run") else "never") for name, r in runs.items()}
    return [
        ("requests sent", [f"{x['sent']:,}" for x in f.values()]),
        ("answered 200", [f"{x['ok']:,}" for x in f.values()]),
        ("refused (503 with Retry-After)", [f"{x['refused']:,}" + (f" ({x['refused_without_retry_after']} without)"
                                            if x["refused_without_retry_after"] else "") for x in f.values()]),
        ("lost (no answer; must be 0)", [f"{x['lost']}" for x in f.values()]),
        ("first planner signal over the target, s after saturation",
         [_s(x["first_over_target_s"]) for x in f.values()]),
        ("first scale-up decision, s after saturation", [_s(x["first_up_decision_s"]) for x in f.values()]),
        ("second encoder serving, s after saturation",
         [_s(x["second_encoder_serving_s"], none=never[n]) for n, x in f.items()]),
        ("most encoders running", [str(x["max_replicas"]) for x in f.values()]),
        ("TTFT p50 / p95 ms, saturating phase", [_ms(x["ttft_saturating"]) for x in f.values()]),
        ("TTFT p50 / p95 ms, its last 30 s", [_ms(x["ttft_saturating_last_30s"]) for x in f.values()]),
        ("TTFT p50 / p95 ms, the whole ramp", [_ms(x["ttft_ramp"]) for x in f.values()]),
        ("back to `min` encoders, s after the load ended",
         [(_s(x["back_to_min_s"]) if x["back_to_min"] else "not within the bound") +
          (" (never left it)" if x["max_replicas"] <= 1 else "") for x in f.values()]),
        ("load average (1 min) before the run", [_s(r["loadavg_before"][0], 2) for r in runs.values()]),
    ]


def section(result: dict, plots: Path) -> str:
    ramp, runs = result["ramp"], result["runs"]
    cfg = next(iter(runs.values()))["planner"] if runs else {}
    lines = [
        "## Autoscaling the encoders (`python -m bench.autoscale`)",
        "",
        f"`mm-encoder serve {result['graph']}` (the generated tiny Kimi-K2.5 checkpoint; etcd, NATS, the cache "
        "tiers, 2 engines, the frontend and the encode planner, every process on the same 2 cores), twice, one "
        "after the other: with the planner live, and with `MM_PLANNER_DRY_RUN=true` (the planner reads the same "
        "signals and decides, but nothing changes: a fixed single encoder). The same ramp of cold images both "
        f"times: every request a new {ramp['side']}x{ramp['side']} JPEG, streamed, {ramp['max_tokens']} tokens; "
        f"{ramp['warm_clients']} client for {ramp['warm_s']:.0f} s, then {ramp['clients']} clients (closed loop) "
        f"for {ramp['sat_s']:.0f} s (saturating: one encoder is busy all the time), then none until the planner is "
        f"back at `min` (at least {ramp['idle_min_s']:.0f} s, at most {ramp['idle_max_s']:.0f} s). Planner: "
        f"{cfg.get('min')}-{cfg.get('max')} encoders, target utilization {cfg.get('target_utilization')}, queue wait "
        f"SLA {cfg.get('queue_wait_sla_s')} s, the graph's cooldowns (10 s up, 30 s down).",
        "",
        "Saturation is the start of the saturating phase (the same instant in both runs); the first planner "
        "signal over the target is its first `/status` sample (every second) where the demand is above target x "
        "measured capacity x running encoders. A second encoder serving: serve's `encoder: 2 running (started "
        "encoder-1)` line, printed once the new worker is healthy and the tiers' upstreams name it. Back at `min`: "
        "serve's line after the last drain. TTFT: the first streamed chunk with content, of the 200s sent in "
        f"the phase. One run each ({result.get('measured', 'date not recorded')}"
        f"{', with `--quick`' if result.get('quick') else ''}): figures from one ramp, on a machine whose 2 cores "
        "every process shares.",
        "",
        "| | " + " | ".join(NAMES.get(n, n) for n in runs) + " |",
        "|---|" + "---:|" * len(runs),
    ]
    lines += [f"| {label} | " + " | ".join(values) + " |" for label, values in _rows(runs)]
    lines += _events(runs)
    lines += _findings(runs)
    png = _plot(result, plots)
    if png:
        lines += ["", f"![replicas, demand and p95 queue wait over time]({png})"]
    return "\n".join(lines) + "\n"


def _events(runs: dict) -> list[str]:
    out = []
    for name, r in runs.items():
        sat = r["phases"]["sat_start"]
        ev = "; ".join(f"{e['t'] - sat:+.0f} s: {e['running']} running ({e['what']})" for e in r["events"])
        ups = [d for d in r["decisions"] if d["t"] >= sat]
        first_up = next((d for d in ups if d["action"] == "up"), None)
        why = f" The first scale-up decision: \"{first_up['reason']}\"." if first_up else ""
        dry = " (a dry run: none carried out)" if r["planner"].get("dry_run") else ""
        out.append(f"- {NAMES.get(name, name)}: {len(ups)} planner decisions to change the fleet after saturation"
                   f"{dry}; serve carried out: {ev or 'nothing'} (times from the start of saturation).{why}")
    return ["", *out] if out else []


def _tail_means(r: dict) -> tuple[float, float | None, float | None]:
    """Over the last 30 s of the saturating phase: 200s per second, and the planner's mean demand
    (patches/s) and mean p95 queue wait (s)."""
    end = r["phases"]["load_end"]
    lo = max(r["phases"]["sat_start"], end - 30.0)
    ok = sum(1 for a in r["answers"] if a["status"] == 200 and lo <= a["at"] < end) / (end - lo)
    pts = [s for s in r["samples"] if "error" not in s and lo <= s["t"] < end]

    def mean(key: str) -> float | None:
        v = [s[key] for s in pts if s.get(key) is not None]
        return sum(v) / len(v) if v else None

    return ok, mean("demand_pps"), mean("queue_wait_p95_s")


def _window(r: dict, lo: float, hi: float) -> str:
    """TTFT p50 / p95 ms of the 200s sent in [lo, hi) seconds after saturation."""
    sat = r["phases"]["sat_start"]
    v = sorted(a["ttft_s"] for a in r["answers"] if a["status"] == 200 and a["ttft_s"] is not None
               and sat + lo <= a["at"] < sat + hi)
    if not v:
        return "-"
    q = lambda f: v[min(len(v) - 1, max(0, math.ceil(f * len(v)) - 1))] * 1e3  # noqa: E731 (nearest rank)
    return f"{q(0.5):,.0f} / {q(0.95):,.0f} (n={len(v):,})"


def _findings(runs: dict) -> list[str]:
    if set(runs) != {"planner", "fixed"}:
        return []
    live, fixed = runs["planner"], runs["fixed"]
    (lo_ok, lo_d, lo_w), (fx_ok, fx_d, fx_w) = _tail_means(live), _tail_means(fixed)
    out = ["", f"Over the last 30 s of the saturating phase: planner live {lo_ok:.1f} answers/s, demand "
           f"{_s(lo_d and lo_d / 1e3)}k patches/s, planner p95 queue wait {_s(lo_w, 2)} s (mean of its samples); "
           f"fixed single encoder {fx_ok:.1f} answers/s, {_s(fx_d and fx_d / 1e3)}k patches/s, {_s(fx_w, 2)} s."]
    sat = live["phases"]["sat_start"]
    ups = [e["t"] - sat for e in live["events"] if e["t"] >= sat and "started" in e["what"]]
    if not ups:
        return out
    last, sat_s = ups[-1], live["phases"]["load_end"] - sat
    out += ["", f"TTFT p50 / p95 ms while the planner was adding encoders (saturation to the last one serving, "
            f"+{last:.0f} s): planner live {_window(live, 0, last)}, fixed {_window(fixed, 0, last)}; from then "
            f"to the load's end: planner live {_window(live, last, sat_s)}, fixed {_window(fixed, last, sat_s)}."]
    if lo_ok <= 1.1 * fx_ok:
        out += ["", "More encoders added at most 10% throughput here: every process of the graph shares the same "
                "2 cores, so a second and third encoder mostly take CPU from the first one, the frontend and "
                "the engines (the closed loop's demand is its throughput), and starting one (loading the tower, "
                "its capacity probe) takes CPU while the load is at its peak. What this run shows is the "
                "planner's behaviour: how fast it reacts, that no request is lost while encoders start and "
                "drain, how long the fleet takes to come back down. A latency gain needs encoders with devices "
                "(or cores) of their own."]
    return out


def _series(samples: list[dict], key: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
    pts = [(s["t"], s[key]) for s in samples if "error" not in s]
    return [t for t, _ in pts], [float("nan") if v is None else v * scale for _, v in pts]


def _plot(result: dict, plots: Path) -> str | None:
    plt = stats.pyplot()
    runs = result["runs"]
    if plt is None or not runs:
        return None
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    for name, r in runs.items():
        c, label, ph = COLORS.get(name, "gray"), NAMES.get(name, name), r["phases"]
        x, y = _series(r["samples"], "running")
        axes[0].step(x, y, where="post", color=c, label=f"{label}: running")
        x, y = _series(r["samples"], "wanted")
        axes[0].step(x, y, where="post", color=c, linestyle=":", alpha=0.7, label=f"{label}: wanted")
        x, y = _series(r["samples"], "demand_pps", 1e-3)
        axes[1].plot(x, y, color=c, label=f"{label}: demand")
        cap = [(s["t"], (s["capacity_pps"] or 0) * (s["running"] or 0) * 1e-3) for s in r["samples"]
               if "error" not in s and s.get("capacity_pps") is not None]
        axes[1].plot([t for t, _ in cap], [v for _, v in cap], color=c, linestyle="--", alpha=0.6,
                     label=f"{label}: measured capacity x running")
        x, y = _series(r["samples"], "queue_wait_p95_s")
        axes[2].plot(x, y, color=c, label=label)
        ok = [(a["at"], a["ttft_s"]) for a in r["answers"] if a["status"] == 200 and a["ttft_s"] is not None]
        axes[3].scatter([t for t, _ in ok], [v for _, v in ok], s=4, color=c, alpha=0.5, label=label)
        for ax in axes:
            ax.axvspan(ph["sat_start"], ph["load_end"], color=c, alpha=0.05)
    titles = ("encoders", "patches/s (thousands)", "p95 queue wait, s (planner window)", "TTFT per request, s")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[0].set_title("Ramp of cold images (shaded: the saturating phase): planner live vs a fixed single encoder")
    axes[-1].set_xlabel("seconds since the load started")
    return stats.save_png(fig, plots, "autoscale-ramp.png")
