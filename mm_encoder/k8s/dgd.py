"""The graph's Dynamo components as one `DynamoGraphDeployment` (nvidia.com/v1beta1: `spec.components[]`,
each with a native pod template), a `Service` per encoder for the tiers to reach its HTTP API, and with
an encode planner the Role and RoleBinding its connector (Dynamo's KubernetesConnector) needs."""

from __future__ import annotations

from typing import Any

from ..core.errors import GraphError
from ..core.topology import Kind
from ..graph.checkpoint import GeneratedCheckpoint
from ..graph.planned import ComponentPlan
from ..graph.schema import Component, Graph
from ..runtime import tracing
from . import availability, policies, sites, tenants, tls
from .names import (
    ENCODER_PORT,
    FRONTEND_PORT,
    MODEL_DIR,
    NOTE,
    PART_OF,
    PLANNER_PORT,
    PLANNER_SERVICE_ACCOUNT,
    K8sNames,
    argv_of,
    component_model_dir,
    env_list,
    labels,
    security_context,
    selector,
)

API_VERSION = "nvidia.com/v1beta1"  # v1alpha1 (spec.services) is deprecated since Dynamo 1.5
DGD_KIND = "DynamoGraphDeployment"
DYNAMO_VERSION = "1.6.1"  # the ai-dynamo runtime in the image (pyproject, Makefile)
MAIN_CONTAINER = "main"  # the container the operator injects its defaults into
# v1beta1 `type` (frontend, worker, prefill, decode, planner, epp; no encode type): the frontend gets a
# Service and probes on 8000; workers are found through discovery, probed on their system port.
COMPONENT_TYPES: dict[Kind, str] = {"frontend": "frontend", "encoder": "worker", "engine": "worker",
                                    "planner": "planner"}
# With an encode planner the engines are `decode`: Dynamo's planner connector finds the encoder by name in
# the prefill slot only while no component is `prefill`, and its decode slot is then the engines, not a
# lone `worker` (runtime/dynamo.py ENCODER_SLOT; docs/kubernetes.md "Autoscaling the encoders").
PLANNED_TYPES: dict[Kind, str] = {**COMPONENT_TYPES, "engine": "decode"}


def _pod_labels(g: Graph, component: str) -> dict[str, str]:
    """Labels for the operator's pods: ours only (the app.kubernetes.io/* ones may be the operator's to set)."""
    return {"mm-encoder/graph": g.name, "mm-encoder/component": component, "app.kubernetes.io/part-of": PART_OF}


class _Storage:
    """Volumes of one Dynamo pod: the model's checkpoint directory, as a native pod volume
    (v1beta1 has no `pvcs` / `volumeMounts` of its own: the podTemplate carries them)."""

    def __init__(self, names: K8sNames, reads_model: bool, image: str, component: str = ""):
        self.volumes: list[dict[str, Any]] = []
        self.mounts: list[dict[str, Any]] = []
        self.init: list[dict[str, Any]] = []
        generated = GeneratedCheckpoint.of(names.g)
        if component in names.component_model_pvc:  # an encoder site's model: its own checkpoint
            self._claim("model", names.component_model_pvc[component], component_model_dir(component))
        elif reads_model and names.model_pvc:
            self._claim("model", names.model_pvc, MODEL_DIR)
        elif reads_model and generated is not None:  # written by the same call as `mm-encoder serve` makes
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


def main_image(g: Graph, c: Component) -> str:
    """The image a component's `main` container runs: its own `image`, else, for a vLLM engine, the
    graph's `vllm_image` (vLLM pins another transformers, so it has an image of its own), else the
    graph's `image`."""
    if c.image:
        return c.image
    return g.vllm_image if c.kind == "engine" and c.backend == "vllm" else g.image


def _component(names: K8sNames, cp: ComponentPlan) -> dict[str, Any]:
    """One `spec.components[]` entry: the operator fills in the container named `main` (probes,
    system port, discovery env) and merges what we set over its defaults. A generated checkpoint's
    init container runs the main image (`make-checkpoint` needs the `engine` extra's transformers)."""
    c, image = cp.component, main_image(names.g, cp.component)
    storage = _Storage(names, cp.reads_model, c.image or names.g.image, cp.name)
    main: dict[str, Any] = {
        "name": MAIN_CONTAINER,
        "image": image,
        "command": ["python", "-m", cp.module],
        "args": argv_of(cp),  # tracing on: as `serve` does, its service name, Dynamo's switch, one protocol
        "env": env_list({**cp.env, **tracing.component_env(cp.env, cp.env.get("OTEL_SERVICE_NAME",
                                                                           f"{names.g.name}/{cp.name}"))}),
    }
    if cp.kind in ("encoder", "planner"):  # ours (the tiers' Service, /status); the operator's stay its own
        port = ENCODER_PORT if cp.kind == "encoder" else PLANNER_PORT
        main["ports"] = [{"name": "mm-http", "containerPort": port, "protocol": "TCP"}]
    if c.resources:
        main["resources"] = {k: {n: str(v) for n, v in q.items()} for k, q in c.resources.items()}
    if storage.mounts:
        main["volumeMounts"] = storage.mounts
    pod: dict[str, Any] = {"securityContext": security_context()}
    if storage.init:
        pod["initContainers"] = storage.init
    pod["containers"] = [main]
    if storage.volumes:
        pod["volumes"] = storage.volumes
    tls.add_to_pod(names, cp, main, pod)  # with TLS: its Secret, ops port, the frontend's HTTPS probes
    tenants.add_to_pod(names, cp, main, pod)  # with tenants: the frontend's key
    availability.add_to_pod(names.g, cp, main, pod)  # its drain on a stop, its spread over nodes
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


def graph_deployment(names: K8sNames, components: list[ComponentPlan]) -> dict[str, Any]:
    g, llm = names.g, names.g.llm
    llm_note = (f"the PersistentVolumeClaim {names.model_pvc} must hold the checkpoint directory (llm.checkpoint "
                f"{llm.checkpoint}), mounted at {MODEL_DIR}" if names.model_pvc else
                f"an init container writes the generated {llm.preset} Kimi-K2.5 checkpoint to {MODEL_DIR}")
    for name, claim_name in names.component_model_pvc.items():
        llm_note += (f"; the PersistentVolumeClaim {claim_name} must hold component {name}'s checkpoint "
                     f"({g.components[name].checkpoint}), mounted at {component_model_dir(name)}")
    frontend = (f"the frontend listens on {FRONTEND_PORT}, the port of the operator's frontend Service (the graph's "
                f"frontend_port {g.frontend_port} is for mm-encoder serve)" if g.of_kind("frontend") else
                "no frontend")
    note = (f"Generated by mm-encoder render-k8s from graph {g.name}. Dynamo namespace {g.namespace} "
            f"(DYN_NAMESPACE set on every component); {frontend}; {llm_note}. {_runtime_note(g)}")
    if names.encoder_svc:
        note += (" Encoder pods carry the labels mm-encoder/graph and mm-encoder/component (podTemplate.metadata) "
                 f"that their Services {', '.join(names.encoder_svc.values())} select.")
    note += sites.note(names) + tls.note(names) + tenants.note(names) + policies.note(names)
    note += availability.note(names, components)
    if g.planner:
        note += (f" The encode planner (component {g.planner[0]}) scales the encoders through the scaling adapter "
                 f"{names.scaling_adapter}, as ServiceAccount {PLANNER_SERVICE_ACCOUNT} (the operator's for every "
                 f"planner; Role and RoleBinding {names.planner_rbac}); "
                 + ("the engines are typed decode, the encoder worker." if g.of_kind("engine") else
                    "the encoder is typed worker."))
    return {
        "apiVersion": API_VERSION,
        "kind": DGD_KIND,
        "metadata": {"name": g.name, "labels": {"app.kubernetes.io/part-of": PART_OF, "mm-encoder/graph": g.name},
                     "annotations": {NOTE: note}},
        "spec": {"components": [_component(names, cp) for cp in components if cp.kind in COMPONENT_TYPES]},
    }


def encoder_services(names: K8sNames) -> list[dict[str, Any]]:
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


def connector_rbac(names: K8sNames) -> list[dict[str, Any]]:
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


def check_planner_types(g: Graph, components: list[dict[str, Any]]) -> None:
    """Dynamo's lookups on the rendered components (planner/monitoring/dgd_services.py): the encoder's count,
    sent for the prefill slot with the encoder's name, reaches the encoder only while no component is typed
    prefill; Dynamo's own planner finds the decode slot only if exactly one component is typed decode."""
    if g.planner is None:
        return
    types = {c["name"]: c["type"] for c in components}
    encoder = g.of_kind("encoder")[0][0]
    prefill = [n for n, t in types.items() if t == "prefill"]
    if prefill or types[encoder] != "worker":
        raise GraphError(f"components.{g.planner[0]}: the encoder count would reach {prefill or types[encoder]}, "
                         f"not the worker component {encoder}")
    decode = [n for n, t in types.items() if t == "decode"]
    if len(decode) != 1 and g.site != "encoder":  # an encoder site has no engines: no decode slot to resolve
        raise GraphError(
            f"components.{g.planner[0]}: with an encode planner the engines are typed decode, and Dynamo's planner "
            f"resolves the decode slot to exactly one component: {', '.join(decode)} would make it ambiguous "
            "(DuplicateSubComponentError); use one engine component with more replicas")


def connector_rules(names: K8sNames) -> list[dict[str, Any]]:
    """What Dynamo's KubernetesConnector calls to set the encoder count (`set_component_replicas`:
    dynamo/planner/connectors/kubernetes.py, clients/kubernetes_api.py), on this graph's objects only."""
    assert names.scaling_adapter is not None, "a graph with an encode planner"
    return [
        # GET the DGD (spec, status) before each decision; PATCH /spec/components/<i>/replicas (a JSON patch)
        # where the component has no scaling adapter (404 on its Scale).
        {"apiGroups": ["nvidia.com"], "resources": ["dynamographdeployments"], "resourceNames": [names.g.name],
         "verbs": ["get", "patch"]},
        # The encoder's scaling adapter: PATCH its Scale (spec.replicas); GET it while a scale-down during
        # start-up is in flight (a 403 there only disables that cancellation).
        {"apiGroups": ["nvidia.com"], "resources": ["dynamographdeploymentscalingadapters/scale"],
         "resourceNames": [names.scaling_adapter], "verbs": ["get", "patch"]},
        # LIST the graph's pods (label nvidia.com/dynamo-graph-deployment-name) before a scale-down or while
        # the DGD is not Ready: terminating or pending pods hold the change (a 403 falls back to Ready alone).
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    ]
