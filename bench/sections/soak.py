"""BENCHMARKS.md's section for bench/soak.py: its figures (the JSON it writes) as markdown and plots."""

from __future__ import annotations

from pathlib import Path


def section(result: dict, plots: Path) -> str:
    """BENCHMARKS.md's part for the soak (bench/report.py), from its JSON alone."""
    cap = result.get("capacity", {})
    lines = [
        "## The soak (`make soak` = `python -m bench.soak`)",
        "",
        "`mm-encoder serve graphs/epd.yaml --restart`, 2 cores shared by every process, chat requests of one",
        "image each (half repeated, half new), each with a 60 s deadline. Capacity is measured first (4",
        f"clients, closed loop, 10 s): {cap.get('req_per_s', '-')} req/s. Overload: an open loop at twice that",
        "rate. Faults: one component stopped a third of the way into the phase at the measured rate",
        "(SIGKILL; SIGTERM for the frontend, a restart); `--restart` brings it back. Latencies are one",
        "run's percentiles of the requests that got a 200.",
        "",
        "| phase | sent | ok | refused (clean 4xx/5xx) | unclean | unreachable | lost | hung | ok p50 / p99 ms |",
        "|---|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for name, r in result.items():
        if not isinstance(r, dict) or "sent" not in r or name == "capacity":
            continue
        codes = ", ".join(f"{n:,} x {c}" for c, n in sorted(r.get("statuses", {}).items())
                          if str(c) not in ("200", "0") and not str(c).isalpha())
        refused = f"{r['refused']:,} ({codes})" if codes else f"{r['refused']:,}"
        lines.append(f"| {name.replace('_', ' ')} | {r['sent']:,} | {r['ok']:,} | {refused} | "
                     f"{r.get('unclean', 0)} | {r['unreachable']} | {r['lost']} | {r['hung']} | "
                     f"{r['p50_ms']} / {r['p99_ms']} |")
    left = result.get("left_after_stop")
    lines += ["", f"Processes left after `serve` stopped, over every session it started: {left}.", ""]
    return "\n".join(lines)
