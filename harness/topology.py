"""An encode worker and an nginx cache tier as processes, with or without TLS: the one way the tests
and benchmarks start either by hand (a whole graph goes through `mm-encoder serve`:
`serve_fixtures.Served`).

Each is a `harness.processes.Process` (its own session, its output kept and logged), stopped by PID
and then by its process group:

- `start_worker`: `python -m mm_encoder.encode_worker`, ready when it prints its ready line, which
  names its HTTP port (a free one unless `--http-port` is given) and, with TLS, its plaintext ops
  port (/health, /ready, /metrics).
- `start_tier`: `python -m mm_encoder.cache_tiers up` (which execs nginx: the PID is nginx's master; with
  TLS it runs nginx as its child, passing on its signals: `cache_tiers/supervise.py`), ready when
  /_cache/health answers: on its port, or with TLS on its plaintext ops listener.

TLS material is a `Tls`: the deployment's CA (a `harness.certs.Certs`) and a certificate issued from
it; with one, the process serves HTTPS to callers with certificates (and calls its next level so).

    certs = Certs(tmp / "pki")
    with start_worker(tls=Tls.issue(certs, "encoder", "encoder")) as worker, \\
            start_tier(tmp, "cluster", "cluster", "--next", worker.address,
                       tls=Tls.issue(certs, "cluster", "cache-cluster")) as tier:
        tier.url()  # https://127.0.0.1:<port>/v1/encode

Also the ports they take (`free_port`, `dynamo_system_port`), nginx's presence (`require_nginx`) and,
for asyncio tests, tiers started and stopped off the event loop (`tiers`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import sys
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.certs import Certs
from harness.processes import Process
from mm_encoder.cache_tiers.nginx import check_install
from mm_encoder.core.errors import CacheTierError
from mm_encoder.security.pki import Issued
from mm_encoder.security.tls import tls_client
from mm_encoder.serve.site import free_port  # the ports a test or benchmark gives its processes


def require_nginx() -> None:
    """The tiers are nginx: without it these tests cannot run, and say what to install."""
    try:
        check_install()
    except CacheTierError as e:
        pytest.fail(str(e), pytrace=False)


def dynamo_system_port() -> int:
    """A free port below 32768 (Dynamo parses DYN_SYSTEM_PORT as a signed 16-bit integer), from the
    ports this test run picks from (`serve.site.port_range`, below the kernel's ephemeral range)."""
    for _ in range(100):
        if (port := free_port()) < 32768:
            return port
    raise RuntimeError("no free port below 32768 in MM_ENCODER_PORTS' range")


@dataclass(frozen=True)
class Tls:
    """A component's TLS material: the deployment's CA and the certificate issued to it."""

    certs: Certs
    issued: Issued

    @classmethod
    def issue(cls, certs: Certs, name: str, role: str, **kw: Any) -> Tls:
        """A new certificate for `name` in `role` from `certs`' CA (`Certs.issue`)."""
        return cls(certs, certs.issue(name, role, **kw))

    @property
    def ca(self) -> Path:
        return self.certs.ca_file

    @property
    def cert(self) -> Path:
        return self.issued.cert

    @property
    def key(self) -> Path:
        return self.issued.key

    def flags(self) -> list[str]:
        """What a worker and a tier take: `--tls-cert`, `--tls-key`, `--tls-ca`."""
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]

    def client(self) -> ssl.SSLContext:
        """A client context presenting this certificate and trusting the CA."""
        return tls_client(self.ca, self.cert, self.key)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


# --- the encode worker --------------------------------------------------------------------------------


class WorkerProcess:
    """A started encode worker: its `Process`, its ready line's ports, its URLs."""

    def __init__(self, proc: Process, ready: str, tls: Tls | None):
        self.proc, self.ready_line, self.tls = proc, ready, tls
        self.fields = dict(f.split("=", 1) for f in ready.split() if "=" in f)
        self.http_port = int(self.fields["http_port"])
        self.ops_port = int(self.fields["ops_port"]) if "ops_port" in self.fields else None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> str:
        """host:port of its HTTP(S) port, as a tier's `--next` names it."""
        return f"127.0.0.1:{self.http_port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.address}"

    @property
    def ops_url(self) -> str:
        """Where its status answers in plaintext: the ops port with TLS, else its HTTP port."""
        return f"http://127.0.0.1:{self.ops_port if self.ops_port is not None else self.http_port}"

    def metric(self, name: str) -> float:
        """The sum of a metric's samples on its /metrics (every label set)."""
        return sum(float(line.rsplit(" ", 1)[1]) for line in _get(self.ops_url + "/metrics").splitlines()
                   if line.startswith((name + " ", name + "{")))

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 30) -> int:
        """`sig` (SIGTERM: it drains), SIGKILL after `grace_s`, then its process group."""
        return self.proc.stop(sig, grace_s)

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_worker(*args: str, model: str = "tiny", tls: Tls | None = None, ops: bool = True,
                 env: Mapping[str, str] | None = None, settings: Mapping[str, Any] | None = None,
                 name: str = "worker", log: Path | None = None, timeout: float = 180) -> WorkerProcess:
    """`python -m mm_encoder.encode_worker --model <model> *args`, once it prints its ready line.

    `args`: its other options (`--http-port N` to choose the port; else a free one). `tls`: its
    certificate (HTTPS to callers with certificates) and, with `ops`, a plaintext ops port. `env`: the
    whole environment (default: this process's); `settings`: worker options given in it
    (`MM_ENCODER_<NAME>`, a list as JSON). Stopped again if it does not get ready within `timeout`
    (AssertionError with its output's tail)."""
    argv = [sys.executable, "-m", "mm_encoder.encode_worker", "--model", model]
    if "--http-port" not in args and "http_port" not in (settings or {}):
        argv += ["--http-port", "0"]
    if tls is not None:
        argv += [*tls.flags(), *(["--ops-port", "0"] if ops else [])]
    environ = dict(os.environ if env is None else env)
    environ.update({f"MM_ENCODER_{k.upper()}": json.dumps(v) if isinstance(v, list | tuple) else str(v)
                    for k, v in (settings or {}).items()})
    proc = Process([*argv, *args], name=name, env=environ, log=log)
    try:
        return WorkerProcess(proc, proc.wait_for("mm-encoder worker ready", timeout), tls)
    except BaseException:
        proc.stop()
        raise


# --- an nginx cache tier -------------------------------------------------------------------------------


class TierProcess:
    """A started cache tier (or the router): its `Process` (PID: nginx's master, or with TLS the tier that
    supervises it and passes signals on), its ports, its URLs."""

    def __init__(self, name: str, tier: str, port: int, ops_port: int | None, proc: Process, tls: Tls | None):
        self.name, self.tier, self.port, self.ops_port, self.proc, self.tls = name, tier, port, ops_port, proc, tls

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log(self) -> Path | None:
        """Its output (nginx's JSON access lines among it)."""
        return self.proc.log

    @property
    def address(self) -> str:
        """host:port, as the next tier's `--next` or the router's `--shard` names it."""
        return f"127.0.0.1:{self.port}"

    def url(self, path: str = "/v1/encode") -> str:
        return f"{'https' if self.tls else 'http'}://{self.address}{path}"

    def ops_url(self, path: str = "/_cache/health") -> str:
        """Where its status answers in plaintext: the ops listener with TLS, else its port."""
        return f"http://127.0.0.1:{self.ops_port if self.ops_port is not None else self.port}{path}"

    def stats(self) -> dict[str, Any]:
        """Its /_cache/stats: requests and cache results counted."""
        loaded: dict[str, Any] = json.loads(_get(self.ops_url("/_cache/stats")))
        return loaded

    async def status(self) -> dict[str, int]:
        """nginx stub_status: active connections and reading/writing counts."""
        text = await asyncio.to_thread(_get, self.ops_url("/_cache/status"))
        words = text.split()
        return {
            "active": int(words[2]),
            "reading": int(words[words.index("Reading:") + 1]),
            "writing": int(words[words.index("Writing:") + 1]),
        }

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 10) -> int:
        """TERM to the master (nginx's fast stop: a test's tier has nothing to finish, and a graceful QUIT
        would wait on any connection a client left open), KILL after `grace_s`, then its process group."""
        return self.proc.stop(sig, grace_s)

    async def astop(self) -> int:
        """`stop`, off the event loop (which may be serving the tier's next level)."""
        return await asyncio.to_thread(self.stop)

    def __enter__(self) -> TierProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_tier(root: Path, name: str, tier: str, *args: str, port: int | None = None, tls: Tls | None = None,
               workers: int | str | None = 1, run_dir: Path | None = None, cache_dir: Path | None = None,
               log: Path | None = None, env: Mapping[str, str] | None = None, timeout: float = 15) -> TierProcess:
    """`python -m mm_encoder.cache_tiers up --tier <tier> *args` on 127.0.0.1:`port` (default: a free
    one), once /_cache/health answers.

    `args`: its levels and options (`--next`, `--shard`, `--direct`, `--max-size` ...). Under `root`:
    its run directory `nginx-<name>`, its cache `cache-<name>` (not the router's) and its output
    `nginx-<name>.log`, unless `run_dir`, `cache_dir`, `log` say otherwise. `workers`: nginx's worker
    processes (None: the tier's default, one per core). `tls`: its certificate (HTTPS both ways) and a
    plaintext ops listener on a free port. `env`: the whole environment (default: this process's).
    Stopped again if not healthy within `timeout` (AssertionError with its output's tail)."""
    port = port or free_port()
    ops_port = free_port() if tls is not None else None
    argv = [sys.executable, "-m", "mm_encoder.cache_tiers", "up", "--tier", tier, "--listen", f"127.0.0.1:{port}",
            "--run-dir", str(run_dir or root / f"nginx-{name}")]
    if tier != "router":
        argv += ["--cache-dir", str(cache_dir or root / f"cache-{name}")]
    if workers is not None:
        argv += ["--workers", str(workers)]
    if tls is not None:
        argv += [*tls.flags(), "--ops-listen", f"127.0.0.1:{ops_port}"]
    proc = Process([*argv, *args], name=f"nginx {name}", env=None if env is None else dict(env),
                   log=log or root / f"nginx-{name}.log")
    t = TierProcess(name, tier, port, ops_port, proc, tls)
    try:
        proc.wait_url(t.ops_url("/_cache/health"), timeout)
    except BaseException:
        t.stop()
        raise
    return t


@asynccontextmanager
async def tiers() -> AsyncIterator[Callable[..., Awaitable[TierProcess]]]:
    """For asyncio tests: `start(...)` (`start_tier`'s arguments) starts a tier off the event loop;
    every tier started is stopped at the end, the last first."""
    started: list[TierProcess] = []

    async def start(root: Path, name: str, tier: str, *args: str, **kw: Any) -> TierProcess:
        t = await asyncio.to_thread(start_tier, root, name, tier, *args, **kw)
        started.append(t)
        return t

    try:
        yield start
    finally:
        for t in reversed(started):
            await t.astop()


def stop_all(procs: Sequence[WorkerProcess | TierProcess | Process]) -> None:
    """Every one of `procs` stopped, the last started first."""
    for p in reversed(procs):
        p.stop()
