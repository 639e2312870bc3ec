"""How a graph is named, addressed and stored on Kubernetes: the `Site` that `render-k8s` plans
on (plan.py), every object name it will create, checked once (DNS-1123 labels, no two alike), the
labels that select its pods, and what an encode planner's connector (Dynamo's KubernetesConnector)
may do to the graph's objects."""

from __future__ import annotations

import re
from typing import Any

from ..core.errors import GraphError
from .graph import Graph, Kind
from .plan import CACHE_TIERS, OPS_KINDS, TLS_KINDS, Site

PORTS: dict[Kind, int] = {  # the frontend's is the operator's: its Service and probes use 8000
    "frontend": 8000, "encoder": 8090, "cache-shared": 8080, "cache-router": 8080, "cache-cluster": 8080,
    "planner": 8010,  # the encode planner's /status, /metrics, /healthz (the operator's planner ports: 9085, 9090)
}
FRONTEND_PORT, ENCODER_PORT, TIER_PORT = PORTS["frontend"], PORTS["encoder"], PORTS["cache-shared"]
PLANNER_PORT = PORTS["planner"]
DYNAMO_KINDS: tuple[Kind, ...] = ("frontend", "encoder", "engine", "planner")  # the DynamoGraphDeployment's components
# The operator runs every `type: planner` pod as this ServiceAccount (whatever the podTemplate says), creates it in
# the graph's namespace with its planner role (cluster-wide mode; with namespaceRestriction its Helm chart does),
# and lets only it and itself change `replicas` of a component with a scaling adapter (its validating webhook).
PLANNER_SERVICE_ACCOUNT = "planner-serviceaccount"
MODEL_DIR = "/models/model"  # the checkpoint directory every model-reading component mounts
RUN_DIR = "/run/mm-cache"
CACHE_DIR = "/cache"
PART_OF = "mm-encoder"
# With TLS: each component's Secret (kubernetes.io/tls keys plus ca.crt, as cert-manager writes them), mounted
# here; encoders and tiers serve health, status and metrics in plaintext on OPS_PORT (the pod network only).
TLS_DIR = "/etc/mm-encoder/tls"
TLS_FILES = (f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", f"{TLS_DIR}/ca.crt")
OPS_PORT = 9091  # beside the operator's system port (9090) on a worker

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def check_name(name: str, what: str, max_len: int = 63) -> str:
    if len(name) > max_len or not _DNS1123_LABEL.match(name):
        raise GraphError(f"{what} {name!r} is not a valid Kubernetes name (a DNS-1123 label: lowercase letters, "
                         f"digits and '-', starting and ending with a letter or digit, at most {max_len} characters); "
                         "shorten or rename the graph or component")
    return name


def labels(g: Graph, component: str, kind: str) -> dict[str, str]:
    """The labels of our own objects (tiers, Services, RBAC, NetworkPolicies, Certificates)."""
    return {"app.kubernetes.io/name": f"{g.name}-{component}", "app.kubernetes.io/instance": g.name,
            "app.kubernetes.io/component": kind, "app.kubernetes.io/part-of": PART_OF,
            "mm-encoder/graph": g.name, "mm-encoder/component": component}


def selector(g: Graph, component: str) -> dict[str, str]:
    """What selects a component's pods: the tiers' own, and the operator's through their podTemplate labels."""
    return {"mm-encoder/graph": g.name, "mm-encoder/component": component}


class K8sNames:
    """Every name the render uses (and the operator will), checked once: DNS-1123 labels, no two alike."""

    def __init__(self, g: Graph):
        self.g = g
        check_name(g.name, "graph name")
        self.components: dict[str, str] = {}  # graph component -> DynamoGraphDeployment `spec.components[].name`
        taken: dict[str, str] = {}

        def claim(name: str, what: str, max_len: int = 63) -> str:
            check_name(name, what, max_len)
            if name in taken:
                raise GraphError(f"{what} {name!r} is also the name of {taken[name]}: rename a component")
            taken[name] = what
            return name

        for cname, c in g.components.items():
            if c.kind in DYNAMO_KINDS:
                self.components[cname] = cname  # already a DNS-1123 label, as v1beta1 `name` allows
                # The operator names the component's objects (DCD, Deployment, Service) <graph>-<name>.
                claim(f"{g.name}-{cname}", f"the operator's objects for component {cname!r}")
        self.encoder_svc = {n: claim(f"{g.name}-{n}-http", f"the HTTP Service of encoder {n!r}")
                            for n, _ in g.of_kind("encoder")}
        # A StatefulSet's name goes into its pods' controller-revision-hash label (63 max): keep 11 spare.
        self.shared = {n: claim(f"{g.name}-{n}", f"the shared tier {n!r}", 52)
                       for n, _ in g.of_kind("cache-shared")}
        self.tiers = {n: claim(f"{g.name}-{n}", f"the {c.kind} tier {n!r}") for n, c in g.components.items()
                      if c.kind in ("cache-router", "cache-cluster")}
        self.tiers |= self.shared
        self.model_pvc = check_name(f"{g.name}-model", "the checkpoint volume claim") if g.llm.checkpoint else None
        # The encoder fleet's Grafana dashboard (deploy/grafana.py), with a graph that has encoders.
        self.dashboard = claim(f"{g.name}-grafana-dashboard", "the Grafana dashboard's ConfigMap") \
            if g.of_kind("encoder") else None
        planner = g.planner
        # The Role and RoleBinding that let the encode planner's connector scale the encoder component.
        self.planner_rbac = claim(f"{g.name}-{planner[0]}-connector", "the encode planner's Role and RoleBinding") \
            if planner else None
        # The operator names a component's DynamoGraphDeploymentScalingAdapter <graph>-<component, lowercase>,
        # which is also what the connector asks for: the operator's objects' name, claimed above.
        self.scaling_adapter = f"{g.name}-{g.of_kind('encoder')[0][0]}" if planner else None
        # With TLS: each component's Secret (and cert-manager Certificate), shared by its replicas, and the
        # NetworkPolicy that lets only its callers reach an encoder's or tier's ports.
        tls = [(n, c) for n, c in g.components.items() if g.tls.enabled and c.kind in TLS_KINDS]
        self.tls_secrets = {n: claim(f"{g.name}-{n}-tls", f"the TLS Secret of component {n!r}") for n, _ in tls}
        self.policies = {n: claim(f"{g.name}-{n}-ingress", f"the NetworkPolicy of component {n!r}")
                         for n, c in tls if c.kind in OPS_KINDS}


class K8sSite(Site):
    """Kubernetes: every replica listens on its kind's fixed port on all interfaces; components
    reach encoders through their Service, shards by their StatefulSet pods' stable names, the
    router and the cluster tier through their Services."""

    connector = "kubernetes"  # an encode planner scales the DynamoGraphDeployment's encoder component

    def __init__(self, names: K8sNames):
        self.names = names
        self.checkpoint_dir = MODEL_DIR

    def listen(self, name: str, kind: Kind, replica: int) -> tuple[str, int]:
        return "0.0.0.0", PORTS[kind]

    def reach(self, name: str, kind: Kind, replicas: int) -> list[str]:
        if kind == "encoder":
            return [f"{self.names.encoder_svc[name]}:{ENCODER_PORT}"]
        if kind == "cache-shared":
            sts = self.names.shared[name]
            return [f"{sts}-{i}.{sts}:{TIER_PORT}" for i in range(replicas)]
        if kind in ("cache-router", "cache-cluster"):
            return [f"{self.names.tiers[name]}:{TIER_PORT}"]
        return []

    def tier_dirs(self, replica: str) -> tuple[str, str]:
        return RUN_DIR, CACHE_DIR

    def tls_files(self, replica: str) -> tuple[str, str, str]:
        return TLS_FILES  # the component's Secret: its replicas share one identity

    def ops_listen(self, name: str, kind: Kind, replica: int) -> tuple[str, int]:
        return "0.0.0.0", OPS_PORT  # in no Service: probes and Prometheus reach the pod

    def server_name(self, name: str, kind: Kind) -> str | None:
        """The Service name others dial (a shard's pods: `<pod>.<service>`), its certificate's first DNS name."""
        if kind == "encoder":
            return self.names.encoder_svc[name]
        if kind in CACHE_TIERS:
            return self.names.tiers[name]
        return f"{self.names.g.name}-{name}" if kind == "frontend" else None  # the operator's frontend Service

    def dynamo_env(self, kind: Kind) -> dict[str, str]:
        # Our components take --namespace from the graph; DYN_NAMESPACE (the operator would set
        # <k8s namespace>-<graph>) and the frontend's prefix are set to match it.
        env = {"DYN_NAMESPACE": self.names.g.namespace}
        if kind == "encoder":  # readiness gates on this endpoint's health (default: ["generate"])
            env["DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS"] = '["encode"]'
        if kind == "frontend":
            env["DYN_NAMESPACE_PREFIX"] = self.names.g.namespace
        if kind == "planner":  # the KubernetesConnector's DGD (the operator injects the same into every container)
            env["DYN_PARENT_DGD_K8S_NAME"] = self.names.g.name
        return env


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
    if len(decode) != 1:
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
