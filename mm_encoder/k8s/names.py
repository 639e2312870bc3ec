"""How a graph is named and labelled on Kubernetes: every object name the render creates (and the
operator will), checked once (DNS-1123 labels, no two alike), the labels that select each
component's pods, the fixed ports and paths every pod shares, and the small pieces every object
repeats (an env list, the pod's security context)."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from ..core.errors import GraphError
from ..core.topology import Kind
from ..graph.planned import ComponentPlan
from ..graph.schema import Graph

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


def component_model_dir(component: str) -> str:
    """Where a component with its own checkpoint (an encoder site's model) mounts it."""
    return f"/models/{component}"
RUN_DIR = "/run/mm-cache"
CACHE_DIR = "/cache"
PART_OF = "mm-encoder"
# With TLS: each component's Secret (kubernetes.io/tls keys plus ca.crt, as cert-manager writes them), mounted
# here; encoders and tiers serve health, status and metrics in plaintext on OPS_PORT (the pod network only).
TLS_DIR = "/etc/mm-encoder/tls"
TLS_FILES = (f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", f"{TLS_DIR}/ca.crt")
TENANT_DIR = "/etc/mm-encoder/tenant"  # with tenants: the frontend's key, from the graph's Secret
TENANT_FILE = "tenant.key"  # its key in the Secret and its file in TENANT_DIR
TENANT_KEY = f"{TENANT_DIR}/{TENANT_FILE}"
OPS_PORT = 9091  # beside the operator's system port (9090) on a worker
# Dynamo's own listeners, fixed so that a NetworkPolicy can name them: the system port the operator sets on
# workers and planners (/health, /live, /metrics), the TCP request plane's server (DYN_TCP_RPC_PORT: encoders,
# engines, the planner's whoami) and the response streams a caller receives on (DYN_TCP_RESPONSE_STREAM_PORT:
# the callee dials the caller back, whatever the request plane). Unset, the last two are OS-assigned.
SYSTEM_PORT = 9090
REQUEST_PLANE_PORT = 9092
RESPONSE_PLANE_PORT = 9093

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def check_name(name: str, what: str, max_len: int = 63) -> str:
    if len(name) > max_len or not _DNS1123_LABEL.match(name):
        raise GraphError(f"{what} {name!r} is not a valid Kubernetes name (a DNS-1123 label: lowercase letters, "
                         f"digits and '-', starting and ending with a letter or digit, at most {max_len} characters); "
                         "shorten or rename the graph or component")
    return name


def check_subdomain(name: str, what: str) -> str:
    """A cluster-scoped object's name: a DNS-1123 subdomain (labels joined by dots, at most 253)."""
    if len(name) > 253 or not all(_DNS1123_LABEL.match(part) for part in name.split(".")):
        raise GraphError(f"{what} {name!r} is not a valid Kubernetes name (a DNS-1123 subdomain); shorten the "
                         "namespace, graph or component name")
    return name


def labels(g: Graph, component: str, kind: str) -> dict[str, str]:
    """The labels of our own objects (tiers, Services, RBAC, NetworkPolicies, Certificates)."""
    return {"app.kubernetes.io/name": f"{g.name}-{component}", "app.kubernetes.io/instance": g.name,
            "app.kubernetes.io/component": kind, "app.kubernetes.io/part-of": PART_OF,
            "mm-encoder/graph": g.name, "mm-encoder/component": component}


def selector(g: Graph, component: str) -> dict[str, str]:
    """What selects a component's pods: the tiers' own, and the operator's through their podTemplate labels."""
    return {"mm-encoder/graph": g.name, "mm-encoder/component": component}


ANYWHERE = ("0.0.0.0/0", "::/0")  # an encoder site's door without --site-cidr


@dataclass(frozen=True)
class Exposure:
    """How other clusters reach an encoder site's router (`render-k8s --site-host, --site-cidr,
    --plaintext-site`): the name or address its LoadBalancer answers on, which the router's certificate
    then carries too; the source ranges the LoadBalancer and the NetworkPolicy admit (none: anywhere); and
    whether a site without TLS may be exposed at all (like `serve --plaintext-off-loopback`)."""

    host: str | None = None
    cidrs: tuple[str, ...] = ()
    plaintext: bool = False

    def __post_init__(self) -> None:
        for cidr in self.cidrs:
            try:
                ipaddress.ip_network(cidr)
            except ValueError:
                raise GraphError(f"--site-cidr {cidr!r} is not a network (ADDRESS/BITS with no host bits set, "
                                 "e.g. 198.51.100.0/24)") from None
        if self.host is not None and self.ip is None and not check_host(self.host):
            raise GraphError(f"--site-host {self.host!r} is neither an IP address nor a DNS name")

    @property
    def ip(self) -> str | None:
        """`host` as an IP address (a certificate's IP SAN), else None (a DNS name)."""
        try:
            return str(ipaddress.ip_address(self.host)) if self.host else None
        except ValueError:
            return None

    @property
    def sources(self) -> tuple[str, ...]:
        return self.cidrs or ANYWHERE


UNEXPOSED = Exposure()  # every graph but an encoder site, and one rendered without the options


def check_host(name: str) -> bool:
    """A DNS name a certificate may carry: DNS-1123 labels joined by dots, at most 253 characters."""
    return len(name) <= 253 and all(_DNS1123_LABEL.match(part) for part in name.lower().split("."))


class K8sNames:
    """Every name the render uses (and the operator will), checked once: DNS-1123 labels, no two alike."""

    def __init__(self, g: Graph, namespace: str | None = None, exposure: Exposure = UNEXPOSED):
        self.g = g
        self.exposure = exposure
        check_name(g.name, "graph name")
        self.components: dict[str, str] = {}  # graph component -> DynamoGraphDeployment `spec.components[].name`
        self._taken: dict[str, str] = {}
        claim = self._claim
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
        # An encoder site's door: the Service of type LoadBalancer that other clusters reach its router through.
        self.door = claim(f"{g.name}-{g.of_kind('cache-router')[0][0]}-lb", "the encoder site's LoadBalancer "
                          "Service") if g.site == "encoder" else None
        self.model_pvc = check_name(f"{g.name}-model", "the checkpoint volume claim") if g.llm.checkpoint else None
        # An encoder site's model with its own checkpoint (`checkpoint` on the component): its own claim.
        self.component_model_pvc = {n: claim(f"{g.name}-{n}-model", f"component {n!r}'s checkpoint volume claim")
                                    for n, c in g.components.items() if c.checkpoint}
        # The encoder fleet's Grafana dashboard (dashboards/grafana.py), with a graph that has encoders.
        self.dashboard = claim(f"{g.name}-grafana-dashboard", "the Grafana dashboard's ConfigMap") \
            if g.of_kind("encoder") else None
        planner = g.planner
        # The Role and RoleBinding that let the encode planner's connector scale the encoder component.
        self.planner_rbac = claim(f"{g.name}-{planner[0]}-connector", "the encode planner's Role and RoleBinding") \
            if planner else None
        # The operator names a component's DynamoGraphDeploymentScalingAdapter <graph>-<component, lowercase>,
        # which is also what the connector asks for: the operator's objects' name, claimed above.
        self.scaling_adapter = f"{g.name}-{g.of_kind('encoder')[0][0]}" if planner else None
        # With TLS: each component's Secret (and cert-manager Certificate), shared by its replicas; the
        # planner's too, for Dynamo's request plane (its /status stays plaintext).
        tls = [n for n in g.components if g.tls.enabled]
        self.tls_secrets = {n: claim(f"{g.name}-{n}-tls", f"the TLS Secret of component {n!r}") for n in tls}
        # Every graph: a NetworkPolicy per component that lets only its callers in, behind one that denies
        # the graph's pods any other ingress; a PodDisruptionBudget per component.
        self.default_deny = claim(f"{g.name}-default-deny", "the graph's default-deny NetworkPolicy")
        self.policies = {n: claim(f"{g.name}-{n}-ingress", f"the NetworkPolicy of component {n!r}")
                         for n in g.components}
        self.budgets = {n: claim(f"{g.name}-{n}-pdb", f"the PodDisruptionBudget of component {n!r}")
                        for n in g.components}
        # With `tls.issuer`: approver-policy's CertificateRequestPolicy per component (cluster-scoped, so
        # named after the namespace too: a DNS subdomain) and the Role and RoleBinding that let cert-manager
        # use them for this namespace's requests.
        self.namespace = namespace
        self.request_policies: dict[str, str] = {}
        self.approval = None
        if g.tls.issuer is not None and namespace is not None:
            check_name(namespace, "the namespace (--namespace)")
            self.request_policies = {n: check_subdomain(f"{PART_OF}.{namespace}.{g.name}.{n}",
                                                        f"the CertificateRequestPolicy of component {n!r}")
                                     for n in tls}
            self.approval = claim(f"{g.name}-certificate-approval", "the approver-policy Role and RoleBinding")

    def _claim(self, name: str, what: str, max_len: int = 63) -> str:
        """`name` for `what`: a valid name, and no other object's."""
        check_name(name, what, max_len)
        if name in self._taken:
            raise GraphError(f"{what} {name!r} is also the name of {self._taken[name]}: rename a component")
        self._taken[name] = what
        return name


UID = 101  # the image's user (docker/Dockerfile)
NOTE = "mm-encoder/note"


def env_list(values: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": k, "value": str(v)} for k, v in values.items()]


def argv_of(cp: ComponentPlan) -> list[str]:
    """The one command line of a component's pods (on this site every replica has the same)."""
    argvs = {r.argv for r in cp.replicas}
    assert len(argvs) == 1, f"{cp.name}: replicas differ on Kubernetes"
    return list(argvs.pop())


def security_context() -> dict[str, Any]:
    """The image's user; fsGroup makes mounted volumes writable for it."""
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID}
