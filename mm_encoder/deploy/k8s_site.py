"""How a graph is named, addressed and stored on Kubernetes: the `Site` that `render-k8s` plans
on (plan.py), and every object name it will create, checked once (DNS-1123 labels, no two alike)."""

from __future__ import annotations

import re

from ..core.errors import GraphError
from .graph import Graph, Kind
from .plan import Site

PORTS: dict[Kind, int] = {  # the frontend's is the operator's: its Service and probes use 8000
    "frontend": 8000, "encoder": 8090, "cache-shared": 8080, "cache-router": 8080, "cache-cluster": 8080,
}
FRONTEND_PORT, ENCODER_PORT, TIER_PORT = PORTS["frontend"], PORTS["encoder"], PORTS["cache-shared"]
MODEL_DIR = "/models/model"  # the checkpoint directory every model-reading component mounts
RUN_DIR = "/run/mm-cache"
CACHE_DIR = "/cache"

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def check_name(name: str, what: str, max_len: int = 63) -> str:
    if len(name) > max_len or not _DNS1123_LABEL.match(name):
        raise GraphError(f"{what} {name!r} is not a valid Kubernetes name (a DNS-1123 label: lowercase letters, "
                         f"digits and '-', starting and ending with a letter or digit, at most {max_len} characters); "
                         "shorten or rename the graph or component")
    return name


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
            if c.kind in ("frontend", "encoder", "engine"):
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


class K8sSite(Site):
    """Kubernetes: every replica listens on its kind's fixed port on all interfaces; components
    reach encoders through their Service, shards by their StatefulSet pods' stable names, the
    router and the cluster tier through their Services."""

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

    def dynamo_env(self, kind: Kind) -> dict[str, str]:
        # Our components take --namespace from the graph; DYN_NAMESPACE (the operator would set
        # <k8s namespace>-<graph>) and the frontend's prefix are set to match it.
        env = {"DYN_NAMESPACE": self.names.g.namespace}
        if kind == "encoder":  # readiness gates on this endpoint's health (default: ["generate"])
            env["DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS"] = '["encode"]'
        if kind == "frontend":
            env["DYN_NAMESPACE_PREFIX"] = self.names.g.namespace
        return env
