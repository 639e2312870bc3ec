"""Who may open a connection to which port of the graph's pods: one NetworkPolicy per component that admits
only its callers on each of its ports, behind one that denies the graph's pods any other ingress. With or
without `tls`: TLS says who a caller is, the policies keep everyone else from reaching the port at all.

A component's ports and their callers (`openings`):
- its HTTP port: the frontend's from anywhere (it is the edge); an encoder's or tier's from the components
  this graph's plan has dial it (a tier's levels, the chain the frontend and the engines ask) among the
  roles the one hop policy admits (`core.topology.callers`, which the plan gives the server as
  `--tls-allow`): never more than the server admits, and not a role it admits that no component of
  this graph dials (the hop policy lets engines fetch from an encoder and a cluster tier call a shard
  tier, which no graph's plan does); an encoder's or tier's from Prometheus too without TLS (its
  /metrics is there then); the planner's from Prometheus (its /metrics; `kubectl port-forward` does not pass
  through policies);
- with TLS, an encoder's or tier's plaintext ops port: from Prometheus;
- Dynamo's system port (the operator's 9090 on workers and planners; the kubelet's probes come from the
  node, which policies never block): from Prometheus (/metrics), and on a worker that registers a model
  from the frontend too: Dynamo (1.4 on) serves the model's card files there (`/v1/metadata/...`,
  DYN_SELF_HOST_METADATA) and the frontend reads them when it discovers the model;
- Dynamo's TCP request plane (with `runtime.request_plane: tcp`): from the Dynamo components that call
  it (`DYNAMO_CALLS`), and the response streams a caller receives on (any request plane: the callee
  dials the caller back) from the components it calls;
- with ZMQ events, an engine's KV event publisher, which binds a port the kernel picks from its
  ephemeral range: that range, from the frontend (its KV router subscribes);
- an encoder site's router (its door): from outside the cluster too, by address (`ipBlock`: the operator's
  `--site-cidr`, else anywhere), since its callers are other clusters' tiers, which no pod selector names.
Egress is not restricted: a model cluster's cluster tier reaches its encoder site without a policy of ours."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..core.topology import CACHE_TIERS, Kind
from ..graph.planned import ComponentPlan
from ..graph.schema import Graph
from .names import (
    OPS_PORT,
    PORTS,
    REQUEST_PLANE_PORT,
    RESPONSE_PLANE_PORT,
    SYSTEM_PORT,
    K8sNames,
    labels,
    selector,
)
from .site import K8sSite

ANYONE = "*"  # a port open to every source (the frontend's OpenAI port)
OUTSIDE = "outside"  # other clusters, by address: an encoder site's door (`K8sNames.exposure`)
PROMETHEUS = "prometheus"  # Prometheus's pods, in any namespace (kube-prometheus-stack labels its own so)
PROMETHEUS_PEER: dict[str, Any] = {"namespaceSelector": {},
                                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
EPHEMERAL = (32768, 60999)  # Linux's default ip_local_port_range, a pod's own unless its sysctls change it
# Who calls whom over Dynamo's request plane, kind to kinds: the frontend its encoders (encode; Dynamo's stock
# frontend its Encode worker) and engines (generate: frontend/provider.py); an engine its encoders (a body
# fetched over RPC, the chain's fallback: engines/process.py); the encode planner the encoders' load and any
# other planner's whoami (planner/__main__.py: a second planner refuses to start). Encoders call nobody.
DYNAMO_CALLS: dict[Kind, tuple[Kind, ...]] = {"frontend": ("encoder", "engine"), "engine": ("encoder",),
                                              "planner": ("encoder", "planner")}
SYSTEM_KINDS: tuple[Kind, ...] = ("encoder", "engine", "planner")  # the operator sets DYN_SYSTEM_PORT on these


def registers_model(g: Graph, kind: Kind) -> bool:
    """Whether a `kind` registers a model with Dynamo, whose card the frontend then fetches from its system
    port: the engines (runtime/dynamo.py `register_engine`), and the encoders as Dynamo's stock frontend's
    Encode worker (`register_encode_worker`)."""
    return kind == "engine" or (kind == "encoder" and g.stock_frontend)


@dataclass(frozen=True)
class Opening:
    """TCP ports `port`..`end` of a component's pods, and who may connect to them: component names,
    PROMETHEUS or ANYONE."""

    what: str
    port: int
    end: int
    sources: frozenset[str]


def _named(g: Graph, kinds: Collection[str]) -> frozenset[str]:
    return frozenset(n for n, c in g.components.items() if c.kind in kinds)


def dynamo_callers(g: Graph, kind: Kind) -> frozenset[str]:
    """The graph's components that call a `kind`'s Dynamo endpoints."""
    return _named(g, [k for k, callees in DYNAMO_CALLS.items() if kind in callees])


def dynamo_callees(g: Graph, kind: Kind) -> frozenset[str]:
    """The graph's components whose Dynamo endpoints a `kind` calls (they dial its response streams)."""
    return _named(g, DYNAMO_CALLS.get(kind, ()))


def dials(cp: ComponentPlan) -> set[str]:
    """The host:port addresses a component's plan has it call over HTTP: a tier's levels, the chain's first
    level for the frontend (ours) and the engines (an encoder's `--handle-chain` only names it)."""
    tier = cp.replicas[0].tier if cp.replicas else None
    out = set(tier.next + tier.direct + tier.shards) if tier is not None else set()
    if cp.chain is not None and cp.kind in ("frontend", "engine") and not cp.component.stock:
        out.add(cp.chain.url.split("://", 1)[1])
    return out


def http_callers(names: K8sNames, plans: list[ComponentPlan], cp: ComponentPlan) -> frozenset[str]:
    """The components that dial `cp`'s HTTP port in this graph's plan, of the roles its server admits."""
    own = set(K8sSite(names).reach(cp.name, cp.kind, cp.component.replicas))
    return frozenset(q.name for q in plans if q.kind in cp.callers and dials(q) & own)


def openings(names: K8sNames, plans: list[ComponentPlan], cp: ComponentPlan) -> list[Opening]:
    """Every port of a component's pods that anyone may reach, and who (module docstring)."""
    g = names.g
    kind, tls = cp.kind, g.tls.enabled
    out: list[Opening] = []

    def add(what: str, port: int, sources: Collection[str], end: int | None = None) -> None:
        if sources:
            out.append(Opening(what, port, end or port, frozenset(sources)))

    if kind == "frontend":
        add("http", PORTS[kind], {ANYONE})
    elif kind == "planner":
        add("http", PORTS[kind], {PROMETHEUS})
    elif kind in PORTS:  # an encoder or a tier: those that dial it, of the hop policy's callers
        add("http", PORTS[kind], http_callers(names, plans, cp) | ({PROMETHEUS} if not tls else set())
            | ({OUTSIDE} if kind == "cache-router" and names.door is not None else set()))
    if tls and (kind == "encoder" or kind in CACHE_TIERS):
        add("ops", OPS_PORT, {PROMETHEUS})
    if kind in SYSTEM_KINDS:
        add("system", SYSTEM_PORT, {PROMETHEUS, *(_named(g, ["frontend"]) if registers_model(g, kind) else ())})
    if g.runtime.request_plane == "tcp":
        add("request-plane", REQUEST_PLANE_PORT, dynamo_callers(g, kind))
    add("response-streams", RESPONSE_PLANE_PORT, dynamo_callees(g, kind))
    if g.runtime.event_plane == "zmq" and kind == "engine":
        add("kv-events", EPHEMERAL[0], _named(g, ["frontend"]), EPHEMERAL[1])
    return out


def _peers(names: K8sNames, sources: frozenset[str]) -> list[dict[str, Any]] | None:
    """A rule's `from`: each source component's pods (this namespace), Prometheus, other clusters by
    address; None: anyone."""
    g = names.g
    if ANYONE in sources:
        return None
    peers: list[dict[str, Any]] = [{"podSelector": {"matchLabels": selector(g, n)}}
                                   for n in g.components if n in sources]
    outside = [{"ipBlock": {"cidr": cidr}} for cidr in names.exposure.sources] if OUTSIDE in sources else []
    return peers + ([PROMETHEUS_PEER] if PROMETHEUS in sources else []) + outside


def _port(o: Opening) -> dict[str, Any]:
    return {"protocol": "TCP", "port": o.port, **({"endPort": o.end} if o.end != o.port else {})}


def network_policies(names: K8sNames, plans: list[ComponentPlan]) -> list[dict[str, Any]]:
    """The graph's default-deny policy, then per component one rule per port: its callers, on that port only."""
    g = names.g
    graph_pods = {"matchLabels": {"mm-encoder/graph": g.name}}
    out: list[dict[str, Any]] = [{
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": names.default_deny, "labels": labels(g, "default-deny", "network-policy")},
        "spec": {"podSelector": graph_pods, "policyTypes": ["Ingress"]},  # no rule: nothing in but what others admit
    }]
    for cp in plans:
        rules = []
        for o in openings(names, plans, cp):
            peers = _peers(names, o.sources)
            rules.append({**({"from": peers} if peers is not None else {}), "ports": [_port(o)]})
        out.append({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                    "metadata": {"name": names.policies[cp.name], "labels": labels(g, cp.name, cp.kind)},
                    "spec": {"podSelector": {"matchLabels": selector(g, cp.name)}, "policyTypes": ["Ingress"],
                             "ingress": rules}})
    return out


def note(names: K8sNames) -> str:
    """What the DynamoGraphDeployment's note says of the policies."""
    out = (f" NetworkPolicies {names.default_deny} and {', '.join(names.policies.values())} admit each "
           "component's callers only, on each port (Prometheus: pods labelled app.kubernetes.io/name=prometheus); "
           "they need a CNI that enforces them.")
    if names.door is not None:
        out += f" The router's port admits other clusters from {', '.join(names.exposure.sources)}."
    return out
