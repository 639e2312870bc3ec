"""etcd and NATS on one machine: the servers Dynamo's distributed runtime needs when a graph asks
for `runtime: {discovery: etcd}` or `nats` planes and the environment names none (ETCD_ENDPOINTS,
NATS_SERVER). Each runs unprivileged on loopback, its data in the run directory, in its own
session; ready when etcd's /health says so or NATS sends its INFO line. Debian: etcd-server, nats-server.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.errors import GraphError
from .site import free_port

if TYPE_CHECKING:
    from ..graph.schema import Runtime

LOOPBACK = "127.0.0.1"
PACKAGES = {"etcd": "etcd-server", "nats-server": "nats-server"}


def check_install(binary: str) -> str:
    path = shutil.which(binary) or next((p for p in (f"/usr/sbin/{binary}", f"/usr/bin/{binary}")
                                         if os.access(p, os.X_OK)), None)
    if path is None:
        raise GraphError(f"{binary} is not installed; on Debian/Ubuntu: apt-get install -y {PACKAGES[binary]}")
    return path


@dataclass
class Server:
    """One etcd or NATS server process; `env` is what Dynamo's components need to reach it."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    probe: tuple[str, int] | str  # (host, port) for NATS' INFO line, or etcd's /health URL
    popen: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    data: Path | None = field(default=None)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def start(self, log: Path) -> None:
        self.log = log
        with log.open("a") as out:
            self.popen = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def ready(self) -> bool:
        try:
            if isinstance(self.probe, str):
                with urllib.request.urlopen(self.probe, timeout=2) as r:
                    health: object = json.loads(r.read()).get("health")
                    return health == "true"
            with socket.create_connection(self.probe, timeout=2) as s:
                return s.recv(5) == b"INFO "
        except (OSError, ValueError):
            return False

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        if self.popen is None:
            raise GraphError(f"{self.name} was never started")
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.popen.poll() is not None:
                raise GraphError(f"{self.name} exited with {self.popen.returncode}: {self.tail()}")
            if time.monotonic() > deadline:
                raise GraphError(f"{self.name} not ready after {timeout_s:.0f} s: {self.tail()}")
            time.sleep(0.05)

    def stop(self, grace_s: float = 10.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-1500:] if self.log and self.log.exists() else ""


# A server's certificate, its key and the CA its clients' certificates must chain to (TLS with
# client certificates: `serve --tls`, docs/security.md); None: plaintext.
ServerTls = tuple[str, str, str]


def etcd(data_dir: Path, client_port: int | None = None, tls: ServerTls | None = None) -> Server:
    """A one-member etcd cluster on loopback; the same data dir and port restart it as it was. With
    `tls`, clients reach it over HTTPS with a certificate from the CA; its health is probed on the
    plaintext metrics listener (loopback), which serves nothing else."""
    client, peer, metrics = client_port or free_port(), free_port(), free_port()
    url = f"{'https' if tls else 'http'}://{LOOPBACK}:{client}"
    cmd = [check_install("etcd"), "--name", "mm", "--data-dir", str(data_dir), "--listen-client-urls", url,
           "--advertise-client-urls", url, "--listen-peer-urls", f"http://{LOOPBACK}:{peer}",
           "--initial-advertise-peer-urls", f"http://{LOOPBACK}:{peer}",
           "--initial-cluster", f"mm=http://{LOOPBACK}:{peer}", "--listen-metrics-urls", f"http://{LOOPBACK}:{metrics}"]
    if tls:
        cert, key, ca = tls
        cmd += ["--cert-file", cert, "--key-file", key, "--client-cert-auth", "--trusted-ca-file", ca]
    return Server("etcd", cmd, {"ETCD_ENDPOINTS": url}, f"http://{LOOPBACK}:{metrics}/health", data=data_dir)


def nats(data_dir: Path, port: int | None = None, tls: ServerTls | None = None) -> Server:
    """nats-server with JetStream (Dynamo's planes use it), on loopback; with `tls`, clients need a
    certificate from the CA (NATS still greets in plaintext, then upgrades: the probe is the same)."""
    port = port or free_port()
    cmd = [check_install("nats-server"), "-a", LOOPBACK, "-p", str(port), "-js", "-sd", str(data_dir)]
    if tls:
        cert, key, ca = tls
        cmd += ["--tlsverify", "--tlscert", cert, "--tlskey", key, "--tlscacert", ca]
    scheme = "tls" if tls else "nats"
    return Server("nats", cmd, {"NATS_SERVER": f"{scheme}://{LOOPBACK}:{port}"}, (LOOPBACK, port), data=data_dir)


def servers_for(runtime: Runtime, run_dir: Path, environ: Mapping[str, str],
                tls: Mapping[str, ServerTls] | None = None) -> list[Server]:
    """The servers a graph's runtime needs that the environment does not already name (`tls`: each
    one's certificate, by name)."""
    out = []
    tls = tls or {}
    if runtime.needs_etcd and not environ.get("ETCD_ENDPOINTS"):
        out.append(etcd(run_dir / "etcd", tls=tls.get("etcd")))
    if runtime.needs_nats and not environ.get("NATS_SERVER"):
        out.append(nats(run_dir / "nats", tls=tls.get("nats")))
    return out
