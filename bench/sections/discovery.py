"""BENCHMARKS.md's section for bench/discovery.py: its figures (the JSON it writes) as markdown and plots."""

from __future__ import annotations

from pathlib import Path

from bench import stats


def section(result: dict, plots: Path) -> str:
    b = result["backends"]
    lines = [
        "## A killed encode worker in discovery: etcd vs file (`python -m bench.discovery`)",
        "",
        "`mm-encoder serve` runs graphs/epd-etcd.yaml (two encode workers, two engines, tiers, frontend) on each "
        "backend:",
        "- etcd discovery with NATS planes (etcd-server and nats-server on loopback);",
        "- the same graph with `runtime` at its default (file discovery, TCP, ZMQ).",
        "",
        "A separate Dynamo client process (harness/dynamo_probe.py) watches `<ns>.mm_encoder.encode`, polling every "
        "50 ms. One worker gets SIGKILL; the time is until the probe lists one instance. Median (min-max) of "
        f"{result['repeats']} run(s) per backend.",
        "",
        "| discovery | time until the killed worker is gone (s) | runs |",
        "|---|---:|---|",
    ]
    for name, r in b.items():
        lines.append(f"| {name} | {stats.fmt(r['time_s'])} | {', '.join(f'{t:.1f}' for t in r['all_s'])} |")
    if "etcd" in b and "file" in b:
        e, f = b["etcd"]["time_s"]["median"], b["file"]["time_s"]["median"]
        why = ("Dynamo's etcd lease outlives its file-store entry in this version." if e > f else
               "the file store's entry outlives the etcd lease in this run.")
        slower = "etcd" if e > f else "file"
        lines += ["", f"- {slower} takes longer here ({max(e, f):.1f} s vs {min(e, f):.1f} s): {why}"]
    else:
        lines.append("")
    lines += [
        "- Neither delay costs requests. The tiers send encode requests to the survivor at once (nginx retries a "
        "refused connection on the next server: `proxy_next_upstream error non_idempotent`), and Dynamo's clients "
        "drop an unreachable instance on their own. In tests/test_runtime_etcd.py, every request started 2 s after "
        "the kill succeeded, and at most the one in flight failed.",
        "- etcd killed and restarted under load with the same data dir and port (tests/test_runtime_etcd.py): "
        "requests kept being answered throughout, since the components hold their instance lists; after the "
        "restart a new client finds both encoders and both engines again, and no component of ours restarted.",
    ]
    return "\n".join(lines) + "\n"
