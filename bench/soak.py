"""The soak (`make soak`; not collected by pytest): the EPD graph under `mm-encoder serve --restart`
(the generated tiny Kimi-K2.5 checkpoint), loaded on loopback, bounded in count and time.

    python -m bench.soak [--load-s 60] [--fault-s 20] [--quick] [--json PATH]

1. Capacity: a closed loop of 4 clients for 10 s (half repeated images, half new ones).
2. Overload: an open loop at twice that rate for `--load-s`. Every request has a 60 s deadline.
3. Faults: the same load at the measured rate while one component of each kind is stopped:
   SIGKILL to encoder, shard, router, cluster tier and engine; SIGTERM to the frontend (a restart).
   `--restart` brings each back.
Outcomes per phase:
- ok: a complete 200 with usage;
- refused: a clean 4xx/5xx with a JSON error body, 503 and 429 among them;
- unreachable: the frontend was not listening (connection refused, during its own restart);
- unclean: an answer that is neither a 200 with usage nor an error with a JSON body;
- lost: the connection dropped without an answer;
- hung: no answer before the deadline.
`lost` and `hung` must be 0, except `lost` for requests that were inside the frontend when it
was told to stop. The last lines check that no process of the graph is left.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import signal
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from harness.media_factory import image_bytes, natural_image
from harness.serve_fixtures import MODEL, Served
from harness.topology import free_port

DEADLINE_S = 60.0
KINDS = ("ok", "refused", "unclean", "unreachable", "lost", "hung")
HOT = [image_bytes(natural_image(112, 84, seed=s)) for s in range(8)]  # repeated: cache hits after the first


def body(i: int) -> bytes:
    data = HOT[i % len(HOT)] if i % 2 else image_bytes(natural_image(112, 84, seed=10_000 + i))  # misses
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return json.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]}).encode()


async def one(session: aiohttp.ClientSession, port: int, payload: bytes, out: list) -> None:
    t0 = time.monotonic()
    try:
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=payload,
                                headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=DEADLINE_S)) as r:
            raw = await r.read()
            try:
                doc = json.loads(raw)
            except ValueError:
                doc = None
            if r.status == 200 and isinstance(doc, dict) and doc.get("usage"):
                kind = "ok"
            elif r.status >= 400 and isinstance(doc, dict):
                kind = "refused"
            else:
                kind = "unclean"  # an answer, but not a complete 200 or a JSON error
            out.append((kind, r.status, time.monotonic() - t0))
    except aiohttp.ClientConnectorError:
        out.append(("unreachable", 0, time.monotonic() - t0))
    except asyncio.TimeoutError:
        out.append(("hung", 0, time.monotonic() - t0))
    except aiohttp.ClientError as e:
        out.append(("lost", type(e).__name__, time.monotonic() - t0))  # the status column names the error


async def closed_loop(port: int, clients: int, seconds: float, start: int) -> list:
    out: list = []
    deadline = time.monotonic() + seconds

    async def client(k: int) -> None:
        i = start + k
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline and len(out) < 10_000:
                await one(s, port, body(i), out)
                i += clients

    await asyncio.gather(*(client(k) for k in range(clients)))
    return out


async def open_loop(port: int, rate: float, seconds: float, start: int, fault=None) -> list:
    """`rate` requests per second for `seconds` (at most 20,000), each on its own; `fault` runs at a third."""
    out: list = []
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.monotonic()
        n = min(int(rate * seconds), 20_000)
        fired = fault is None
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))  # pacing the load, not waiting on it
            if not fired and time.monotonic() - t0 >= seconds / 3:
                fault()
                fired = True
            tasks.append(asyncio.ensure_future(one(s, port, body(start + i), out)))
        await asyncio.gather(*tasks)
    return out


def summary(results: list) -> dict:
    kinds = Counter(k for k, _, _ in results)
    ok = sorted(t for k, _, t in results if k == "ok")
    return {"sent": len(results), **{k: kinds.get(k, 0) for k in KINDS},
            "statuses": dict(Counter(s for _, s, _ in results)),
            "p50_ms": round(statistics.median(ok) * 1e3, 1) if ok else None,
            "p99_ms": round(ok[min(len(ok) - 1, int(len(ok) * 0.99))] * 1e3, 1) if ok else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load-s", type=float, default=60.0)
    p.add_argument("--fault-s", type=float, default=20.0)
    p.add_argument("--quick", action="store_true", help="20 s of overload, 12 s per fault")
    p.add_argument("--no-faults", action="store_true", help="capacity and overload only")
    p.add_argument("--faults", default="encoder,shared-0,router,cluster,engine-0,frontend",
                   help="the components to stop, in order")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.quick:
        args.load_s, args.fault_s = 20.0, 12.0
    run_dir = Path(tempfile.mkdtemp(prefix="mm-soak-")) / "run"
    port = free_port()
    served = Served("graphs/epd.yaml", run_dir, port, "--restart")
    report: dict = {}
    try:
        served.wait_for("ready: OpenAI base URL", 240)
        warm = asyncio.run(closed_loop(port, 4, 10.0, 0))
        rate = max(1.0, sum(1 for k, _, _ in warm if k == "ok") / 10.0)
        report["capacity"] = {"req_per_s": round(rate, 1), **summary(warm)}
        print(f"capacity: {rate:.1f} req/s", flush=True)
        if args.load_s > 0:
            report["overload_2x"] = summary(asyncio.run(open_loop(port, 2 * rate, args.load_s, 100_000)))
            print("overload:", report["overload_2x"], flush=True)
        faults = () if args.no_faults else [
            (name, signal.SIGTERM if name == "frontend" else signal.SIGKILL) for name in args.faults.split(",")]
        for name, sig in faults:
            state = json.loads((run_dir / "state.json").read_text())
            pid = next(c["pid"] for c in state["components"] if c["name"] == name)
            results = asyncio.run(open_loop(port, rate, args.fault_s, 200_000 + random.randrange(10**6),
                                            fault=lambda pid=pid, sig=sig: os.killpg(pid, sig)))
            served.wait_for(f"{name} restarted", 120)
            report[f"{sig.name} {name}"] = summary(results)
            print(f"{sig.name} {name}:", report[f"{sig.name} {name}"], flush=True)
    finally:
        if served.proc.poll() is None:
            served.stop()  # asserts "no processes left" over every session serve started
    report["left_after_stop"] = "none" if "no processes left" in served.text else "some"
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
