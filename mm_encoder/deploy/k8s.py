"""`mm-encoder render-k8s GRAPH`: the graph's plan (plan.py) as Kubernetes objects.

    mm-encoder render-k8s graphs/epd.yaml -o epd.k8s.yaml && kubectl apply -n NS -f epd.k8s.yaml

One `DynamoGraphDeployment` for the frontend, encoders and engines; a `Service` per encoder for
the tiers to reach its HTTP API; the nginx tiers as StatefulSet (shared) and Deployments (router,
cluster). Every component's command line comes from the plan, on a `K8sSite` (fixed ports,
Service DNS names, volumes under /models and /cache). What each object is for and why:
docs/kubernetes.md.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_settings import SettingsError

from ..core.errors import GraphError
from .cache_tiers import parse_args as parse_tier_args
from .graph import Component, Graph, Kind, load_graph
from .k8s_site import (
    CACHE_DIR,
    ENCODER_PORT,
    FRONTEND_PORT,
    LLM_DIR,
    RUN_DIR,
    TIER_PORT,
    VISION_DIR,
    K8sNames,
    K8sSite,
    pascal,  # noqa: F401 (re-exported: how service names are spelled, for callers of render)
)
from .plan import MODULES, ComponentPlan, GeneratedLLM, plan

API_VERSION = "nvidia.com/v1alpha1"
DGD_KIND = "DynamoGraphDeployment"
UID = 101  # the image's user (docker/Dockerfile)
NOTE = "mm-encoder/note"
PART_OF = "mm-encoder"
# The operator's component types: the frontend gets a Service and probes on 8000; workers are
# found through discovery and probed on their system port (docs/kubernetes.md).
COMPONENT_TYPES: dict[Kind, str] = {"frontend": "frontend", "encoder": "worker", "engine": "worker"}

_SIZE = re.compile(r"^([0-9]+)([kmgKMG]?)$")
_MI = 1 << 20
_GI = 1 << 30


# --- small helpers ---------------------------------------------------------------------------

def _env(values: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": k, "value": str(v)} for k, v in values.items()]


def _size_bytes(value: str) -> int:
    """An nginx size TierConfig has validated (512k, 64m, 2g) in bytes."""
    m = _SIZE.match(value)
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": _MI, "g": _GI}[m.group(2).lower()]


def _quantity(n_bytes: int) -> str:
    mi = math.ceil(n_bytes / _MI)
    return f"{mi // 1024}Gi" if mi % 1024 == 0 else f"{mi}Mi"


def _dynamo_resources(resources: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Kubernetes resource names -> the DynamoGraphDeployment's `resources` (cpu, memory, gpu, custom)."""
    out: dict[str, Any] = {}
    for section in ("requests", "limits"):
        items: dict[str, Any] = {}
        for key, value in resources.get(section, {}).items():
            if key in ("cpu", "memory"):
                items[key] = str(value)
            elif key == "nvidia.com/gpu":
                items["gpu"] = str(value)
            else:
                items.setdefault("custom", {})[key] = str(value)
        if items:
            out[section] = items
    unknown = set(resources) - {"requests", "limits"}
    if unknown:
        raise GraphError(f"resources: only requests and limits are supported, not {sorted(unknown)}")
    return out


def _argv(cp: ComponentPlan) -> list[str]:
    """The one command line of a component's pods (on this site every replica has the same)."""
    argvs = {r.argv for r in cp.replicas}
    assert len(argvs) == 1, f"{cp.name}: replicas differ on Kubernetes"
    return list(argvs.pop())


def _labels(g: Graph, component: str, kind: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": f"{g.name}-{component}", "app.kubernetes.io/instance": g.name,
            "app.kubernetes.io/component": kind, "app.kubernetes.io/part-of": PART_OF,
            "mm-encoder/graph": g.name, "mm-encoder/component": component}


def _pod_labels(g: Graph, component: str) -> dict[str, str]:
    """Labels for the operator's pods: ours only (the app.kubernetes.io/* ones may be the operator's to set)."""
    return {"mm-encoder/graph": g.name, "mm-encoder/component": component, "app.kubernetes.io/part-of": PART_OF}


def _selector(g: Graph, component: str) -> dict[str, str]:
    return {"mm-encoder/graph": g.name, "mm-encoder/component": component}


def _security_context() -> dict[str, Any]:
    """The image's user; fsGroup makes mounted volumes writable for it."""
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID}


# --- the DynamoGraphDeployment ---------------------------------------------------------------

class _Storage:
    """Volumes of one Dynamo pod: the LLM directory and the vision checkpoint."""

    def __init__(self, names: K8sNames, uses: frozenset[str], image: str):
        self.pvc_mounts: list[dict[str, str]] = []  # the service's `volumeMounts` (operator-made PVC volumes)
        self.volumes: list[dict[str, Any]] = []
        self.mounts: list[dict[str, Any]] = []
        self.init: list[dict[str, Any]] = []
        generated = GeneratedLLM.of(names.g)
        if "llm" in uses and names.llm_pvc:
            self.pvc_mounts.append({"name": names.llm_pvc, "mountPoint": LLM_DIR})
        elif "llm" in uses:  # the test LLM, written by the same call as `mm-encoder serve` makes
            self.volumes.append({"name": "llm", "emptyDir": {}})
            self.mounts.append({"name": "llm", "mountPath": LLM_DIR})
            self.init.append({
                "name": "make-llm-dir", "image": image,
                "command": ["python", "-m", MODULES["engine"], *generated.argv(LLM_DIR)],
                "volumeMounts": [{"name": "llm", "mountPath": LLM_DIR}],
            })
        if "vision" in uses and names.vision_pvc:
            self.pvc_mounts.append({"name": names.vision_pvc, "mountPoint": VISION_DIR})


def _dynamo_service(names: K8sNames, cp: ComponentPlan) -> dict[str, Any]:
    c, image = cp.component, cp.component.image or names.g.image
    storage = _Storage(names, cp.uses, image)
    spec: dict[str, Any] = {"componentType": COMPONENT_TYPES[cp.kind], "replicas": c.replicas}
    if c.resources:
        spec["resources"] = _dynamo_resources(c.resources)
    if storage.pvc_mounts:
        spec["volumeMounts"] = storage.pvc_mounts
    spec["extraPodMetadata"] = {"labels": _pod_labels(names.g, cp.name)}
    container: dict[str, Any] = {
        "image": image,
        "command": ["python", "-m", cp.module],
        "args": _argv(cp),
        "env": _env(cp.env),
    }
    if storage.mounts:
        container["volumeMounts"] = storage.mounts
    pod: dict[str, Any] = {"securityContext": _security_context()}
    if storage.init:
        pod["initContainers"] = storage.init
    if storage.volumes:
        pod["volumes"] = storage.volumes
    pod["mainContainer"] = container
    spec["extraPodSpec"] = pod
    return spec


def _graph_deployment(names: K8sNames, components: list[ComponentPlan]) -> dict[str, Any]:
    g, llm = names.g, names.g.llm
    services = {names.services[cp.name]: _dynamo_service(names, cp) for cp in components if cp.kind in COMPONENT_TYPES}
    llm_note = (f"the PersistentVolumeClaim {names.llm_pvc} must hold the LLM directory (llm.model_dir "
                f"{llm.model_dir}), mounted at {LLM_DIR}" if names.llm_pvc else
                f"an init container writes the generated test LLM for {llm.vision_model} to {LLM_DIR}")
    note = (f"Generated by mm-encoder render-k8s from graph {g.name}. Dynamo namespace {g.namespace} "
            f"(DYN_NAMESPACE set on every component); the frontend listens on {FRONTEND_PORT}, the port of the "
            f"operator's frontend Service (the graph's frontend_port {g.frontend_port} is for mm-encoder serve); "
            f"{llm_note}.")
    if names.encoder_svc:
        note += (" Encoder pods carry the labels mm-encoder/graph and mm-encoder/component (extraPodMetadata) that "
                 f"their Services {', '.join(names.encoder_svc.values())} select.")
    spec: dict[str, Any] = {}
    pvcs = [p for p in (names.llm_pvc, names.vision_pvc) if p]
    if pvcs:
        spec["pvcs"] = [{"name": p, "create": False} for p in pvcs]
    spec["services"] = services
    return {
        "apiVersion": API_VERSION,
        "kind": DGD_KIND,
        "metadata": {"name": g.name, "labels": {"app.kubernetes.io/part-of": PART_OF, "mm-encoder/graph": g.name},
                     "annotations": {NOTE: note}},
        "spec": spec,
    }


def _encoder_services(names: K8sNames) -> list[dict[str, Any]]:
    g = names.g
    out = []
    for cname, svc in names.encoder_svc.items():
        out.append({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": svc,
                "labels": {**_labels(g, cname, "encoder"), "app.kubernetes.io/name": svc},
                "annotations": {NOTE: (
                    f"Selects the pods of DynamoGraphDeployment {g.name} service {names.services[cname]} by the labels "
                    "its extraPodMetadata sets. Should an operator not apply extraPodMetadata, select "
                    f"nvidia.com/dynamo-graph-deployment-name: {g.name} and nvidia.com/dynamo-component: "
                    f"{names.services[cname]} instead.")},
            },
            "spec": {
                "selector": _selector(g, cname),
                "ports": [{"name": "http", "port": ENCODER_PORT, "targetPort": ENCODER_PORT, "protocol": "TCP"}],
            },
        })
    return out


# --- the nginx tiers -------------------------------------------------------------------------

def _tier_memory(max_size: int, keys_zone: int, c: Component) -> tuple[str, dict[str, Any]]:
    """tmpfs sizeLimit above --max-size, and memory that counts the tmpfs (it is charged to the pod)."""
    size_limit = max_size + max(max_size // 8, 256 * _MI)
    if c.resources:
        return _quantity(size_limit), dict(c.resources)
    request = size_limit + keys_zone + 256 * _MI
    limit = request + max(size_limit // 4, _GI)
    return _quantity(size_limit), {"requests": {"cpu": "1", "memory": _quantity(request)},
                                   "limits": {"memory": _quantity(limit)}}


def _tier_pod(names: K8sNames, cp: ComponentPlan, resources: dict[str, Any], cache_size_limit: str | None) -> dict:
    def probe(period: int) -> dict[str, Any]:
        return {"httpGet": {"path": cp.health_path, "port": "http"}, "periodSeconds": period, "failureThreshold": 3}

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
        "args": _argv(cp),
        "ports": [{"name": "http", "containerPort": TIER_PORT, "protocol": "TCP"}],
        "readinessProbe": probe(5),
        "livenessProbe": probe(10),
        "resources": resources,
        "volumeMounts": mounts,
    }
    if c.env:
        container["env"] = _env(c.env)
    return {
        "metadata": {"labels": _labels(names.g, cp.name, c.kind)},
        "spec": {"securityContext": _security_context(), "containers": [container], "volumes": volumes},
    }


def _service(g: Graph, cname: str, kind: str, name: str, headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if headless:
        spec["clusterIP"] = "None"  # per-pod DNS names <pod>.<service>
        spec["publishNotReadyAddresses"] = True  # nginx resolves its upstreams once, when it starts
    spec["selector"] = _selector(g, cname)
    spec["ports"] = [{"name": "http", "port": TIER_PORT, "targetPort": "http", "protocol": "TCP"}]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "labels": _labels(g, cname, kind)}, "spec": spec}


def _tiers(names: K8sNames, components: list[ComponentPlan]) -> list[dict[str, Any]]:
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
            out.append(_deployment(g, cp.name, c, name, _tier_pod(names, cp, resources, None)))
            continue
        try:  # the sizes nginx will use: the graph's, else TierConfig's
            _, cfg = parse_tier_args(_argv(cp))
        except (ValidationError, SettingsError) as e:
            raise GraphError(f"components.{cp.name}.args: {e}") from None
        size_limit, resources = _tier_memory(_size_bytes(cfg.max_size), _size_bytes(cfg.keys_zone), c)
        template = _tier_pod(names, cp, resources, size_limit)
        if cp.kind == "cache-cluster":
            out.append(_service(g, cp.name, c.kind, name))
            out.append(_deployment(g, cp.name, c, name, template))
            continue
        out.append(_service(g, cp.name, c.kind, name, headless=True))
        out.append({
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": name, "labels": _labels(g, cp.name, c.kind)},
            "spec": {
                "serviceName": name,
                "replicas": c.replicas,
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": _selector(g, cp.name)},
                "template": template,
            },
        })
    return out


def _deployment(g: Graph, cname: str, c: Component, name: str, template: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": _labels(g, cname, c.kind)},
        "spec": {"replicas": c.replicas, "selector": {"matchLabels": _selector(g, cname)}, "template": template},
    }


# --- entry points ----------------------------------------------------------------------------

def _check_components(g: Graph) -> None:
    """What Kubernetes would refuse in a component's `resources` and `env`, refused here by path."""
    for n, c in g.components.items():
        if c.resources:
            _dynamo_resources(c.resources)  # fail early on unknown sections
        for key in c.env:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_.-]*$", key):
                raise GraphError(f"components.{n}.env: {key!r} is not a valid environment variable name")


def render(graph: Graph) -> list[dict[str, Any]]:
    """The graph as Kubernetes objects: the DynamoGraphDeployment, the encoders' Services, the tiers."""
    names = K8sNames(graph)
    _check_components(graph)
    components = plan(graph, K8sSite(names))
    objects = [_graph_deployment(names, components), *_encoder_services(names), *_tiers(names, components)]
    return json.loads(json.dumps(objects))  # plain, unshared data: no YAML anchors, safe to mutate


def render_yaml(graph: Graph) -> str:
    header = (f"# Rendered by `mm-encoder render-k8s` from graph {graph.name}: kubectl apply -n NAMESPACE -f FILE\n"
              "# Needs the NVIDIA Dynamo operator (DynamoGraphDeployment, nvidia.com/v1alpha1).\n")
    return header + yaml.safe_dump_all(render(graph), sort_keys=False, default_flow_style=False, width=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mm-encoder render-k8s",
                                description="render a graph file as Kubernetes objects (a DynamoGraphDeployment "
                                            "plus the nginx cache tiers), multi-document YAML")
    p.add_argument("graph", type=Path, help="graph file, e.g. graphs/epd.yaml")
    p.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        text = render_yaml(load_graph(args.graph))
    except GraphError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        args.output.write_text(text)
    except OSError as e:
        print(f"error: cannot write {args.output}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
