"""Kubernetes as a site for a graph's plan (`graph.plan`): every replica on its kind's fixed port on
all interfaces, encoders reached through their Service, shards by their StatefulSet pods' stable
names, the router and the cluster tier through their Services; the certificate of a component in its
Secret, shared by its replicas; Dynamo's listeners on fixed ports, and with TLS its request plane too."""

from __future__ import annotations

from ..core.topology import Kind
from ..graph.planned import Address, Site, TlsFiles
from ..graph.schema import Component, Graph
from ..security.identity import server_host
from .names import (
    CACHE_DIR,
    ENCODER_PORT,
    MODEL_DIR,
    OPS_PORT,
    PORTS,
    REQUEST_PLANE_PORT,
    RESPONSE_PLANE_PORT,
    RUN_DIR,
    TENANT_KEY,
    TIER_PORT,
    TLS_FILES,
    K8sNames,
    component_model_dir,
)

# Dynamo's TCP TLS checks every server a process dials (a worker by its pod IP, a caller's response stream
# by its pod IP) against one name, DYN_TCP_TLS_SERVER_NAME: every Dynamo component's certificate carries it.
REQUEST_PLANE = "request-plane"


def request_plane_host(g: Graph) -> str:
    """The one DNS name Dynamo's TCP TLS checks on this graph's request plane: `request-plane.<graph>.<td>`."""
    return server_host(g.tls.trust_domain, g.name, REQUEST_PLANE)


class K8sSite(Site):

    connector = "kubernetes"  # an encode planner scales the DynamoGraphDeployment's encoder component

    def __init__(self, names: K8sNames):
        self.names = names
        self.checkpoint_dir = MODEL_DIR

    def checkpoint_of(self, name: str, component: Component) -> str:
        """A component's own checkpoint: its own claim, mounted at /models/<component> (dgd.py)."""
        return component_model_dir(name) if component.checkpoint else self.checkpoint_dir

    def listen(self, name: str, kind: Kind, replica: int) -> Address:
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

    def tls_files(self, replica: str) -> TlsFiles:
        return TlsFiles(*TLS_FILES)  # the component's Secret: its replicas share one identity

    def tenant_key(self) -> str:
        return TENANT_KEY  # the graph's Secret (k8s/tenants.py)

    def ops_listen(self, name: str, kind: Kind, replica: int) -> Address:
        return "0.0.0.0", OPS_PORT  # in no Service: probes and Prometheus reach the pod

    def server_name(self, name: str, kind: Kind) -> str | None:
        """Its role's name, `<role>.<graph>.<trust domain>`: what every certificate of that role carries
        (and no other role's), whichever of the role's Services or pods a tier reaches."""
        g = self.names.g
        return server_host(g.tls.trust_domain, g.name, kind)

    def dynamo_env(self, kind: Kind) -> dict[str, str]:
        # Our components take --namespace from the graph; DYN_NAMESPACE (the operator would set
        # <k8s namespace>-<graph>) and the frontend's prefix are set to match it.
        g = self.names.g
        env = {"DYN_NAMESPACE": g.namespace,
               # fixed, so that each NetworkPolicy admits its callers on a known port (k8s/policies.py)
               "DYN_TCP_RPC_PORT": str(REQUEST_PLANE_PORT), "DYN_TCP_RESPONSE_STREAM_PORT": str(RESPONSE_PLANE_PORT)}
        if g.tls.enabled:  # the request plane and its response streams (TCP whatever the plane) both ways
            env |= TlsFiles(*TLS_FILES).dynamo_env({})
            env["DYN_TCP_TLS_SERVER_NAME"] = request_plane_host(g)  # peers are dialled by pod IP
        if kind == "encoder":  # readiness gates on this endpoint's health (default: ["generate"])
            env["DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS"] = '["encode"]'
        if kind == "frontend":
            env["DYN_NAMESPACE_PREFIX"] = g.namespace
        if kind == "planner":  # the KubernetesConnector's DGD (the operator injects the same into every container)
            env["DYN_PARENT_DGD_K8S_NAME"] = g.name
        return env
