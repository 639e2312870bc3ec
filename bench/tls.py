"""TLS against plaintext, side by side in one run (issue 33): the cluster tier's hits and a full chat.

    python -m bench.tls [--quick] [--json PATH] [--rounds N]

1. Cache hits. Two stacks at once, each an encode worker (`tiny-wide`: a 616x644 JPEG's body is
   ~4.7 MB, a 4K image's K2.5 embeddings) behind a cluster tier: one in plaintext, one with TLS and
   client certificates on both hops (one CA; the load client presents an engine's certificate).
   After one fill, an aiohttp client with keep-alive connections (and, with TLS, session reuse)
   sends the engine's body fetch (`POST /v1/encode/fetch`, the whole body back) and the frontend's
   header question (`HEAD /v1/encode`) to the cluster tier: req/s over 8 connections and the p50
   over 1, for a few seconds each, the two stacks alternating in rounds. The client shares the
   machine's two cores with nginx, so both stacks' figures are bounded by it alike.
2. A full image chat. `mm-encoder serve graphs/epd.yaml` and the same with `--tls`, at once: the
   README's chat (`max_tokens` 1) with a new image each time (an encode through every hop) and with
   the same image again (the tiers' hit), the two graphs alternating; latency medians.
Figures: median (min-max) over rounds or requests; ratios TLS / plaintext of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import shutil
import ssl
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import uvloop

from bench import stats
from bench import worker as worker_bench
from harness import topology
from harness.certs import Certs
from harness.media_factory import image_bytes, natural_image
from harness.procfs import cpu_ns
from harness.serve_fixtures import MODEL, QUESTION, Served
from harness.topology import Tls, free_port
from mm_encoder.runtime.procfs import processes
from mm_encoder.security.tls import tls_client

TARGET = 0.8  # the issue's: cluster-tier hits at >= 0.8x of plaintext throughput


def jpeg(seed: int, w: int = 616, h: int = 644) -> bytes:
    return image_bytes(natural_image(w, h, seed=seed), "JPEG")


def start_cluster(stack: contextlib.ExitStack, run: Path, name: str, worker: str, tls: Tls | None) -> tuple[str, int]:
    """A cluster tier in front of `worker` (host:port; `harness.topology`, nginx's default workers); its URL
    once healthy, and its session (nginx's master and workers)."""
    tier = stack.enter_context(topology.start_tier(run, name, "cluster", "--next", worker, tls=tls, workers=None))
    return tier.url(""), tier.pid


def cpu_ms(session: int) -> float:
    """CPU time so far of every thread of every process in `session` (nginx's master and workers), ms."""
    return sum(cpu_ns(p.pid) for p in processes() if p.pgid == session) / 1e6


Stack = tuple[str, ssl.SSLContext | None, int]  # the cluster tier's URL, the client's context, nginx's session


def start_stacks(stack: contextlib.ExitStack, run: Path, certs: Certs) -> dict[str, Stack]:
    """name -> its cluster tier."""
    out: dict[str, Stack] = {}
    for name, tls in (("plaintext", False), ("tls", True)):
        settings = {"tls_allow": ["cache-cluster"]} if tls else {}
        worker = stack.enter_context(worker_bench.start_worker(
            "tiny-wide", tls=Tls.issue(certs, "encoder", "encoder") if tls else None, **settings))
        url, session = start_cluster(stack, run, name, worker.address,
                                     Tls.issue(certs, "cluster", "cache-cluster") if tls else None)
        engine = certs.issue("engine-0", "engine") if tls else None
        out[name] = (url, tls_client(certs.ca_file, engine.cert, engine.key) if engine else None, session)
    return out


async def load(url: str, ctx: ssl.SSLContext | None, method: str, body: bytes, conns: int, seconds: float) -> dict:
    """`conns` keep-alive connections sending the same request for `seconds`: req/s and the p50 ms."""
    path = "/v1/encode/fetch" if method == "POST" else "/v1/encode"
    headers = {"Content-Type": "application/msgpack"}  # the tier keys the entry by the body's sha256
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=conns, ssl=ctx if ctx is not None else False)
    async with aiohttp.ClientSession(connector=connector) as session:
        deadline = time.perf_counter() + seconds

        async def client() -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                async with session.request(method, url + path, data=body, headers=headers) as r:
                    await r.read()
                    errors += r.status != 200 or r.headers.get("X-Cache-Status") != "cluster=HIT"
                latencies.append((time.perf_counter() - t0) * 1e3)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(conns)))
        elapsed = time.perf_counter() - t0
    return {"rps": len(latencies) / elapsed, "p50_ms": stats.summary(latencies)["median"], "errors": errors,
            "n": len(latencies)}


def _run(coro: Any) -> Any:
    """On uvloop, as every process of the package runs (asyncio's own TLS transport, in Python, would
    make the client the bottleneck of the TLS figures)."""
    return uvloop.run(coro)


def hits(stacks: dict[str, Stack], rounds: int, seconds: float) -> dict:
    """Per stack and request kind: req/s (8 connections), the p50 (1), and the tier's own CPU per
    request (nginx's, all its processes: what bounds a tier whose clients are other machines)."""
    body = msgpack.packb({"model": "tiny-wide", "data": jpeg(3)})
    for url, ctx, _ in stacks.values():  # the fill (the worker encodes once per stack)
        _run(load(url, ctx, "POST", body, 1, 0.01))
    raw: dict[str, dict[str, list[dict]]] = {n: {"fetch": [], "head": []} for n in stacks}
    for _ in range(rounds):
        for name, (url, ctx, session) in stacks.items():
            for what, method in (("fetch", "POST"), ("head", "HEAD")):
                c0 = cpu_ms(session)
                many = _run(load(url, ctx, method, body, 8, seconds))
                cpu = (cpu_ms(session) - c0) / max(many["n"], 1)
                one = _run(load(url, ctx, method, body, 1, seconds / 2))
                raw[name][what].append({"rps_c8": many["rps"], "p50_c1_ms": one["p50_ms"], "tier_cpu_ms": cpu,
                                        "errors": many["errors"] + one["errors"]})
    out: dict = {n: {w: {m: stats.summary(r[m] for r in rs) for m in ("rps_c8", "p50_c1_ms", "tier_cpu_ms")}
                     | {"errors": sum(r["errors"] for r in rs)} for w, rs in by.items()} for n, by in raw.items()}
    out["ratio"] = {w: stats.ratio(out["tls"][w]["rps_c8"], out["plaintext"][w]["rps_c8"]) for w in ("fetch", "head")}
    # the tier's capacity with TLS over without: its CPU per hit, plaintext over TLS
    out["capacity_ratio"] = {w: stats.ratio(out["plaintext"][w]["tier_cpu_ms"], out["tls"][w]["tier_cpu_ms"])
                             for w in ("fetch", "head")}
    return out


def chat_ms(port: int, image: bytes, ctx: ssl.SSLContext | None) -> float:
    url = "data:image/jpeg;base64," + base64.b64encode(image).decode()
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}]}]}
    req = urllib.request.Request(f"{'https' if ctx else 'http'}://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120, context=ctx) as r:
        r.read()
        assert r.status == 200
    return (time.perf_counter() - t0) * 1e3


def chats(run: Path, n: int) -> dict:
    graphs = {"plaintext": (), "tls": ("--tls",)}
    ports = {name: free_port() for name in graphs}
    served = {name: Served("graphs/epd.yaml", run / f"graph-{name}", ports[name], *flags)
              for name, flags in graphs.items()}
    try:
        for s in served.values():
            s.wait_for("ready: OpenAI base URL", 600)
        ctx = {"plaintext": None, "tls": tls_client(run / "graph-tls" / "tls" / "ca" / "ca.pem")}
        cold: dict[str, list[float]] = {name: [] for name in graphs}
        warm: dict[str, list[float]] = {name: [] for name in graphs}
        same = jpeg(7, 640, 480)
        for name in graphs:
            chat_ms(ports[name], same, ctx[name])  # the first: fills the tiers
        for i in range(n):
            for name in graphs:
                cold[name].append(chat_ms(ports[name], jpeg(100 + i, 640, 480), ctx[name]))
                warm[name].append(chat_ms(ports[name], same, ctx[name]))
    finally:
        for s in served.values():
            s.stop(check=False)
    out = {name: {"cold_ms": stats.summary(cold[name]), "hit_ms": stats.summary(warm[name])} for name in graphs}
    out["ratio"] = {k: stats.ratio(out["tls"][k], out["plaintext"][k]) for k in ("cold_ms", "hit_ms")}
    return out


def run(args: argparse.Namespace) -> dict:
    rounds, seconds, n = (1, 1.0, 2) if args.quick else (args.rounds, 4.0, 8)
    run_dir = Path(tempfile.mkdtemp(prefix="mm-bench-tls-"))
    worker_bench.CONFIGS = worker_bench.bench_configs()
    try:
        with contextlib.ExitStack() as stack:
            cache = hits(start_stacks(stack, run_dir, Certs(run_dir / "pki")), rounds, seconds)
        chat = chats(run_dir, n)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(worker_bench.CONFIGS, ignore_errors=True)
    return {"machine": stats.machine(), "rounds": rounds, "seconds": seconds, "chats": n, "target": TARGET,
            "hits": cache, "chat": chat}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    result = run(args)
    for what in ("fetch", "head"):
        t, pl = result["hits"]["tls"][what], result["hits"]["plaintext"][what]
        print(f"cluster hit {what}: plaintext {stats.fmt(pl['rps_c8'], 0)} req/s, p50 {stats.fmt(pl['p50_c1_ms'], 2)} "
              f"ms; TLS {stats.fmt(t['rps_c8'], 0)} req/s, p50 {stats.fmt(t['p50_c1_ms'], 2)} ms; "
              f"TLS/plaintext {result['hits']['ratio'][what]:.2f}; the tier's CPU per hit "
              f"{stats.fmt(pl['tier_cpu_ms'], 3)} / {stats.fmt(t['tier_cpu_ms'], 3)} ms: capacity "
              f"{result['hits']['capacity_ratio'][what]:.2f} "
              f"(target >= {TARGET})")
    c = result["chat"]
    print(f"chat, new image: plaintext {stats.fmt(c['plaintext']['cold_ms'])} ms, TLS {stats.fmt(c['tls']['cold_ms'])} "
          f"ms; hit: {stats.fmt(c['plaintext']['hit_ms'])} / {stats.fmt(c['tls']['hit_ms'])} ms")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
