"""BENCHMARKS.md's section for bench/tracing.py: its figures (the JSON it writes) as markdown."""

from __future__ import annotations

from pathlib import Path

from bench import stats

NAMES = {"before": "before tracing (`{baseline}`)", "off": "tracing off (no OTEL endpoint)",
         "on": "tracing on (OTLP/HTTP, every span)"}


def section(result: dict, plots: Path) -> str:
    v, r = result["variants"], result["ratios"]
    lines = [
        "## What tracing costs the frontend (`python -m bench.tracing`)",
        "",
        "Three `mm-encoder serve graphs/epd.yaml` at once (the generated tiny Kimi-K2.5): the package before "
        "tracing, this one with tracing off, and this one exporting every span (ours and Dynamo's) over OTLP/HTTP "
        "to a receiver in the benchmark. The README's chat (a cache hit after the first), `max_tokens` 1, in blocks "
        f"of {result['block_size']} requests, the three interleaved; {result['blocks']} blocks each. The "
        "frontend process's CPU time (all its threads, /proc schedstat) per request, and the request latency: "
        "median (min-max) over blocks.",
        "",
        "| variant | frontend CPU per request (ms) | latency (ms) |",
        "|---|---:|---:|",
    ]
    for name, f in v.items():
        lines.append(f"| {NAMES[name].format(baseline=result['baseline'])} | "
                     f"{stats.fmt(f['cpu_ms_per_request'], 2)} | {stats.fmt(f['latency_ms'])} |")
    lines += [
        "",
        f"- off / before: **{r['off_vs_before']:.3f}**" + (
            " (within this machine's noise: the no-op spans cost nothing measurable);"
            if abs(r["off_vs_before"] - 1) <= 0.05 else "; tracing off costs the frontend this much more or less;"),
        f"- on / off: **{r['on_vs_off']:.3f}** ({result['spans_received']:,} spans received), the price of "
        "recording and exporting every span, Dynamo's own included; sample (`OTEL_TRACES_SAMPLER`) to pay less.",
    ]
    return "\n".join(lines) + "\n"
