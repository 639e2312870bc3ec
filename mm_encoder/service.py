"""`EncodeService`: the engine behind both transports.

One request walks down the cache hierarchy's bottom two levels and then the pipeline:

    URL alias (scope, url) -> mm_hash ─┐
    mm_hash -> body ───────────────────┤ hit: answer
    fetch (async I/O) -> hash -> ...   ┘ miss:
    decode + preprocess (CPU pool) -> queue -> forward (one device thread, several items per
    forward up to `batch_max_patches`) -> copy + pack + zstd (postprocess pool) -> caches

The stages run on different executors so that packing item A overlaps the forward of item B,
and a slow download never blocks the device. Identical concurrent work runs once (single-flight,
per URL and per mm_hash). Items past the caches are bounded (`max_pending`): beyond it a request
gets 503 + Retry-After instead of growing memory. A request cancelled before its forward starts
is dropped from the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from . import media, wire
from .caches import AliasCache, BodyCache, SingleFlight
from .encoder import Encoder, Prepared
from .errors import MediaError, UnknownModelError
from .fetch import Fetcher
from .hashing import mm_hash
from .metrics import ServiceMetrics
from .protocol import Draining, EncodeRequest, Overloaded
from .settings import WorkerSettings
from .spec import PreprocessConfig

log = logging.getLogger("mm_encoder.service")

_HASH_IN_THREAD_BYTES = 1 << 20  # blake3 runs ~6 GB/s: below 1 MiB a thread hop costs more than it saves


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


@dataclass
class EncodeResult:
    body: bytes  # wire format v1
    mm_hash: str
    source: str  # who answered: "alias", "mm_hash", "coalesced" or "forward"
    timings_ms: dict[str, float] = field(default_factory=dict)

    def server_timing(self) -> str:
        """The `Server-Timing` header value: one metric per stage, plus the answering level."""
        parts = [f"{stage};dur={ms:.2f}" for stage, ms in self.timings_ms.items()]
        parts.append(f'cache;desc="{self.source}"')
        return ", ".join(parts)


@dataclass
class _Job:
    """One item's preprocessed chunks waiting for the device."""

    mm_hash: str
    modality: str
    prepared: list[Prepared]
    future: asyncio.Future
    enqueued: float

    @property
    def patches(self) -> int:
        return sum(p.num_patches for p in self.prepared)


class EncodeService:
    def __init__(self, encoder: Encoder, settings: WorkerSettings, fetcher: Fetcher | None = None):
        self.encoder = encoder
        self.settings = settings
        self.fetcher = fetcher or Fetcher(settings.fetch_policy())
        self.alias = AliasCache(settings.alias_cache_entries, settings.alias_ttl_s)
        self.bodies = BodyCache(settings.cache_bytes)
        self._url_flights: SingleFlight = SingleFlight()
        self._hash_flights: SingleFlight = SingleFlight()
        self._cpu = ThreadPoolExecutor(settings.cpu_workers, thread_name_prefix="mm-cpu")
        self._device = ThreadPoolExecutor(1, thread_name_prefix="mm-device")
        self._post = ThreadPoolExecutor(settings.post_workers, "mm-post") if settings.post_workers else None
        self._jobs: deque[_Job] = deque()
        self._jobs_ready: asyncio.Event | None = None
        self._batcher: asyncio.Task | None = None
        self._pending = 0
        self._inflight = 0
        self._idle: asyncio.Event | None = None
        self.draining = False
        self.served_names = {n.lower() for n in encoder.spec.served_names}
        self.metrics = ServiceMetrics(self.alias, self.bodies, lambda: self._pending, lambda: self._inflight)

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._jobs_ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._batcher = asyncio.create_task(self._run_batcher(), name="mm-encoder-batcher")

    @property
    def ready(self) -> bool:
        return self._batcher is not None and not self._batcher.done() and not self.draining

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests (503 draining) and wait for in-flight ones; False on timeout."""
        self.draining = True
        if self._idle is None:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            log.warning("drain: %d requests still in flight after %.1f s", self._inflight, timeout_s)
            return False

    async def close(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._batcher
        for job in self._jobs:
            job.future.cancel()
        self._jobs.clear()
        await self.fetcher.close()
        for pool in (self._cpu, self._device, self._post):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    # --- the request path --------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name.lower() not in self.served_names:
            raise UnknownModelError(name, sorted(self.encoder.spec.served_names))

    async def encode(self, req: EncodeRequest, transport: str = "http") -> EncodeResult:
        t0 = time.perf_counter()
        self._inflight += 1
        self._idle.clear()
        try:
            if self.draining:
                raise Draining("this worker is shutting down; retry on another replica", http_status=503)
            result = await self._encode(req)
        except asyncio.CancelledError:
            self.metrics.requests.labels(transport, "cancelled").inc()
            raise
        except Exception as e:
            code = getattr(e, "code", "internal")
            self.metrics.requests.labels(transport, code).inc()
            if code in ("overloaded", "draining"):
                self.metrics.rejected.labels(code).inc()
            raise
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
        result.timings_ms["total"] = _ms(t0)
        self.metrics.requests.labels(transport, "ok").inc()
        self.metrics.served_from.labels(result.source).inc()
        self.metrics.observe_timings(result.timings_ms)
        self.metrics.body_bytes.inc(len(result.body))
        log.log(
            logging.DEBUG if result.source in ("alias", "mm_hash") else logging.INFO,
            "encode %s via %s from %s: %d bytes, %s", result.mm_hash[:16], transport, result.source,
            len(result.body), " ".join(f"{k}={v:.1f}ms" for k, v in result.timings_ms.items()),
        )
        return result

    async def _encode(self, req: EncodeRequest) -> EncodeResult:
        self.check_model(req.model)
        cfg = req.processor.apply(self.encoder.spec.preprocess) if req.processor else self.encoder.spec.preprocess
        identity = self.encoder.identity(cfg)
        if req.data is not None:
            return await self._from_bytes(req.data, req.modality, cfg, identity, {})
        if req.url[:5].lower() == "data:":  # inline content: nothing to alias, nothing to download
            fetched = await self.fetcher.fetch(req.url)
            return await self._from_bytes(fetched.data, req.modality, cfg, identity, {})
        h = self.alias.get(req.scope, req.url, identity)
        if h is not None:
            body = self.bodies.get(h)
            if body is not None:
                return EncodeResult(body, h, "alias")
        key = (req.scope, req.url, identity, req.modality)
        result, joined = await self._url_flights.run(key, lambda: self._from_url(req, cfg, identity))
        if joined:
            self.metrics.coalesced.labels("fetch").inc()
            return EncodeResult(result.body, result.mm_hash, "coalesced", dict(result.timings_ms))
        return result

    async def _from_url(self, req: EncodeRequest, cfg: PreprocessConfig, identity: bytes) -> EncodeResult:
        with self._admit():
            t0 = time.perf_counter()
            self.metrics.fetches.inc()
            fetched = await self.fetcher.fetch(req.url)
            self.metrics.fetch_bytes.inc(len(fetched.data))
            timings = {"fetch": _ms(t0)}
        result = await self._from_bytes(fetched.data, req.modality, cfg, identity, timings)
        self.alias.put(req.scope, req.url, identity, result.mm_hash)  # only after success: errors are not cached
        return result

    async def _from_bytes(
        self, data: bytes, modality: str | None, cfg: PreprocessConfig, identity: bytes, timings: dict[str, float]
    ) -> EncodeResult:
        if not data:
            raise MediaError("empty", "the media item has no bytes")
        sniffed = media.sniff_modality(data)
        if modality is not None and modality != sniffed:
            raise MediaError("bad_input", f"modality is {modality!r} but the bytes are {sniffed}; fix or omit it")
        if len(data) > _HASH_IN_THREAD_BYTES:
            h = await asyncio.get_running_loop().run_in_executor(self._cpu, mm_hash, identity, sniffed, data)
        else:
            h = mm_hash(identity, sniffed, data)
        body = self.bodies.get(h)
        if body is not None:
            return EncodeResult(body, h, "mm_hash", timings)
        (body, work), joined = await self._hash_flights.run(h, lambda: self._encode_new(data, sniffed, cfg, h))
        if joined:
            self.metrics.coalesced.labels("encode").inc()
        return EncodeResult(body, h, "coalesced" if joined else "forward", {**timings, **work})

    async def _encode_new(self, data: bytes, modality: str, cfg: PreprocessConfig, h: str) -> tuple[bytes, dict]:
        loop = asyncio.get_running_loop()
        with self._admit():
            prepared = await loop.run_in_executor(self._cpu, self.encoder.prepare_media, data, cfg)
            timings = {
                "decode": sum(p.timings_ms["decode"] for p in prepared),
                "preprocess": sum(p.timings_ms["preprocess"] for p in prepared),
            }
            job = _Job(h, modality, prepared, loop.create_future(), time.perf_counter())
            self._jobs.append(job)
            self._jobs_ready.set()
            outputs, queue_ms, forward_ms, packed = await job.future
            timings["queue"] = queue_ms
            timings["forward"] = forward_ms
            if packed is None:
                t1 = time.perf_counter()
                packed = await loop.run_in_executor(self._post, self._pack, h, modality, prepared, outputs)
                timings["pack"] = _ms(t1)
            else:
                packed, timings["pack"] = packed
            self.bodies.put(h, packed)
            return packed, timings

    @contextlib.contextmanager
    def _admit(self) -> Iterator[None]:
        if self._pending >= self.settings.max_pending:
            raise Overloaded(
                f"the encode queue is full ({self.settings.max_pending} items); retry after "
                f"{self.settings.retry_after_s} s or on another replica"
            )
        self._pending += 1
        try:
            yield
        finally:
            self._pending -= 1

    # --- device side -------------------------------------------------------------------------

    async def _run_batcher(self) -> None:
        """Forms batches from queued jobs and runs them, one at a time, on the device thread."""
        loop = asyncio.get_running_loop()
        limit = self.settings.batch_max_patches
        while True:
            while not self._jobs:
                self._jobs_ready.clear()
                await self._jobs_ready.wait()
            batch: list[_Job] = []
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
            if not batch:
                continue
            start = time.perf_counter()
            self.metrics.forwards.inc()
            self.metrics.forward_items.inc(len(batch))
            self.metrics.batch_patches.observe(patches)
            try:
                outputs, forward_ms, packed = await loop.run_in_executor(self._device, self._forward, batch)
            except Exception as e:  # a failed forward fails its own jobs, never the batcher
                log.exception("forward of %d items failed", len(batch))
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(e)
                continue
            for job, out, pk in zip(batch, outputs, packed, strict=True):
                if not job.future.done():
                    job.future.set_result((out, (start - job.enqueued) * 1e3, forward_ms, pk))

    def _forward(self, batch: list[_Job]) -> tuple[list[list[torch.Tensor]], float, list]:
        """Device thread: one forward over every chunk of every job; packs here too if there is
        no postprocess pool (`post_workers=0`: the no-overlap baseline)."""
        flat = [p for job in batch for p in job.prepared]
        outputs, forward_ms = self.encoder.forward(flat)
        per_job, i = [], 0
        for job in batch:
            per_job.append(outputs[i : i + len(job.prepared)])
            i += len(job.prepared)
        if self._post is not None:
            return per_job, forward_ms, [None] * len(batch)
        packed = []
        for job, outs in zip(batch, per_job, strict=True):
            t0 = time.perf_counter()
            packed.append((self._pack(job.mm_hash, job.modality, job.prepared, outs), _ms(t0)))
        return per_job, forward_ms, packed

    def _pack(self, h: str, modality: str, prepared: list[Prepared], outputs: list[torch.Tensor]) -> bytes:
        embeds = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return wire.encode(
            mm_hash=h,
            model=self.encoder.spec.name,
            modality=modality,
            embeds=embeds,
            grid_thws=[p.grid for p in prepared],
            timestamps=[p.timestamp for p in prepared] if modality == "video" else None,
            dtype=self.settings.wire_dtype,
            byte_planes=self.settings.wire_byte_planes,
            level=self.settings.zstd_level,
        )
