"""How long a SIGKILLed encode worker stays in Dynamo's discovery (not a test):

    python -m bench.discovery [--repeats 1] [--json PATH]

Per discovery backend, `mm-encoder serve` runs graphs/epd-etcd.yaml (two encode workers): as is
(etcd discovery, NATS planes; etcd and nats-server started here on loopback) and with `runtime`
set back to the default (file discovery, TCP, ZMQ). A separate Dynamo client process
(harness/dynamo_probe.py) watches `<ns>.mm_encoder.encode`; one worker gets SIGKILL and the time
until the probe lists one instance is measured. A clean exit deregisters at once in both;
this measures what a crash costs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import yaml

from bench import stats
from harness.dynamo_probe import Probe
from harness.serve_fixtures import Served
from harness.topology import free_port
from mm_encoder.serve import infra

ROOT = Path(__file__).resolve().parents[1]


def measure(backend: str, work: Path) -> float:
    graph = yaml.safe_load((ROOT / "graphs" / "epd-etcd.yaml").read_text())
    env: dict[str, str] = {}
    servers = []
    if backend == "file":
        graph["runtime"] = {}
        graph["name"], graph["namespace"] = "epd-file", "mm-file"
    else:
        for s in (infra.etcd(work / "etcd"), infra.nats(work / "nats")):
            s.start(work / f"{s.name}.log")
            s.wait_ready()
            servers.append(s)
            env |= s.env
    path = work / f"{graph['name']}.yaml"
    path.write_text(yaml.safe_dump(graph))
    run_dir = work / "run"
    served = Served(str(path), run_dir, free_port(), env=env)
    try:
        served.wait_for("ready: OpenAI base URL", 240)
        state = json.loads((run_dir / "state.json").read_text())
        probe_env = {**env, "DYN_FILE_KV": str(run_dir / "dynamo-store")} if backend == "file" else env
        planes = {} if backend == "etcd" else {"DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": "tcp",
                                                "DYN_EVENT_PLANE": "zmq"}
        with Probe({**probe_env, **planes}, f"{graph['namespace']}.mm_encoder.encode") as probe:
            if probe.wait_count(2, 60) is None:
                raise RuntimeError(f"the probe never saw two workers: {probe.events}")
            victim = next(c for c in state["components"] if c["name"] == "encoder-0")
            os.killpg(victim["pid"], signal.SIGKILL)
            killed = time.monotonic()
            left = probe.wait_count(1, 180)
        if left is None:
            raise RuntimeError(f"{backend}: the killed worker was still listed after 180 s")
        return left - killed
    finally:
        if served.proc.poll() is None:
            served.stop()
        for s in servers:
            s.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="the same (one repeat)")
    p.add_argument("--backends", default="etcd,file", help="comma-separated: etcd, file")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    out = {}
    for backend in args.backends.split(","):
        times = []
        for _ in range(1 if args.quick else args.repeats):
            work = Path(tempfile.mkdtemp(prefix=f"mm-bench-discovery-{backend}-"))
            try:
                times.append(measure(backend, work))
            finally:
                shutil.rmtree(work, ignore_errors=True)
        out[backend] = {"time_s": stats.summary(times), "all_s": [round(t, 1) for t in times]}
        print(backend, out[backend], flush=True)
    out = {"machine": stats.machine(), "repeats": 1 if args.quick else args.repeats, "backends": out}
    print(json.dumps(out, indent=2))
    stats.emit(out, args.json, "discovery")


if __name__ == "__main__":
    main()
