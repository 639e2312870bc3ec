"""The processes of one component on this machine: a `Fleet` starts its replicas, checks their health,
restarts or reports the dead, grows and drains as the encoder count moves, reloads a tier's config,
and stops them. Only a fleet changes its own list of processes.

Each replica is a process in its own session (stopping it stops its children: nginx workers,
thread pools), its output in `run_dir/<replica>.log`; every session ever started is recorded, so
the leftover check at the end covers restarts and scaled replicas too.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..cache_tiers.reload import reload_tier
from ..core.errors import GraphError
from ..graph.plan import READY_LINE
from ..graph.planned import ComponentPlan, Replica
from ..runtime import procfs
from .site import LOOPBACK, connect_host


@dataclass
class Proc:
    """One replica of a planned component, as a process."""

    plan: ComponentPlan
    replica: Replica
    popen: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    restarts: int = 0
    state: str = "new"  # new, starting, up, down, draining, stopped
    renew_by: float | None = None  # monotonic: when the certificate it read once (Dynamo's planes) is due

    @property
    def name(self) -> str:
        return self.replica.name

    @property
    def kind(self) -> str:
        return self.plan.kind

    @property
    def cmd(self) -> list[str]:
        python = self.plan.component.python
        return [os.path.abspath(python) if python else sys.executable, "-m", self.plan.module, *self.replica.argv]

    @property
    def url(self) -> str | None:
        tls = self.plan.tls and self.kind != "planner"  # the planner's /status stays plaintext
        if self.replica.http is None:
            return None
        host, port = self.replica.http
        return f"{'https' if tls else 'http'}://{connect_host(host)}:{port}"

    @property
    def ops_url(self) -> str | None:
        """With TLS: its health, status and metrics in plaintext (encoders and tiers)."""
        return f"http://{LOOPBACK}:{self.replica.ops_port}" if self.replica.ops_port else None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text(errors="replace") if self.log and self.log.exists() else ""
        return "\n".join("    " + line for line in text.splitlines()[-lines:])


@dataclass
class Launch:
    """What the fleets of one graph share: where their processes run and log, what each is given
    before it starts (its environment; its certificate), how long each may take, and every session
    started."""

    run_dir: Path
    env: Callable[[Proc], dict[str, str]]
    prepare: Callable[[Proc], None] = lambda p: None
    client_context: Callable[[], ssl.SSLContext | None] = lambda: None  # the HTTPS health checks' (TLS)
    start_timeout_s: float = 180.0
    grace_s: float = 30.0
    sessions: set[int] = field(default_factory=set)
    # called while a replica is waited on (start, drain): work that cannot wait for it (a certificate renewal)
    tick: Callable[[], None] = lambda: None


class Fleet:
    def __init__(self, plan: ComponentPlan, launch: Launch):
        self.plan, self.launch = plan, launch
        self._procs = [Proc(plan, r) for r in plan.replicas]

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def kind(self) -> str:
        return self.plan.kind

    @property
    def procs(self) -> tuple[Proc, ...]:
        return tuple(self._procs)

    @property
    def live(self) -> list[Proc]:
        """The replicas up or on their way up, in index order."""
        return [p for p in self._procs if p.state in ("up", "starting")]

    def start(self, started: Callable[[Proc], None] = lambda p: None) -> None:
        """Every replica, one after the other, each waited on until healthy."""
        for p in self._procs:
            self._spawn(p)
            self._wait_healthy(p)
            started(p)

    def check(self, restart: bool) -> list[str]:
        """Deaths since the last check (with each log's tail), and with `restart` the restarts."""
        events = []
        for p in self._procs:
            if p.popen is None or p.state != "up" or p.alive:
                continue
            p.state = "down"
            events.append(f"{p.name} exited with {p.popen.returncode}; last log lines:\n{p.tail()}")
            _signal_group(p.popen.pid, signal.SIGKILL)  # what it left (a killed nginx master's workers)
            if restart:
                p.restarts += 1
                self._spawn(p)
                try:
                    self._wait_healthy(p)
                    events.append(f"{p.name} restarted (restart {p.restarts}), pid {p.popen.pid}")
                except GraphError as e:
                    events.append(f"{p.name} restart failed: {e}")
        return events

    def grow(self, target: ComponentPlan) -> tuple[list[str], str]:
        """The replicas of `target` not running yet, started in index order and waited on: (their
        names, why the next one failed to start or "")."""
        live = {p.name for p in self.live}
        started: list[str] = []
        for r in target.replicas:
            if r.name in live:
                continue
            self._procs = [p for p in self._procs if p.name != r.name]  # a dead one of that name: replaced
            p = Proc(target, r)
            self._procs.append(p)
            try:
                self._spawn(p)
                self._wait_healthy(p)
            except (GraphError, OSError) as e:  # its certificate, its process, its health
                if p.popen is not None:
                    self._kill(p)
                self._procs.remove(p)
                return started, f"{r.name} failed to start: {str(getattr(e, 'message', e)).splitlines()[0]}"
            started.append(r.name)
        return started, ""

    def retiring(self, target: ComponentPlan) -> list[Proc]:
        """The live replicas `target` has no place for, newest first (the order they leave in)."""
        keep = {r.name for r in target.replicas}
        return sorted((p for p in self.live if p.name not in keep), key=lambda p: p.name, reverse=True)

    def drain(self, procs: list[Proc]) -> None:
        """SIGTERM to each: it refuses new work, finishes what it holds, leaves discovery and exits."""
        for p in procs:
            p.state = "draining"
            assert p.popen is not None
            _signal_group(p.popen.pid, signal.SIGTERM)
            self._wait_exit(p, self.launch.grace_s + 15)
            p.state = "stopped"
            self._procs.remove(p)

    def reconfigure(self, plan: ComponentPlan, *, old_gone: bool) -> bool:
        """A tier's running replicas reloaded where `plan` changes their config (their upstreams): True
        once every reload is done (with `old_gone`, the old nginx workers have exited too)."""
        done = True
        for p in self._procs:
            new = next((r for r in plan.replicas if r.name == p.name), None)
            if new is None or new.tier is None or new.tier == p.replica.tier or p.popen is None or p.state != "up":
                continue
            done &= reload_tier(p.popen.pid, new.tier, self.launch.run_dir, old_gone=old_gone)
            p.plan, p.replica = plan, new
        self.plan = plan
        return done

    def restart(self, p: Proc) -> str:
        """`p` drained (SIGTERM: it refuses new work, finishes what it holds, leaves discovery) and started
        again, waited on until healthy: what a process that reads its certificate once needs to renew it."""
        assert p.popen is not None
        p.state = "draining"
        _signal_group(p.popen.pid, signal.SIGTERM)
        self._wait_exit(p, self.launch.grace_s + 15)
        p.restarts += 1
        try:
            self._spawn(p)
            self._wait_healthy(p)
        except (GraphError, OSError) as e:  # left "up" and dead: `check` reports it and, with restart, retries
            if p.popen is not None and p.popen.poll() is None:
                self._kill(p)
            p.state = "up"
            return f"{p.name}: restart for its new certificate failed: {str(getattr(e, 'message', e)).splitlines()[0]}"
        return f"{p.name} restarted with a new certificate for Dynamo's planes, pid {p.popen.pid}"

    def signal(self, sig: int) -> list[int]:
        """`sig` to each replica that is up (SIGHUP: read its certificates again; one still starting may not
        handle it yet, and has new certificates anyway); their PIDs."""
        told = [p.popen.pid for p in self._procs if p.popen is not None and p.state == "up" and p.alive]
        for pid in told:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return told

    def stop(self) -> None:
        """Newest first, whole sessions: SIGTERM (nginx: QUIT, its graceful stop), SIGKILL after the grace."""
        for p in reversed(self._procs):
            if p.popen is None or not p.alive:
                continue
            _signal_group(p.popen.pid, signal.SIGQUIT if p.kind.startswith("cache-") else signal.SIGTERM)
            try:
                p.popen.wait(self.launch.grace_s)
            except subprocess.TimeoutExpired:
                self._kill(p)
            p.state = "stopped"

    def _spawn(self, p: Proc) -> None:
        self.launch.prepare(p)
        p.log = self.launch.run_dir / f"{p.name}.log"
        with p.log.open("a") as log:
            p.popen = subprocess.Popen(p.cmd, env=self.launch.env(p), stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True, cwd=self.launch.run_dir)
        self.launch.sessions.add(p.popen.pid)
        p.state = "starting"

    def _healthy(self, p: Proc) -> bool:
        if p.plan.health_path is None:
            return p.log is not None and READY_LINE in p.log.read_text(errors="replace")
        tls = self.launch.client_context() if p.ops_url is None else None
        try:
            with urllib.request.urlopen(f"{p.ops_url or p.url}{p.plan.health_path}", timeout=2, context=tls) as r:
                if r.status != 200 or (p.kind == "frontend" and not json.loads(r.read()).get("data")):
                    return False
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):  # another server's port
            return False
        return _listens(p, p.replica.ops_port or p.replica.port)  # the answer was this replica's own


    def _wait_healthy(self, p: Proc) -> None:
        assert p.popen is not None
        deadline = time.monotonic() + self.launch.start_timeout_s
        while not self._healthy(p):
            if p.popen.poll() is not None:
                raise GraphError(f"{p.name} exited with {p.popen.returncode} while starting:\n{p.tail()}")
            if time.monotonic() > deadline:
                raise GraphError(f"{p.name} was not healthy after {self.launch.start_timeout_s:.0f} s:\n{p.tail()}")
            self.launch.tick()
            time.sleep(0.1)
        p.state = "up"

    def _wait_exit(self, p: Proc, timeout: float) -> None:
        """Until `p` exits (killed after `timeout`), the launch's other work going on meanwhile."""
        assert p.popen is not None
        deadline = time.monotonic() + timeout
        while p.popen.poll() is None:
            if time.monotonic() > deadline:
                self._kill(p)
                return
            self.launch.tick()
            time.sleep(0.1)

    def _kill(self, p: Proc) -> None:
        assert p.popen is not None
        _signal_group(p.popen.pid, signal.SIGKILL)
        p.popen.wait(10)


def _listens(p: Proc, port: int | None) -> bool:
    """Whether a process of the replica's session listens on `port`: a health answer from another
    process that holds the port (another graph's, after this replica failed to bind it) is not its."""
    if p.popen is None or port is None:
        return False
    ours = {inode for inode, (_, bound) in procfs.tcp_sockets(procfs.LISTEN).items() if bound == port}
    return any(inode in ours for pid in procfs.leftover_pids({p.popen.pid}) for inode in procfs.socket_fds(pid))


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
