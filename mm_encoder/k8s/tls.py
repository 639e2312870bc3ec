"""`render-k8s` with the graph's `tls` (docs/kubernetes.md "TLS"): each component's certificate from its
own Secret, mounted read-only; probes that hold no certificate kept off the HTTPS ports; with `tls.issuer`,
one cert-manager Certificate per component; and NetworkPolicies that let only each hop's callers (the
roles its server admits) reach the encoders' and tiers' HTTPS ports, and only Prometheus their ops ports.

Names: a component's Secret (and Certificate) is `<graph>-<component>-tls`, shared by its replicas; its
certificate carries its identity (`spiffe://<trust domain>/<graph>/<role>/<component>`), the Service names
the others dial (K8sSite.server_name) and its role's name, which a tier checks its upstreams for."""

from __future__ import annotations

from typing import Any

from ..core.topology import CACHE_TIERS
from ..graph.plan import OPS_KINDS
from ..graph.planned import ComponentPlan
from ..graph.schema import Graph
from ..security.identity import SpiffeId, server_host
from ..security.pki import ORGANIZATION
from .names import FRONTEND_PORT, OPS_PORT, PORTS, TLS_DIR, TLS_FILES, K8sNames, labels, selector
from .site import K8sSite

VOLUME = "tls"
SECRET_MODE = 0o400  # the kubelet adds group read for the pod's fsGroup: 0440, root and the image's group
OPS_PORT_NAME = "mm-ops"
CERT_MANAGER = "cert-manager.io"
USAGES = ["server auth", "client auth", "digital signature"]  # both ends of a handshake, as pki.py issues them
# Prometheus's pods in any namespace (kube-prometheus-stack labels its own so): the only readers of the ops ports.
PROMETHEUS: dict[str, Any] = {"namespaceSelector": {},
                              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
# An exec probe with the pod's own certificate, for a frontend that asks its clients for one (the kubelet has none).
_CHECK = ("import ssl, sys, urllib.request as u; c = ssl.create_default_context(cafile=sys.argv[3]); "
          "c.check_hostname = False; c.load_cert_chain(sys.argv[1], sys.argv[2]); "
          "u.urlopen(sys.argv[4], context=c, timeout=4)")


def add_to_pod(names: K8sNames, cp: ComponentPlan, container: dict[str, Any], spec: dict[str, Any]) -> None:
    """With TLS: the component's Secret at TLS_DIR (read-only, 0400), an encoder's or tier's ops port, a
    tier's probes on it, and the frontend's probes over HTTPS."""
    secret = names.tls_secrets.get(cp.name)
    if secret is None:
        return
    container.setdefault("volumeMounts", []).append({"name": VOLUME, "mountPath": TLS_DIR, "readOnly": True})
    spec.setdefault("volumes", []).append({"name": VOLUME, "secret": {"secretName": secret,
                                                                      "defaultMode": SECRET_MODE}})
    if cp.kind in OPS_KINDS:
        container.setdefault("ports", []).append({"name": OPS_PORT_NAME, "containerPort": OPS_PORT,
                                                  "protocol": "TCP"})
    if cp.kind in CACHE_TIERS:  # the encoders' probes are the operator's, on Dynamo's plaintext system port
        for probe in ("readinessProbe", "livenessProbe"):
            container[probe]["httpGet"]["port"] = OPS_PORT_NAME
    if cp.kind == "frontend":
        container.update(frontend_probes(names.g))


def frontend_probes(g: Graph) -> dict[str, Any]:
    """The operator's frontend probes (/live, /health on 8000) over HTTPS; they take precedence over its own."""
    def probe(path: str, failures: int) -> dict[str, Any]:
        url = f"https://127.0.0.1:{FRONTEND_PORT}{path}"
        action = {"exec": {"command": ["python", "-c", _CHECK, *TLS_FILES, url]}} if g.tls.client_auth else \
            {"httpGet": {"path": path, "port": FRONTEND_PORT, "scheme": "HTTPS"}}
        return {**action, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": failures}

    return {"startupProbe": probe("/live", 30), "livenessProbe": probe("/live", 3),
            "readinessProbe": probe("/health", 3)}


def dns_names(names: K8sNames) -> dict[str, list[str]]:
    """Each TLS component's certificate's DNS names: the Service names it is dialled by (a shard's pods too),
    then its role's name in this graph, `<role>.<graph>.<trust domain>`, which a tier checks its upstreams
    for (`security.identity`); never another component's name."""
    g, site = names.g, K8sSite(names)
    out: dict[str, list[str]] = {}
    for cname in names.tls_secrets:
        c = g.components[cname]
        own = site.server_name(cname, c.kind)
        out[cname] = [own] if own else []
        if c.kind == "cache-shared":  # the router dials each shard by its pod's stable name
            out[cname] += [a.rsplit(":", 1)[0] for a in site.reach(cname, c.kind, c.replicas)]
        out[cname].append(server_host(g.tls.trust_domain, g.name, c.kind))
    return out


def uri(names: K8sNames, cname: str) -> str:
    """The component's identity (its replicas share its Secret): spiffe://<trust domain>/<graph>/<role>/<component>."""
    g = names.g
    return SpiffeId(g.tls.trust_domain, g.name, g.components[cname].kind, cname).uri


def certificates(names: K8sNames) -> list[dict[str, Any]]:
    """With `tls.issuer`: one cert-manager Certificate per component, into the Secret its pods mount."""
    g = names.g
    if g.tls.issuer is None:
        return []
    kind, _, issuer = g.tls.issuer.rpartition("/")
    hosts = dns_names(names)
    out = []
    for cname, secret in names.tls_secrets.items():
        ckind = g.components[cname].kind
        spec: dict[str, Any] = {
            "secretName": secret,
            "commonName": cname,
            "subject": {"organizations": [ORGANIZATION], "organizationalUnits": [ckind]},
        }
        spec["uris"] = [uri(names, cname)]
        spec["dnsNames"] = hosts[cname]
        spec |= {"usages": USAGES, "privateKey": {"algorithm": "ECDSA", "size": 256, "encoding": "PKCS8"},
                 "issuerRef": {"name": issuer, "kind": kind or "Issuer", "group": CERT_MANAGER}}
        out.append({"apiVersion": f"{CERT_MANAGER}/v1", "kind": "Certificate",
                    "metadata": {"name": secret, "labels": labels(g, cname, ckind)}, "spec": spec})
    return out


def network_policies(names: K8sNames, plans: list[ComponentPlan]) -> list[dict[str, Any]]:
    """Per encoder and tier: its HTTPS port from the pods of the roles it admits, its ops port from
    Prometheus; an encoder's other ports (Dynamo's system port and request plane) from the namespace."""
    g = names.g
    out = []
    for cp in plans:
        name = names.policies.get(cp.name)
        if name is None:
            continue
        admitted = cp.callers  # the hop policy, as the server itself takes it
        peers = [{"podSelector": {"matchLabels": selector(g, n)}} for n, c in g.components.items()
                 if c.kind in admitted]
        port = PORTS[cp.kind]
        rules: list[dict[str, Any]] = [{"from": peers, "ports": [_tcp(port)]}] if peers else []  # no `from`: anyone
        rules.append({"from": [PROMETHEUS], "ports": [_tcp(OPS_PORT)]})
        if cp.kind == "encoder":
            rules.append({"from": [{"podSelector": {}}, PROMETHEUS], "ports": _other_ports(port, OPS_PORT)})
        out.append({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                    "metadata": {"name": name, "labels": labels(g, cp.name, cp.kind)},
                    "spec": {"podSelector": {"matchLabels": selector(g, cp.name)}, "policyTypes": ["Ingress"],
                             "ingress": rules}})
    return out


def _tcp(port: int, end: int | None = None) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port, **({"endPort": end} if end is not None and end != port else {})}


def _other_ports(*closed: int) -> list[dict[str, Any]]:
    """Every TCP port but `closed` (as ranges), and every UDP port."""
    out, start = [], 1
    for p in sorted(closed):
        if start < p:
            out.append(_tcp(start, p - 1))
        start = p + 1
    return [*out, _tcp(start, 65535), {"protocol": "UDP", "port": 1, "endPort": 65535}]


def note(names: K8sNames) -> str:
    """What the DynamoGraphDeployment's note says of TLS: the Secrets, who makes them, what each must carry."""
    g = names.g
    if not names.tls_secrets:
        return ""
    hosts = dns_names(names)
    made = f"cert-manager Certificates of the same names (issuer {g.tls.issuer})" if g.tls.issuer else \
        "you (kubectl create secret generic NAME --from-file=tls.crt=... --from-file=tls.key=... " \
        "--from-file=ca.crt=...)"
    each = "; ".join(f"{secret} (CN {n}, OU {g.components[n].kind}, URI {uri(names, n)}, DNS {', '.join(hosts[n])})"
                     for n, secret in names.tls_secrets.items())
    return (f" TLS: each component mounts its Secret at {TLS_DIR} (tls.crt, tls.key, ca.crt), made by {made}: {each}."
            f" NetworkPolicies {', '.join(names.policies.values())} need a CNI that enforces them.")
