"""docs/observability.md "Metrics" is the table of every metric the package exports: held here to
the real exporters (harness/metric_exports.py), names, types and labels; and 0.2's names are still
emitted, under the new names' samples, until 0.4."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.metric_exports import exported, service_metrics
from mm_encoder.core import deprecated_metrics
from mm_encoder.frontend.metrics import registry as frontend_registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "observability.md"
DYNAMO = {"worker": {"dynamo_namespace", "dynamo_component", "dynamo_endpoint", "worker_type"},
          "planner": {"dynamo_namespace", "dynamo_component"}, "frontend": set(), "tier": set()}


def section() -> str:
    text = DOC.read_text()
    start = text.index("\n## Metrics\n")
    end = text.find("\n## ", start + 1)
    return text[start: end if end >= 0 else None]


def rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| `")]


def names_in(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


@pytest.fixture(scope="module")
def families():
    return exported()


def test_the_table_lists_exactly_what_the_exporters_export(families):
    main, _, deprecated = section().partition("### 0.2's names")
    table = {names_in(r[0])[0]: r for r in rows(main)}
    current = {n: f for n, f in families.items() if not f.deprecated}
    assert set(table) == set(current), (set(table) ^ set(current))
    for name, (_, typ, _unit, labels, meaning, readers) in table.items():
        f = current[name]
        assert typ == f.type, name
        assert set(names_in(labels)) == set(f.labels) - DYNAMO[f.exporter], name
        assert meaning and readers, name
    aliases = {names_in(r[0])[0]: names_in(r[1])[0] for r in rows(deprecated.split("###")[0])}
    assert set(aliases) == {n for n, f in families.items() if f.deprecated}
    assert set(aliases.values()) <= set(current)


def test_names_follow_dynamos_conventions(families):
    for name, f in families.items():
        if f.deprecated:
            continue
        assert name.startswith(("dynamo_component_", "dynamo_frontend_", "dynamo_planner_")), name
        assert name.endswith("_total") == (f.type == "counter"), name
        assert "_ms" not in name and "milliseconds" not in name, name
        assert DYNAMO[f.exporter] <= f.labels, name


def test_the_deprecated_names_carry_the_new_samples_with_the_old_labels():
    """0.2's names, emitted until 0.4: the same values as the new names, 0.2's label sets (no Dynamo
    labels), DEPRECATED in their HELP text naming the new name."""
    m = service_metrics()
    m.fetch_bytes.inc(123)
    text = m.render().decode()
    assert "# HELP mm_encoder_fetch_bytes_total DEPRECATED, removed in 0.4.0: use " \
           "dynamo_component_encode_fetch_bytes_total." in text
    assert "mm_encoder_fetch_bytes_total 123.0" in text
    assert 'mm_encoder_requests_total{outcome="ok",transport="http"} 1.0' in text
    assert 'mm_encoder_stage_seconds_count{stage="total"} 1.0' in text
    assert 'mm_encoder_cache_bytes{level="mm_hash"} 0.0' in text
    ok = {"transport": "http", "outcome": "ok"}
    old_name = m.registry.get_sample_value("mm_encoder_requests_total", ok)  # the alias, as /metrics shows it
    assert old_name == m.own.get_sample_value("dynamo_component_encode_requests_total", ok) == 1
    snap = {"model": "m", "requests": 3, "media_items": 2, "encoder_calls": 2, "encoder_fallbacks": 1,
            "encoder_body_bytes": 0, "errors": {}, "routed": {}, "media_requests_in_flight": 1}
    reg = frontend_registry(lambda: [snap])
    for new, old in deprecated_metrics.FRONTEND.items():
        suffix = "" if new.endswith("in_flight") else "_total"
        assert reg.get_sample_value(old + suffix, {"model": "m"}) == reg.get_sample_value(new + suffix,
                                                                                          {"model": "m"}), old
