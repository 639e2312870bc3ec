"""Prometheus helpers every process's metrics share (docs/observability.md "Metrics").

Metrics are written with their own labels only; the labels that say where they come from (Dynamo's
`dynamo_namespace`, `dynamo_component`, `dynamo_endpoint`, `worker_type`) are added to every sample
when the registry is collected (`WithLabels`), so no call site repeats them and Dynamo's
`/metrics` (which appends our exposition as it is) carries them as its own metrics do.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client.core import Metric
from prometheus_client.registry import Collector


class Source(Protocol):
    """Anything that collects metric families: a `CollectorRegistry` or a `Collector`."""

    def collect(self) -> Iterable[Metric]: ...


class WithLabels(Collector):
    """`source`'s families with `labels` added to every sample (a sample's own label wins a clash)."""

    def __init__(self, source: Source, labels: Mapping[str, str]):
        self.source, self.labels = source, dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**self.labels, **s.labels}) for s in family.samples]
            yield out


def exposed_name(family: Metric) -> str:
    """The name a family's samples are queried by: a counter's with `_total`, else the family's own
    (a histogram's `_bucket`, `_sum` and `_count` hang off it)."""
    return f"{family.name}_total" if family.type == "counter" else family.name
