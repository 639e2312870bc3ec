"""Real nginx cache tiers for tests: started through `python -m mm_encoder.cache_tiers up` (which
execs nginx, so the child's PID is nginx's master) as a `harness.processes.Process`, ready when
/_cache/health answers, stopped by PID with QUIT (then KILL), then by its session."""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from harness.processes import Process
from mm_encoder.cache_tiers.nginx import check_install
from mm_encoder.core.errors import CacheTierError
from mm_encoder.serve.site import free_port


def require_nginx() -> None:
    """The tiers are nginx: without it these tests cannot run, and say what to install."""
    try:
        check_install()
    except CacheTierError as e:
        pytest.fail(str(e), pytrace=False)


def dynamo_system_port() -> int:
    """A free port below 32768: Dynamo parses DYN_SYSTEM_PORT as a signed 16-bit integer."""
    for port in random.Random().sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32768")


@dataclass
class Tier:
    name: str
    port: int
    proc: Process

    @property
    def log(self) -> Path | None:
        return self.proc.log

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, path: str = "/v1/encode") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def stop(self) -> None:
        """QUIT (nginx's graceful stop) to the master, KILL after 10 s, then its session."""
        await asyncio.to_thread(self.proc.stop, signal.SIGQUIT, 10)

    async def status(self) -> dict[str, int]:
        """nginx stub_status: active connections and reading/writing/waiting counts."""
        async with aiohttp.ClientSession() as s, s.get(self.url("/_cache/status")) as r:
            text = await r.text()
        words = text.split()
        return {
            "active": int(words[2]),
            "reading": int(words[words.index("Reading:") + 1]),
            "writing": int(words[words.index("Writing:") + 1]),
        }


async def start_tier(tmp_path: Path, name: str, tier: str, *args: str, port: int | None = None) -> Tier:
    port = port or free_port()
    cmd = [sys.executable, "-m", "mm_encoder.cache_tiers", "up", "--tier", tier, "--listen", f"127.0.0.1:{port}",
           "--run-dir", str(tmp_path / f"nginx-{name}"), "--workers", "1", *args]
    if tier != "router":
        cmd += ["--cache-dir", str(tmp_path / f"cache-{name}")]
    t = Tier(name, port, Process(cmd, name=f"nginx {name}", log=tmp_path / f"nginx-{name}.log"))
    try:
        await asyncio.to_thread(t.proc.wait_url, t.url("/_cache/health"), 15)
    except AssertionError:
        await t.stop()
        raise
    return t


@asynccontextmanager
async def tiers():
    """Collects started tiers and stops every one of them (by PID) at the end."""
    started: list[Tier] = []

    async def start(*a, **kw) -> Tier:
        t = await start_tier(*a, **kw)
        started.append(t)
        return t

    try:
        yield start
    finally:
        for t in reversed(started):
            await t.stop()
