"""`EncodeService`: the engine behind both transports. One request reads top to bottom:

    encode         count, time and log the request; 503 while draining
    _answer        URL alias (scope, url, identity) -> mm_hash -> body: hit, answer
    _from_url      miss: fetch (async I/O), once per URL in flight (single-flight)
    _from_bytes    identify (modality + mm_hash, in a thread when big) -> body cache, keyed by the
                   request's scope and the mm_hash (`caches.body_key`: a tenant's own)
    _compute       miss: plan (CPU pool: the header, what it will cost) -> reserve its pixels and
                   patches (`admission`) -> decode + preprocess (CPU pool) -> DeviceBatcher (queue,
                   forward, pack) -> body cache, once per (scope, mm_hash) in flight (single-flight)

The stages run on different executors so a slow download never blocks the device. What the worker
takes on at once is bounded by one `Admission` (items past the caches, pixels being decoded,
patches prepared), always reserved on the event loop before work goes to a pool: beyond it a
request gets 503 + Retry-After instead of growing memory. A request cancelled before its forward
starts is dropped from the queue.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from ..core import wire
from ..core.errors import Draining, DtypeMismatch, MediaError, RevisionMismatch, UnknownModelError
from ..core.requests import EncodeReply, EncodeRequest
from ..core.spec import PreprocessConfig
from ..core.timing import ms_since
from ..fetch import Fetcher
from ..model.steps import EncodeSteps, Prepared
from ..runtime import tracing
from ..security.pki import seconds_left
from .admission import Admission
from .batcher import DeviceBatcher
from .caches import AliasCache, BodyCache, SingleFlight, body_key
from .metrics import ServiceMetrics
from .settings import WorkerSettings

log = logging.getLogger(__name__)
T = TypeVar("T")

_HASH_IN_THREAD_BYTES = 1 << 20  # blake3 runs ~6 GB/s: below 1 MiB a thread hop costs more than it saves


def _check_modality(asked: str | None, found: str) -> None:
    if asked is not None and asked != found:
        raise MediaError("bad_input", f"modality is {asked!r} but the bytes are {found}; fix or omit it")


@dataclass
class EncodeResult:
    packed: wire.Packed  # the wire-v1 body and its header, as the batcher made them (and the cache keeps them)
    source: str  # who answered: "alias", "mm_hash", "coalesced" or "forward"
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def body(self) -> bytes:
        return self.packed.body

    @property
    def header(self) -> wire.WireHeader:
        return self.packed.header

    @property
    def mm_hash(self) -> str:
        return self.packed.header.mm_hash

    def server_timing(self) -> str:
        """The `Server-Timing` header value: one metric per stage, plus the answering level."""
        parts = [f"{stage};dur={ms:.2f}" for stage, ms in self.timings_ms.items()]
        parts.append(f'cache;desc="{self.source}"')
        return ", ".join(parts)

    def reply(self, header_only: bool = False) -> EncodeReply:
        if header_only:
            return EncodeReply(b"", self.mm_hash, self.source, self.timings_ms, self.header.to_meta())
        return EncodeReply(self.body, self.mm_hash, self.source, self.timings_ms)


def certificates(settings: WorkerSettings) -> dict[str, float]:
    """Seconds left on the worker's certificates: its HTTPS port's, and the one Dynamo's planes read."""
    paths = {"http": settings.tls_cert, "dynamo": os.environ.get("DYN_TCP_TLS_CERT_PATH")}
    return {which: left for which, path in paths.items() if path and (left := seconds_left(path)) is not None}


class EncodeService:
    def __init__(self, encoder: EncodeSteps, settings: WorkerSettings, fetcher: Fetcher | None = None):
        self.encoder = encoder
        self.settings = settings
        self.fetcher = fetcher or Fetcher(settings.fetch_policy())
        self.alias = AliasCache(settings.alias_cache_entries, settings.alias_ttl_s)
        self.bodies = BodyCache(settings.cache_bytes)
        self._url_flights: SingleFlight[EncodeResult] = SingleFlight()
        self._hash_flights: SingleFlight[tuple[wire.Packed, dict[str, float]]] = SingleFlight()
        self._cpu = ThreadPoolExecutor(settings.cpu_workers, thread_name_prefix="mm-cpu")
        self.admission = Admission(max_receiving_bytes=settings.max_receiving_bytes, max_pending=settings.max_pending,
                                   retry_after_s=settings.retry_after_s, limits=encoder.limits)
        self._inflight = 0
        self._idle: asyncio.Event | None = None
        self.draining = False
        self.served_names = {n.lower() for n in encoder.spec.served_names}
        self.metrics = ServiceMetrics(self.alias, self.bodies, self.admission,
                                      inflight=lambda: self._inflight, queued=lambda: len(self.batcher),
                                      namespace=settings.namespace, certificates=lambda: certificates(settings))
        self.batcher = DeviceBatcher(encoder, settings, self.metrics)

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._idle = asyncio.Event()
        self._idle.set()
        self.batcher.start()

    @property
    def ready(self) -> bool:
        return self.batcher.running and not self.draining

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
        await self.batcher.close()
        await self.fetcher.close()
        self._cpu.shutdown(wait=False, cancel_futures=True)

    # --- the request path --------------------------------------------------------------------

    def check_model(self, name: str, revision: str | None = None, dtype: str | None = None) -> None:
        if name.lower() not in self.served_names:
            raise UnknownModelError(name, sorted(self.encoder.spec.served_names))
        if revision is not None and revision != self.encoder.spec.revision:
            raise RevisionMismatch(f"model {name} here is revision {self.encoder.spec.revision}, the request expects "
                                   f"{revision}: the frontend and this encoder read different checkpoints")
        if dtype is not None and dtype != self.batcher.wire_dtype:
            raise DtypeMismatch(f"this worker packs {self.batcher.wire_dtype} rows, the request expects {dtype}: "
                                f"serve both with one dtype (--dtype, or --wire-dtype here)")

    async def encode(self, req: EncodeRequest, transport: str = "http",
                     parent: tracing.Context | None = None) -> EncodeResult:
        """One request, as one span (`mm_encoder.encode`, a child of the caller's `parent` context):
        which level answered, the mm_hash, and the stages below it as child spans."""
        with tracing.span("mm_encoder.encode", parent, kind="server",
                          attributes={"mm_encoder.transport": transport, "mm_encoder.model": req.model}) as span:
            result = await self._encode(req, transport)
            span.set_attributes({"mm_encoder.source": result.source, "mm_encoder.mm_hash": result.mm_hash,
                                 "mm_encoder.body_bytes": len(result.body)})
            log.debug("encoded %s over %s: from %s, %d bytes", result.mm_hash[:16], transport, result.source,
                      len(result.body))
            return result

    async def _encode(self, req: EncodeRequest, transport: str) -> EncodeResult:
        t0 = time.perf_counter()
        idle = self._idle
        if idle is None:
            raise RuntimeError("the encode service is not started")
        self._inflight += 1
        idle.clear()
        try:
            if self.draining:
                raise Draining("this worker is shutting down; retry on another replica")
            result = await self._answer(req)
        except asyncio.CancelledError:
            self.metrics.requests.labels(transport, "cancelled").inc()
            raise
        except Exception as e:
            self.metrics.refused(transport, getattr(e, "code", "internal"))
            raise
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                idle.set()
        result.timings_ms["total"] = ms_since(t0)
        self.metrics.served(transport, result.source, result.timings_ms, len(result.body))
        log.log(
            logging.DEBUG if result.source in ("alias", "mm_hash") else logging.INFO,
            "encode %s via %s from %s: %d bytes, %s", result.mm_hash[:16], transport, result.source,
            len(result.body), " ".join(f"{k}={v:.1f}ms" for k, v in result.timings_ms.items()),
        )
        return result

    async def _answer(self, req: EncodeRequest) -> EncodeResult:
        self.check_model(req.model, req.revision, req.dtype)
        cfg = req.processor.apply(self.encoder.spec.preprocess) if req.processor else self.encoder.spec.preprocess
        if req.data is not None:
            return await self._from_bytes(req.data, req.modality, cfg, {}, req.scope)
        url = req.url
        assert url is not None  # a request holds exactly one of `url` and `data` (EncodeRequest checks)
        if url[:5].lower() == "data:":  # inline content: nothing to alias, nothing to download
            fetched = await self.fetcher.fetch(url)
            return await self._from_bytes(fetched.data, req.modality, cfg, {}, req.scope)
        identity = self.encoder.identity(cfg)
        h = self.alias.get(req.scope, url, identity)
        if h is not None:
            packed = self.bodies.get(body_key(req.scope, h))
            if packed is not None:
                hit = EncodeResult(packed, "alias")
                _check_modality(req.modality, hit.header.modality)  # answer as a miss would
                return hit
        key = (req.scope, url, identity, req.modality)
        result, joined = await self._url_flights.run(key, lambda: self._from_url(req, url, cfg, identity))
        if joined:
            self.metrics.coalesced.labels("fetch").inc()
            return EncodeResult(result.packed, "coalesced", dict(result.timings_ms))
        return result

    async def _from_url(self, req: EncodeRequest, url: str, cfg: PreprocessConfig, identity: bytes) -> EncodeResult:
        with self.admission.pending.hold():
            t0 = time.perf_counter()
            self.metrics.fetches.inc()
            with tracing.span("fetch") as span:
                fetched = await self.fetcher.fetch(url)
                span.set_attribute("mm_encoder.bytes", len(fetched.data))
            self.metrics.fetch_bytes.inc(len(fetched.data))
            timings = {"fetch": ms_since(t0)}
        result = await self._from_bytes(fetched.data, req.modality, cfg, timings, req.scope)
        self.alias.put(req.scope, url, identity, result.mm_hash)  # only after success: errors are not cached
        return result

    async def _from_bytes(
        self, data: bytes, modality: str | None, cfg: PreprocessConfig, timings: dict[str, float], scope: str = ""
    ) -> EncodeResult:
        """The item's body: from the mm_hash LRU or a forward pass shared with a request in flight for
        the same item, both within the request's scope (a tenant never joins or reuses another's)."""
        if not data:
            raise MediaError("empty", "the media item has no bytes")
        if len(data) > _HASH_IN_THREAD_BYTES:
            identified = await self._in_pool(self.encoder.identify, data, cfg)
        else:
            identified = self.encoder.identify(data, cfg)
        sniffed, h = identified
        _check_modality(modality, sniffed)
        key = body_key(scope, h)
        packed = self.bodies.get(key)
        if packed is not None:
            return EncodeResult(packed, "mm_hash", timings)
        (packed, work), joined = await self._hash_flights.run(key, lambda: self._compute(data, identified, cfg, key))
        if joined:
            self.metrics.coalesced.labels("encode").inc()
        return EncodeResult(packed, "coalesced" if joined else "forward", {**timings, **work})

    async def _compute(self, data: bytes, identified: tuple[str, str], cfg: PreprocessConfig, key: str
                       ) -> tuple[wire.Packed, dict[str, float]]:
        modality, h = identified
        with self.admission.pending.hold():
            with tracing.span("plan", attributes={"mm_encoder.mm_hash": h, "mm_encoder.modality": modality}) as span:
                plan = await self._in_pool(self.encoder.plan, data, cfg, identified=identified)
                span.set_attributes({"mm_encoder.patches": plan.patches, "mm_encoder.pixels": plan.pixels})
            await self.admission.prepared.acquire(plan.patches)
            self.metrics.patches_admitted.inc(plan.patches)
            prepare: Future[list[Prepared]] | None = None
            try:
                await self.admission.decoding.acquire(plan.pixels)
                prepare = self._cpu.submit(self.encoder.decode, data, plan, cfg)
                # the pixels are given back when the decode ends, even if this request is cancelled first
                prepare.add_done_callback(lambda _: self.admission.decoding.release_soon(plan.pixels))
                with tracing.span("decode+preprocess"):
                    prepared = await asyncio.wrap_future(prepare)
                timings = {
                    "decode": sum(p.timings_ms["decode"] for p in prepared),
                    "preprocess": sum(p.timings_ms["preprocess"] for p in prepared),
                }
                with tracing.span("device", attributes={"mm_encoder.patches": plan.patches}) as span:
                    packed, device = await self.batcher.submit(h, modality, prepared)
                    # queue wait, forward and pack, as the device thread measured them
                    span.set_attributes({f"mm_encoder.{k}_ms": round(v, 3) for k, v in device.items()})
            finally:  # the patches: once the forward has them no more (or the cancelled decode is over)
                if prepare is None or prepare.done():
                    self.admission.prepared.release(plan.patches)
                else:
                    prepare.add_done_callback(lambda _: self.admission.prepared.release_soon(plan.patches))
            self.bodies.put(key, packed)
            return packed, {**timings, **device}

    async def _in_pool(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._cpu, functools.partial(fn, *args, **kwargs))
