"""Every metric family the package exports, from the real exporters (nothing started): an encode
worker's `ServiceMetrics` over real caches and admission, the frontend's processor registry, the
encode planner's `PlannerMetrics`, and the cache tiers' families as nginx serves them (declared in
`cache_tiers/metrics.py`; tests/test_cache_tiers.py holds a real tier's /metrics to them). What
tests/test_metrics_doc.py holds docs/observability.md's table to, and tests/test_dashboard.py the
dashboard's queries."""

from __future__ import annotations

from dataclasses import dataclass

from mm_encoder.cache_tiers.metrics import FAMILIES as TIER_FAMILIES
from mm_encoder.core.prom import Source, exposed_name
from mm_encoder.core.spec import MediaLimits
from mm_encoder.encode_worker.admission import Admission
from mm_encoder.encode_worker.caches import AliasCache, BodyCache
from mm_encoder.encode_worker.metrics import ServiceMetrics
from mm_encoder.frontend.metrics import registry as frontend_registry
from mm_encoder.planner.service import PlannerMetrics


@dataclass(frozen=True)
class Family:
    name: str  # as queried: a counter's with `_total`
    type: str  # counter, gauge, histogram
    help: str
    labels: frozenset[str]  # the labels its samples carry (none when it has no sample yet)
    exporter: str  # worker, frontend, planner, tier

    @property
    def deprecated(self) -> bool:
        return self.help.startswith("DEPRECATED")


def service_metrics() -> ServiceMetrics:
    admission = Admission(max_receiving_bytes=1 << 20, max_pending=4, retry_after_s=1, limits=MediaLimits())
    m = ServiceMetrics(AliasCache(8, 60), BodyCache(1 << 20), admission, inflight=lambda: 0, queued=lambda: 0,
                       certificates=lambda: {"http": 3600.0})
    # one sample of every labelled family, so its labels show
    m.served("http", "forward", {"total": 1.0}, 10)
    m.refused("http", "overloaded")
    m.coalesced.labels("fetch").inc()
    return m


def _families(source: Source, exporter: str) -> list[Family]:
    return [Family(exposed_name(f), f.type, f.documentation,
                   frozenset(k for s in f.samples for k in s.labels if k not in ("le", "quantile")), exporter)
            for f in source.collect()]


def exported() -> dict[str, Family]:
    planner = PlannerMetrics()
    planner.replicas.labels("wanted").set(1)
    planner.decisions.labels("hold").inc()
    planner.dropped.labels("invalid").inc()
    snap = {"model": "m", "requests": 1, "media_items": 1, "encoder_calls": 1, "encoder_fallbacks": 0,
            "encoder_body_bytes": 0, "errors": {"overloaded": 1}, "routed": {"1": 1}, "media_requests_in_flight": 0}
    found = [*_families(service_metrics().registry, "worker"),
             *_families(frontend_registry(lambda: [snap]), "frontend"), *_families(planner.registry, "planner"),
             *(Family(f.name, f.type, f.help, frozenset({"tier", *f.labels}), "tier") for f in TIER_FAMILIES)]
    out = {f.name: f for f in found}
    assert len(out) == len(found), "two exporters export one name"
    return out
