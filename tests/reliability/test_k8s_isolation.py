"""Kubernetes isolates (issue 43, finding 5): for shipped graphs, with and without `tls`, the rendered
NetworkPolicies are evaluated as Kubernetes does (a pod selected by an Ingress policy takes only what some
rule of those policies admits: a port it names, from a peer it names; a rule without `from` admits anyone)
against pods labelled as the render labels them, Prometheus's pod in its own namespace, a stranger in the
namespace, one in another namespace, another graph's pods and a client outside the cluster. For every port
of every component, the sources admitted are exactly the callers this file's own table says, and no other
port of any pod admits anyone.

The table is written here by hand, per graph, from what each process dials (not from `core.topology` or the
renderer): HTTP hops of the plan, Dynamo's request plane (TCP: the frontend calls encoders and engines,
engines call encoders, the planner calls encoders and other planners) and its response streams (the callee
dials the caller back, whatever the request plane), model cards the frontend reads from a worker's system
port, Prometheus's scrapes, and with ZMQ events the frontend's subscription to each engine's publisher,
which binds a port of the kernel's ephemeral range. An encoder site's router admits other clusters by
address (`ipBlock`): anywhere by default, which a CNI may match pod addresses against too (Calico does),
so the table counts every source; with `--site-cidr` only the sources within it."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from mm_encoder.graph.schema import Graph
from mm_encoder.k8s import render as k8s
from mm_encoder.k8s.names import Exposure

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
NS = "team-a"
OUTSIDE_IP = "198.51.100.7"  # a client outside the cluster, e.g. another cluster's tier
PROM, ANYONE = "prometheus", "*"
HTTP, OPS, SYSTEM, RPC, RESPONSES, EVENTS = 8080, 9091, 9090, 9092, 9093, range(32768, 61000)
ENCODER_HTTP, FRONTEND_HTTP, PLANNER_HTTP = 8090, 8000, 8010


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str | None  # None: not a pod (a client outside the cluster)
    labels: dict[str, str] = field(default_factory=dict)
    ip: str = "10.244.1.9"  # a pod's address (what an ipBlock is matched against); OUTSIDE_IP outside


def _calls(tls: bool, *, http: dict[str, set[str]], rpc: dict[str, set[str]] | None,
           responses: dict[str, set[str]], system: dict[str, set[str]], zmq_engines: tuple[str, ...] = (),
           planner: bool = False) -> dict[str, dict[int, set[str]]]:
    """Per component, per port: its callers. `http`: each HTTP port's callers (keyed by component, the port is
    its kind's); the others by Dynamo's roles. Prometheus scrapes an encoder's and a tier's /metrics on its HTTP
    port without TLS and on its ops port with TLS."""
    ports: dict[str, dict[int, set[str]]] = {}
    http_port = {"encoder": ENCODER_HTTP, "frontend": FRONTEND_HTTP, "planner": PLANNER_HTTP}
    for target, callers in http.items():
        ports.setdefault(target, {})[http_port.get(target, HTTP)] = set(callers)
    if "encoder" in ports:
        ports["encoder"][ENCODER_HTTP if not tls else OPS] = ports["encoder"].get(
            ENCODER_HTTP if not tls else OPS, set()) | {PROM}
    for tier in ("shared", "router", "cluster"):  # a tier's /metrics: as an encoder's
        if tier in http:
            if tls:
                ports[tier][OPS] = {PROM}
            else:
                ports[tier][HTTP] |= {PROM}
    for table, port in ((rpc or {}, RPC), (responses, RESPONSES), (system, SYSTEM)):
        for target, callers in table.items():
            ports.setdefault(target, {})[port] = set(callers)
    for engine in zmq_engines:
        ports[engine][EVENTS.start] = {"frontend"}
    if planner:
        ports.setdefault("planner", {})[PLANNER_HTTP] = {PROM}
    return ports


def expected(name: str, tls: bool) -> dict[str, dict[int, set[str]]]:
    """Who calls whom, by hand, per shipped graph (the module docstring says from what)."""
    epd_http = {"frontend": {ANYONE}, "cluster": {"frontend", "engine"}, "router": {"cluster"}, "shared": {"router"},
                "encoder": {"shared", "cluster"}}  # the cluster tier's direct route reaches the encoders
    epd_rpc = {"encoder": {"frontend", "engine"}, "engine": {"frontend"}}
    epd_responses = {"frontend": {"encoder", "engine"}, "engine": {"encoder"}}
    epd_system = {"encoder": {PROM}, "engine": {PROM, "frontend"}}  # the engine's model card, for the frontend
    if name == "epd":
        return _calls(tls, http=epd_http, rpc=epd_rpc, responses=epd_responses, system=epd_system)
    if name == "epd-etcd":  # NATS request plane: no RPC listener, response streams all the same
        return _calls(tls, http=epd_http, rpc=None, responses=epd_responses, system=epd_system)
    if name == "epd-autoscale":  # etcd, NATS events, TCP requests; the planner reads the encoders' load
        return _calls(tls, http=epd_http, planner=True,
                      rpc={**epd_rpc, "encoder": {"frontend", "engine", "planner"}, "planner": {"planner"}},
                      responses={**epd_responses, "planner": {"encoder", "planner"}},
                      system={**epd_system, "planner": {PROM}})
    if name == "epd-stock":  # Dynamo's frontend: it asks no tier; the encoder registers as its Encode worker
        return _calls(tls, http={**epd_http, "cluster": {"engine"}}, rpc=epd_rpc, responses=epd_responses,
                      system={"encoder": {PROM, "frontend"}, "engine": {PROM, "frontend"}})
    if name == "epd-vllm":  # one cache tier, ZMQ KV events from the engine to the frontend's router
        return _calls(tls, http={"frontend": {ANYONE}, "cluster": {"frontend", "engine"}, "encoder": {"cluster"}},
                      rpc=epd_rpc, responses=epd_responses, system=epd_system, zmq_engines=("engine",))
    if name == "encoder-site":  # other clusters call its router (ipBlock anywhere); nothing calls the encoders' RPC
        return _calls(tls, http={"router": {ANYONE}, "shared": {"router"}, "encoder": {"shared"}}, rpc=None,
                      responses={}, system={"encoder": {PROM}})
    if name == "model-cluster":  # its cluster tier calls the encoder site (egress, not restricted); no encoders
        return _calls(tls, http={"frontend": {ANYONE}, "cluster": {"frontend", "engine"}}, rpc={"engine": {"frontend"}},
                      responses={"frontend": {"engine"}}, system={"engine": {PROM, "frontend"}})
    if name == "agg":  # no encoder: the frontend calls the engine, which calls nobody
        return _calls(tls, http={"frontend": {ANYONE}}, rpc={"engine": {"frontend"}},
                      responses={"frontend": {"engine"}}, system={"engine": {PROM, "frontend"}})
    raise AssertionError(f"no table for graph {name}")


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what the render uses; anything else is unmodelled
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_admits(peer: dict[str, Any], policy_ns: str, source: Pod) -> bool:
    if "ipBlock" in peer:  # by address, whoever holds it (a CNI may match pods' addresses too)
        assert set(peer) == {"ipBlock"} and set(peer["ipBlock"]) == {"cidr"}, peer
        network = ipaddress.ip_network(peer["ipBlock"]["cidr"])
        return ipaddress.ip_address(source.ip) in network
    if source.namespace is None:  # outside the cluster: only an ipBlock would name it
        return False
    assert set(peer) <= {"podSelector", "namespaceSelector"}, peer
    ns_labels = {"kubernetes.io/metadata.name": source.namespace}
    in_ns = _matches(peer["namespaceSelector"], ns_labels) if "namespaceSelector" in peer else \
        source.namespace == policy_ns
    return in_ns and _matches(peer.get("podSelector", {}), source.labels)


def _port_admits(ports: list[dict[str, Any]] | None, port: int) -> bool:
    return ports is None or any(p["protocol"] == "TCP" and p["port"] <= port <= p.get("endPort", p["port"])
                                for p in ports)


def admitted(policies: list[dict[str, Any]], target: Pod, port: int, sources: list[Pod]) -> set[str]:
    """The sources that may open a TCP connection to `target`'s `port`, as a NetworkPolicy-enforcing CNI decides."""
    selecting = [p for p in policies if "Ingress" in p["spec"]["policyTypes"]
                 and _matches(p["spec"]["podSelector"], target.labels)]
    if not selecting:
        return {s.name for s in sources}  # not isolated
    out = set()
    for source in sources:
        for p in selecting:
            for rule in p["spec"].get("ingress", []):
                if _port_admits(rule.get("ports"), port) and (
                        "from" not in rule or any(_peer_admits(peer, NS, source) for peer in rule["from"])):
                    out.add(source.name)
    return out


def _pods(docs: list[dict[str, Any]]) -> dict[str, Pod]:
    """Each component's pod, labelled as the render labels it (the DGD's pod templates and the tiers')."""
    out = {}
    for d in docs:
        if d["kind"] == "DynamoGraphDeployment":
            for c in d["spec"]["components"]:
                out[c["name"]] = Pod(c["name"], NS, c["podTemplate"]["metadata"]["labels"])
        elif d["kind"] in ("StatefulSet", "Deployment"):
            labels = d["spec"]["template"]["metadata"]["labels"]
            out[labels["mm-encoder/component"]] = Pod(labels["mm-encoder/component"], NS, labels)
    return out


def _graph(name: str, tls: bool) -> Graph:
    doc = yaml.safe_load((GRAPHS / f"{name}.yaml").read_text())
    if tls:
        doc["tls"] = {"enabled": True}
    if doc.get("site") == "cluster":  # render-k8s --encoder-site URL
        doc["encoder_site"]["url"] = f"{'https' if tls else 'http'}://203.0.113.10:8090"
    return Graph.model_validate(doc)


CASES = [(n, tls) for n in sorted(p.stem for p in GRAPHS.glob("*.yaml")) for tls in (False, True)
         if not (tls and n in ("epd-stock", "epd-vllm"))]  # TLS refuses Dynamo's stock frontend and ZMQ events


def _sources(pods: dict[str, Pod]) -> list[Pod]:
    """The graph's pods, Prometheus's, and strangers: in the namespace, in another, another graph's, outside."""
    prometheus = Pod(PROM, "monitoring", {"app.kubernetes.io/name": "prometheus"})
    strangers = [Pod("stranger", NS, {"app": "debug"}), Pod("elsewhere", "team-b", {}),
                 Pod("other-graph", NS, {"mm-encoder/graph": "other", "mm-encoder/component": "frontend"}),
                 Pod("outside", None, ip=OUTSIDE_IP)]
    return [*pods.values(), prometheus, *strangers]


@pytest.mark.parametrize(("name", "tls"), CASES)
def test_every_port_admits_exactly_its_callers(name, tls):
    graph = _graph(name, tls)
    docs = k8s.render(graph, exposure=Exposure(plaintext=graph.site == "encoder" and not tls))
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    pods = _pods(docs)
    sources = _sources(pods)
    table = expected(name, tls)
    assert set(pods) == {n for n in _graph(name, tls).components}
    for component, pod in pods.items():
        ports = table.get(component, {})
        # every port a rule names (each end of each range, and one past it), the table's, and the extremes
        probes = {1, 65535, *ports}
        for p in policies:
            for rule in p["spec"].get("ingress", []):
                for r in rule.get("ports", []):
                    probes |= {r["port"] - 1, r["port"], r.get("endPort", r["port"]), r.get("endPort", r["port"]) + 1}
        for port in sorted(probes):
            want = next((callers for start, callers in ports.items()
                         if port == start or (start == EVENTS.start and port in EVENTS)), set())
            if ANYONE in want:
                want = {s.name for s in sources}
            assert admitted(policies, pod, port, sources) == want, (name, tls, component, port)


@pytest.mark.parametrize("tls", [False, True])
def test_an_encoder_sites_door_admits_only_the_networks_it_is_given(tls):
    """With `--site-cidr`, the router's port admits sources within those networks only: a client there, no pod
    of the cluster (its address is elsewhere) and no other port; the rest of the site as without."""
    graph = _graph("encoder-site", tls)
    docs = k8s.render(graph, exposure=Exposure(cidrs=("198.51.100.0/24", "2001:db8::/32"), plaintext=not tls))
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    pods = _pods(docs)
    sources = _sources(pods)
    # the router's metrics: Prometheus, on its port without TLS (on the ops port with)
    assert admitted(policies, pods["router"], HTTP, sources) == {"outside"} | (set() if tls else {"prometheus"})
    for component, pod in pods.items():
        for port, callers in expected("encoder-site", tls).get(component, {}).items():
            if component != "router" or port != HTTP:
                assert admitted(policies, pod, port, sources) == callers, (component, port)
        assert "outside" not in admitted(policies, pod, 1, sources) | admitted(policies, pod, OPS, sources)
