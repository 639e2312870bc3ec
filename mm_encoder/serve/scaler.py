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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading

from ..core.errors import GraphError

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
