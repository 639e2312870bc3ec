"""The encoder fleet's Grafana dashboard (mm_encoder/dashboards/encoder-fleet.json): what
tools/dashboard.py builds with grafana-foundation-sdk, a well-formed Grafana dashboard, and every
query names a metric the package really exports (harness/metric_exports.py)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.metric_exports import exported
from mm_encoder.dashboards.grafana import FLEET

ROOT = Path(__file__).resolve().parents[1]
PROMQL_WORDS = {"sum", "rate", "histogram_quantile", "label_values", "clamp_min", "max", "min", "avg", "count",
                "increase", "irate", "and", "or", "unless", "offset", "bool"}
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def fleet_dashboard() -> dict:
    """The dashboard the package ships, as JSON."""
    return json.loads(FLEET.read_text())


def panels(d: dict) -> list[dict]:
    return [p for p in d["panels"] if p["type"] != "row"]


def metrics_in(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label matchers, ranges,
    grouping clauses, functions and numbers are taken out."""
    e = re.sub(r'"[^"]*"', "", expr)
    e = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    e = re.sub(r"label_values\(([^,()]+),[^)]*\)", r"\1", e)
    return {w for w in re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", e) if w not in PROMQL_WORDS}


def test_metrics_in_reads_names_not_labels():
    expr = ('histogram_quantile(0.95, sum by (le, stage) (rate(a_seconds_bucket{x=~"$ns",y="z"}[$__rate_interval])))'
            " / sum(b_total) + label_values(c{d=\"e\"}, dynamo_namespace)")
    assert metrics_in(expr) == {"a_seconds_bucket", "b_total", "c"}


@pytest.mark.skipif(importlib.util.find_spec("grafana_foundation_sdk") is None,
                    reason="grafana-foundation-sdk (the dev extra, Python 3.11+) is not installed")
def test_the_committed_json_is_what_the_generator_builds():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "dashboard.py"), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert FLEET.is_file()


def test_it_is_a_well_formed_grafana_dashboard():
    d = fleet_dashboard()
    assert d["title"] and d["uid"] == "mm-encoder-fleet" and isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["namespace"]["type"] == "query" and variables["namespace"]["includeAll"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["x"] + g["w"] <= 24 and g["h"] > 0
        taken = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not taken & cells, f"panel {p['id']} overlaps another"
        cells |= taken
    for p in panels(d):
        assert p["type"] == "timeseries" and p["title"] and p["description"], p["id"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)) and all(refs), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}" and t["expr"] and t["legendFormat"]


def test_the_issue_asks_for_these_panels():
    titles = {p["title"] for p in panels(fleet_dashboard())}
    for wanted in ("Encode requests by outcome", "Latency per stage (p95)", "Hit ratio per cache level",
                   "Encodes per unique image", "Queue wait", "Refusals by reason",
                   "Forward busy fraction per worker", "Bytes moved", "Tier hit ratio per tier",
                   "Tier hit ratio per cluster", "Tier requests per cluster", "Tier upstream errors",
                   "Tier bytes sent"):
        assert wanted in titles


def test_every_query_names_a_metric_the_package_exports():
    families = {n: f for n, f in exported().items() if not f.deprecated}
    d = fleet_dashboard()
    exprs = [t["expr"] for p in panels(d) for t in p["targets"]]
    exprs += [v["query"] for v in d["templating"]["list"] if v["type"] == "query"]
    read: set[str] = set()
    for expr in exprs:
        names = metrics_in(expr)
        assert names, expr
        for name in names:
            base = next((name[: -len(s)] for s in HISTOGRAM_SERIES if name.endswith(s)), None)
            if base is not None and base in families:
                assert families[base].type == "histogram", name
            else:
                assert name in families, f"{name} (in {expr}) is not exported"
            read.add(base if base in families else name)
    assert "$namespace" in "".join(exprs)
    # the worker's queries select its Dynamo labels, as the package writes them
    for expr in exprs:
        if "dynamo_component_encode_" in expr and "{" in expr:
            assert 'dynamo_component="mm_encoder"' in expr, expr
    assert {"dynamo_component_encode_stage_duration_seconds", "dynamo_component_encode_queue_wait_seconds",
            "dynamo_component_embedding_cache_refills_total"} <= read
