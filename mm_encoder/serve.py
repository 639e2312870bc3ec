"""`mm-encoder serve GRAPH`: run a whole graph on one machine.

Each component replica is a process in its own session (so stopping it stops its children:
nginx workers, thread pools), started in dependency order (encoders, shared tier, router,
cluster tier, engines, frontend) and waited on until healthy. Dynamo runs without etcd or NATS
(file discovery in the run directory, TCP request plane, ZMQ events). `run_dir/state.json`
records ports and PIDs for `mm-encoder status` and for tests; logs are `run_dir/<name>.log`.
Ctrl-C or SIGTERM stops everything in reverse order (SIGTERM, then SIGKILL after a grace period)
and checks that no process of the graph is left.
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
from dataclasses import dataclass, field
from pathlib import Path

from .graph import Graph, GraphError, load_graph

PY = sys.executable
ORDER = ("encoder", "cache-shared", "cache-router", "cache-cluster", "engine", "frontend")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str  # component name, plus -N for replicas beyond one
    kind: str
    cmd: list[str]
    port: int | None = None
    ready_line: str | None = None  # printed on stdout when ready (engines)
    health_path: str | None = None  # HTTP path that answers 200 when ready
    popen: subprocess.Popen | None = None
    log: Path | None = None
    restarts: int = 0
    state: str = "new"
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str | None:
        return f"http://127.0.0.1:{self.port}" if self.port else None


class GraphRunner:
    def __init__(self, graph: Graph, run_dir: Path, *, restart: bool = False, grace_s: float = 30.0,
                 start_timeout_s: float = 180.0):
        self.graph = graph
        self.run_dir = run_dir.resolve()
        self.restart = restart
        self.grace_s = grace_s
        self.start_timeout_s = start_timeout_s
        self.procs: list[Proc] = []
        self.env = {
            **os.environ,
            "DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
            "DYN_FILE_KV": str(self.run_dir / "dynamo-store"), "DYN_TCP_RPC_HOST": "127.0.0.1",
            "DYN_TCP_MAX_MESSAGE_SIZE": os.environ.get("DYN_TCP_MAX_MESSAGE_SIZE", str(256 << 20)),
            "DYN_SELF_HOST_METADATA": "0", "DYN_LOG": os.environ.get("DYN_LOG", "warn"),
            "PYTHONUNBUFFERED": "1",
        }

    # --- the plan ----------------------------------------------------------------------------

    def llm_dir(self) -> Path:
        if self.graph.llm.model_dir:
            return Path(self.graph.llm.model_dir)
        from .engines.lm import make_model_dir

        target = self.run_dir / "llm" / self.graph.llm.name
        if not (target / "config.json").is_file():
            make_model_dir(target, self.graph.llm.vision_model, name=self.graph.llm.name,
                           context_length=self.graph.llm.context_length)
        return target

    def plan(self) -> list[Proc]:
        g, ns, llm = self.graph, self.graph.namespace, self.graph.llm
        model_dir = str(self.llm_dir())
        procs: list[Proc] = []

        def named(base: str, i: int, n: int) -> str:
            return base if n == 1 else f"{base}-{i}"

        encoders = []
        for name, c in g.of_kind("encoder"):
            for i in range(c.replicas):
                port = free_port()
                cmd = [PY, "-m", "mm_encoder.worker", "--model", llm.vision_model, "--dynamo", "--namespace", ns,
                       "--http-port", str(port), *(["--checkpoint", llm.checkpoint] if llm.checkpoint else []),
                       *c.args]
                procs.append(Proc(named(name, i, c.replicas), c.kind, cmd, port, health_path="/ready",
                                  extra={"env": c.env}))
                encoders.append(f"127.0.0.1:{port}")
        shards = []
        for name, c in g.of_kind("cache-shared"):
            for i in range(c.replicas):
                port = free_port()
                pname = named(name, i, c.replicas)
                procs.append(self._tier(pname, "shared", port, [a for e in encoders for a in ("--next", e)], c))
                shards.append(f"127.0.0.1:{port}")
        router = None
        for name, c in g.of_kind("cache-router"):
            router = free_port()
            procs.append(self._tier(name, "router", router, [a for s in shards for a in ("--shard", s)], c))
        cluster = None
        for name, c in g.of_kind("cache-cluster"):
            cluster = free_port()
            nxt = [f"127.0.0.1:{router}"] if router else encoders
            args = [a for n in nxt for a in ("--next", n)] + [a for e in encoders for a in ("--direct", e)]
            procs.append(self._tier(name, "cluster", cluster, args, c))
        for name, c in g.of_kind("engine"):
            for i in range(c.replicas):
                cmd = [PY, "-m", "mm_encoder.engines.reference", "--model-dir", model_dir, "--namespace", ns,
                       "--block-size", str(g.block_size), *c.args]
                if g.inline_encoding:
                    cmd += ["--encoder-model", llm.vision_model,
                            *(["--encoder-checkpoint", llm.checkpoint] if llm.checkpoint else [])]
                procs.append(Proc(named(name, i, c.replicas), c.kind, cmd, ready_line="engine ready",
                                  extra={"env": c.env}))
        for name, c in g.of_kind("frontend"):
            cmd = [PY, "-m", "mm_encoder.frontend", "--model-dir", model_dir, "--namespace", ns,
                   "--http-port", str(g.frontend_port), "--block-size", str(g.block_size)]
            if cluster:
                route = "cluster,shared" if router else "cluster"
                cmd += ["--encoder-http", f"http://127.0.0.1:{cluster}", "--encoder-route", route]
            elif shards:
                cmd += ["--encoder-http", f"http://127.0.0.1:{router}", "--encoder-route", "shared"]
            if g.inline_encoding:
                cmd += ["--inline-media"]
            procs.append(Proc(name, c.kind, [*cmd, *c.args], g.frontend_port, health_path="/v1/models",
                              extra={"env": c.env}))
        return sorted(procs, key=lambda p: ORDER.index(p.kind))

    def _tier(self, name: str, tier: str, port: int, args: list[str], c) -> Proc:
        cmd = [PY, "-m", "mm_encoder.cache_tier", "up", "--tier", tier, "--listen", f"127.0.0.1:{port}",
               "--run-dir", str(self.run_dir / f"nginx-{name}"), *args]
        if tier != "router":
            cmd += ["--cache-dir", str(self.run_dir / f"cache-{name}")]
        return Proc(name, c.kind, [*cmd, *c.args], port, health_path="/_cache/health", extra={"env": c.env})

    # --- running -----------------------------------------------------------------------------

    def spawn(self, p: Proc) -> None:
        p.log = self.run_dir / f"{p.name}.log"
        env = {**self.env, **p.extra.get("env", {})}
        with p.log.open("a") as log:
            p.popen = subprocess.Popen(p.cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                       cwd=self.run_dir)
        p.state = "starting"

    def healthy(self, p: Proc) -> bool:
        if p.ready_line is not None:
            return p.log is not None and p.ready_line in p.log.read_text(errors="replace")
        try:
            with urllib.request.urlopen(f"{p.url}{p.health_path}", timeout=2) as r:
                if r.status != 200:
                    return False
                if p.kind == "frontend":
                    return bool(json.loads(r.read()).get("data"))
                return True
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_healthy(self, p: Proc) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not self.healthy(p):
            if p.popen.poll() is not None:
                raise GraphError(f"{p.name} exited with {p.popen.returncode} while starting:\n{self.tail(p)}")
            if time.monotonic() > deadline:
                raise GraphError(f"{p.name} was not healthy after {self.start_timeout_s:.0f} s:\n{self.tail(p)}")
            time.sleep(0.1)
        p.state = "up"

    def tail(self, p: Proc, lines: int = 15) -> str:
        text = p.log.read_text(errors="replace") if p.log and p.log.exists() else ""
        return "\n".join("    " + line for line in text.splitlines()[-lines:])

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.procs = self.plan()
        for p in self.procs:
            self.spawn(p)
            self.wait_healthy(p)
            print(f"  {p.name:12s} {p.kind:14s} up   pid {p.popen.pid}" + (f"  {p.url}" if p.url else ""), flush=True)
        self.write_state()

    def write_state(self) -> None:
        state = {
            "graph": self.graph.name, "namespace": self.graph.namespace, "run_dir": str(self.run_dir),
            "base_url": f"http://127.0.0.1:{self.graph.frontend_port}/v1", "model": self.graph.llm.name,
            "supervisor_pid": os.getpid(),
            "components": [{"name": p.name, "kind": p.kind, "pid": p.popen.pid if p.popen else None,
                            "url": p.url, "log": str(p.log)} for p in self.procs],
        }
        (self.run_dir / "state.json").write_text(json.dumps(state, indent=2))

    def check(self) -> list[str]:
        """One pass over the processes: report deaths (with the log's tail), restart if asked."""
        events = []
        for p in self.procs:
            if p.popen is None or p.state != "up" or p.popen.poll() is None:
                continue
            p.state = "down"
            events.append(f"{p.name} exited with {p.popen.returncode}; last log lines:\n{self.tail(p)}")
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
        groups = {p.popen.pid for p in self.procs if p.popen is not None}
        for pgid in groups:  # children left behind by a process that exited (e.g. nginx workers)
            _signal_group(pgid, signal.SIGKILL)
        return leftover_pids(groups)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def leftover_pids(groups: set[int]) -> list[int]:
    """Live processes (not zombies) whose process group is one of the graph's sessions."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, pgid = fields[0], int(fields[2])
        if pgid in groups and state != "Z":
            alive.append(int(entry.name))
    return alive


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mm-encoder serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("graph", type=Path, help="a graph file, e.g. graphs/epd.yaml")
    p.add_argument("--run-dir", type=Path, help="logs, state, Dynamo store (default: /tmp/mm-encoder-<graph>)")
    p.add_argument("--restart", action="store_true", help="restart a component that dies")
    p.add_argument("--port", type=int, help="the frontend's port (default: the graph's frontend_port)")
    p.add_argument("--status-interval", type=float, default=60.0, help="seconds between status lines (0: never)")
    args = p.parse_args(argv)
    try:
        graph = load_graph(args.graph)
    except GraphError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    if args.port:
        graph = graph.model_copy(update={"frontend_port": args.port})
    run_dir = args.run_dir or Path(f"/tmp/mm-encoder-{graph.name}")
    runner = GraphRunner(graph, run_dir, restart=args.restart)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # also when started in the background, where SIGINT is ignored
    print(f"mm-encoder serve {args.graph} (graph {graph.name}, namespace {graph.namespace}); logs in {run_dir}",
          flush=True)
    rc = 0
    try:
        runner.start()
        print(f"graph {graph.name} ready: OpenAI base URL http://127.0.0.1:{graph.frontend_port}/v1 "
              f"(model {graph.llm.name}); status: mm-encoder status --run-dir {run_dir}; Ctrl-C stops", flush=True)
        last = time.monotonic()
        while True:
            for event in runner.check():
                print(event, flush=True)
            if args.status_interval and time.monotonic() - last >= args.status_interval:
                from .status import collect, format_lines

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
        left = runner.stop()
        if left:
            print(f"warning: processes left behind: {left}", file=sys.stderr)
            rc = rc or 1
        else:
            print("stopped; no processes left", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
