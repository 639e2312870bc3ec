"""`mm-encoder render-k8s GRAPH`: the same graph file as `mm-encoder serve`, as Kubernetes objects.

    mm-encoder render-k8s graphs/epd.yaml -o epd.k8s.yaml && kubectl apply -n NS -f epd.k8s.yaml

What comes out (multi-document YAML, in this order):

- one `DynamoGraphDeployment` (`nvidia.com/v1alpha1`, name = the graph's name) with one entry in
  `spec.services` per frontend / encoder / engine component, named in PascalCase (`encoder` ->
  `Encoder`, `vision-encoder` -> `VisionEncoder`). The Dynamo operator turns each entry into a
  Deployment of pods named `<graph>-<service in lower case>`.
- a plain `Service` per encoder component, `<graph>-<component>-http`, port 8090: the nginx tiers
  reach the encode workers' HTTP API through it (the operator makes no Service for a worker's own
  port). It selects the pods by the labels `mm-encoder/graph` and `mm-encoder/component`, which the
  DynamoGraphDeployment puts on them through `extraPodMetadata.labels`. The operator also labels
  every pod `nvidia.com/dynamo-graph-deployment-name: <graph>` and `nvidia.com/dynamo-component:
  <Service>`; an operator that ignored `extraPodMetadata` would need the selector changed to those
  (the Service's `mm-encoder/note` annotation says so too).
- the nginx cache tiers, when the graph has them, generated from the graph (same structure as the
  hand-written `configs/k8s/cache-tiers.yaml`): cache-shared as a headless Service + StatefulSet
  (stable pod names `<graph>-<component>-N`, `publishNotReadyAddresses` so that the router's nginx
  resolves them before they are ready), cache-router as a Service + Deployment with one `--shard`
  per StatefulSet pod, cache-cluster as a Service + Deployment (`--next` the router, `--direct` the
  encoders). Caches live on `emptyDir: {medium: Memory}` with a `sizeLimit` above `--max-size`.

Why each component type (the operator's `componentType`; it knows planner, frontend, worker,
prefill, decode, epp and default):
- `frontend` for the frontend: the operator gives it a Service and probes on port 8000 (`/live`,
  `/health` of Dynamo's HTTP service, which our frontend runs), so it listens on 8000 here whatever
  the graph's `frontend_port` (that one is for `mm-encoder serve` on one machine).
- `worker` for encoders and engines: both serve a Dynamo endpoint and are found through discovery.
  The operator probes a worker's system port (9090, `DYN_SYSTEM_PORT`) and gates readiness (and so
  Kubernetes discovery) on the endpoints named in `DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS`, by
  default `["generate"]`: right for the engines (`<ns>.engine.generate`), so the encoders get
  `["encode"]` (`<ns>.mm_encoder.encode`). An engine does prefill and decode itself, hence not
  prefill/decode.

Settings every Dynamo container gets (component `env` in the graph wins over all of them):
`DYN_NAMESPACE=<graph namespace>` (the operator would set `<k8s namespace>-<graph>`; our components
take `--namespace` from the graph, and the frontend's `DYN_NAMESPACE_PREFIX` is set to match),
`DYN_REQUEST_PLANE=tcp` and `DYN_EVENT_PLANE=zmq` (no NATS needed; discovery is the operator's
Kubernetes backend), `DYN_TCP_MAX_MESSAGE_SIZE=268435456` (a 4K image is a ~40 MB request).
So two graphs deployed into one Kubernetes namespace need different `namespace`s in their files
(graphs/epd.yaml and graphs/agg.yaml have). Every pod runs as uid/gid 101, the image's user.

The LLM directory (config.json, tokenizer, chat template) that the frontend and the engines read:
with `llm.model_dir` unset, an init container writes the generated test LLM into an emptyDir (the
same call as `mm-encoder serve`, deterministic, so frontend and engines agree); with it set, the
PersistentVolumeClaim `<graph>-llm` (create it; `spec.pvcs` refers to it with `create: false`) must
hold that directory's contents and is mounted at /models/llm through the service's `volumeMounts`
(likewise `<graph>-vision` at /models/vision for `llm.checkpoint`). A component's
`image`, `env` and `resources` in the graph override the defaults; `resources` use Kubernetes
names (`cpu`, `memory`, `nvidia.com/gpu`) and become the service's Dynamo `resources` (`gpu`).
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

from .graph import Component, Graph, GraphError, load_graph

API_VERSION = "nvidia.com/v1alpha1"
DGD_KIND = "DynamoGraphDeployment"
FRONTEND_PORT = 8000  # the operator's frontend port: its Service and probes use it
ENCODER_PORT = 8090
TIER_PORT = 8080
LLM_DIR = "/models/llm"
VISION_DIR = "/models/vision"
RUN_DIR = "/run/mm-cache"
CACHE_DIR = "/cache"
MAX_MESSAGE_SIZE = 256 << 20  # DYN_TCP_MAX_MESSAGE_SIZE: 4K images make ~40 MB requests
UID = 101  # the image's user (docker/Dockerfile)
NOTE = "mm-encoder/note"
PART_OF = "mm-encoder"

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SIZE = re.compile(r"^([0-9]+)([kmgKMG]?)$")
_MI = 1 << 20
_GI = 1 << 30
# Writes the generated test LLM exactly as `mm-encoder serve` does (mm_encoder.serve.GraphRunner.llm_dir).
_MAKE_LLM = ("import sys; from mm_encoder.engines.lm import make_model_dir; "
             "make_model_dir(sys.argv[1], sys.argv[2], name=sys.argv[3], context_length=int(sys.argv[4]))")


# --- small helpers ---------------------------------------------------------------------------

def pascal(name: str) -> str:
    """`vision-encoder` -> `VisionEncoder`: the DynamoGraphDeployment service name."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("-") if part)


def _check_name(name: str, what: str, max_len: int = 63) -> str:
    if len(name) > max_len or not _DNS1123_LABEL.match(name):
        raise GraphError(f"{what} {name!r} is not a valid Kubernetes name (a DNS-1123 label: lowercase letters, "
                         f"digits and '-', starting and ending with a letter or digit, at most {max_len} characters); "
                         "shorten or rename the graph or component")
    return name


def _env(values: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": k, "value": str(v)} for k, v in values.items()]


def _size_bytes(value: str, what: str) -> int:
    m = _SIZE.match(value)
    if not m:
        raise GraphError(f"{what}: {value!r} is not an nginx size (like 512m or 2g)")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": _MI, "g": _GI}[m.group(2).lower()]


def _quantity(n_bytes: int) -> str:
    mi = math.ceil(n_bytes / _MI)
    return f"{mi // 1024}Gi" if mi % 1024 == 0 else f"{mi}Mi"


def _last_option(args: list[str], flag: str, default: str) -> str:
    """The value argparse will use for `flag`: its last occurrence (`--flag v` or `--flag=v`)."""
    value = default
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _has_option(args: list[str] | tuple[str, ...], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _with_defaults(defaults: list[tuple[str, str]], args: tuple[str, ...]) -> list[str]:
    """Default `--flag value` pairs the component's own args do not set, then those args."""
    return [*(x for flag, value in defaults if not _has_option(args, flag) for x in (flag, value)), *args]


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


class _Plan:
    """Every name the render uses (and the operator will), checked once: DNS-1123 labels, no two alike."""

    def __init__(self, g: Graph):
        self.g = g
        _check_name(g.name, "graph name")
        self.services: dict[str, str] = {}  # component -> DynamoGraphDeployment service name
        taken: dict[str, str] = {}

        def claim(name: str, what: str, max_len: int = 63) -> str:
            _check_name(name, what, max_len)
            if name in taken:
                raise GraphError(f"{what} {name!r} is also the name of {taken[name]}: rename a component")
            taken[name] = what
            return name

        for cname, c in g.components.items():
            if c.kind in ("frontend", "encoder", "engine"):
                svc = self.services[cname] = pascal(cname)
                # The operator names the component's objects (Deployment, Service) <graph>-<service lowercased>.
                claim(f"{g.name}-{svc.lower()}", f"the operator's objects for component {cname!r}")
        self.encoder_svc = {n: claim(f"{g.name}-{n}-http", f"the HTTP Service of encoder {n!r}")
                            for n, _ in g.of_kind("encoder")}
        # A StatefulSet's name goes into its pods' controller-revision-hash label (63 max): keep 11 spare.
        self.shared = [(n, c, claim(f"{g.name}-{n}", f"the shared tier {n!r}", 52))
                       for n, c in g.of_kind("cache-shared")]
        self.router = [(n, c, claim(f"{g.name}-{n}", f"the router {n!r}")) for n, c in g.of_kind("cache-router")]
        self.cluster = [(n, c, claim(f"{g.name}-{n}", f"the cluster tier {n!r}"))
                        for n, c in g.of_kind("cache-cluster")]
        self.llm_pvc = _check_name(f"{g.name}-llm", "the LLM volume claim") if g.llm.model_dir else None
        self.vision_pvc = _check_name(f"{g.name}-vision", "the vision checkpoint claim") if g.llm.checkpoint else None
        if (self.shared or self.cluster) and not self.encoder_svc:
            raise GraphError("cache tiers front encode workers: add an encoder component")
        for n, c in g.components.items():
            if c.resources:
                _dynamo_resources(c.resources)  # fail early on unknown sections
            for key in c.env:
                if not re.match(r"^[A-Za-z_][A-Za-z0-9_.-]*$", key):
                    raise GraphError(f"components.{n}.env: {key!r} is not a valid environment variable name")

    def encoders(self) -> list[str]:
        return [f"{svc}:{ENCODER_PORT}" for svc in self.encoder_svc.values()]

    def shard_addresses(self) -> list[str]:
        """Each StatefulSet pod by its stable DNS name through the headless Service."""
        return [f"{sts}-{i}.{sts}:{TIER_PORT}" for _, c, sts in self.shared for i in range(c.replicas)]

    def router_address(self) -> str | None:
        return f"{self.router[0][2]}:{TIER_PORT}" if self.router else None

    def cluster_address(self) -> str | None:
        return f"{self.cluster[0][2]}:{TIER_PORT}" if self.cluster else None


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

    def __init__(self):
        self.pvc_mounts: list[dict[str, str]] = []  # the service's `volumeMounts` (operator-made PVC volumes)
        self.volumes: list[dict[str, Any]] = []
        self.mounts: list[dict[str, Any]] = []
        self.init: list[dict[str, Any]] = []

    def llm(self, plan: _Plan, image: str) -> None:
        g = plan.g
        if plan.llm_pvc:
            self.pvc_mounts.append({"name": plan.llm_pvc, "mountPoint": LLM_DIR})
            return
        self.volumes.append({"name": "llm", "emptyDir": {}})
        self.mounts.append({"name": "llm", "mountPath": LLM_DIR})
        self.init.append({
            "name": "make-llm-dir", "image": image,
            "command": ["python", "-c", _MAKE_LLM, LLM_DIR, g.llm.vision_model, g.llm.name, str(g.llm.context_length)],
            "volumeMounts": [{"name": "llm", "mountPath": LLM_DIR}],
        })

    def vision(self, plan: _Plan) -> None:
        if plan.vision_pvc:
            self.pvc_mounts.append({"name": plan.vision_pvc, "mountPoint": VISION_DIR})


def _dynamo_service(plan: _Plan, name: str, c: Component, component_type: str, module: str, args: list[str],
                    env: dict[str, str], storage: _Storage, image: str) -> dict[str, Any]:
    g = plan.g
    spec: dict[str, Any] = {"componentType": component_type, "replicas": c.replicas}
    if c.resources:
        spec["resources"] = _dynamo_resources(c.resources)
    if storage.pvc_mounts:
        spec["volumeMounts"] = storage.pvc_mounts
    spec["extraPodMetadata"] = {"labels": _pod_labels(g, name)}
    container: dict[str, Any] = {
        "image": image,
        "command": ["python", "-m", module],
        "args": args,
        "env": _env({**env, **c.env}),
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


def _dynamo_env(g: Graph) -> dict[str, str]:
    return {
        "DYN_NAMESPACE": g.namespace,
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "DYN_TCP_MAX_MESSAGE_SIZE": str(MAX_MESSAGE_SIZE),
        "PYTHONUNBUFFERED": "1",
    }


def _graph_deployment(plan: _Plan) -> dict[str, Any]:
    g, llm = plan.g, plan.g.llm
    services: dict[str, Any] = {}
    for name, c in g.components.items():
        image = c.image or g.image
        storage = _Storage()
        if c.kind == "encoder":
            storage.vision(plan)
            args = ["--model", llm.vision_model, *(["--checkpoint", VISION_DIR] if llm.checkpoint else []),
                    "--dynamo", "--http-host", "0.0.0.0", "--http-port", str(ENCODER_PORT), "--namespace", g.namespace,
                    *c.args]
            env = {**_dynamo_env(g), "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["encode"]'}
            services[plan.services[name]] = _dynamo_service(plan, name, c, "worker", "mm_encoder.worker", args, env,
                                                            storage, image)
        elif c.kind == "engine":
            storage.llm(plan, image)
            args = ["--model-dir", LLM_DIR, "--namespace", g.namespace, "--block-size", str(g.block_size),
                    "--name", llm.name]
            if g.inline_encoding:  # the aggregated baseline: the engine encodes media itself
                storage.vision(plan)
                args += ["--encoder-model", llm.vision_model,
                         *(["--encoder-checkpoint", VISION_DIR] if llm.checkpoint else [])]
            services[plan.services[name]] = _dynamo_service(plan, name, c, "worker", "mm_encoder.engines.reference",
                                                            [*args, *c.args], _dynamo_env(g), storage, image)
        elif c.kind == "frontend":
            storage.llm(plan, image)
            args = ["--model-dir", LLM_DIR, "--http-host", "0.0.0.0", "--http-port", str(FRONTEND_PORT),
                    "--namespace", g.namespace, "--block-size", str(g.block_size)]
            if plan.cluster_address():
                args += ["--encoder-http", f"http://{plan.cluster_address()}",
                         "--encoder-route", "cluster,shared" if plan.router else "cluster"]
            elif plan.router_address():
                args += ["--encoder-http", f"http://{plan.router_address()}", "--encoder-route", "shared"]
            if g.inline_encoding:
                args += ["--inline-media"]
            env = {**_dynamo_env(g), "DYN_NAMESPACE_PREFIX": g.namespace}
            services[plan.services[name]] = _dynamo_service(plan, name, c, "frontend", "mm_encoder.frontend",
                                                            [*args, *c.args], env, storage, image)
    llm_note = (f"the PersistentVolumeClaim {plan.llm_pvc} must hold the LLM directory (llm.model_dir "
                f"{llm.model_dir}), mounted at {LLM_DIR}" if plan.llm_pvc else
                f"an init container writes the generated test LLM for {llm.vision_model} to {LLM_DIR}")
    note = (f"Generated by mm-encoder render-k8s from graph {g.name}. Dynamo namespace {g.namespace} "
            f"(DYN_NAMESPACE set on every component); the frontend listens on {FRONTEND_PORT}, the port of the "
            f"operator's frontend Service (the graph's frontend_port {g.frontend_port} is for mm-encoder serve); "
            f"{llm_note}.")
    if plan.encoder_svc:
        note += (" Encoder pods carry the labels mm-encoder/graph and mm-encoder/component (extraPodMetadata) that "
                 f"their Services {', '.join(plan.encoder_svc.values())} select.")
    spec: dict[str, Any] = {}
    pvcs = [p for p in (plan.llm_pvc, plan.vision_pvc) if p]
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


def _encoder_services(plan: _Plan) -> list[dict[str, Any]]:
    g = plan.g
    out = []
    for cname, svc in plan.encoder_svc.items():
        out.append({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": svc,
                "labels": {**_labels(g, cname, "encoder"), "app.kubernetes.io/name": svc},
                "annotations": {NOTE: (
                    f"Selects the pods of DynamoGraphDeployment {g.name} service {plan.services[cname]} by the labels "
                    "its extraPodMetadata sets. Should an operator not apply extraPodMetadata, select "
                    f"nvidia.com/dynamo-graph-deployment-name: {g.name} and nvidia.com/dynamo-component: "
                    f"{plan.services[cname]} instead.")},
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


def _tier_pod(plan: _Plan, cname: str, c: Component, tier: str, args: list[str], resources: dict[str, Any],
              cache_size_limit: str | None) -> dict[str, Any]:
    g = plan.g

    def probe(period: int) -> dict[str, Any]:
        return {"httpGet": {"path": "/_cache/health", "port": "http"}, "periodSeconds": period, "failureThreshold": 3}

    mounts = [{"name": "run", "mountPath": RUN_DIR}]
    volumes: list[dict[str, Any]] = [{"name": "run", "emptyDir": {}}]
    if cache_size_limit:
        mounts.insert(0, {"name": "cache", "mountPath": CACHE_DIR})
        volumes.insert(0, {"name": "cache", "emptyDir": {"medium": "Memory", "sizeLimit": cache_size_limit}})
    container: dict[str, Any] = {
        "name": "nginx",
        "image": c.image or g.image,
        "command": ["mm-encoder"],
        "args": ["cache", "up", "--tier", tier, "--listen", f"0.0.0.0:{TIER_PORT}", "--run-dir", RUN_DIR, *args],
        "ports": [{"name": "http", "containerPort": TIER_PORT, "protocol": "TCP"}],
        "readinessProbe": probe(5),
        "livenessProbe": probe(10),
        "resources": resources,
        "volumeMounts": mounts,
    }
    if c.env:
        container["env"] = _env(c.env)
    return {
        "metadata": {"labels": _labels(g, cname, c.kind)},
        "spec": {"securityContext": _security_context(), "containers": [container], "volumes": volumes},
    }


def _service(plan: _Plan, cname: str, kind: str, name: str, headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if headless:
        spec["clusterIP"] = "None"  # per-pod DNS names <pod>.<service>
        spec["publishNotReadyAddresses"] = True  # nginx resolves its upstreams once, when it starts
    spec["selector"] = _selector(plan.g, cname)
    spec["ports"] = [{"name": "http", "port": TIER_PORT, "targetPort": "http", "protocol": "TCP"}]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "labels": _labels(plan.g, cname, kind)}, "spec": spec}


def _cache_args(c: Component, tier: str, read_timeout: str) -> tuple[list[str], int, int]:
    """The tier's options after --next/--direct (defaults, then the graph's args) and its two memory sizes."""
    args = _with_defaults([("--cache-dir", CACHE_DIR), ("--max-size", "1g"), ("--keys-zone", "64m"),
                           ("--lock-timeout", "600s"), ("--lock-age", "600s"), ("--read-timeout", read_timeout),
                           ("--workers", "auto")], c.args)
    max_size = _size_bytes(_last_option(args, "--max-size", "1g"), f"components.{tier}: --max-size")
    keys_zone = _size_bytes(_last_option(args, "--keys-zone", "64m"), f"components.{tier}: --keys-zone")
    return args, max_size, keys_zone


def _tiers(plan: _Plan) -> list[dict[str, Any]]:
    g = plan.g
    out: list[dict[str, Any]] = []
    encoders = plan.encoders()
    for cname, c, sts in plan.shared:
        options, max_size, keys_zone = _cache_args(c, cname, "900s")
        size_limit, resources = _tier_memory(max_size, keys_zone, c)
        args = [*(a for e in encoders for a in ("--next", e)), *options]
        out.append(_service(plan, cname, c.kind, sts, headless=True))
        out.append({
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": sts, "labels": _labels(g, cname, c.kind)},
            "spec": {
                "serviceName": sts,
                "replicas": c.replicas,
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": _selector(g, cname)},
                "template": _tier_pod(plan, cname, c, "shared", args, resources, size_limit),
            },
        })
    for cname, c, name in plan.router:
        args = [*(a for s in plan.shard_addresses() for a in ("--shard", s)),
                *_with_defaults([("--read-timeout", "900s"), ("--workers", "auto")], c.args)]
        resources = dict(c.resources) or {"requests": {"cpu": "500m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
        out.append(_service(plan, cname, c.kind, name))
        out.append(_deployment(plan, cname, c, name, _tier_pod(plan, cname, c, "router", args, resources, None)))
    for cname, c, name in plan.cluster:
        options, max_size, keys_zone = _cache_args(c, cname, "1500s")
        size_limit, resources = _tier_memory(max_size, keys_zone, c)
        nxt = [plan.router_address()] if plan.router else encoders
        args = [*(a for n in nxt for a in ("--next", n)), *(a for e in encoders for a in ("--direct", e)), *options]
        out.append(_service(plan, cname, c.kind, name))
        out.append(_deployment(plan, cname, c, name, _tier_pod(plan, cname, c, "cluster", args, resources, size_limit)))
    return out


def _deployment(plan: _Plan, cname: str, c: Component, name: str, template: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": _labels(plan.g, cname, c.kind)},
        "spec": {"replicas": c.replicas, "selector": {"matchLabels": _selector(plan.g, cname)}, "template": template},
    }


# --- entry points ----------------------------------------------------------------------------

def render(graph: Graph) -> list[dict[str, Any]]:
    """The graph as Kubernetes objects: the DynamoGraphDeployment, the encoders' Services, the tiers."""
    plan = _Plan(graph)
    objects = [_graph_deployment(plan), *_encoder_services(plan), *_tiers(plan)]
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
