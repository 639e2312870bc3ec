"""Kubernetes as a site for a graph's plan (`graph.plan`): every replica on its kind's fixed port on
all interfaces, encoders reached through their Service, shards by their StatefulSet pods' stable
names, the router and the cluster tier through their Services; the certificate of a component in its
Secret, shared by its replicas."""

from __future__ import annotations

from ..core.topology import CACHE_TIERS, Kind
from ..graph.planned import Address, Site, TlsFiles
from .names import CACHE_DIR, ENCODER_PORT, MODEL_DIR, OPS_PORT, PORTS, RUN_DIR, TIER_PORT, TLS_FILES, K8sNames


class K8sSite(Site):

    connector = "kubernetes"  # an encode planner scales the DynamoGraphDeployment's encoder component

    def __init__(self, names: K8sNames):
        self.names = names
        self.checkpoint_dir = MODEL_DIR

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

    def ops_listen(self, name: str, kind: Kind, replica: int) -> Address:
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
