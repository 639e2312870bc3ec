"""Prometheus metrics of the frontend's processors, appended to Dynamo's system `/metrics`
(set DYN_SYSTEM_PORT): Dynamo owns the HTTP metrics (`dynamo_frontend_*`); these add what only the
processor knows, as `dynamo_frontend_multimodal_*` (docs/observability.md has the table). 0.2's
`mm_frontend_*` names are emitted too until 0.4 (`core.deprecated_metrics`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..core import deprecated_metrics

PREFIX = "dynamo_frontend_multimodal"


class _ProcessorCollector(Collector):
    def __init__(self, snapshots: Callable[[], Iterable[dict[str, Any]]]) -> None:
        self.snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        snaps = list(self.snapshots())
        simple = (
            ("requests", "Chat requests seen by the multimodal processor"),
            ("media_items", "Media items in those requests"),
            ("encoder_calls", "Calls to the encoder (one per media item)"),
            ("encoder_fallbacks", "Calls that fell back from the cache chain to direct RPC"),
            ("encoder_body_bytes", "Embedding bytes received from the encoders (0: handles only)"),
        )
        for key, doc in simple:
            c = CounterMetricFamily(f"{PREFIX}_{key}", doc, labels=["model"])
            for s in snaps:
                c.add_metric([s["model"]], s[key])
            yield c
        errors = CounterMetricFamily(f"{PREFIX}_errors", "Refused or failed requests by code",
                                     labels=["model", "code"])
        routed = CounterMetricFamily(f"{PREFIX}_routed", "Requests routed per engine instance",
                                     labels=["model", "worker"])
        live = GaugeMetricFamily(f"{PREFIX}_media_requests_in_flight",
                                 "Requests with media between encoding and the engine's first token",
                                 labels=["model"])
        for s in snaps:
            for code, n in s["errors"].items():
                errors.add_metric([s["model"], code], n)
            for worker, n in s["routed"].items():
                routed.add_metric([s["model"], worker], n)
            live.add_metric([s["model"]], s["media_requests_in_flight"])
        yield errors
        yield routed
        yield live


def exposition(snapshots: Callable[[], Iterable[dict[str, Any]]]) -> Callable[[], str]:
    """A zero-argument callback for `endpoint.metrics.register_prometheus_expfmt_callback`."""
    processors = registry(snapshots)
    return lambda: generate_latest(processors).decode()


def registry(snapshots: Callable[[], Iterable[dict[str, Any]]]) -> CollectorRegistry:
    """The processors' metrics, and under 0.2's names until 0.4."""
    out = CollectorRegistry(auto_describe=False)
    processors = _ProcessorCollector(snapshots)
    out.register(processors)
    out.register(deprecated_metrics.DeprecatedAliases(processors, deprecated_metrics.FRONTEND))
    return out
