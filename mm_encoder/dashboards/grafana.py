"""The Grafana dashboard the package ships, and the ConfigMap `render-k8s` wraps it in.

`encoder-fleet.json` (beside this module) is built by `tools/dashboard.py` (grafana-foundation-sdk) from
the metrics in docs/observability.md; tests/test_dashboard.py holds every query to a metric the
package exports. kube-prometheus-stack's Grafana sidecar loads every ConfigMap labelled
`grafana_dashboard: "1"` (its default label) as dashboards, one per data key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FLEET = Path(__file__).parent / "encoder-fleet.json"
SIDECAR_LABEL = {"grafana_dashboard": "1"}
DATA_KEY = "mm-encoder-fleet.json"  # one file name, whatever the graph: two graphs' ConfigMaps are one dashboard


def config_map(name: str, labels: dict[str, str]) -> dict[str, Any]:
    """The encoder fleet's dashboard as a ConfigMap for the Grafana sidecar."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "labels": {**labels, **SIDECAR_LABEL}},
            "data": {DATA_KEY: FLEET.read_text()}}
