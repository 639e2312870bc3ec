"""The graph's nginx tiers on Kubernetes: the shared tier's shards as a StatefulSet behind a headless
Service (stable pod names the router hashes over), the router and the cluster tier as Deployments
behind Services; each cache on a memory-backed volume sized above its `--max-size`; their /metrics where
the encoders' is, for one PodMonitor (port `mm-http`, or `mm-ops` with TLS)."""

from __future__ import annotations

import math
import re
from typing import Any

from ..graph.planned import ComponentPlan
from ..graph.schema import Component, Graph
from . import availability, tls
from .names import (
    CACHE_DIR,
    NOTE,
    RUN_DIR,
    TIER_PORT,
    K8sNames,
    argv_of,
    env_list,
    labels,
    security_context,
    selector,
)

# The encoders' name for the port that serves /metrics without TLS: one PodMonitor endpoint scrapes both
# (docs/kubernetes.md); with TLS both serve it on the plaintext ops port, `mm-ops` (tls.py).
HTTP_PORT_NAME = "mm-http"
_SIZE = re.compile(r"^([0-9]+)([kmgKMG]?)$")
_MI = 1 << 20
_GI = 1 << 30


def _size_bytes(value: str) -> int:
    """An nginx size TierConfig has validated (512k, 64m, 2g) in bytes."""
    m = _SIZE.match(value)
    if m is None:
        raise ValueError(f"{value!r} is not an nginx size")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": _MI, "g": _GI}[m.group(2).lower()]


def _quantity(n_bytes: int) -> str:
    mi = math.ceil(n_bytes / _MI)
    return f"{mi // 1024}Gi" if mi % 1024 == 0 else f"{mi}Mi"


def _tier_memory(max_size: int, keys_zone: int, c: Component) -> tuple[str, dict[str, Any]]:
    """tmpfs sizeLimit above --max-size, and memory that counts the tmpfs (it is charged to the pod)."""
    size_limit = max_size + max(max_size // 8, 256 * _MI)
    if c.resources:
        return _quantity(size_limit), dict(c.resources)
    request = size_limit + keys_zone + 256 * _MI
    limit = request + max(size_limit // 4, _GI)
    return _quantity(size_limit), {"requests": {"cpu": "1", "memory": _quantity(request)},
                                   "limits": {"memory": _quantity(limit)}}


def _tier_pod(names: K8sNames, cp: ComponentPlan, resources: dict[str, Any],
              cache_size_limit: str | None) -> dict[str, Any]:
    def probe(period: int) -> dict[str, Any]:
        return {"httpGet": {"path": cp.health_path, "port": HTTP_PORT_NAME}, "periodSeconds": period,
                "failureThreshold": 3}

    c = cp.component
    mounts = [{"name": "run", "mountPath": RUN_DIR}]
    volumes: list[dict[str, Any]] = [{"name": "run", "emptyDir": {}}]
    if cache_size_limit:
        mounts.insert(0, {"name": "cache", "mountPath": CACHE_DIR})
        volumes.insert(0, {"name": "cache", "emptyDir": {"medium": "Memory", "sizeLimit": cache_size_limit}})
    container: dict[str, Any] = {
        "name": "nginx",
        "image": c.image or names.g.image,
        "command": ["python", "-m", cp.module],
        "args": argv_of(cp),
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": TIER_PORT, "protocol": "TCP"}],
        "readinessProbe": probe(5),
        "livenessProbe": probe(10),
        "resources": resources,
        "volumeMounts": mounts,
    }
    if c.env:
        container["env"] = env_list(c.env)
    spec = {"securityContext": security_context(), "containers": [container], "volumes": volumes}
    tls.add_to_pod(names, cp, container, spec)  # with TLS: its Secret, and its probes on the ops port
    availability.add_to_pod(names.g, cp, container, spec)  # a graceful stop (QUIT), its spread over nodes
    return {"metadata": {"labels": labels(names.g, cp.name, c.kind)}, "spec": spec}


def _service(g: Graph, cname: str, kind: str, name: str, headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if headless:
        spec["clusterIP"] = "None"  # per-pod DNS names <pod>.<service>
        spec["publishNotReadyAddresses"] = True  # nginx resolves its upstreams once, when it starts
    spec["selector"] = selector(g, cname)
    spec["ports"] = [{"name": "http", "port": TIER_PORT, "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "labels": labels(g, cname, kind)}, "spec": spec}


def tier_objects(names: K8sNames, components: list[ComponentPlan]) -> list[dict[str, Any]]:
    g = names.g
    out: list[dict[str, Any]] = []
    for cp in components:
        c, name = cp.component, names.tiers.get(cp.name)
        if name is None:
            continue
        if cp.kind == "cache-router":
            resources = dict(c.resources) or {"requests": {"cpu": "500m", "memory": "128Mi"},
                                              "limits": {"memory": "512Mi"}}
            out.append(_service(g, cp.name, c.kind, name))
            out.append(_deployment(g, cp, name, _tier_pod(names, cp, resources, None)))
            continue
        cfg = cp.replicas[0].tier  # the sizes nginx will use: the graph's, else TierConfig's
        assert cfg is not None
        size_limit, resources = _tier_memory(_size_bytes(cfg.max_size), _size_bytes(cfg.keys_zone), c)
        template = _tier_pod(names, cp, resources, size_limit)
        if cp.kind == "cache-cluster":
            out.append(_service(g, cp.name, c.kind, name))
            out.append(_deployment(g, cp, name, template))
            continue
        out.append(_service(g, cp.name, c.kind, name, headless=True))
        out.append({
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": name, "labels": labels(g, cp.name, c.kind)},
            "spec": {
                "serviceName": name,
                "replicas": c.replicas,
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": selector(g, cp.name)},
                "template": template,
            },
        })
    return out


def _deployment(g: Graph, cp: ComponentPlan, name: str, template: dict[str, Any]) -> dict[str, Any]:
    """The router or the cluster tier: at least two replicas (the note says when the graph's were raised),
    and a rollout that starts a new pod before it stops an old one."""
    replicas = availability.tier_replicas(cp)
    meta: dict[str, Any] = {"name": name, "labels": labels(g, cp.name, cp.kind)}
    if replicas != cp.component.replicas:
        meta["annotations"] = {NOTE: f"replicas raised from the graph's {cp.component.replicas} to {replicas}: "
                                     "every request passes this tier, so one pod lost is not an outage"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {"replicas": replicas, "selector": {"matchLabels": selector(g, cp.name)},
                 "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                 "template": template},
    }


