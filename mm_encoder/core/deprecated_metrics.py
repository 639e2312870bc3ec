"""The metric names 0.2 exported, kept for one release under their new names' samples.

0.3 names its metrics in Dynamo's conventions (docs/observability.md "Metrics"); an operator's
dashboards and alerts may still read 0.2's `mm_encoder_*` (encode worker) and `mm_frontend_*`
(frontend) names, so both exporters re-emit every renamed family under its old name too, with its
0.2 labels (Dynamo's labels left off, as 0.2 had them) and "DEPRECATED" in its HELP text.
Removed in 0.4.0 (CHANGELOG.md): delete this module and the two `DeprecatedAliases` lines that
use it (encode_worker/metrics.py, frontend/metrics.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from .prom import Source, exposed_name

REMOVED_IN = "0.4.0"

# new family -> 0.2's family (families as prometheus_client names them: a counter without `_total`)
WORKER: Mapping[str, str] = {
    "dynamo_component_encode_requests": "mm_encoder_requests",
    "dynamo_component_encode_served_from": "mm_encoder_served_from",
    "dynamo_component_encode_stage_duration_seconds": "mm_encoder_stage_seconds",
    "dynamo_component_encode_fetches": "mm_encoder_fetches",
    "dynamo_component_encode_fetch_bytes": "mm_encoder_fetch_bytes",
    "dynamo_component_encode_forwards": "mm_encoder_forwards",
    "dynamo_component_encode_forward_items": "mm_encoder_forward_items",
    "dynamo_component_encode_batch_patches": "mm_encoder_batch_patches",
    "dynamo_component_encode_coalesced": "mm_encoder_coalesced",
    "dynamo_component_encode_rejected": "mm_encoder_rejected",
    "dynamo_component_encode_response_bytes": "mm_encoder_response_bytes",
    "dynamo_component_encode_pending_items": "mm_encoder_pending",
    "dynamo_component_encode_decoding_pixels": "mm_encoder_decoding_pixels",
    "dynamo_component_encode_prepared_patches": "mm_encoder_prepared_patches",
    "dynamo_component_encode_inflight_requests": "mm_encoder_inflight",
    "dynamo_component_encode_queue_depth": "mm_encoder_queue_depth",
    "dynamo_component_embedding_cache_hits": "mm_encoder_cache_hits",
    "dynamo_component_embedding_cache_misses": "mm_encoder_cache_misses",
    "dynamo_component_embedding_cache_evictions": "mm_encoder_cache_evictions",
    "dynamo_component_embedding_cache_expirations": "mm_encoder_cache_expirations",
    "dynamo_component_embedding_cache_entries": "mm_encoder_cache_entries",
    "dynamo_component_embedding_cache_current_bytes": "mm_encoder_cache_bytes",
}
FRONTEND: Mapping[str, str] = {
    "dynamo_frontend_multimodal_requests": "mm_frontend_requests",
    "dynamo_frontend_multimodal_media_items": "mm_frontend_media_items",
    "dynamo_frontend_multimodal_encoder_calls": "mm_frontend_encoder_calls",
    "dynamo_frontend_multimodal_encoder_fallbacks": "mm_frontend_encoder_fallbacks",
    "dynamo_frontend_multimodal_encoder_body_bytes": "mm_frontend_encoder_body_bytes",
    "dynamo_frontend_multimodal_errors": "mm_frontend_errors",
    "dynamo_frontend_multimodal_routed": "mm_frontend_routed",
    "dynamo_frontend_multimodal_media_requests_in_flight": "mm_frontend_media_requests_in_flight",
}


class DeprecatedAliases(Collector):
    """Each of `source`'s families that `names` maps, again under its old name (same samples and
    labels: `source` is the registry before any `WithLabels`)."""

    def __init__(self, source: Source, names: Mapping[str, str]):
        self.source, self.names = source, names

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            old = self.names.get(family.name)
            if old is None:
                continue
            doc = f"DEPRECATED, removed in {REMOVED_IN}: use {exposed_name(family)}. {family.documentation}"
            out = Metric(old, doc, family.type, family.unit)
            out.samples = [s._replace(name=old + s.name[len(family.name):]) for s in family.samples]
            yield out
