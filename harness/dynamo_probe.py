"""A Dynamo client in its own process (one runtime per process): prints `{"t": ..., "n": ...}`
whenever the number of instances of an endpoint changes, polling every 50 ms; stops on SIGTERM.

    python -m harness.dynamo_probe NAMESPACE.COMPONENT.ENDPOINT   (discovery and planes from DYN_* env)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

from harness.processes import Process
from mm_encoder.runtime.dynamo import make_runtime

ROOT = Path(__file__).resolve().parents[1]


async def main(path: str) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    rt = make_runtime(asyncio.get_running_loop())
    client = await rt.endpoint(path).client()
    await client.wait_for_instances()
    last = None
    while not stop.is_set():
        n = len(client.instance_ids())
        if n != last:
            print(json.dumps({"t": time.monotonic(), "n": n}), flush=True)
            last = n
        await asyncio.sleep(0.05)
    rt.shutdown()


class Probe:
    """This module as a `Process`, watching one endpoint's instances (`events`: every count it printed)."""

    def __init__(self, env: dict[str, str], path: str):
        self.proc = Process([sys.executable, "-m", "harness.dynamo_probe", path], name=f"probe {path}", cwd=ROOT,
                            env={**os.environ, "DYN_DISCOVERY_BACKEND": "etcd", "DYN_REQUEST_PLANE": "nats",
                                 "DYN_EVENT_PLANE": "nats", "DYN_LOG": "error", **env})

    @property
    def events(self) -> list[dict]:
        return [e for e in map(_event, list(self.proc.lines)) if e is not None]

    def wait_count(self, n: int, timeout: float) -> float | None:
        """The probe's clock time when the count became n (None: not within timeout)."""
        line = self.proc.wait_line(lambda text: (_event(text) or {}).get("n") == n, timeout)
        return None if line is None else _event(line)["t"]

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stop(signal.SIGTERM, grace_s=20)


def _event(line: str) -> dict | None:
    """One of the lines `main` prints (its other output, Dynamo's log, is not)."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) and {"t", "n"} <= event.keys() else None




if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
