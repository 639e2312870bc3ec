"""`mm-encoder serve` as the executor of an encode planner's decisions (the other side of Dynamo's
VirtualConnector): more encode workers, or one fewer, with no request lost.

A thread holds Dynamo's `VirtualConnectorClient` on its own event loop and runtime: it waits for a
decision, hands the encoder count to the supervisor's loop (`Scaler.pending`) and acknowledges the
decision (`complete`) once the fleet is at that count, or failed to get there. The supervisor
(`GraphRunner.scale_to`, runner.py, with the encoders' `Fleet`) carries it out:

- up: new workers start on new ports and are waited on until ready; then the shared tier's
  upstreams (and the cluster tier's `--direct` list) are rewritten and nginx reloads them
  gracefully (HUP): its old workers finish what they hold;
- down: the newest worker leaves the tiers' upstreams first (reload, and the old nginx workers
  that could still send it requests have exited), then gets SIGTERM: it drains (what it holds
  finishes, new work is refused with 503 "draining"), leaves Dynamo's discovery and exits.

Dynamo RPC callers learn the new set from discovery; the frontend's chain goes through the tiers.

Scaling never takes the graph down: a count outside the planner's [min, max] is clamped
(`executable`), one that is not a count is refused, both logged; a failed scale is reported and
acknowledged, and this thread outlives a failed read of the decision.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
from typing import Any

from ..core.errors import GraphError

log = logging.getLogger(__name__)
POLL_S = 2.0  # the executor reads the current decision at least this often


def executable(count: object, bounds: tuple[int, int]) -> tuple[int | None, str]:
    """The encoder count serve carries out for a decision's `count`: within the planner's `bounds`
    ([--min-replicas, --max-replicas]), with why it differs from what was asked ("" when it does
    not); None when `count` is no count at all (a bool, a float, a string). A count outside the
    bounds comes from a bug or from another writer of the coordinator's key: serve must neither
    stop the graph on a 0 nor spend minutes starting a billion workers."""
    low, high = bounds
    if isinstance(count, bool) or not isinstance(count, int):
        return None, f"refused: {count!r} is not an encoder count"
    if count < low:
        return low, f"asked for {count} encoders, below the planner's minimum: carrying out {low}"
    if count > high:
        return high, f"asked for {count} encoders, above the planner's maximum: carrying out {high}"
    return count, ""


class Scaler:
    """The executor's thread: decisions in from Dynamo's VirtualConnectorClient, counts out to the
    supervisor (`pending`), acknowledgements back once each is carried out (`done`)."""

    def __init__(self, namespace: str, env: dict[str, str], running: int):
        self.namespace, self.env = namespace, env
        self.running = running  # encoders the supervisor last brought the fleet to
        self._in: queue.Queue[tuple[object, concurrent.futures.Future[tuple[str, int]]]] = queue.Queue()
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

    def pending(self) -> tuple[object, concurrent.futures.Future[tuple[str, int]]] | None:
        """A decision to carry out: (its encoder count as the coordinator holds it, the future to set with
        what was done and how many run)."""
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

    async def _take(self, client: Any, last: tuple[int, object] | None) -> tuple[int, object] | None:
        """The current decision handed to the supervisor (unless already carried out) and acknowledged
        once it was; what was last acknowledged, (decision id, count)."""
        decision = await client.get()
        count = decision.num_prefill_workers  # the encoder count (runtime.dynamo.ENCODER_SLOT)
        if (isinstance(count, int) and count < 0) or (decision.decision_id, count) == last:
            return last  # -1: the coordinator has no decision yet
        done: concurrent.futures.Future[tuple[str, int]] = concurrent.futures.Future()
        self._in.put((count, done))  # the supervisor clamps it and compares it with what runs (scale_to)
        outcome, self.running = await asyncio.wrap_future(done)
        log.info("decision %s carried out: %s", decision.decision_id, outcome or "no change")
        await client.complete(decision)
        return decision.decision_id, count

    async def _main(self) -> None:
        from ..runtime.dynamo import make_runtime, scaling_client

        os.environ.update(self.env)  # Dynamo's runtime reads its discovery and planes from the environment
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        runtime = make_runtime(self._loop)
        try:
            client = scaling_client(runtime, self.namespace)
            self._ready.set()
            last: tuple[int, object] | None = None  # (decision id, count) last acknowledged
            while not self._stop.is_set():
                # a new decision ends the wait at once; the poll also catches what `wait` misses: a
                # restarted planner's coordinator numbers its decisions from 0 again, ids this client
                # has already acknowledged (Dynamo 1.6.1), so the count is compared as well
                try:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(client.wait(), POLL_S)
                    last = await self._take(client, last)
                except Exception:  # etcd unreachable for a moment, say: this thread goes on, and so does serve
                    log.exception("reading or acknowledging the encode planner's decision failed")
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), POLL_S)
        finally:
            runtime.shutdown()
