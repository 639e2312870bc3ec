"""Peak memory of one encode worker under hostile load (not a test):

    python -m bench.hostile_memory [--json PATH]

A worker (`tiny`, default limits) on loopback. Each attack in its own fresh worker, peak RSS (the
kernel's VmHWM) read after it:
- 32 concurrent 60 MB msgpack bodies (random bytes: refused once read);
- 8 concurrent lying-header JPEGs (2.5 KB each, claiming 8000x8000);
- the longest video the limits allow: 600 s (`max_video_seconds`) of 448x448 at 2 fps, 1,200
  sampled frames of 256 patches;
- a video at the decoded-work cap: a worker with `--max-video-patches 262144` (1/8 of the
  default) and 64 sampled frames of 4,096 patches (896x896, 32 s): what still grows with a video is
  its prepared float32 patches (3 x 14 x 14 x 4 = 2,352 bytes each), so this measures the per-patch
  cost the default cap multiplies;
- the idle worker, for the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
from pathlib import Path

import aiohttp
import msgpack

from bench import stats
from harness.media_factory import video_bytes
from harness.topology import start_worker


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
        elif name in VIDEOS:
            side, seconds, _ = VIDEOS[name]
            data = video_bytes(side, side, frames=int(seconds * 2), fps=2, still=True)
            statuses = [await post(msgpack.packb({"model": "tiny", "data": data, "modality": "video"}),
                                   "application/msgpack")]
        else:
            statuses = []
    return {s: statuses.count(s) for s in set(statuses)}


def run(name: str) -> dict:
    env = {**os.environ, "MM_ENCODER_LOG_LEVEL": "WARNING"}
    extra = VIDEOS[name][2] if name in VIDEOS else []
    with start_worker(*extra, env=env, timeout=180) as worker:
        before = vm(worker.pid, "VmRSS")
        statuses = asyncio.run(attack(worker.http_port, name))
        return {"attack": name, "statuses": statuses, "rss_before_mb": round(before, 1),
                "peak_rss_mb": round(vm(worker.pid, "VmHWM"), 1)}


# video attacks: frame side, seconds at 2 fps, worker options
VIDEOS = {"video_longest": (448, 600, []),
          "video_patch_cap": (896, 32, ["--max-video-patches", str(1 << 18)])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    p.add_argument("--repeats", type=int, default=1, help="fresh workers per attack")
    p.add_argument("--quick", action="store_true", help="one run per attack")
    args = p.parse_args()
    repeats = 1 if args.quick else args.repeats
    runs = {name: [run(name) for _ in range(repeats)] for name in ("idle", "bodies", "jpegs", *VIDEOS)}
    out = {"machine": stats.machine(), "repeats": repeats, "attacks": {
        name: {"rss_before_mb": stats.summary(r["rss_before_mb"] for r in rs),
               "peak_rss_mb": stats.summary(r["peak_rss_mb"] for r in rs), "statuses": rs[-1]["statuses"]}
        for name, rs in runs.items()}}
    print(json.dumps(out, indent=2))
    stats.emit(out, args.json, "hostile_memory")


if __name__ == "__main__":
    main()
