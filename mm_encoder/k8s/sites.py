"""An encoder site and its model clusters on Kubernetes (docs/kubernetes.md "Sites"), each rendered on its
own, for its own cluster and namespace.

An encoder site's router is its door: a Service of type LoadBalancer on the graph's `site_port` passes TCP
through to the router's port, so the router itself terminates TLS, asks each caller for its certificate and
admits the model clusters the graph names by their spiffe:// URIs (an Ingress that terminated TLS would
hide that certificate from it). A model cluster's cluster tier dials its encoder site's URL, the
LoadBalancer's address, and with TLS checks the site router's certificate for the site graph's name."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from ..core.errors import GraphError
from ..graph.schema import Graph
from .names import NOTE, TIER_PORT, Exposure, K8sNames, labels, selector


def with_options(g: Graph, name: str | None = None, url: str | None = None, tenant_header: str | None = None
                 ) -> Graph:
    """The graph with `render-k8s --name NAME` (a second model cluster from one file: the name is its
    identity), `--encoder-site URL` and `--tenant-header NAME` over the file's, validated again as a
    whole (an https:// URL goes with the graph's TLS), as `serve` takes the same options."""
    if name is None and url is None and tenant_header is None:
        return g
    if url is not None and g.site != "cluster":
        raise GraphError(f"--encoder-site names a model cluster's encoder site; graph {g.name} is not one "
                         "(site: cluster)")
    doc = g.model_dump()
    doc["name"] = name or doc["name"]
    doc["encoder_site"]["url"] = url or doc["encoder_site"]["url"]
    doc["tenants"]["header"] = tenant_header or doc["tenants"]["header"]
    try:
        return Graph.model_validate(doc)
    except ValidationError as e:
        raise GraphError("; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())) from None


def check(g: Graph, exposure: Exposure) -> None:
    """What each kind of site needs before it renders, refused by the option that supplies it."""
    if g.site == "cluster" and g.encoder_site.url is None:
        raise GraphError(f"graph {g.name} is a model cluster: name its encoder site's URL, the address of the site "
                         "router's LoadBalancer (render-k8s --encoder-site URL, or the graph's encoder_site.url)")
    if g.site != "encoder" and (exposure.host or exposure.cidrs or exposure.plaintext):
        raise GraphError(f"--site-host, --site-cidr and --plaintext-site expose an encoder site's router; graph "
                         f"{g.name} is not one (site: encoder)")
    if g.site == "encoder" and not g.tls.enabled and not exposure.plaintext:
        raise GraphError(f"graph {g.name} is an encoder site: its router is exposed to other clusters through a "
                         "LoadBalancer, so it needs the graph's TLS (tls: {enabled: true, ...}, the model clusters' "
                         "CA), or say --plaintext-site: anyone who reaches the LoadBalancer (within --site-cidr) "
                         "can then call the encoders and read the cached embeddings")


def door_service(names: K8sNames) -> list[dict[str, Any]]:
    """An encoder site's router as other clusters reach it: a LoadBalancer on `site_port`, TCP passed through.
    `externalTrafficPolicy: Local` keeps the caller's address, which the NetworkPolicy's ipBlock (and the
    router's log) sees; with `Cluster` a node's address would replace it. `--site-cidr` also limits the
    LoadBalancer itself (`loadBalancerSourceRanges`, where the cloud provider implements it)."""
    g, name, exposure = names.g, names.door, names.exposure
    if name is None:
        return []
    router = g.of_kind("cache-router")[0][0]
    spec: dict[str, Any] = {
        "type": "LoadBalancer",
        "externalTrafficPolicy": "Local",
        "selector": selector(g, router),
        "ports": [{"name": "site", "port": g.site_port, "targetPort": "http", "protocol": "TCP"}],
    }
    if exposure.cidrs:
        spec["loadBalancerSourceRanges"] = list(exposure.cidrs)
    return [{"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": name, "labels": {**labels(g, router, "cache-router"), "app.kubernetes.io/name": name},
                          "annotations": {NOTE: door_note(names)}},
             "spec": spec}]


def door_note(names: K8sNames) -> str:
    """What the LoadBalancer Service's note says: who may call through it, and how they name it."""
    g = names.g
    who = (f"the router admits the cache-cluster tiers of the model clusters {', '.join(g.clusters)} by their "
           f"certificates (spiffe://{g.tls.trust_domain}/<cluster>/cache-cluster/...), from the same CA"
           if g.tls.enabled else "plaintext (--plaintext-site): anyone who reaches it")
    terminated = " (the router terminates TLS)" if g.tls.enabled else ""
    return (f"The encoder site {g.name}'s door: port {g.site_port} to its router's {TIER_PORT}, TCP passed "
            f"through{terminated}; {who}. Each model cluster renders with --encoder-site "
            f"{'https' if g.tls.enabled else 'http'}://<this Service's external address>:{g.site_port}.")


def note(names: K8sNames) -> str:
    """What the DynamoGraphDeployment's note says of the site it is part of (nothing for a single graph)."""
    g = names.g
    if g.site == "encoder":
        return (f" An encoder site: no frontend or engines; model clusters call its router through the "
                f"LoadBalancer Service {names.door} on port {g.site_port}.")
    if g.site == "cluster":
        checked = (f", its certificate checked for cache-router.{g.encoder_site.graph}.{g.tls.trust_domain}"
                   if g.tls.enabled else "")
        return (f" A model cluster: no encoders; the cluster tier sends its misses to the encoder site "
                f"{g.encoder_site.graph} at {g.encoder_site.url}{checked} (egress is not restricted).")
    return ""
