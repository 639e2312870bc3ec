"""`render-k8s` with the graph's `tls` (docs/kubernetes.md "TLS"): each component's certificate from its
own Secret, mounted read-only; probes that hold no certificate kept off the HTTPS ports; with `tls.issuer`,
one cert-manager Certificate per component and the approver-policy objects that let only this namespace
request this graph's identities.

Names: a component's Secret (and Certificate) is `<graph>-<component>-tls`, shared by its replicas. Its
certificate carries the component's one identity, the URI `spiffe://<trust domain>/<graph>/<role>/<component>`
(what every hop admits callers by, and Python clients check servers by), and as DNS names the Service names
it is dialled by, its role's name `<role>.<graph>.<trust domain>` (what an nginx tier checks its next level
for) and, on a Dynamo component, the request plane's name (`site.request_plane_host`): never another
component's name, so no certificate passes for a component it is not."""

from __future__ import annotations

from typing import Any

from ..core.topology import CACHE_TIERS
from ..graph.plan import OPS_KINDS
from ..graph.planned import ComponentPlan
from ..graph.schema import Graph
from ..security.identity import SpiffeId, server_host
from ..security.pki import ORGANIZATION
from .names import FRONTEND_PORT, OPS_PORT, TLS_DIR, TLS_FILES, K8sNames, labels
from .site import K8sSite, request_plane_host

VOLUME = "tls"
SECRET_MODE = 0o400  # the kubelet adds group read for the pod's fsGroup: 0440, root and the image's group
OPS_PORT_NAME = "mm-ops"
CERT_MANAGER = "cert-manager.io"
APPROVER_POLICY = "policy.cert-manager.io"
USAGES = ["server auth", "client auth", "digital signature"]  # both ends of a handshake, as pki.py issues them
PRIVATE_KEY = {"algorithm": "ECDSA", "size": 256, "encoding": "PKCS8"}  # EC P-256, as pki.py's keys
MIN_DURATION_S = 3600  # cert-manager refuses a Certificate shorter than an hour
# The requester approver-policy checks is whoever created the CertificateRequest: for a Certificate, cert-manager's
# controller (its Helm chart's ServiceAccount), not the pods (docs/security.md "Identities on Kubernetes").
CERT_MANAGER_ACCOUNT = "cert-manager/cert-manager"
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


def identity(g: Graph, component: str) -> SpiffeId:
    """A component's one identity: its replicas share its Secret, so the name part is the component's."""
    return SpiffeId(g.tls.trust_domain, g.name, g.components[component].kind, component)


def dns_names(names: K8sNames) -> dict[str, list[str]]:
    """Each TLS component's certificate's DNS names: the Service names it is dialled by (a shard's pods
    too), its role's name, and on a Dynamo component the request plane's name. Only its own."""
    g, site = names.g, K8sSite(names)
    out: dict[str, list[str]] = {}
    for cname in names.tls_secrets:
        c = g.components[cname]
        own = ([names.encoder_svc[cname]] if c.kind == "encoder" else [names.tiers[cname]] if c.kind in CACHE_TIERS
               else [f"{g.name}-{cname}"] if c.kind == "frontend" else [])  # the operator's frontend Service
        if c.kind == "cache-shared":  # the router dials each shard by its pod's stable name
            own += [a.rsplit(":", 1)[0] for a in site.reach(cname, c.kind, c.replicas)]
        own.append(server_host(g.tls.trust_domain, g.name, c.kind))
        if c.kind not in CACHE_TIERS:  # Dynamo's: its TCP TLS checks every peer by one name
            own.append(request_plane_host(g))
        if cname == door(names) and names.exposure.host and names.exposure.ip is None:
            own.append(names.exposure.host)  # the LoadBalancer's name, for clients that check it
        out[cname] = own
    return out


def door(names: K8sNames) -> str | None:
    """An encoder site's router, the one component other clusters dial (through its LoadBalancer)."""
    return names.g.of_kind("cache-router")[0][0] if names.door is not None else None


def ip_addresses(names: K8sNames, component: str) -> list[str]:
    """The IP addresses a component's certificate carries: the encoder site's LoadBalancer's, if given so."""
    ip = names.exposure.ip
    return [ip] if ip is not None and component == door(names) else []


def duration_s(g: Graph, component: str) -> int:
    """How long a component's certificate lives. A tier re-reads its files when cert-manager renews them
    (cache_tiers/supervise.py); a Dynamo component's request plane reads its certificate once, so its
    certificate lives as long as the graph gives Dynamo's planes. cert-manager's minimum is an hour."""
    t = g.tls
    life = t.cert_lifetime_s if g.components[component].kind in CACHE_TIERS else t.dynamo_cert_lifetime_s
    return max(MIN_DURATION_S, int(life))


def go_duration(seconds: int) -> str:
    """A Go duration, as cert-manager's `duration` and `renewBefore` take it: 24h, 90m, 4000s."""
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _issuer(g: Graph) -> dict[str, str]:
    assert g.tls.issuer is not None
    kind, _, issuer = g.tls.issuer.rpartition("/")
    return {"name": issuer, "kind": kind or "Issuer", "group": CERT_MANAGER}


def certificates(names: K8sNames) -> list[dict[str, Any]]:
    """With `tls.issuer`: one cert-manager Certificate per component, into the Secret its pods mount,
    renewed at two thirds of its life (cert-manager's default share)."""
    g = names.g
    if g.tls.issuer is None:
        return []
    hosts = dns_names(names)
    out = []
    for cname, secret in names.tls_secrets.items():
        ckind, life = g.components[cname].kind, duration_s(g, cname)
        spec: dict[str, Any] = {
            "secretName": secret,
            "commonName": cname,
            "subject": {"organizations": [ORGANIZATION], "organizationalUnits": [ckind]},
            "duration": go_duration(life),
            "renewBefore": go_duration(life // 3),
            "dnsNames": hosts[cname],
            **({"ipAddresses": ips} if (ips := ip_addresses(names, cname)) else {}),
            "uris": [identity(g, cname).uri],
            "usages": USAGES,
            "privateKey": PRIVATE_KEY,
            "issuerRef": _issuer(g),
        }
        out.append({"apiVersion": f"{CERT_MANAGER}/v1", "kind": "Certificate",
                    "metadata": {"name": secret, "labels": labels(g, cname, ckind)}, "spec": spec})
    return out


def request_policies(names: K8sNames, cert_manager: str = CERT_MANAGER_ACCOUNT) -> list[dict[str, Any]]:
    """With `tls.issuer`: per component, approver-policy's CertificateRequestPolicy that approves exactly its
    Certificate (its CN, subject, URI, DNS names, usages, key, at most its duration) when requested from this
    namespace through this issuer, and the Role and RoleBinding that let cert-manager's controller, which
    creates every Certificate's requests, use them here. Any other request through the issuer matches no
    policy of ours; from another namespace, none at all (docs/security.md "Identities on Kubernetes")."""
    g = names.g
    if not names.request_policies or names.approval is None or names.namespace is None:
        return []
    hosts = dns_names(names)
    out: list[dict[str, Any]] = []
    for cname, policy in names.request_policies.items():
        ckind = g.components[cname].kind
        allowed: dict[str, Any] = {
            "commonName": {"value": cname, "required": True},
            "dnsNames": {"values": hosts[cname], "required": True},
            **({"ipAddresses": {"values": ips, "required": True}} if (ips := ip_addresses(names, cname)) else {}),
            "uris": {"values": [identity(g, cname).uri], "required": True},
            "usages": USAGES,
            "subject": {"organizations": {"values": [ORGANIZATION], "required": True},
                        "organizationalUnits": {"values": [ckind], "required": True}},
        }
        size = PRIVATE_KEY["size"]
        out.append({
            "apiVersion": f"{APPROVER_POLICY}/v1alpha1", "kind": "CertificateRequestPolicy",
            "metadata": {"name": policy, "labels": labels(g, cname, ckind)},
            "spec": {
                "allowed": allowed,
                "constraints": {"maxDuration": go_duration(duration_s(g, cname)),
                                "privateKey": {"algorithm": PRIVATE_KEY["algorithm"], "minSize": size,
                                               "maxSize": size}},
                "selector": {"issuerRef": _issuer(g), "namespace": {"matchNames": [names.namespace]}},
            },
        })
    account_ns, _, account = cert_manager.partition("/")
    rbac = "rbac.authorization.k8s.io"
    meta = {"name": names.approval, "labels": labels(g, "certificate-approval", "tls")}
    return [*out,
            {"apiVersion": f"{rbac}/v1", "kind": "Role", "metadata": meta,
             "rules": [{"apiGroups": [APPROVER_POLICY], "resources": ["certificaterequestpolicies"],
                        "verbs": ["use"], "resourceNames": list(names.request_policies.values())}]},
            {"apiVersion": f"{rbac}/v1", "kind": "RoleBinding", "metadata": meta,
             "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": account_ns}],
             "roleRef": {"apiGroup": rbac, "kind": "Role", "name": names.approval}}]


def note(names: K8sNames) -> str:
    """What the DynamoGraphDeployment's note says of TLS: the Secrets, who makes them, what each must carry."""
    g = names.g
    if not names.tls_secrets:
        return ""
    hosts = dns_names(names)
    made = f"cert-manager Certificates of the same names (issuer {g.tls.issuer})" if g.tls.issuer else \
        "you (kubectl create secret generic NAME --from-file=tls.crt=... --from-file=tls.key=... " \
        "--from-file=ca.crt=...), from one CA, each certificate with exactly the URI and DNS names below"
    each = "; ".join(f"{secret} (CN {n}, OU {g.components[n].kind}, URI {identity(g, n).uri}, "
                     f"DNS {', '.join(hosts[n])}{''.join(f', IP {ip}' for ip in ip_addresses(names, n))})"
                     for n, secret in names.tls_secrets.items())
    out = f" TLS: each component mounts its Secret at {TLS_DIR} (tls.crt, tls.key, ca.crt), made by {made}: {each}."
    if names.request_policies:
        out += (f" approver-policy approves only these requests, from namespace {names.namespace}: "
                f"CertificateRequestPolicies {', '.join(names.request_policies.values())} (cert-manager's own "
                "approver must be off).")
    return out + (" Dynamo's request plane reads its certificate once: restart a Dynamo component after "
                  "its Secret is renewed, before the old certificate ends.")
