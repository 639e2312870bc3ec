"""Prometheus metrics of one encode service, in its own registry.

Its own `CollectorRegistry` (not the process-global one) so that two services in one process
(tests, benchmarks) never share counters, and the Dynamo system server can append exactly this
text to its `/metrics`. Cache levels are read at scrape time from the caches' own counters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..runtime.dynamo import ENCODER_COMPONENT, NAMESPACE
from .admission import Admission
from .caches import AliasCache, BodyCache
from .load import CapacityMeter

DYNAMO_LABELS = ("dynamo_namespace", "dynamo_component", "worker_type")  # Dynamo's own metrics carry them
STAGES = ("fetch", "decode", "preprocess", "queue", "forward", "pack", "total")
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def _le(bound: float) -> str:
    """A bucket's `le` label as prometheus-client writes it (1 -> "1.0", inf -> "+Inf")."""
    return str(floatToGoString(bound))  # type: ignore[no-untyped-call]


class _CacheCollector(Collector):
    def __init__(self, alias: AliasCache, body: BodyCache):
        self.alias, self.body = alias, body

    def collect(self) -> Iterator[Metric]:
        levels: dict[str, AliasCache | BodyCache] = {"alias": self.alias, "mm_hash": self.body}
        for name, doc, attr in (
            ("hits", "Cache hits", "hits"),
            ("misses", "Cache misses", "misses"),
            ("evictions", "Entries evicted to stay within the cap", "evictions"),
            ("expirations", "Entries dropped because their TTL passed", "expirations"),
        ):
            c = CounterMetricFamily(f"mm_encoder_cache_{name}", doc, labels=["level"])
            for level, cache in levels.items():
                c.add_metric([level], getattr(cache.stats, attr))
            yield c
        entries = GaugeMetricFamily("mm_encoder_cache_entries", "Entries held", labels=["level"])
        size = GaugeMetricFamily("mm_encoder_cache_bytes", "Bytes held (mm_hash level: bodies)", labels=["level"])
        for level, cache in levels.items():
            entries.add_metric([level], len(cache))
        size.add_metric(["mm_hash"], self.body.bytes)
        yield entries
        yield size


class ServiceMetrics:
    def __init__(self, alias: AliasCache, body: BodyCache, admission: Admission, *, inflight: Callable[[], int],
                 queued: Callable[[], int], capacity: CapacityMeter | None = None, namespace: str = NAMESPACE):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.dynamo = {"dynamo_namespace": namespace, "dynamo_component": ENCODER_COMPONENT, "worker_type": "encode"}
        self.capacity = capacity or CapacityMeter()
        self.requests = Counter(
            "mm_encoder_requests", "Encode requests by transport and outcome (ok or an error code)",
            ["transport", "outcome"], registry=r,
        )
        self.served_from = Counter(
            "mm_encoder_served_from", "Successful requests by the level that answered them", ["level"], registry=r
        )
        self.stage_seconds = Histogram(
            "mm_encoder_stage_seconds", "Per-request time per pipeline stage", ["stage"], buckets=_BUCKETS, registry=r
        )
        self.fetches = Counter("mm_encoder_fetches", "Media downloads started", registry=r)
        self.fetch_bytes = Counter("mm_encoder_fetch_bytes", "Media bytes downloaded", registry=r)
        self.forwards = Counter("mm_encoder_forwards", "Forward batches run on the device", registry=r)
        self.forward_items = Counter("mm_encoder_forward_items", "Media items encoded by forward passes", registry=r)
        self.batch_patches = Histogram(
            "mm_encoder_batch_patches", "Patches per forward batch", registry=r,
            buckets=(256, 1024, 2048, 4096, 8192, 16384, 32768, 65536),
        )
        self.coalesced = Counter(
            "mm_encoder_coalesced", "Requests that joined identical in-flight work (single-flight)", ["stage"],
            registry=r,
        )
        self.rejected = Counter("mm_encoder_rejected", "Requests refused with 503", ["reason"], registry=r)
        # the load signals an encode planner reads (encode_worker/load.py): counted in patches, labelled as
        # Dynamo labels a component's metrics (its namespace and component; `worker_type` "encode")
        d = self.dynamo
        self.forward_seconds = Counter("mm_encoder_forward_seconds",
                                       "Device seconds in forward passes (its rate: the device's busy fraction)",
                                       DYNAMO_LABELS, registry=r).labels(**d)
        self.patches_admitted = Counter("mm_encoder_patches_admitted",
                                        "Patches of the items admitted past the caches (demand)", DYNAMO_LABELS,
                                        registry=r).labels(**d)
        self.patches_encoded = Counter("mm_encoder_patches_encoded", "Patches encoded by forward passes",
                                       DYNAMO_LABELS, registry=r).labels(**d)
        self.queue_wait = Histogram("mm_encoder_queue_wait_seconds", "Per item: from the device queue to its "
                                    "forward", DYNAMO_LABELS, buckets=_BUCKETS, registry=r).labels(**d)
        Gauge("mm_encoder_capacity_patches_per_second",
              "Patches the device encodes per second of forward time: the last forwards, else the start-up probe",
              DYNAMO_LABELS, registry=r).labels(**d).set_function(lambda: self.capacity.patches_per_second)
        self.body_bytes = Counter("mm_encoder_response_bytes", "Response body bytes produced", registry=r)
        Gauge("mm_encoder_pending", "Items admitted past the caches, not yet packed",
              registry=r).set_function(lambda: admission.pending.in_use)
        Gauge("mm_encoder_decoding_pixels", "Pixels reserved for decoding, all requests together",
              registry=r).set_function(lambda: admission.decoding.in_use)
        Gauge("mm_encoder_prepared_patches", "Patches reserved for prepared items not yet encoded",
              registry=r).set_function(lambda: admission.prepared.in_use)
        Gauge("mm_encoder_inflight", "Requests being served", registry=r).set_function(inflight)
        Gauge("mm_encoder_queue_depth", "Items waiting for the device", registry=r).set_function(queued)
        r.register(_CacheCollector(alias, body))

    def served(self, transport: str, source: str, timings_ms: dict[str, float], body_bytes: int) -> None:
        self.requests.labels(transport, "ok").inc()
        self.served_from.labels(source).inc()
        self.observe_timings(timings_ms)
        self.body_bytes.inc(body_bytes)

    def refused(self, transport: str, code: str) -> None:
        self.requests.labels(transport, code).inc()
        if code in ("overloaded", "draining"):
            self.rejected.labels(code).inc()

    def observe_timings(self, timings_ms: dict[str, float]) -> None:
        for stage, ms in timings_ms.items():
            if stage in STAGES:
                self.stage_seconds.labels(stage).observe(ms / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def load(self, *, draining: bool) -> dict[str, Any]:
        """The load signals as one map, for the encode planner (`<namespace>.mm_encoder.load`): the
        same counters as /metrics, so the planner takes rates as Prometheus would."""
        def get(name: str, labels: dict[str, str] | None = None) -> float | None:
            return self.registry.get_sample_value(name, labels if labels is not None else self.dynamo)

        capacity = self.capacity.patches_per_second
        return {
            "forward_seconds": get("mm_encoder_forward_seconds_total") or 0.0,
            "patches_admitted": get("mm_encoder_patches_admitted_total") or 0.0,
            "patches_encoded": get("mm_encoder_patches_encoded_total") or 0.0,
            "rejected": {reason: get("mm_encoder_rejected_total", {"reason": reason}) or 0.0
                         for reason in ("overloaded", "draining")},
            "queue_depth": int(get("mm_encoder_queue_depth", {}) or 0),
            "queue_wait_buckets": [[le, get("mm_encoder_queue_wait_seconds_bucket", {"le": _le(le), **self.dynamo})
                                    or 0.0] for le in (*_BUCKETS, math.inf)],
            "capacity_pps": None if math.isnan(capacity) else capacity,
            "draining": draining,
        }

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (0 when absent; the Dynamo labels may go unsaid): for tests and benchmarks."""
        found = self.registry.get_sample_value(name, labels or {})
        if found is None:
            found = self.registry.get_sample_value(name, {**(labels or {}), **self.dynamo})
        return found or 0.0
