"""Prometheus metrics of the frontend's processors, appended to Dynamo's system `/metrics`
(set DYN_SYSTEM_PORT): Dynamo owns the HTTP metrics; these add what only the processor knows."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


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
            c = CounterMetricFamily(f"mm_frontend_{key}", doc, labels=["model"])
            for s in snaps:
                c.add_metric([s["model"]], s[key])
            yield c
        errors = CounterMetricFamily("mm_frontend_errors", "Refused or failed requests by code",
                                     labels=["model", "code"])
        routed = CounterMetricFamily("mm_frontend_routed", "Requests routed per engine instance",
                                     labels=["model", "worker"])
        live = GaugeMetricFamily("mm_frontend_media_requests_in_flight",
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
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ProcessorCollector(snapshots))
    return lambda: generate_latest(registry).decode()
