"""`mm-encoder serve GRAPH`: run a whole graph on one machine.

The graph's plan (plan.py) on a `LocalSite`: every component on loopback, each replica on a free
port, Dynamo without etcd or NATS by default (file discovery in the run directory, TCP request
plane, ZMQ events); a graph's `runtime` may ask for etcd discovery and NATS planes, and then etcd
and nats-server run here too (`infra.py`) unless ETCD_ENDPOINTS / NATS_SERVER name existing ones.
Each replica is a process in its own session (so stopping it stops its children: nginx workers,
thread pools), started in the plan's order and waited on until healthy.
`run_dir/state.json` records ports and PIDs for `mm-encoder status` and for tests; logs are
`run_dir/<name>.log`. Ctrl-C or SIGTERM stops everything in reverse order (SIGTERM, then SIGKILL
after a grace period) and checks that no process of the graph is left.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import NoReturn

from ..core.errors import GraphError
from ..runtime import tracing
from . import infra
from .graph import Graph, Kind, find_graph, load_graph
from .plan import DYNAMO_KINDS, READY_LINE, ComponentPlan, GeneratedCheckpoint, Replica, Site, plan
from .procfs import leftover_pids
from .scaling import Scaler, check_local, scale_to
from .status import collect, format_lines
from .tls_site import LocalTls, ready_note

PY = sys.executable
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
        return port


class LocalSite(Site):
    """One machine: loopback, a free port per replica (the frontend on the graph's port), files in
    the run directory, file discovery in `run_dir/dynamo-store`."""

    def __init__(self, graph: Graph, run_dir: Path):
        self.graph = graph
        self.run_dir = run_dir
        # resolved here: components start in the run directory, where a relative path means nothing
        self.checkpoint_dir = (str(Path(graph.llm.checkpoint).resolve()) if graph.llm.checkpoint
                               else str(run_dir / "checkpoint" / f"kimi-k2.5-{graph.llm.preset}"))
        self._ports: dict[tuple[str, int], int] = {}
        self.tls = LocalTls(run_dir, graph.tls.ca_dir) if graph.tls.enabled else None

    def tls_files(self, replica: str) -> tuple[str, str, str]:
        assert self.tls is not None  # the plan asks only with the graph's TLS on
        return self.tls.files(replica)

    def ops_listen(self, name: str, kind: Kind, replica: int) -> tuple[str, int]:
        return self.listen(f"{name}:ops", kind, replica)

    def listen(self, name: str, kind: Kind, replica: int) -> tuple[str, int]:
        if (name, replica) not in self._ports:
            graph_port = kind == "frontend" and ":" not in name  # the frontend's own port, not an ops port
            port = self.graph.frontend_port if graph_port else free_port()
            # a port just freed may be handed out again: never give two components one port
            while not graph_port and port in {self.graph.frontend_port, *self._ports.values()}:
                port = free_port()
            self._ports[(name, replica)] = port
        return LOOPBACK, self._ports[(name, replica)]

    def reach(self, name: str, kind: Kind, replicas: int) -> list[str]:
        if kind == "engine":  # found through Dynamo's discovery, not by address
            return []
        return [":".join(map(str, self.listen(name, kind, i))) for i in range(replicas)]

    def tier_dirs(self, replica: str) -> tuple[str, str]:
        return str(self.run_dir / f"nginx-{replica}"), str(self.run_dir / f"cache-{replica}")

    def dynamo_env(self, kind: Kind) -> dict[str, str]:
        env = {
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_FILE_KV": str(self.run_dir / "dynamo-store"),
            # every Dynamo listener on loopback: request plane, response streams, system server
            "DYN_TCP_RPC_HOST": LOOPBACK,
            "DYN_TCP_RESPONSE_STREAM_HOST": LOOPBACK,
            "DYN_SYSTEM_HOST": LOOPBACK,
            "DYN_EVENT_PLANE_HOST": LOOPBACK,  # the KV event publisher (ZMQ) binds 0.0.0.0 without it
            "DYN_SELF_HOST_METADATA": "0",
            "DYN_LOG": os.environ.get("DYN_LOG", "warn"),
        }
        if "DYN_TCP_MAX_MESSAGE_SIZE" in os.environ:  # the caller's own limit wins over the plan's
            env["DYN_TCP_MAX_MESSAGE_SIZE"] = os.environ["DYN_TCP_MAX_MESSAGE_SIZE"]
        return env


@dataclass
class Proc:
    """One replica of a planned component, as a process."""

    component: ComponentPlan
    replica: Replica
    popen: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    restarts: int = 0
    state: str = "new"

    @property
    def name(self) -> str:
        return self.replica.name

    @property
    def kind(self) -> str:
        return self.component.kind

    @property
    def cmd(self) -> list[str]:
        python = self.component.component.python
        return [os.path.abspath(python) if python else PY, "-m", self.component.module, *self.replica.argv]

    @property
    def url(self) -> str | None:
        tls = self.component.tls and self.kind != "planner"  # the planner's /status stays plaintext
        return f"{'https' if tls else 'http'}://{LOOPBACK}:{self.replica.port}" if self.replica.port else None

    @property
    def ops_url(self) -> str | None:
        """With TLS: its health, status and metrics in plaintext (encoders and tiers)."""
        return f"http://{LOOPBACK}:{self.replica.ops_port}" if self.replica.ops_port else None


class GraphRunner:
    def __init__(self, graph: Graph, run_dir: Path, *, restart: bool = False, grace_s: float = 30.0,
                 start_timeout_s: float = 180.0):
        self.graph = graph
        self.run_dir = run_dir.resolve()
        self.site = LocalSite(graph, self.run_dir)
        self.restart = restart
        self.grace_s = grace_s
        self.start_timeout_s = start_timeout_s
        self.procs: list[Proc] = []
        self.plans: list[ComponentPlan] = []
        self.servers: list[infra.Server] = []  # etcd / NATS, when the graph's runtime needs them
        self.runtime_env: dict[str, str] = {}  # how Dynamo's components reach those (ETCD_ENDPOINTS, ...)
        self.sessions: set[int] = set()  # process groups of every replica started, restarts included
        self.scaling: dict[str, object] = {}  # the last encode-planner decision carried out (scaling.py)

    def prepare(self) -> list[Proc]:
        """The run directory, the generated checkpoint (if the graph names none) and the processes to start."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        generated = GeneratedCheckpoint.of(self.graph)
        if generated is not None and not (Path(self.site.checkpoint_dir) / "config.json").is_file():
            generated.write(self.site.checkpoint_dir)
        elif not (Path(self.site.checkpoint_dir) / "config.json").is_file():
            raise GraphError(f"llm.checkpoint {self.site.checkpoint_dir} has no config.json: not a model checkpoint")
        self.plans = plans = plan(self.graph, self.site)
        if self.site.tls is not None:
            self.site.tls.issue(plans)
        return [Proc(c, r) for c in plans for r in c.replicas]

    def rotate(self) -> str:
        """New certificates for every replica (the CA kept), each process told to read its own again
        (SIGHUP: nginx reloads gracefully, our processes reload their SSL contexts; nats-server
        reloads; etcd reads its files at each handshake), with no request dropped (docs/security.md)."""
        if self.site.tls is None:
            return "rotation: this graph runs without TLS"
        self.site.tls.issue(self.plans)
        told = [p.popen.pid for p in self.procs if p.popen is not None and p.popen.poll() is None]
        for pid in told:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGHUP)
        for server in self.servers:
            if server.name == "nats" and server.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server.pid, signal.SIGHUP)
        return f"rotation: new certificates for {len(told)} processes, each told to read them again"

    # --- running -----------------------------------------------------------------------------

    def spawn(self, p: Proc) -> subprocess.Popen[bytes]:
        p.log = self.run_dir / f"{p.name}.log"
        env = {**os.environ, **(self.runtime_env if p.kind in DYNAMO_KINDS else {}), **p.component.env}
        if self.site.tls and p.kind in DYNAMO_KINDS:  # Dynamo's planes with this replica's certificate
            env |= self.site.tls.dynamo_env(self.site.tls.files(p.name), self.runtime_env,
                                            self.graph.runtime.request_plane)
        # tracing on: one service each, Dynamo's spans beside ours, one protocol (observability.md)
        env.update(tracing.component_env(env, p.component.env.get("OTEL_SERVICE_NAME",
                                                                  f"{self.graph.name}/{p.component.name}"), p.name))
        with p.log.open("a") as log:
            popen = p.popen = subprocess.Popen(p.cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True, cwd=self.run_dir)
        self.sessions.add(popen.pid)  # every session ever started: the leftover check covers them all
        p.state = "starting"
        return popen

    def healthy(self, p: Proc) -> bool:
        if p.component.health_path is None:
            return p.log is not None and READY_LINE in p.log.read_text(errors="replace")
        tls = self.site.tls.client_context if self.site.tls and p.ops_url is None else None
        try:
            with urllib.request.urlopen(f"{p.ops_url or p.url}{p.component.health_path}", timeout=2,
                                        context=tls) as r:
                if r.status != 200:
                    return False
                if p.kind == "frontend":
                    return bool(json.loads(r.read()).get("data"))
                return True
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_healthy(self, p: Proc) -> None:
        popen = p.popen
        if popen is None:
            raise GraphError(f"{p.name} was never started")
        deadline = time.monotonic() + self.start_timeout_s
        while not self.healthy(p):
            if popen.poll() is not None:
                raise GraphError(f"{p.name} exited with {popen.returncode} while starting:\n{self.tail(p)}")
            if time.monotonic() > deadline:
                raise GraphError(f"{p.name} was not healthy after {self.start_timeout_s:.0f} s:\n{self.tail(p)}")
            time.sleep(0.1)
        p.state = "up"

    def tail(self, p: Proc, lines: int = 15) -> str:
        text = p.log.read_text(errors="replace") if p.log and p.log.exists() else ""
        return "\n".join("    " + line for line in text.splitlines()[-lines:])

    def start(self) -> None:
        self.procs = self.prepare()
        self.start_servers()
        for p in self.procs:
            popen = self.spawn(p)
            self.wait_healthy(p)
            print(f"  {p.name:12s} {p.kind:14s} up   pid {popen.pid}" + (f"  {p.url}" if p.url else ""), flush=True)
        self.write_state()

    def start_servers(self) -> None:
        """etcd / NATS first, unless the environment already names them."""
        self.servers = infra.servers_for(self.graph.runtime, self.run_dir, os.environ,
                                         self.site.tls.servers() if self.site.tls else None)
        self.runtime_env = {k: os.environ[k] for k in ("ETCD_ENDPOINTS", "NATS_SERVER") if os.environ.get(k)}
        for server in self.servers:
            server.start(self.run_dir / f"{server.name}.log")
            server.wait_ready()
            self.runtime_env |= server.env
            print(f"  {server.name:12s} {'runtime':14s} up   pid {server.pid}  {next(iter(server.env.values()))}",
                  flush=True)

    def write_state(self) -> None:
        state = {
            "graph": self.graph.name, "namespace": self.graph.namespace, "run_dir": str(self.run_dir),
            "base_url": self.base_url, "model": self.graph.llm.served_name,
            **({"tls": self.site.tls.state()} if self.site.tls else {}),
            "supervisor_pid": os.getpid(),
            "components": [{"name": p.name, "kind": p.kind, "pid": p.popen.pid if p.popen else None,
                            "url": p.url, **({"ops_url": p.ops_url} if p.ops_url else {}), "log": str(p.log)}
                           for p in self.procs],
            "runtime": {**self.runtime_env, "servers": [{"name": s.name, "pid": s.pid} for s in self.servers]},
            **({"scaling": self.scaling} if self.scaling else {}),
        }
        (self.run_dir / "state.json").write_text(json.dumps(state, indent=2))

    @property
    def base_url(self) -> str:
        return f"{'https' if self.site.tls else 'http'}://{LOOPBACK}:{self.graph.frontend_port}/v1"

    def executor(self) -> Scaler | None:
        """With an encode planner: the thread that takes its decisions (Dynamo's VirtualConnectorClient)."""
        planner = next((p for p in self.procs if p.kind == "planner"), None)
        if planner is None:
            return None
        running = sum(1 for p in self.procs if p.kind == "encoder" and p.state == "up")
        tls = self.site.tls.dynamo_env((*self.site.tls.launcher, str(self.site.tls.ca_file)), self.runtime_env,
                                       self.graph.runtime.request_plane) if self.site.tls else {}
        scaler = Scaler(self.graph.namespace, {**self.runtime_env, **planner.component.env, **tls}, running)
        scaler.start()
        return scaler

    def check(self) -> list[str]:
        """One pass over the processes: report deaths (with the log's tail), restart if asked."""
        events = []
        for p in self.procs:
            if p.popen is None or p.state != "up" or p.popen.poll() is None:
                continue
            p.state = "down"
            events.append(f"{p.name} exited with {p.popen.returncode}; last log lines:\n{self.tail(p)}")
            # what it left in its session (a killed nginx master's workers keep serving its port)
            _signal_group(p.popen.pid, signal.SIGKILL)
            if self.restart:
                p.restarts += 1
                self.spawn(p)
                try:
                    self.wait_healthy(p)
                    events.append(f"{p.name} restarted (restart {p.restarts}), pid {p.popen.pid}")
                except GraphError as e:
                    events.append(f"{p.name} restart failed: {e}")
                self.write_state()
        return events

    def stop(self) -> list[int]:
        """Reverse order; whole sessions; returns PIDs of the graph still alive afterwards (none)."""
        for p in reversed(self.procs):
            if p.popen is None or p.popen.poll() is not None:
                continue
            sig = signal.SIGQUIT if p.kind.startswith("cache-") else signal.SIGTERM  # nginx: QUIT is graceful
            _signal_group(p.popen.pid, sig)
            try:
                p.popen.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(p.popen.pid, signal.SIGKILL)
                p.popen.wait(10)
            p.state = "stopped"
        for server in reversed(self.servers):  # after everything that used them
            server.stop(self.grace_s)
        groups = self.sessions | {s.popen.pid for s in self.servers if s.popen is not None}
        for pgid in groups:  # children left behind by a process that exited (e.g. nginx workers)
            _signal_group(pgid, signal.SIGKILL)
        return leftover_pids(groups)


def say(text: str) -> None:
    """A multi-line message (a death with its log's tail) as one write to stdout, so that a reader of
    the pipe never sees half of it; print() may split it at its buffer's edge."""
    sys.stdout.flush()
    data = (text + "\n").encode()
    while data:
        data = data[os.write(sys.stdout.fileno(), data):]


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mm-encoder serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("graph", help="a shipped graph's name (mm-encoder graphs lists them), e.g. epd, or a graph file")
    p.add_argument("--run-dir", type=Path, help="logs, state, Dynamo store (default: /tmp/mm-encoder-<graph>)")
    p.add_argument("--restart", action="store_true", help="restart a component that dies")
    p.add_argument("--port", type=int, help="the frontend's port (default: the graph's frontend_port)")
    p.add_argument("--status-interval", type=float, default=60.0, help="seconds between status lines (0: never)")
    p.add_argument("--checkpoint", type=Path, help="the model's checkpoint directory, for every component (default: "
                   "the graph's llm.checkpoint, else a generated tiny Kimi-K2.5)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), help="dtype of every component that runs a model "
                   "(default: the graph's llm.dtype)")
    p.add_argument("--preset", choices=("tiny", "small", "vllm-tiny"),
                   help="without a checkpoint: the generated Kimi-K2.5's "
                   "size (default: the graph's llm.preset)")
    p.add_argument("--tls", action="store_true", help="TLS with client certificates on every hop, from a "
                   "throwaway CA in the run directory (the graph's `tls`; docs/security.md)")
    p.add_argument("--tls-dir", type=Path, help="with --tls: the operator's CA (its ca.pem and ca.key) instead")
    args = p.parse_args(argv)
    try:
        graph_file = find_graph(args.graph)
        graph = load_graph(graph_file)
    except GraphError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    if args.port:
        graph = graph.model_copy(update={"frontend_port": args.port})
    if args.tls or args.tls_dir:
        tls = {"enabled": True, **({"ca_dir": str(args.tls_dir.resolve())} if args.tls_dir else {})}
        graph = graph.model_copy(update={"tls": graph.tls.model_copy(update=tls)})
    llm = {k: v for k, v in (("checkpoint", args.checkpoint and str(args.checkpoint.resolve())),
                             ("dtype", args.dtype), ("preset", args.preset)) if v}
    if llm:
        graph = graph.model_copy(update={"llm": graph.llm.model_copy(update=llm)})
    for name, c in graph.components.items():  # an interpreter of the graph's own (vLLM's virtualenv)
        if c.python and not os.access(c.python, os.X_OK):
            print(f"error: component {name}: python {c.python} is not an executable here"
                  + (" (make vllm-venv builds it)" if c.backend == "vllm" else ""), file=sys.stderr)
            return 2
    try:
        check_local(graph)
    except GraphError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    run_dir = args.run_dir or Path(f"/tmp/mm-encoder-{graph.name}")
    runner = GraphRunner(graph, run_dir, restart=args.restart)
    scaler: Scaler | None = None

    def on_signal(signum: int, frame: FrameType | None) -> NoReturn:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # also when started in the background, where SIGINT is ignored
    rotate = []  # SIGHUP: new certificates, taken up in the loop below
    signal.signal(signal.SIGHUP, lambda signum, frame: rotate.append(True))
    print(f"mm-encoder serve {graph_file} (graph {graph.name}, namespace {graph.namespace}); logs in {run_dir}",
          flush=True)
    rc = 0
    try:
        runner.start()
        print(f"graph {graph.name} ready: OpenAI base URL {runner.base_url} (model {graph.llm.served_name}); "
              f"{ready_note(runner.site.tls)}; status: mm-encoder status --run-dir {run_dir}; Ctrl-C stops", flush=True)
        scaler = runner.executor()
        scaled = graph.of_kind("encoder")[0][0] if scaler is not None else ""  # the planner's encoders
        last = time.monotonic()
        while True:
            if rotate:
                rotate.clear()
                say(runner.rotate())
            for event in runner.check():
                say(event)
            if scaler is not None and (decision := scaler.pending()) is not None:
                count, done = decision
                outcome = scale_to(runner, scaled, count)
                done.set_result(outcome)
                if outcome[0]:
                    print(f"scaled (the encode planner's decision): {outcome[0]}", flush=True)
            if args.status_interval and time.monotonic() - last >= args.status_interval:
                for line in format_lines(collect(run_dir)):
                    print(line, flush=True)
                last = time.monotonic()
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except GraphError as e:
        print(f"error: {e.message}", file=sys.stderr)
        rc = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the stop below must not be interrupted
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("stopping ...", flush=True)
        if scaler is not None:
            scaler.stop()
        left = runner.stop()
        if left:
            print(f"warning: processes left behind: {left}", file=sys.stderr)
            rc = rc or 1
        else:
            print("stopped; no processes left", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
