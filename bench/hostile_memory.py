"""Peak memory of one encode worker under hostile load (not a test):

    python bench/hostile_memory.py [--json PATH]

A worker (`tiny`, default limits) on loopback. Three attacks, each in its own fresh worker, peak
RSS (the kernel's VmHWM) read after it:
- 32 concurrent 60 MB msgpack bodies (random bytes: refused once read);
- 8 concurrent lying-header JPEGs (2.5 KB each, claiming 8000x8000);
- the idle worker, for the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import msgpack

ROOT = Path(__file__).resolve().parents[1]


def vm(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def lying_jpeg() -> bytes:
    """A small real JPEG whose SOF header is rewritten to claim 8000x8000."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (90, 90, 90)).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    i = data.index(b"\xff\xc0")
    data[i + 5 : i + 9] = (8000).to_bytes(2, "big") * 2
    return bytes(data)


async def attack(port: int, name: str) -> dict:
    url = f"http://127.0.0.1:{port}/v1/encode"
    async with aiohttp.ClientSession() as s:
        async def post(body: bytes, ctype: str) -> int:
            try:
                async with s.post(url, data=body, headers={"Content-Type": ctype}) as r:
                    await r.read()
                    return r.status
            except aiohttp.ClientError:
                return 0

        if name == "bodies":
            big = msgpack.packb({"model": "tiny", "data": os.urandom(60 << 20)})
            statuses = await asyncio.gather(*(post(big, "application/msgpack") for _ in range(32)))
        elif name == "jpegs":
            body = msgpack.packb({"model": "tiny", "data": lying_jpeg()})
            statuses = await asyncio.gather(*(post(body, "application/msgpack") for _ in range(8)))
        else:
            statuses = []
    return {s: statuses.count(s) for s in set(statuses)}


def run(name: str) -> dict:
    env = {**os.environ, "MM_ENCODER_HTTP_PORT": "0", "MM_ENCODER_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "mm_encoder.worker", "--model", "tiny"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        port = int(line.split("http_port=")[1].split()[0])
        before = vm(proc.pid, "VmRSS")
        statuses = asyncio.run(attack(port, name))
        return {"attack": name, "statuses": statuses, "rss_before_mb": round(before, 1),
                "peak_rss_mb": round(vm(proc.pid, "VmHWM"), 1)}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    p.add_argument("--quick", action="store_true", help="the same")
    args = p.parse_args()
    out = [run(name) for name in ("idle", "bodies", "jpegs")]
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
