"""The device side of the worker: queued items -> forward passes -> packed wire-v1 bodies.

One asyncio task forms batches from the queue, greedily and in order, up to the encoder's
`batch_max_patches` (an item bigger than the cap goes alone), and runs each on the one device
thread. Packing (copy, byte planes, zstd) runs in the postprocess pool, so packing item A overlaps
the forward of item B; with `post_workers=0` it runs on the device thread (the no-overlap
baseline). A job whose request was cancelled while queued is dropped before its forward.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeGuard

import torch

from ..core import wire
from ..core.timing import ms_since
from ..core.wire_schema import DTYPE_SIZES, WireDtype
from ..model.steps import EncodeSteps, Prepared
from .load import probe
from .metrics import ServiceMetrics
from .settings import WorkerSettings

log = logging.getLogger(__name__)
# What the device thread hands back per job: its rows, and its packed body with the pack time when
# there is no postprocess pool to pack it in.
_Packed = tuple[wire.Packed, float]
_Done = tuple[list[torch.Tensor], float, float, _Packed | None]  # rows, queue ms, forward ms, packed


@dataclass
class Job:
    """One media item's preprocessed chunks waiting for the device."""

    mm_hash: str
    modality: str
    prepared: list[Prepared]
    future: asyncio.Future[_Done]
    enqueued: float

    @property
    def patches(self) -> int:
        return sum(p.num_patches for p in self.prepared)


class DeviceBatcher:
    def __init__(self, encoder: EncodeSteps, settings: WorkerSettings, metrics: ServiceMetrics):
        self.encoder = encoder
        self.settings = settings
        self.metrics = metrics
        # the rows leave in the dtype the model ran in unless the operator says otherwise: --dtype fp32
        # is fp32 from the tower to the engine, bf16 (production) costs no extra bytes
        self.wire_dtype: WireDtype = settings.wire_dtype or wire_name(encoder.dtype)
        self._device = ThreadPoolExecutor(1, thread_name_prefix="mm-device")
        self._post = ThreadPoolExecutor(settings.post_workers, "mm-post") if settings.post_workers else None
        self._jobs: deque[Job] = deque()
        self._ready: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        """Jobs waiting for the device (the `dynamo_component_encode_queue_depth` gauge)."""
        return len(self._jobs)

    def start(self) -> None:
        self._ready = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="mm-encoder-batcher")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for job in self._jobs:
            job.future.cancel()
        self._jobs.clear()
        for pool in (self._device, self._post):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    async def submit(self, mm_hash: str, modality: str, prepared: list[Prepared]
                     ) -> tuple[wire.Packed, dict[str, float]]:
        """Queue one item; its wire-v1 body (with its header) and the queue/forward/pack timings."""
        loop = asyncio.get_running_loop()
        job = Job(mm_hash, modality, prepared, loop.create_future(), time.perf_counter())
        self._jobs.append(job)
        self._started().set()
        outputs, queue_ms, forward_ms, packed_here = await job.future
        timings = {"queue": queue_ms, "forward": forward_ms}
        if packed_here is None:
            t0 = time.perf_counter()
            packed = await loop.run_in_executor(self._post, self.pack, job, outputs)
            timings["pack"] = ms_since(t0)
        else:
            packed, timings["pack"] = packed_here
        return packed, timings

    def _started(self) -> asyncio.Event:
        """The event that wakes the batching task (made by `start`, in the serving loop)."""
        if self._ready is None:
            raise RuntimeError("the device batcher is not started")
        return self._ready

    async def _run(self) -> None:
        """Forms batches from queued jobs and runs them, one at a time, on the device thread."""
        loop = asyncio.get_running_loop()
        ready = self._started()
        if self.settings.capacity_probe:
            await self._probe(loop)
        while True:
            while not self._jobs:
                ready.clear()
                await ready.wait()
            batch = self._take(self.encoder.batch_max_patches)
            if not batch:
                continue
            start = time.perf_counter()
            patches = sum(job.patches for job in batch)
            self.metrics.forwards.inc()
            self.metrics.forward_items.inc(len(batch))
            self.metrics.batch_patches.observe(patches)
            for job in batch:
                self.metrics.queue_wait.observe(start - job.enqueued)
            try:
                outputs, forward_ms, packed = await loop.run_in_executor(self._device, self._forward, batch)
            except Exception as e:  # a failed forward fails its own jobs, never the batcher
                log.exception("forward of %d items failed", len(batch))
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(e)
                continue
            self.metrics.forward_seconds.inc(forward_ms / 1e3)
            self.metrics.patches_encoded.inc(patches)
            self.metrics.capacity.observe(patches, forward_ms / 1e3)
            for job, out, pk in zip(batch, outputs, packed, strict=True):
                if not job.future.done():
                    job.future.set_result((out, (start - job.enqueued) * 1e3, forward_ms, pk))

    async def _probe(self, loop: asyncio.AbstractEventLoop) -> None:
        """The capacity estimate before any live forward (`load.probe`, on the device thread); a
        probe that fails leaves it unknown and the worker serving."""
        try:
            patches, seconds = await loop.run_in_executor(self._device, probe, self.encoder)
        except Exception:
            log.warning("capacity probe failed; the estimate waits for live forwards", exc_info=True)
            return
        self.metrics.capacity.probed = patches / seconds
        log.info("capacity probe: %d patches in %.1f ms (%.0f patches/s)", patches, seconds * 1e3, patches / seconds)

    def _take(self, limit: int) -> list[Job]:
        """Queued jobs in order while they fit under `limit` patches (the first one always)."""
        batch: list[Job] = []
        patches = 0
        while self._jobs:
            job = self._jobs[0]
            if job.future.done():  # cancelled while queued: its forward never starts
                self._jobs.popleft()
                continue
            if batch and patches + job.patches > limit:
                break
            batch.append(self._jobs.popleft())
            patches += job.patches
        return batch

    def _forward(self, batch: list[Job]) -> tuple[list[list[torch.Tensor]], float, list[_Packed | None]]:
        """Device thread: one forward over every chunk of every job; packs here too if there is
        no postprocess pool."""
        flat = [p for job in batch for p in job.prepared]
        outputs, forward_ms = self.encoder.forward(flat)
        per_job: list[list[torch.Tensor]] = []
        i = 0
        for job in batch:
            per_job.append(outputs[i : i + len(job.prepared)])
            i += len(job.prepared)
        if self._post is not None:
            return per_job, forward_ms, [None] * len(batch)
        packed: list[_Packed | None] = []
        for job, outs in zip(batch, per_job, strict=True):
            t0 = time.perf_counter()
            packed.append((self.pack(job, outs), ms_since(t0)))
        return per_job, forward_ms, packed

    def pack(self, job: Job, outputs: list[torch.Tensor]) -> wire.Packed:
        embeds = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return wire.pack(
            mm_hash=job.mm_hash,
            model=self.encoder.spec.name,
            modality=job.modality,
            embeds=embeds,
            grid_thws=[p.grid for p in job.prepared],
            timestamps=_timestamps(job),
            dtype=self.wire_dtype,
            byte_planes=self.settings.wire_byte_planes,
            level=self.settings.zstd_level,
        )


def _timestamps(job: Job) -> list[str] | None:
    """A video's chunk stamps (every video chunk has one); None for an image."""
    if job.modality != "video":
        return None
    return [p.timestamp for p in job.prepared if p.timestamp is not None]


def wire_name(dtype: torch.dtype) -> WireDtype:
    """torch's dtype -> its wire name (the wire spells dtypes as torch does)."""
    name = str(dtype).removeprefix("torch.")
    if not _is_wire_dtype(name):
        raise ValueError(f"the encoder runs in {name}, which the wire cannot carry; set --wire-dtype")
    return name


def _is_wire_dtype(name: str) -> TypeGuard[WireDtype]:
    return name in DTYPE_SIZES
