"""`mm-encoder serve` as the executor of an encode planner's decisions (the other side of Dynamo's
VirtualConnector): more encode workers, or one fewer, with no request lost.

A thread holds Dynamo's `VirtualConnectorClient` on its own event loop and runtime: it waits for a
decision, hands the encoder count to the supervisor's loop (`Scaler.pending`) and acknowledges the
decision (`complete`) once the fleet is at that count, or failed to get there. The supervisor
(`GraphRunner.scale_to`, in local.py) carries it out:

- up: new workers start on new ports and are waited on until ready; then the shared tier's
  upstreams (and the cluster tier's `--direct` list) are rewritten and nginx reloads them
  gracefully (HUP): its old workers finish what they hold;
- down: the newest worker leaves the tiers' upstreams first (reload, and the old nginx workers
  that could still send it requests have exited), then gets SIGTERM: it drains (what it holds
  finishes, new work is refused with 503 "draining"), leaves Dynamo's discovery and exits.

Dynamo RPC callers learn the new set from discovery; the frontend's chain goes through the tiers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.errors import GraphError
from . import cache_tiers
from .graph import Graph
from .plan import ComponentPlan, plan
from .procfs import processes

if TYPE_CHECKING:
    from .local import GraphRunner, Proc

log = logging.getLogger(__name__)
POLL_S = 2.0  # the executor reads the current decision at least this often


class Scaler:
    """The executor's thread: decisions in from Dynamo's VirtualConnectorClient, counts out to the
    supervisor (`pending`), acknowledgements back once each is carried out (`done`)."""

    def __init__(self, namespace: str, env: dict[str, str], running: int):
        self.namespace, self.env = namespace, env
        self.running = running  # encoders the supervisor last brought the fleet to
        self._in: queue.Queue[tuple[int, concurrent.futures.Future[tuple[str, int]]]] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mm-encoder-scaler", daemon=True)

    def start(self, timeout_s: float = 60.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise GraphError(f"the scaling executor did not reach Dynamo's runtime within {timeout_s:.0f} s")
        if self.error is not None:
            raise GraphError(f"the scaling executor could not start: {self.error}")

    def pending(self) -> tuple[int, concurrent.futures.Future[tuple[str, int]]] | None:
        """A decision to carry out: (encoder count, the future to set with what was done and how many run)."""
        try:
            return self._in.get_nowait()
        except queue.Empty:
            return None

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # reported by start(), or in the log once running
            self.error = e
            self._ready.set()
            log.exception("scaling executor stopped")

    async def _main(self) -> None:
        from ..runtime.dynamo import make_runtime, scaling_client

        os.environ.update(self.env)  # Dynamo's runtime reads its discovery and planes from the environment
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        runtime = make_runtime(self._loop)
        try:
            client = scaling_client(runtime, self.namespace)
            self._ready.set()
            last: tuple[int, int] | None = None  # (decision id, count) last acknowledged
            while not self._stop.is_set():
                # a new decision ends the wait at once; the poll also catches what `wait` misses: a
                # restarted planner's coordinator numbers its decisions from 0 again, ids this client
                # has already acknowledged (Dynamo 1.6.1), so the count is compared as well
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(client.wait(), POLL_S)
                decision = await client.get()
                count = decision.num_prefill_workers  # the encoder count (runtime.dynamo.ENCODER_SLOT)
                if count < 0 or (decision.decision_id, count) == last:
                    continue
                done: concurrent.futures.Future[tuple[str, int]] = concurrent.futures.Future()
                self._in.put((count, done))  # the supervisor compares it with what runs (scale_to)
                outcome, self.running = await asyncio.wrap_future(done)
                log.info("decision %s carried out: %s", decision.decision_id, outcome)
                await client.complete(decision)
                last = (decision.decision_id, count)
        finally:
            runtime.shutdown()


def reload_tier(pid: int, argv: Iterable[str], run_dir: Path, *, old_gone: bool, timeout_s: float = 30.0) -> bool:
    """Rewrite a running nginx tier's config for `argv` (its new upstreams), check it, and reload it
    (HUP). Returns once a new nginx worker serves and, with `old_gone`, every old one has finished
    what it held and exited: True, or False if some were still busy at `timeout_s`."""
    _, cfg = cache_tiers.parse_args(list(argv))
    cmd, conf = cache_tiers.prepare(cfg)
    test = subprocess.run([*cmd, "-t", "-q"], capture_output=True, text=True, cwd=run_dir)
    if test.returncode != 0:
        raise GraphError(f"nginx rejected the reloaded {conf}:\n{test.stderr.strip()}")
    old = _children(pid)
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = _children(pid)
        if now - old and (not old_gone or not now & old):
            return True
        time.sleep(0.05)
    if not _children(pid) - old:
        raise GraphError(f"nginx {pid} did not reload {conf} within {timeout_s:.0f} s")
    return False


def _children(pid: int) -> set[int]:
    """The live child processes of `pid` (an nginx master's workers)."""
    return {p.pid for p in processes() if p.ppid == pid}


def check_local(graph: Graph) -> None:
    """An encode planner on one machine: Dynamo's VirtualConnector keeps its decisions in etcd."""
    if graph.planner is not None and not graph.runtime.needs_etcd:
        raise GraphError(f"graph {graph.name}: an encode planner on one machine uses Dynamo's VirtualConnector, "
                         "whose state lives in etcd: set `runtime: {discovery: etcd}` (serve then runs etcd)")


def scale_to(runner: GraphRunner, component: str, n: int) -> tuple[str, int]:
    """Bring `component` (the planner's encoders) to `n` running replicas, as the module says;
    returns what was done and how many now run. Replicas are started in index order and stopped newest first, so the
    running ones are always indices 0..k-1 and the plan for k gives every tier's upstreams."""
    from .local import Proc

    def planned(count: int) -> dict[str, ComponentPlan]:
        g = runner.graph
        sized = g.model_copy(update={"components": {**g.components,
                                                    component: g.components[component].model_copy(
                                                        update={"replicas": count})}})
        return {c.name: c for c in plan(sized, runner.site)}

    live = {p.name: p for p in runner.procs if p.component.name == component and p.state in ("up", "starting")}
    target = planned(n)[component]
    if set(live) == {r.name for r in target.replicas}:
        return "", len(live)  # already there (a repeated or re-sent decision)
    started, failed = [], ""
    for r in target.replicas:
        if r.name in live:
            continue
        runner.procs = [p for p in runner.procs if p.name != r.name]  # a dead one of that name: replaced
        p = Proc(target, r)
        last = max(i for i, q in enumerate(runner.procs) if q.component.name == component or q.kind == "encoder")
        runner.procs.insert(last + 1, p)
        runner.spawn(p)
        try:
            runner.wait_healthy(p)
        except GraphError as e:
            failed = f"; {r.name} failed to start: {e.message.splitlines()[0]}"
            if p.popen is not None:
                _kill_session(p.popen)
            runner.procs.remove(p)
            break
        started.append(r.name)
    stopping = sorted((p for name, p in live.items() if name not in {r.name for r in target.replicas}),
                      key=lambda p: p.name, reverse=True)
    running = len(live) + len(started) - len(stopping)
    plans = planned(running)
    drained = _reload_tiers(runner, plans, old_gone=bool(stopping))
    for p in stopping:
        _drain(p, runner.grace_s)
        runner.procs.remove(p)
    runner.scaling = {"component": component, "wanted": n, "running": running, "at": time.time(),
                      "started": started, "stopped": [p.name for p in stopping]}
    runner.write_state()
    what = (f"started {', '.join(started)}" if started else "") + (f"drained {', '.join(p.name for p in stopping)}"
                                                                   if stopping else "")
    late = "" if drained else " (some nginx workers were still finishing requests)"
    return f"{component}: {running} running ({what or 'no change'}){late}{failed}", running


def _reload_tiers(runner: GraphRunner, plans: dict[str, ComponentPlan], *, old_gone: bool) -> bool:
    """Every cache tier whose upstreams name encoders (shared: `--next`; cluster: `--direct`)."""
    done = True
    for p in runner.procs:
        if p.kind not in ("cache-shared", "cache-cluster") or p.popen is None or p.state != "up":
            continue
        replica = next(r for r in plans[p.component.name].replicas if r.name == p.name)
        if replica.argv != p.replica.argv:
            done &= reload_tier(p.popen.pid, replica.argv, runner.run_dir, old_gone=old_gone)
            p.component, p.replica = plans[p.component.name], replica
    return done


def _drain(p: Proc, grace_s: float) -> None:
    """SIGTERM: the worker refuses new work, finishes what it holds, leaves discovery and exits."""
    p.state = "draining"
    assert p.popen is not None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.popen.pid, signal.SIGTERM)
    try:
        p.popen.wait(grace_s + 15)
    except subprocess.TimeoutExpired:
        _kill_session(p.popen)
    p.state = "stopped"


def _kill_session(popen: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, signal.SIGKILL)
    popen.wait(10)
