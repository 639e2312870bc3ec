"""A whole graph on one machine: the plan on a `LocalSite`, one `Fleet` per component started in the
plan's order and waited on until healthy, then supervised until told to stop.

Dynamo runs without etcd or NATS by default (file discovery in the run directory, TCP request plane,
ZMQ events); a graph's `runtime` may ask for etcd discovery and NATS planes, and then etcd and
nats-server run here too (`infra.py`) unless ETCD_ENDPOINTS / NATS_SERVER name existing ones.
`run_dir/state.json` records ports and PIDs for `mm-encoder status` and for tests. The supervision
loop reports deaths (and restarts with `restart`), carries out an encode planner's decisions, renews
certificates on SIGHUP, and on stop everything goes in reverse order, then the leftover check.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ..core.errors import GraphError, MMEncoderError
from ..graph.checkpoint import GeneratedCheckpoint
from ..graph.plan import DYNAMO_KINDS, plan
from ..graph.planned import ComponentPlan, TlsFiles
from ..graph.schema import Graph
from ..planner.settings import REPLICA_LIMIT, check_args
from ..runtime import tracing
from ..runtime.procfs import leftover_pids
from ..security.issuing import LAUNCHER
from ..security.pki import RENEW_AT, describe
from . import infra
from .fleet import Fleet, Launch, Proc
from .scaler import Scaler, executable
from .site import LOOPBACK, LocalSite, connect_host, private_run_dir, ready_note
from .status import collect, format_lines


class GraphRunner:
    def __init__(self, graph: Graph, run_dir: Path, *, restart: bool = False, grace_s: float = 30.0,
                 start_timeout_s: float = 180.0, bind: str = LOOPBACK):
        self.graph = graph
        self.run_dir = run_dir.resolve()
        self.site = LocalSite(graph, self.run_dir, bind)
        self.restart = restart
        self.fleets: list[Fleet] = []
        self.servers: list[infra.Server] = []  # etcd / NATS, when the graph's runtime needs them
        self.runtime_env: dict[str, str] = {}  # how Dynamo's components reach those (ETCD_ENDPOINTS, ...)
        self.scaling: dict[str, object] = {}  # the last encode-planner decision carried out
        self.bounds = scaling_bounds(graph)  # what scale_to carries out: the planner's [min, max]
        issuer = self.site.issuer
        self.launch = Launch(self.run_dir, self._env, self._certify, lambda: issuer.client_context if issuer else None,
                             start_timeout_s, grace_s, tick=self._renew_if_due)
        self.rotations = threading.Event()  # set (SIGHUP): new certificates, taken up by `supervise`
        self.scaler: Scaler | None = None  # the scaling executor running now (`executor`)
        self.executor_due: float | None = None  # when its certificate for Dynamo's planes is due
        # what every process starts from: taken now, before the scaling executor's thread sets Dynamo's
        # planes (the launcher's etcd key among them) in this process's own environment
        self.environ = dict(os.environ)

    @property
    def procs(self) -> list[Proc]:
        """Every replica's process, in start order."""
        return [p for f in self.fleets for p in f.procs]

    @property
    def base_url(self) -> str:
        """What callers use: the OpenAI base URL, or an encoder site's URL for its model clusters."""
        scheme, host = "https" if self.site.issuer else "http", connect_host(self.site.bind)
        if self.graph.site == "encoder":
            return f"{scheme}://{host}:{self.graph.site_port}"
        return f"{scheme}://{host}:{self.graph.frontend_port}/v1"

    def prepare(self) -> None:
        """The run directory, the generated checkpoint (if the graph names none), the fleets."""
        private_run_dir(self.run_dir)
        generated = GeneratedCheckpoint.of(self.graph)
        if generated is not None and not (Path(self.site.checkpoint_dir) / "config.json").is_file():
            generated.write(self.site.checkpoint_dir)
        elif not (Path(self.site.checkpoint_dir) / "config.json").is_file():
            raise GraphError(f"llm.checkpoint {self.site.checkpoint_dir} has no config.json: not a model checkpoint")
        for name, c in self.graph.of_kind("encoder"):  # an encoder site's models: each its own checkpoint
            if c.checkpoint and not (Path(self.site.checkpoint_of(name, c)) / "config.json").is_file():
                raise GraphError(f"components.{name}.checkpoint {c.checkpoint} has no config.json: not a model "
                                 "checkpoint")
        plans = plan(self.graph, self.site)
        if self.site.issuer is not None:  # the site's own certificates; each replica's as it starts (`_certify`)
            self.site.issuer.issue([])
            # serve's own Dynamo client (the scaling executor) reads its certificate once: the planes' lifetime
            self.site.issuer.issue_planes([(LAUNCHER, "client")])
            if self.site.issuer.warning:
                print(f"warning: {self.site.issuer.warning}", file=sys.stderr, flush=True)
        self.fleets = [Fleet(cp, self.launch) for cp in plans]

    def start(self) -> None:
        self.prepare()
        self._start_servers()
        for fleet in self.fleets:
            fleet.start(self._started)
        self._renew_if_due()  # none has run past its certificate when the graph says it is ready
        self.write_state()

    def _started(self, p: Proc) -> None:
        """A replica is up: said; and certificates due meanwhile renewed (a start may outlast short ones)."""
        print(f"  {p.name:12s} {p.kind:14s} up   pid {p.popen.pid if p.popen else '-'}"
              + (f"  {p.url}" if p.url else ""), flush=True)
        self._renew_if_due()

    def _renew_if_due(self) -> None:
        issuer = self.site.issuer
        if issuer is not None and issuer.due is not None and time.monotonic() >= issuer.due:
            say(self.rotate())

    def _start_servers(self) -> None:
        """etcd / NATS first, unless the environment already names them."""
        self.servers = infra.servers_for(self.graph.runtime, self.run_dir, os.environ,
                                         self.site.issuer.servers() if self.site.issuer else None)
        self.runtime_env = {k: os.environ[k] for k in ("ETCD_ENDPOINTS", "NATS_SERVER") if os.environ.get(k)}
        for server in self.servers:
            server.start(self.run_dir / f"{server.name}.log")
            server.wait_ready()
            self.runtime_env |= server.env
            print(f"  {server.name:12s} {'runtime':14s} up   pid {server.pid}  {next(iter(server.env.values()))}",
                  flush=True)

    def _env(self, p: Proc) -> dict[str, str]:
        """A replica's environment: ours, how Dynamo's planes are reached (with its certificate), then tracing."""
        dynamo = p.kind in DYNAMO_KINDS
        env = {**self.environ, **(self.runtime_env if dynamo else {}), **p.plan.env}
        if p.replica.tls is not None and dynamo:
            env |= p.replica.tls.plane.dynamo_env(self.runtime_env)
        # tracing on: one service each, Dynamo's spans beside ours, one protocol (observability.md)
        service = p.plan.env.get("OTEL_SERVICE_NAME", f"{self.graph.name}/{p.plan.name}")
        return env | tracing.component_env(env, service, p.name)

    def _certify(self, p: Proc) -> None:
        """Before a replica starts: a new certificate (a replica scaled up again must not find its expired
        one), and a new one for Dynamo's planes, which its runtime reads once (renewed by restarting it)."""
        issuer = self.site.issuer
        if issuer is None or p.replica.tls is None:
            return
        issuer.issue([(p.name, p.kind)], site=False)
        if p.kind in DYNAMO_KINDS:
            issuer.issue_planes([(p.name, p.kind)])
            p.renew_by = time.monotonic() + RENEW_AT * issuer.plane_lifetime.total_seconds()

    def supervise(self, scaler: Scaler | None = None, status_interval: float = 0.0,
                  stop: threading.Event | None = None) -> None:
        """Until `stop` is set (or KeyboardInterrupt): deaths reported (restarts with `restart`), certificates
        renewed on `rotations`, the planner's decisions carried out, a status line every `status_interval` s."""
        stop = stop or threading.Event()
        last = time.monotonic()
        while not stop.is_set():
            if self.rotations.is_set():  # SIGHUP: now
                self.rotations.clear()
                say(self.rotate())
            self._renew_if_due()
            if (due := self._plane_due()) is not None:  # one at a time: the others keep serving
                say(next(f for f in self.fleets if due in f.procs).restart(due))
                self.write_state()
            events = [e for f in self.fleets for e in f.check(self.restart)]
            for event in events:
                say(event)
            if events and self.restart:  # new PIDs
                self.write_state()
            if self.executor_due is not None and time.monotonic() >= self.executor_due:
                scaler = self._renew_executor(scaler)
            if scaler is not None and (decision := scaler.pending()) is not None:
                self._carry_out(*decision)
            if status_interval and time.monotonic() - last >= status_interval:
                for line in format_lines(collect(self.run_dir)):
                    print(line, flush=True)
                last = time.monotonic()
            stop.wait(0.5)

    def _carry_out(self, count: object, done: concurrent.futures.Future[tuple[str, int]]) -> None:
        """One decision, whatever it holds: scaling never raises out of the supervisor (the graph
        keeps serving), and `done` is always set, so the executor's thread never waits forever."""
        outcome = ("", self._encoders_running())
        try:
            outcome = self.scale_to(count)
        except Exception as e:  # a bug or an unforeseen error: reported, the graph goes on
            outcome = (f"scaling to {count!r} failed: {type(e).__name__}: {e}", self._encoders_running())
        finally:
            done.set_result(outcome)
        if outcome[0]:
            print(f"scaled (the encode planner's decision): {outcome[0]}", flush=True)

    def _encoders_running(self) -> int:
        return sum(len(f.live) for f in self.fleets if f.kind == "encoder")

    def _planned(self, component: str, n: int) -> dict[str, ComponentPlan]:
        """The plan with `component` at `n` replicas (the same ports for those already planned)."""
        g = self.graph
        sized = g.model_copy(update={"components": {**g.components, component: g.components[component].model_copy(
            update={"replicas": n})}})
        return {cp.name: cp for cp in plan(sized, self.site)}

    def scale_to(self, count: object) -> tuple[str, int]:
        """The planner's encoders brought to `count` running replicas, clamped to the planner's
        [min, max] (`scaler.executable`: a count that is no count is refused); (what was done, how
        many run).

        Up: new workers start on new ports and are waited on until ready; then the tiers' upstreams
        are rewritten and nginx reloads them gracefully. Down: the newest workers leave the tiers'
        upstreams first (and the old nginx workers that could still send them requests exit), then
        drain. Replicas start in index order and stop newest first, so the running ones are always
        0..k-1 and the plan for k gives every tier's upstreams."""
        fleet = next((f for f in self.fleets if f.kind == "encoder"), None)
        if fleet is None:
            return "refused: this graph runs no encoder to scale", 0
        n, note = executable(count, self.bounds)
        note = f"{fleet.name}: {note}" if note else ""
        if n is None:
            return note, len(fleet.live)
        target = self._planned(fleet.name, n)[fleet.name]
        if {p.name for p in fleet.live} == {r.name for r in target.replicas}:
            return note, len(fleet.live)  # already there (a repeated or re-sent decision)
        try:
            started, failed = fleet.grow(target)
            retiring = fleet.retiring(target)
            running = len(fleet.live) - len(retiring)
            plans = self._planned(fleet.name, running)
            settled = [f.reconfigure(plans[f.name], old_gone=bool(retiring)) for f in self.fleets
                       if f.kind in ("cache-shared", "cache-cluster")]
            fleet.drain(retiring)
        except MMEncoderError as e:  # a tier that would not reload: say so, keep serving
            return f"{fleet.name}: scaling to {n} failed: {e.message}", len(fleet.live)
        self.scaling = {"component": fleet.name, "wanted": n, "running": running, "at": time.time(),
                        "started": started, "stopped": [p.name for p in retiring]}
        self.write_state()
        what = (f"started {', '.join(started)}" if started else "") + \
            (f"drained {', '.join(p.name for p in retiring)}" if retiring else "")
        late = "" if all(settled) else " (some nginx workers were still finishing requests)"
        summary = f"{fleet.name}: {running} running ({what or 'no change'}){late}{'; ' + failed if failed else ''}"
        return (f"{note}; {summary}" if note else summary), running

    def _plane_due(self) -> Proc | None:
        """A running replica whose certificate for Dynamo's planes is due for renewal (the earliest)."""
        now = time.monotonic()
        due = [p for p in self.procs if p.state == "up" and p.renew_by is not None and p.renew_by <= now]
        return min(due, key=lambda p: p.renew_by or 0.0) if due else None

    def rotate(self) -> str:
        """New certificates for every replica running now (the CA kept), each process told to read its own
        again (SIGHUP: nginx reloads gracefully, our processes reload their SSL contexts; nats-server
        reloads; etcd reads its files at each handshake), with no request dropped (docs/security.md).
        Run on SIGHUP and whenever the certificates are two thirds through their life."""
        if self.site.issuer is None:
            return "rotation: this graph runs without TLS"
        # those up: one starting has new ones already, and may be reading them now
        self.site.issuer.issue((p.name, p.kind) for p in self.procs if p.replica.tls and p.state == "up" and p.alive)
        told = [pid for f in self.fleets for pid in f.signal(signal.SIGHUP)]
        for server in self.servers:
            if server.name == "nats" and server.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server.pid, signal.SIGHUP)
        self.write_state()
        return f"rotation: new certificates for {len(told)} processes, each told to read them again"

    def executor(self) -> Scaler | None:
        """With an encode planner: the thread that takes its decisions (Dynamo's VirtualConnectorClient)."""
        planner = next((f for f in self.fleets if f.kind == "planner"), None)
        if planner is None:
            return None
        running = sum(1 for p in self.procs if p.kind == "encoder" and p.state == "up")
        issuer = self.site.issuer
        tls = TlsFiles(*issuer.plane_files(LAUNCHER)).dynamo_env(self.runtime_env) if issuer else {}
        scaler = Scaler(self.graph.namespace, {**self.runtime_env, **planner.plan.env, **tls}, running)
        scaler.start()
        self.scaler = scaler
        if issuer:  # it reads its certificate once, like any Dynamo process: renewed by a new one
            self.executor_due = time.monotonic() + RENEW_AT * issuer.plane_lifetime.total_seconds()
        return scaler

    def _renew_executor(self, old: Scaler | None) -> Scaler | None:
        """A new scaling executor with a new certificate for Dynamo's planes, the old one stopped first (a
        decision it had not taken stays published: the new one takes it); None, tried again in 30 s, if
        it does not start."""
        assert self.site.issuer is not None
        if old is not None:
            old.stop()
        self.site.issuer.issue_planes([(LAUNCHER, "client")])
        try:
            new = self.executor()
        except MMEncoderError as e:
            say(f"scaling executor: could not start again with its new certificate: {e.message}; retrying later")
            self.executor_due = time.monotonic() + 30
            self.scaler = None
            return None
        say("scaling executor restarted with a new certificate for Dynamo's planes")
        return new

    @staticmethod
    def _certificates(p: Proc) -> dict[str, str]:
        """When the replica's certificates end (`mm-encoder status` shows the time left)."""
        out, tls = {}, p.replica.tls
        if tls is not None:
            for key, path in (("cert_not_after", tls.cert), ("plane_cert_not_after", tls.plane_cert)):
                if path and Path(path).is_file():
                    with contextlib.suppress(MMEncoderError):
                        out[key] = describe(Path(path))["not_after"]
        return out

    def write_state(self) -> None:
        state = {
            "graph": self.graph.name, "namespace": self.graph.namespace, "run_dir": str(self.run_dir),
            "base_url": self.base_url, "model": self.graph.llm.served_name,
            **({"tls": self.site.issuer.state()} if self.site.issuer else {}),
            "supervisor_pid": os.getpid(),
            "components": [{"name": p.name, "kind": p.kind, "pid": p.popen.pid if p.popen else None,
                            "url": p.url, **({"ops_url": p.ops_url} if p.ops_url else {}), "log": str(p.log),
                            **self._certificates(p)} for p in self.procs],
            "runtime": {**self.runtime_env, "servers": [{"name": s.name, "pid": s.pid} for s in self.servers]},
            **({"scaling": self.scaling} if self.scaling else {}),
        }
        # whole or not at all: `mm-encoder status` and the tests read it while serve rewrites it (a scale)
        tmp = self.run_dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self.run_dir / "state.json")

    def stop(self) -> list[int]:
        """Reverse order; whole sessions; returns PIDs of the graph still alive afterwards (none)."""
        for fleet in reversed(self.fleets):
            fleet.stop()
        for server in reversed(self.servers):  # after everything that used them
            server.stop(self.launch.grace_s)
        groups = self.launch.sessions | {s.popen.pid for s in self.servers if s.popen is not None}
        for pgid in groups:  # children left behind by a process that exited (e.g. nginx workers)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        return leftover_pids(groups)

    def run(self, source: str, status_interval: float = 0.0) -> int:
        """Start, say so, supervise until SIGINT/SIGTERM, stop: serve's exit status (`source`: the graph's
        file, for the first line). SIGHUP renews the certificates (`rotate`) and stops nothing."""
        def interrupt(signum: int, frame: object) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, interrupt)
        signal.signal(signal.SIGINT, interrupt)  # also when started in the background, where SIGINT is ignored
        signal.signal(signal.SIGHUP, lambda signum, frame: self.rotations.set())
        g, rc = self.graph, 0
        print(f"mm-encoder serve {source} (graph {g.name}, namespace {g.namespace}); logs in {self.run_dir}",
              flush=True)
        try:
            self.start()
            what = (f"encoder site URL {self.base_url} (model clusters: serve ... --encoder-site {self.base_url})"
                    if g.site == "encoder" else f"OpenAI base URL {self.base_url} (model {g.llm.served_name})")
            print(f"graph {g.name} ready: {what}; {ready_note(self.site.issuer, self.site.bind)}; "
                  f"status: mm-encoder status --run-dir {self.run_dir}; Ctrl-C stops", flush=True)
            self.supervise(self.executor(), status_interval)
        except KeyboardInterrupt:
            pass
        except GraphError as e:
            print(f"error: {e.message}", file=sys.stderr)
            rc = 1
        finally:
            rc = self._shutdown(self.scaler) or rc
        return rc

    def _shutdown(self, scaler: Scaler | None) -> int:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the stop below must not be interrupted
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("stopping ...", flush=True)
        if scaler is not None:
            scaler.stop()
        left = self.stop()
        if left:
            print(f"warning: processes left behind: {left}", file=sys.stderr)
            return 1
        print("stopped; no processes left", flush=True)
        return 0


def scaling_bounds(graph: Graph) -> tuple[int, int]:
    """The encoder counts serve carries out: the graph's planner's [--min-replicas, --max-replicas] as
    the planner process reads them (its args, over its `env`'s MM_PLANNER_*, over serve's environment);
    without a planner, [1, REPLICA_LIMIT]."""
    found = graph.planner
    if found is None:
        return 1, REPLICA_LIMIT
    _, planner = found
    from_env = [f"--{key.removeprefix('MM_PLANNER_').lower().replace('_', '-')}={planner.env[key]}"
                for key in ("MM_PLANNER_MIN_REPLICAS", "MM_PLANNER_MAX_REPLICAS") if key in planner.env]
    s = check_args([*from_env, *planner.args])  # the last of a repeated option wins: the args
    return s.min_replicas, s.max_replicas


def say(text: str) -> None:
    """A multi-line message (a death with its log's tail) as one write to stdout, so that a reader of
    the pipe never sees half of it; print() may split it at its buffer's edge."""
    sys.stdout.flush()
    data = (text + "\n").encode()
    while data:
        data = data[os.write(sys.stdout.fileno(), data):]
