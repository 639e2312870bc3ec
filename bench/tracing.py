"""What tracing costs the frontend: its CPU per request with tracing off against the code before
tracing ("before"), and on against off, side by side in one run.

    python -m bench.tracing [--quick] [--json PATH] [--blocks N] [--block-size N] [--baseline REF]

Three `mm-encoder serve graphs/epd.yaml` run at once on the generated tiny Kimi-K2.5 checkpoint:
- before: the package at `--baseline` (a git worktree; default the commit before issue 32's
  tracing), no OpenTelemetry environment;
- off: this tree, no OpenTelemetry environment (the API's no-op spans);
- on: this tree exporting every span over OTLP/HTTP to a receiver in this process (`harness.otlp`,
  decoding each `ExportTraceServiceRequest`), Dynamo's own spans included, batched every 500 ms
  (so the export's cost falls within the measured blocks).
Each request is the README's chat (the sample photo; a cache hit after the first) with
`max_tokens` 1, so the frontend's own work is a large share of the time. Requests go in blocks of
`--block-size`, the three graphs' blocks interleaved; per block, the frontend process's CPU time
(the sum over its threads of /proc/<pid>/task/*/schedstat, nanoseconds) divided by the requests,
and each request's latency. Figures are medians over blocks (min-max), ratios of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import stats
from harness.otlp import Receiver
from harness.procfs import cpu_ns
from harness.serve_fixtures import MODEL, ROOT, Served, sample_content
from harness.topology import free_port

VARIANTS = ("before", "off", "on")
BASELINE = "70175a5^"  # main before issue 32's first step: no span anywhere


def chat(port: int) -> float:
    """One request; its latency in ms."""
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": sample_content()}]}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
        assert r.status == 200
    return (time.perf_counter() - t0) * 1e3


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "DYN_LOGGING_JSONL"}


def measure(blocks: int, block_size: int, baseline: str) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-tracing-"))
    tree = tmp / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), baseline], check=True)
    served: dict[str, Served] = {}
    try:
        with Receiver() as receiver:
            ports = {v: free_port() for v in VARIANTS}
            env = _clean_env()
            served["before"] = Served("graphs/epd.yaml", tmp / "before", ports["before"], cwd=tree,
                                      command=[sys.executable, "-m", "mm_encoder.cli"],
                                      env={**env, "PYTHONPATH": str(tree)})
            served["off"] = Served("graphs/epd.yaml", tmp / "off", ports["off"], env=env,
                                   unset=tuple(k for k in os.environ if k.startswith("OTEL_")))
            served["on"] = Served("graphs/epd.yaml", tmp / "on", ports["on"], unset=("DYN_LOGGING_JSONL",),
                                  env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                                       "OTEL_BSP_SCHEDULE_DELAY": "500"})  # exports within the blocks
            for s in served.values():
                s.wait_for("ready: OpenAI base URL", 600)
            pids = {v: s.component("frontend")["pid"] for v, s in served.items()}
            for v in VARIANTS:  # warm: the first encodes, the rest are what is measured
                for _ in range(3):
                    chat(ports[v])
            cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
            latency: dict[str, list[float]] = {v: [] for v in VARIANTS}
            deadline = time.monotonic() + 1800
            for b in range(blocks):
                order = VARIANTS[b % 3:] + VARIANTS[:b % 3]  # each variant first as often as the others
                for v in order:
                    c0 = cpu_ns(pids[v])
                    latency[v] += [chat(ports[v]) for _ in range(block_size)]
                    cpu[v].append((cpu_ns(pids[v]) - c0) / 1e6 / block_size)
                if time.monotonic() > deadline:
                    break
            for s in served.values():  # every process flushes what it still batches on its way out
                s.stop(check=False)
            spans = len(receiver.spans)
    finally:
        for s in served.values():
            if s.proc.poll() is None:
                s.stop(check=False)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    figures = {v: {"cpu_ms_per_request": stats.summary(cpu[v]), "latency_ms": stats.summary(latency[v])}
               for v in VARIANTS}
    return {
        "baseline": baseline, "blocks": len(cpu["off"]), "block_size": block_size, "spans_received": spans,
        "variants": figures,
        "ratios": {"off_vs_before": stats.ratio(figures["off"]["cpu_ms_per_request"],
                                                figures["before"]["cpu_ms_per_request"]),
                   "on_vs_off": stats.ratio(figures["on"]["cpu_ms_per_request"],
                                            figures["off"]["cpu_ms_per_request"])},
        "machine": stats.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: 3 blocks of 10")
    p.add_argument("--json", type=Path)
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--block-size", type=int, default=20)
    p.add_argument("--baseline", default=BASELINE, help="the git revision measured as 'before'")
    a = p.parse_args(argv)
    blocks, size = (3, 10) if a.quick else (a.blocks, a.block_size)
    result = measure(blocks, size, a.baseline)
    for v in VARIANTS:
        f = result["variants"][v]
        print(f"{v:>6}: frontend CPU {stats.fmt(f['cpu_ms_per_request'], 2)} ms/request, "
              f"latency {stats.fmt(f['latency_ms'])} ms")
    print(f"off/before {result['ratios']['off_vs_before']:.3f}, on/off {result['ratios']['on_vs_off']:.3f}; "
          f"{result['spans_received']} spans received")
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
