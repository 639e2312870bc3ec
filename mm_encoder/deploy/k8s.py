"""`mm-encoder render-k8s GRAPH`: the graph's plan (plan.py) as Kubernetes objects.

    mm-encoder render-k8s graphs/epd.yaml -o epd.k8s.yaml && kubectl apply -n NS -f epd.k8s.yaml

One `DynamoGraphDeployment` (nvidia.com/v1beta1: `spec.components[]`, each with a native pod template)
for the frontend, encoders, engines and encode planner; a `Service` per encoder for the tiers to reach
its HTTP API; with a planner, the Role and RoleBinding its connector needs; the nginx tiers as
StatefulSet (shared) and Deployments (router, cluster); the encoders' Grafana dashboard as a ConfigMap
(grafana.py); with the graph's `tls`, each component's Secret mounted, cert-manager Certificates and
NetworkPolicies (k8s_tls.py). Every component's command line comes from the plan, on a `K8sSite` (fixed
ports, Service DNS names, volumes under /models and /cache). What each object is for and why: docs/kubernetes.md.
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
from ..runtime import tracing
from . import grafana, k8s_tls
from .cache_tiers import parse_args as parse_tier_args
from .graph import Component, Graph, Kind, find_graph, load_graph
from .k8s_site import (
    CACHE_DIR,
    ENCODER_PORT,
    FRONTEND_PORT,
    MODEL_DIR,
    PART_OF,
    PLANNER_PORT,
    PLANNER_SERVICE_ACCOUNT,
    RUN_DIR,
    TIER_PORT,
    K8sNames,
    K8sSite,
    check_planner_types,
    connector_rules,
    labels,
    selector,
)
from .plan import ComponentPlan, GeneratedCheckpoint, plan

API_VERSION = "nvidia.com/v1beta1"  # v1alpha1 (spec.services) is deprecated since Dynamo 1.5
DGD_KIND = "DynamoGraphDeployment"
DYNAMO_VERSION = "1.6.1"  # the ai-dynamo runtime in the image (pyproject, Makefile)
MAIN_CONTAINER = "main"  # the container the operator injects its defaults into
UID = 101  # the image's user (docker/Dockerfile)
NOTE = "mm-encoder/note"
# v1beta1 `type` (frontend, worker, prefill, decode, planner, epp; no encode type): the frontend gets a
# Service and probes on 8000; workers are found through discovery, probed on their system port.
COMPONENT_TYPES: dict[Kind, str] = {"frontend": "frontend", "encoder": "worker", "engine": "worker",
                                    "planner": "planner"}
# With an encode planner the engines are `decode`: Dynamo's planner connector finds the encoder by name in
# the prefill slot only while no component is `prefill`, and its decode slot is then the engines, not a
# lone `worker` (runtime/dynamo.py ENCODER_SLOT; docs/kubernetes.md "Autoscaling the encoders").
PLANNED_TYPES: dict[Kind, str] = {**COMPONENT_TYPES, "engine": "decode"}

_SIZE = re.compile(r"^([0-9]+)([kmgKMG]?)$")
_MI = 1 << 20
_GI = 1 << 30


# --- small helpers ---------------------------------------------------------------------------

def _env(values: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": k, "value": str(v)} for k, v in values.items()]


def _size_bytes(value: str) -> int:
    """An nginx size TierConfig has validated (512k, 64m, 2g) in bytes."""
    m = _SIZE.match(value)
    if m is None:
        raise ValueError(f"{value!r} is not an nginx size")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": _MI, "g": _GI}[m.group(2).lower()]


def _quantity(n_bytes: int) -> str:
    mi = math.ceil(n_bytes / _MI)
    return f"{mi // 1024}Gi" if mi % 1024 == 0 else f"{mi}Mi"


def _check_resources(where: str, resources: dict[str, dict[str, str]]) -> None:
    unknown = set(resources) - {"requests", "limits"}
    if unknown:
        raise GraphError(f"{where}.resources: only requests and limits are supported, not {sorted(unknown)}")


def _argv(cp: ComponentPlan) -> list[str]:
    """The one command line of a component's pods (on this site every replica has the same)."""
    argvs = {r.argv for r in cp.replicas}
    assert len(argvs) == 1, f"{cp.name}: replicas differ on Kubernetes"
    return list(argvs.pop())


def _pod_labels(g: Graph, component: str) -> dict[str, str]:
    """Labels for the operator's pods: ours only (the app.kubernetes.io/* ones may be the operator's to set)."""
    return {"mm-encoder/graph": g.name, "mm-encoder/component": component, "app.kubernetes.io/part-of": PART_OF}


def _security_context() -> dict[str, Any]:
    """The image's user; fsGroup makes mounted volumes writable for it."""
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID}


# --- the DynamoGraphDeployment ---------------------------------------------------------------

class _Storage:
    """Volumes of one Dynamo pod: the model's checkpoint directory, as a native pod volume
    (v1beta1 has no `pvcs` / `volumeMounts` of its own: the podTemplate carries them)."""

    def __init__(self, names: K8sNames, uses: frozenset[str], image: str):
        self.volumes: list[dict[str, Any]] = []
        self.mounts: list[dict[str, Any]] = []
        self.init: list[dict[str, Any]] = []
        generated = GeneratedCheckpoint.of(names.g)
        if "model" in uses and names.model_pvc:
            self._claim("model", names.model_pvc, MODEL_DIR)
        elif "model" in uses and generated is not None:  # written by the same call as `mm-encoder serve` makes
            self.volumes.append({"name": "model", "emptyDir": {}})
            self.mounts.append({"name": "model", "mountPath": MODEL_DIR})
            self.init.append({
                "name": "make-checkpoint", "image": image,
                "command": ["python", "-m", generated.MODULE, *generated.argv(MODEL_DIR)],
                "volumeMounts": [{"name": "model", "mountPath": MODEL_DIR}],
            })

    def _claim(self, name: str, claim: str, path: str) -> None:
        self.volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        self.mounts.append({"name": name, "mountPath": path, "readOnly": True})


def _component(names: K8sNames, cp: ComponentPlan) -> dict[str, Any]:
    """One `spec.components[]` entry: the operator fills in the container named `main` (probes,
    system port, discovery env) and merges what we set over its defaults."""
    c, image = cp.component, cp.component.image or names.g.image
    storage = _Storage(names, cp.uses, image)
    main: dict[str, Any] = {
        "name": MAIN_CONTAINER,
        "image": image,
        "command": ["python", "-m", cp.module],
        "args": _argv(cp),  # tracing on: as `serve` does, its service name, Dynamo's switch, one protocol
        "env": _env({**cp.env, **tracing.component_env(cp.env, cp.env.get("OTEL_SERVICE_NAME",
                                                                           f"{names.g.name}/{cp.name}"))}),
    }
    if cp.kind in ("encoder", "planner"):  # ours (the tiers' Service, /status); the operator's stay its own
        port = ENCODER_PORT if cp.kind == "encoder" else PLANNER_PORT
        main["ports"] = [{"name": "mm-http", "containerPort": port, "protocol": "TCP"}]
    if c.resources:
        main["resources"] = {k: {n: str(v) for n, v in q.items()} for k, q in c.resources.items()}
    if storage.mounts:
        main["volumeMounts"] = storage.mounts
    pod: dict[str, Any] = {"securityContext": _security_context()}
    if storage.init:
        pod["initContainers"] = storage.init
    pod["containers"] = [main]
    if storage.volumes:
        pod["volumes"] = storage.volumes
    k8s_tls.add_to_pod(names, cp, main, pod)  # with TLS: its Secret, ops port, the frontend's HTTPS probes
    out: dict[str, Any] = {
        "name": names.components[cp.name],
        "type": (PLANNED_TYPES if names.g.planner else COMPONENT_TYPES)[cp.kind],
        "replicas": c.replicas,  # with a planner, the encoder's starting count (its scaling adapter's from then on)
    }
    if cp.kind == "encoder" and names.scaling_adapter:  # the DGDSA the planner's connector scales
        out["scalingAdapter"] = {}
    # The image's tag is mm-encoder's version, not Dynamo's: say which runtime it carries.
    out["runtimeVersionOverride"] = DYNAMO_VERSION
    out["podTemplate"] = {"metadata": {"labels": _pod_labels(names.g, cp.name)}, "spec": pod}
    return out


def _runtime_note(g: Graph) -> str:
    """What the graph's `runtime` asks of the cluster (the operator's platform provides etcd and NATS)."""
    rt = g.runtime
    if rt.discovery in ("default", "kubernetes"):
        note = "Discovery: the operator's Kubernetes backend (DynamoWorkerMetadata + EndpointSlices)"
    else:
        note = "Discovery: etcd (DYN_DISCOVERY_BACKEND=etcd; ETCD_ENDPOINTS from the operator's platform)"
    planes = f"; request plane {rt.request_plane}, event plane {rt.event_plane}"
    if rt.needs_nats:
        planes += " (NATS_SERVER from the operator's platform, else set it in the components' env)"
    return note + planes + "."


def _graph_deployment(names: K8sNames, components: list[ComponentPlan]) -> dict[str, Any]:
    g, llm = names.g, names.g.llm
    llm_note = (f"the PersistentVolumeClaim {names.model_pvc} must hold the checkpoint directory (llm.checkpoint "
                f"{llm.checkpoint}), mounted at {MODEL_DIR}" if names.model_pvc else
                f"an init container writes the generated {llm.preset} Kimi-K2.5 checkpoint to {MODEL_DIR}")
    note = (f"Generated by mm-encoder render-k8s from graph {g.name}. Dynamo namespace {g.namespace} "
            f"(DYN_NAMESPACE set on every component); the frontend listens on {FRONTEND_PORT}, the port of the "
            f"operator's frontend Service (the graph's frontend_port {g.frontend_port} is for mm-encoder serve); "
            f"{llm_note}. {_runtime_note(g)}")
    if names.encoder_svc:
        note += (" Encoder pods carry the labels mm-encoder/graph and mm-encoder/component (podTemplate.metadata) "
                 f"that their Services {', '.join(names.encoder_svc.values())} select.")
    note += k8s_tls.note(names)
    if g.planner:
        note += (f" The encode planner (component {g.planner[0]}) scales the encoders through the scaling adapter "
                 f"{names.scaling_adapter}, as ServiceAccount {PLANNER_SERVICE_ACCOUNT} (the operator's for every "
                 f"planner; Role and RoleBinding {names.planner_rbac}); the engines are typed decode, the encoder "
                 "worker.")
    return {
        "apiVersion": API_VERSION,
        "kind": DGD_KIND,
        "metadata": {"name": g.name, "labels": {"app.kubernetes.io/part-of": PART_OF, "mm-encoder/graph": g.name},
                     "annotations": {NOTE: note}},
        "spec": {"components": [_component(names, cp) for cp in components if cp.kind in COMPONENT_TYPES]},
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
                "labels": {**labels(g, cname, "encoder"), "app.kubernetes.io/name": svc},
                "annotations": {NOTE: (
                    f"Selects the pods of DynamoGraphDeployment {g.name} component {names.components[cname]} by the "
                    "labels its podTemplate.metadata sets. Should an operator not keep them, select "
                    f"nvidia.com/dynamo-graph-deployment-name: {g.name} and nvidia.com/dynamo-component: "
                    f"{names.components[cname]} instead.")},
            },
            "spec": {
                "selector": selector(g, cname),
                "ports": [{"name": "http", "port": ENCODER_PORT, "targetPort": ENCODER_PORT, "protocol": "TCP"}],
            },
        })
    return out


def _connector_rbac(names: K8sNames) -> list[dict[str, Any]]:
    """The encode planner's connector may read and scale this graph's encoder, and no more (k8s_site.py)."""
    g, name = names.g, names.planner_rbac
    if g.planner is None or name is None:
        return []
    rbac_labels = labels(g, g.planner[0], "planner") | {"app.kubernetes.io/name": name}
    rbac = "rbac.authorization.k8s.io"
    return [
        {"apiVersion": f"{rbac}/v1", "kind": "Role", "metadata": {"name": name, "labels": rbac_labels},
         "rules": connector_rules(names)},
        {"apiVersion": f"{rbac}/v1", "kind": "RoleBinding", "metadata": {"name": name, "labels": rbac_labels},
         # no namespace: a RoleBinding's ServiceAccount subject is its own namespace's, the graph's
         "subjects": [{"kind": "ServiceAccount", "name": PLANNER_SERVICE_ACCOUNT}],
         "roleRef": {"apiGroup": rbac, "kind": "Role", "name": name}},
    ]


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


def _tier_pod(names: K8sNames, cp: ComponentPlan, resources: dict[str, Any],
              cache_size_limit: str | None) -> dict[str, Any]:
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
    spec = {"securityContext": _security_context(), "containers": [container], "volumes": volumes}
    k8s_tls.add_to_pod(names, cp, container, spec)  # with TLS: its Secret, and its probes on the ops port
    return {"metadata": {"labels": labels(names.g, cp.name, c.kind)}, "spec": spec}


def _service(g: Graph, cname: str, kind: str, name: str, headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if headless:
        spec["clusterIP"] = "None"  # per-pod DNS names <pod>.<service>
        spec["publishNotReadyAddresses"] = True  # nginx resolves its upstreams once, when it starts
    spec["selector"] = selector(g, cname)
    spec["ports"] = [{"name": "http", "port": TIER_PORT, "targetPort": "http", "protocol": "TCP"}]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "labels": labels(g, cname, kind)}, "spec": spec}


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


def _deployment(g: Graph, cname: str, c: Component, name: str, template: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels(g, cname, c.kind)},
        "spec": {"replicas": c.replicas, "selector": {"matchLabels": selector(g, cname)}, "template": template},
    }


# --- entry points ----------------------------------------------------------------------------

def _check_components(g: Graph) -> None:
    """What Kubernetes would refuse in a component's `resources` and `env`, refused here by path."""
    if g.runtime.discovery == "file":
        raise GraphError("runtime.discovery: file discovery cannot span pods (each has its own filesystem); "
                         "use default (the operator's Kubernetes discovery) or etcd")
    for n, c in g.components.items():
        _check_resources(f"components.{n}", c.resources)
        for key in c.env:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_.-]*$", key):
                raise GraphError(f"components.{n}.env: {key!r} is not a valid environment variable name")


def render(graph: Graph) -> list[dict[str, Any]]:
    """The graph as Kubernetes objects: the DynamoGraphDeployment, the encoders' Services, the tiers, the dashboard."""
    names = K8sNames(graph)
    _check_components(graph)
    components = plan(graph, K8sSite(names))
    dgd = _graph_deployment(names, components)
    check_planner_types(graph, dgd["spec"]["components"])
    objects = [*k8s_tls.certificates(names), dgd, *_encoder_services(names), *_connector_rbac(names),
               *_tiers(names, components)]
    if names.dashboard is not None:  # the encoder fleet's Grafana dashboard, for Grafana's sidecar
        objects.append(grafana.config_map(names.dashboard, labels(graph, "grafana-dashboard", "dashboard")))
    objects += k8s_tls.network_policies(names, components)  # with TLS
    plain: list[dict[str, Any]] = json.loads(json.dumps(objects))  # unshared data: no YAML anchors, safe to mutate
    return plain


def render_yaml(graph: Graph) -> str:
    header = (f"# Rendered by `mm-encoder render-k8s` from graph {graph.name}: kubectl apply -n NAMESPACE -f FILE\n"
              f"# Needs the NVIDIA Dynamo operator (DynamoGraphDeployment {API_VERSION}, Dynamo {DYNAMO_VERSION}).\n")
    return header + yaml.safe_dump_all(render(graph), sort_keys=False, default_flow_style=False, width=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mm-encoder render-k8s",
                                description="render a graph as Kubernetes objects (a DynamoGraphDeployment "
                                            "plus the nginx cache tiers), multi-document YAML")
    p.add_argument("graph", help="a shipped graph's name (mm-encoder graphs lists them), e.g. epd, or a graph file")
    p.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        text = render_yaml(load_graph(find_graph(args.graph)))
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
