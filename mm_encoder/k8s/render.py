"""`mm-encoder render-k8s GRAPH`: the graph's plan (`graph.plan`) as Kubernetes objects.

    mm-encoder render-k8s graphs/epd.yaml -o epd.k8s.yaml && kubectl apply -n NS -f epd.k8s.yaml

The Dynamo components as one DynamoGraphDeployment with the encoders' Services and the planner's
RBAC (`dgd.py`), the nginx tiers (`tiers.py`), the encoders' Grafana dashboard as a ConfigMap
(`dashboards/`), and with the graph's `tls` each component's Secret mounted, cert-manager
Certificates and NetworkPolicies (`tls.py`). Every component's command line comes from the plan, on
a `K8sSite` (fixed ports, Service DNS names, volumes under /models and /cache). What each object is
for and why: docs/kubernetes.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import GraphError
from ..dashboards import grafana
from ..graph.plan import plan
from ..graph.schema import Graph, load_graph
from ..graph.shipped import find_graph
from . import availability, dgd, policies, sites, tiers, tls
from .names import UNEXPOSED, Exposure, K8sNames, labels
from .site import K8sSite


def _check_resources(where: str, resources: dict[str, dict[str, str]]) -> None:
    unknown = set(resources) - {"requests", "limits"}
    if unknown:
        raise GraphError(f"{where}.resources: only requests and limits are supported, not {sorted(unknown)}")


def _check_components(g: Graph) -> None:
    """What Kubernetes would refuse in a component's `resources` and `env`, refused here by path."""
    if g.runtime.discovery == "file":
        raise GraphError("runtime.discovery: file discovery cannot span pods (each has its own filesystem); "
                         "use default (the operator's Kubernetes discovery) or etcd")
    for n, c in g.components.items():
        _check_resources(f"components.{n}", c.resources)
        for key in c.env:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_.-]*$", key):
                raise GraphError(f"components.{n}.env: {key!r} is not a valid environment variable name")


def render(graph: Graph, namespace: str | None = None, cert_manager: str = tls.CERT_MANAGER_ACCOUNT,
           exposure: Exposure = UNEXPOSED) -> list[dict[str, Any]]:
    """The graph as Kubernetes objects: the DynamoGraphDeployment, the encoders' Services, the tiers, the
    dashboard, the NetworkPolicies and PodDisruptionBudgets; with `tls.issuer` the Certificates and the
    approver-policy objects for `namespace` (refused without one), requested by `cert_manager`'s account;
    an encoder site's router exposed as `exposure` says (`sites.py`)."""
    sites.check(graph, exposure)
    if graph.tls.issuer is not None and namespace is None:
        raise GraphError("tls.issuer: the render approves this graph's certificate requests from one namespace "
                         "only (approver-policy): name it with --namespace NS, the namespace you apply the file to")
    if not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", cert_manager):
        raise GraphError(f"--cert-manager-account {cert_manager!r}: NAMESPACE/SERVICEACCOUNT of cert-manager's "
                         "controller (its Helm chart's default: cert-manager/cert-manager)")
    names = K8sNames(graph, namespace, exposure)
    _check_components(graph)
    components = plan(graph, K8sSite(names))
    deployment = dgd.graph_deployment(names, components)
    dgd.check_planner_types(graph, deployment["spec"]["components"])
    objects = [*tls.certificates(names), *tls.request_policies(names, cert_manager), deployment,
               *dgd.encoder_services(names), *dgd.connector_rbac(names), *tiers.tier_objects(names, components),
               *sites.door_service(names)]
    if names.dashboard is not None:  # the encoder fleet's Grafana dashboard, for Grafana's sidecar
        objects.append(grafana.config_map(names.dashboard, labels(graph, "grafana-dashboard", "dashboard")))
    objects += policies.network_policies(names, components) + availability.budgets(names, components)
    plain: list[dict[str, Any]] = json.loads(json.dumps(objects))  # unshared data: no YAML anchors, safe to mutate
    return plain


def render_yaml(graph: Graph, namespace: str | None = None, cert_manager: str = tls.CERT_MANAGER_ACCOUNT,
                exposure: Exposure = UNEXPOSED) -> str:
    header = (f"# Rendered by `mm-encoder render-k8s` from graph {graph.name}: kubectl apply -n NAMESPACE -f FILE\n"
              f"# Needs the NVIDIA Dynamo operator (DynamoGraphDeployment {dgd.API_VERSION}, "
              f"Dynamo {dgd.DYNAMO_VERSION}).\n")
    return header + yaml.safe_dump_all(render(graph, namespace, cert_manager, exposure), sort_keys=False,
                                       default_flow_style=False, width=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mm-encoder render-k8s",
                                description="render a graph as Kubernetes objects (a DynamoGraphDeployment "
                                            "plus the nginx cache tiers), multi-document YAML")
    p.add_argument("graph", help="a shipped graph's name (mm-encoder graphs lists them), e.g. epd, or a graph file")
    p.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    p.add_argument("-n", "--namespace", help="the namespace the file is applied to: with tls.issuer, the only one "
                                             "whose certificate requests approver-policy approves (required then)")
    p.add_argument("--cert-manager-account", default=tls.CERT_MANAGER_ACCOUNT,
                   help="with tls.issuer: cert-manager's controller ServiceAccount, NAMESPACE/NAME, which requests "
                        "every Certificate's certificates (default: %(default)s)")
    p.add_argument("--name", help="the graph's name for this render (default: the file's `name`): a second model "
                   "cluster from one file; its objects and its certificates' identity carry it")
    p.add_argument("--encoder-site", metavar="URL", help="a model cluster (site: cluster): its encoder site's URL, "
                   "the site router's LoadBalancer, https://HOST:PORT with TLS (default: the graph's encoder_site.url)")
    p.add_argument("--site-host", metavar="NAME", help="an encoder site (site: encoder): the DNS name or IP address "
                   "its LoadBalancer answers on, which the router's certificate then carries too (with tls.issuer)")
    p.add_argument("--site-cidr", metavar="CIDR", action="append", default=[], help="an encoder site: a network its "
                   "model clusters call from, once per network: the LoadBalancer and the router's NetworkPolicy "
                   "admit only these (default: anywhere)")
    p.add_argument("--plaintext-site", action="store_true", help="an encoder site without TLS: expose its router "
                   "anyway; anyone who reaches the LoadBalancer can call the encoders and read their answers")
    p.add_argument("--tenant-header", metavar="NAME", help="serve tenants: the frontend takes each request's "
                   "tenant from this header, set by the operator's gateway, and keys every cache entry by it "
                   "(docs/tenants.md; the key from the Secret <graph>-tenant-key; default: the graph's tenants.header)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        graph = sites.with_options(load_graph(find_graph(args.graph)), args.name, args.encoder_site,
                                   args.tenant_header)
        exposure = Exposure(args.site_host, tuple(args.site_cidr), args.plaintext_site)
        text = render_yaml(graph, args.namespace, args.cert_manager_account, exposure)
    except GraphError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output is None:
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:  # the reader stopped early (`| head`): nothing more to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    try:
        args.output.write_text(text)
    except OSError as e:
        print(f"error: cannot write {args.output}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
