"""Prometheus metrics of one encode service, in its own registry (the table: docs/observability.md).

Its own `CollectorRegistry` (not the process-global one) so that two services in one process
(tests, benchmarks) never share counters, and the Dynamo system server can append exactly this
text to its `/metrics`. Named in Dynamo's conventions: `dynamo_component_encode_*`, and Dynamo's own
`dynamo_component_embedding_cache_*` for the two cache levels (read at scrape time from the caches'
own counters); every sample carries Dynamo's component labels (`dynamo_namespace`,
`dynamo_component="mm_encoder"`, `dynamo_endpoint="encode"`, `worker_type="encode"`), added when
the registry is collected. 0.2's `mm_encoder_*` names are emitted too until 0.4
(`core.deprecated_metrics`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..core import deprecated_metrics
from ..core.prom import WithLabels
from ..runtime.dynamo import ENCODE_ENDPOINT, ENCODER_COMPONENT, NAMESPACE
from .admission import Admission
from .caches import AliasCache, BodyCache
from .load import CapacityMeter

PREFIX = "dynamo_component_encode"
CACHE_PREFIX = "dynamo_component_embedding_cache"  # Dynamo's multimodal embedding cache metrics, per `level`
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
            c = CounterMetricFamily(f"{CACHE_PREFIX}_{name}", doc, labels=["level"])
            for level, cache in levels.items():
                c.add_metric([level], getattr(cache.stats, attr))
            yield c
        refills = CounterMetricFamily(f"{CACHE_PREFIX}_refills", "Bodies put back after the cache had dropped "
                                      "them (evicted or too big to keep): re-encodes", labels=["level"])
        refills.add_metric(["mm_hash"], self.body.stats.refills)
        yield refills
        entries = GaugeMetricFamily(f"{CACHE_PREFIX}_entries", "Entries held", labels=["level"])
        size = GaugeMetricFamily(f"{CACHE_PREFIX}_current_bytes", "Bytes held (mm_hash level: bodies)",
                                 labels=["level"])
        for level, cache in levels.items():
            entries.add_metric([level], len(cache))
        size.add_metric(["mm_hash"], self.body.bytes)
        yield entries
        yield size


class _CertificateCollector(Collector):
    """Seconds until each of the worker's certificates ends, by which (`http`: its HTTPS port's, renewed
    in place; `dynamo`: the one Dynamo's planes read at start). None without TLS."""

    def __init__(self, certificates: Callable[[], dict[str, float]]):
        self.certificates = certificates

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(f"{PREFIX}_tls_certificate_expiry_seconds", "Seconds until the certificate ends "
                              "(negative: ended); alert well before 0", labels=["certificate"])
        for which, seconds in self.certificates().items():
            g.add_metric([which], seconds)
        yield g


class ServiceMetrics:
    def __init__(self, alias: AliasCache, body: BodyCache, admission: Admission, *, inflight: Callable[[], int],
                 queued: Callable[[], int], capacity: CapacityMeter | None = None, namespace: str = NAMESPACE,
                 certificates: Callable[[], dict[str, float]] = dict):
        # `own`: the metrics with their own labels only (what `load` reads); `registry`: what /metrics
        # shows, `own` with Dynamo's labels, and 0.2's names until 0.4
        self.own = r = CollectorRegistry(auto_describe=True)
        # Dynamo's component labels: a request's endpoint is the worker's one encode endpoint whichever
        # transport brought it (the `transport` label tells HTTP from Dynamo RPC)
        self.dynamo = {"dynamo_namespace": namespace, "dynamo_component": ENCODER_COMPONENT,
                       "dynamo_endpoint": ENCODE_ENDPOINT, "worker_type": "encode"}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(WithLabels(r, self.dynamo))
        self.registry.register(deprecated_metrics.DeprecatedAliases(r, deprecated_metrics.WORKER))
        self.capacity = capacity or CapacityMeter()
        self.requests = Counter(
            f"{PREFIX}_requests", "Encode requests by transport and outcome (ok, cancelled or an error code)",
            ["transport", "outcome"], registry=r,
        )
        self.served_from = Counter(
            f"{PREFIX}_served_from", "Successful requests by the level that answered them (alias, mm_hash, "
            "coalesced, forward)", ["level"], registry=r,
        )
        self.stage_seconds = Histogram(
            f"{PREFIX}_stage_duration_seconds", "Per-request time per pipeline stage", ["stage"], buckets=_BUCKETS,
            registry=r,
        )
        self.fetches = Counter(f"{PREFIX}_fetches", "Media downloads started", registry=r)
        self.fetch_bytes = Counter(f"{PREFIX}_fetch_bytes", "Media bytes downloaded", registry=r)
        self.forwards = Counter(f"{PREFIX}_forwards", "Forward batches run on the device", registry=r)
        self.forward_items = Counter(f"{PREFIX}_forward_items", "Media items encoded by forward passes", registry=r)
        self.batch_patches = Histogram(
            f"{PREFIX}_batch_patches", "Patches per forward batch", registry=r,
            buckets=(256, 1024, 2048, 4096, 8192, 16384, 32768, 65536),
        )
        self.coalesced = Counter(f"{PREFIX}_coalesced", "Requests that joined identical in-flight work "
                                 "(single-flight)", ["stage"], registry=r)
        self.rejected = Counter(f"{PREFIX}_rejected", "Requests refused with 503", ["reason"], registry=r)
        # the load signals an encode planner reads (encode_worker/load.py): counted in patches
        self.forward_seconds = Counter(f"{PREFIX}_forward_seconds", "Device seconds in forward passes (its rate: "
                                       "the device's busy fraction)", registry=r)
        self.patches_admitted = Counter(f"{PREFIX}_patches_admitted", "Patches of the items admitted past the "
                                        "caches (demand)", registry=r)
        self.patches_encoded = Counter(f"{PREFIX}_patches_encoded", "Patches encoded by forward passes", registry=r)
        self.queue_wait = Histogram(f"{PREFIX}_queue_wait_seconds", "Per item: from the device queue to its "
                                    "forward", buckets=_BUCKETS, registry=r)
        Gauge(f"{PREFIX}_capacity_patches_per_second",
              "Patches the device encodes per second of forward time: the last forwards, else the start-up probe",
              registry=r).set_function(lambda: self.capacity.patches_per_second)
        self.body_bytes = Counter(f"{PREFIX}_response_bytes", "Response body bytes produced", registry=r)
        Gauge(f"{PREFIX}_pending_items", "Items admitted past the caches, not yet packed",
              registry=r).set_function(lambda: admission.pending.in_use)
        Gauge(f"{PREFIX}_decoding_pixels", "Pixels reserved for decoding, all requests together",
              registry=r).set_function(lambda: admission.decoding.in_use)
        Gauge(f"{PREFIX}_prepared_patches", "Patches reserved for prepared items not yet encoded",
              registry=r).set_function(lambda: admission.prepared.in_use)
        Gauge(f"{PREFIX}_inflight_requests", "Requests being served", registry=r).set_function(inflight)
        Gauge(f"{PREFIX}_queue_depth", "Items waiting for the device", registry=r).set_function(queued)
        for collector in (_CacheCollector(alias, body), _CertificateCollector(certificates)):
            r.register(collector)

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
        def get(name: str, labels: dict[str, str] | None = None) -> float:
            return self.own.get_sample_value(f"{PREFIX}_{name}", labels or {}) or 0.0

        capacity = self.capacity.patches_per_second
        return {
            "forward_seconds": get("forward_seconds_total"),
            "patches_admitted": get("patches_admitted_total"),
            "patches_encoded": get("patches_encoded_total"),
            "rejected": {reason: get("rejected_total", {"reason": reason}) for reason in ("overloaded", "draining")},
            "queue_depth": int(get("queue_depth")),
            "queue_wait_buckets": [[le, get("queue_wait_seconds_bucket", {"le": _le(le)})]
                                   for le in (*_BUCKETS, math.inf)],
            "capacity_pps": None if math.isnan(capacity) else capacity,
            "draining": draining,
        }
