"""The Grafana dashboards the package ships (`encoder-fleet.json`, built by tools/dashboard.py) and
the ConfigMap `render-k8s` wraps them in for Grafana's sidecar (`grafana.py`)."""
