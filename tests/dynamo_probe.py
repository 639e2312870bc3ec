"""A Dynamo client in its own process (one runtime per process): prints `{"t": ..., "n": ...}`
whenever the number of instances of an endpoint changes, polling every 50 ms; stops on SIGTERM.

    python tests/dynamo_probe.py NAMESPACE.COMPONENT.ENDPOINT   (discovery and planes from DYN_* env)
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time

from mm_encoder.runtime.dynamo import make_runtime


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


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
