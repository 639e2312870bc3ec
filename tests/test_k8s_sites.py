"""`render-k8s` for sites: an encoder site (graphs/encoder-site.yaml) and a model cluster
(graphs/model-cluster.yaml), each rendered on its own. The encoder site's router is exposed to other clusters
through a LoadBalancer that passes TCP through (the router terminates TLS and admits the model clusters it
names by their certificates); a model cluster's tier calls the encoder site's URL. Checked with the same
schemas and Kubernetes models as tests/test_k8s.py; who may reach which port:
tests/reliability/test_k8s_isolation.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from harness.k8s_schema import CERTIFICATE, CERTIFICATE_REQUEST_POLICY, DYNAMO_GRAPH_DEPLOYMENT, NETWORK_POLICY, errors
from mm_encoder.cache_tiers.cli import parse_args
from mm_encoder.core.errors import GraphError
from mm_encoder.graph.schema import Graph
from mm_encoder.k8s import render as k8s
from mm_encoder.k8s import sites
from mm_encoder.k8s.names import NOTE, Exposure

GRAPHS = Path(__file__).resolve().parents[1] / "graphs"
DGD = "DynamoGraphDeployment"
ISSUED = {"enabled": True, "issuer": "ClusterIssuer/mm-ca"}
ANYWHERE = [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}]
SITE = "https://203.0.113.10:8090"


def doc_of(name: str, **changes) -> dict:
    doc = yaml.safe_load((GRAPHS / f"{name}.yaml").read_text())
    return doc | changes


def graph_of(name: str, **changes) -> Graph:
    return Graph.model_validate(doc_of(name, **changes))


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def tier_args(docs: list[dict], name: str) -> list[str]:
    return one(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]["args"]


def round_trip(value: dict, model: str) -> dict:
    from kubernetes.client import ApiClient

    api = ApiClient()
    back: dict = api.sanitize_for_serialization(api._ApiClient__deserialize(value, model))  # type: ignore[attr-defined]
    return back


@pytest.fixture(scope="module")
def site_docs() -> list[dict]:
    return k8s.render(graph_of("encoder-site", tls=ISSUED), "mm-site")


def test_an_encoder_site_is_its_encoders_tiers_and_a_loadbalancer_to_its_router(site_docs):
    """No frontend or engines: the DGD holds the encoders alone (typed worker; the CRD needs no frontend) and
    passes its schema; the router, with TLS, admits the cluster tiers of the model clusters the graph names;
    a Service of type LoadBalancer passes `site_port` through to the router's port, keeping the caller's
    address (externalTrafficPolicy Local), and Kubernetes' own model reads it back unchanged."""
    dgd = one(site_docs, DGD)
    assert errors(dgd, DYNAMO_GRAPH_DEPLOYMENT) == []
    assert [(c["name"], c["type"]) for c in dgd["spec"]["components"]] == [("encoder", "worker")]
    assert "An encoder site" in dgd["metadata"]["annotations"][NOTE]
    _, router = parse_args(tier_args(site_docs, "encoder-site-router"))
    assert router.tls_allow == ("cache-cluster",) and router.tls_allow_graphs == ("cluster-a", "cluster-b")
    door = one(site_docs, "Service", "encoder-site-router-lb")
    assert door["spec"] == {"type": "LoadBalancer", "externalTrafficPolicy": "Local",
                            "selector": {"mm-encoder/graph": "encoder-site", "mm-encoder/component": "router"},
                            "ports": [{"name": "site", "port": 8090, "targetPort": "http", "protocol": "TCP"}]}
    assert round_trip(door, "V1Service") == door
    assert "cluster-a, cluster-b" in door["metadata"]["annotations"][NOTE]
    assert [d["metadata"]["name"] for d in site_docs if d["kind"] == "Service" and "type" in d["spec"]] == [
        "encoder-site-router-lb"]  # the only Service other clusters reach


def test_the_routers_port_alone_admits_other_clusters_by_address(site_docs):
    """The router's NetworkPolicy admits its port from anywhere by address (an ipBlock; its callers are other
    clusters' tiers, which no pod selector names), and nothing else of the site is open outside it; with
    --site-cidr only those networks, on the LoadBalancer too."""
    policies = {d["metadata"]["name"]: d for d in site_docs if d["kind"] == "NetworkPolicy"}
    for name, policy in policies.items():
        assert errors(policy, NETWORK_POLICY) == [], name
        for rule in policy["spec"].get("ingress", []):
            assert "from" in rule, name  # no port open to anyone without naming them
            by_address = [p for p in rule["from"] if "ipBlock" in p]
            if name == "encoder-site-router-ingress" and rule["ports"] == [{"protocol": "TCP", "port": 8080}]:
                assert rule["from"] == ANYWHERE
            else:
                assert by_address == [], (name, rule)
    cidrs = ("198.51.100.0/24", "2001:db8::/32")
    docs = k8s.render(graph_of("encoder-site", tls=ISSUED), "mm-site", exposure=Exposure(cidrs=cidrs))
    door = one(docs, "Service", "encoder-site-router-lb")
    assert door["spec"]["loadBalancerSourceRanges"] == list(cidrs) and round_trip(door, "V1Service") == door
    router = one(docs, "NetworkPolicy", "encoder-site-router-ingress")["spec"]["ingress"]
    assert [r["from"] for r in router if r["ports"][0]["port"] == 8080] == [
        [{"ipBlock": {"cidr": c}} for c in cidrs]]


@pytest.mark.parametrize(("host", "field"), [("encoders.example.com", "dnsNames"), ("203.0.113.10", "ipAddresses")])
def test_the_loadbalancers_name_is_in_the_routers_certificate_and_no_other(host, field):
    """--site-host puts the LoadBalancer's name (or address) into the router's Certificate, and approver-policy's
    policy for it permits exactly that, from this namespace only; no other component's certificate carries it."""
    docs = k8s.render(graph_of("encoder-site", tls=ISSUED), "mm-site", exposure=Exposure(host=host))
    certs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "CertificateRequestPolicy"}
    router = certs["encoder-site-router-tls"]
    assert host in router[field] and router["uris"] == ["spiffe://mm-encoder.local/encoder-site/cache-router/router"]
    assert "cache-router.encoder-site.mm-encoder.local" in router["dnsNames"]
    allowed = policies["mm-encoder.mm-site.encoder-site.router"]
    assert allowed["allowed"][field]["values"] == router[field]
    assert allowed["selector"]["namespace"] == {"matchNames": ["mm-site"]}
    for d in docs:
        if d["kind"] in ("Certificate", "CertificateRequestPolicy"):
            assert errors(d, CERTIFICATE if d["kind"] == "Certificate" else CERTIFICATE_REQUEST_POLICY) == []
    for name, spec in certs.items():
        if name != "encoder-site-router-tls":
            assert host not in spec["dnsNames"] + spec.get("ipAddresses", []), name
    note = one(docs, DGD)["metadata"]["annotations"][NOTE]
    assert host in note


def test_an_encoder_site_without_tls_is_exposed_only_when_asked():
    """A LoadBalancer in plaintext lets anyone who reaches it use the encoders and read their answers: refused
    by name (as serve refuses --bind off loopback without TLS) unless --plaintext-site says so."""
    graph = graph_of("encoder-site")
    with pytest.raises(GraphError, match="--plaintext-site"):
        k8s.render(graph)
    docs = k8s.render(graph, exposure=Exposure(plaintext=True))
    assert one(docs, "Service", "encoder-site-router-lb")["spec"]["type"] == "LoadBalancer"
    assert "plaintext" in one(docs, "Service", "encoder-site-router-lb")["metadata"]["annotations"][NOTE]


def test_an_encoder_site_with_a_planner_scales_its_encoders_without_engines():
    """An encode planner on an encoder site: the encoder stays worker-typed, and with no engines there is no
    decode slot to resolve (a single graph needs exactly one)."""
    doc = doc_of("encoder-site", tls=ISSUED)
    doc["runtime"] = {"discovery": "etcd", "event_plane": "nats"}
    doc["components"]["planner"] = {"kind": "planner", "args": ["--min-replicas", "1", "--max-replicas", "3"]}
    docs = k8s.render(Graph.model_validate(doc), "mm-site")
    dgd = one(docs, DGD)
    assert errors(dgd, DYNAMO_GRAPH_DEPLOYMENT) == []
    assert {c["name"]: c["type"] for c in dgd["spec"]["components"]} == {"encoder": "worker", "planner": "planner"}
    assert one(docs, "Role", "encoder-site-planner-connector")


@pytest.mark.parametrize("tls", [False, True])
def test_a_model_clusters_tier_calls_its_encoder_site(tls):
    """A model cluster runs no encoders (no encoder Service, no dashboard): its cluster tier's --next and
    --direct are the encoder site's address, and with TLS it checks the site router's certificate for the site
    graph's name; its own certificate's URI is the one the site's router admits it by."""
    url = SITE if tls else "http://203.0.113.10:8090"
    graph = graph_of("model-cluster", **({"tls": ISSUED} if tls else {}))
    docs = k8s.render(sites.with_options(graph, url=url), "mm-a")
    dgd = one(docs, DGD)
    assert errors(dgd, DYNAMO_GRAPH_DEPLOYMENT) == []
    assert {c["name"]: c["type"] for c in dgd["spec"]["components"]} == {"engine": "worker", "frontend": "frontend"}
    assert not [d for d in docs if d["kind"] == "ConfigMap" or d["metadata"]["name"].endswith("-http")]
    _, tier = parse_args(tier_args(docs, "cluster-a-cluster"))
    assert tier.next == tier.direct == ("203.0.113.10:8090",)
    assert f"at {url}" in dgd["metadata"]["annotations"][NOTE]
    if tls:
        assert tier.tls and tier.tls_server_name == "cache-router.encoder-site.mm-encoder.local"
        assert one(docs, "Certificate", "cluster-a-cluster-tls")["spec"]["uris"] == [
            "spiffe://mm-encoder.local/cluster-a/cache-cluster/cluster"]
    assert not any(d["kind"] == "Service" and "type" in d["spec"] for d in docs)  # nothing exposed but as before


def test_a_model_cluster_without_its_encoder_sites_url_is_refused_by_name(tmp_path, capsys):
    """Without encoder_site.url, render-k8s says which option names it; --encoder-site sets it (https:// only
    with the graph's TLS), and names nothing on a graph that is not a model cluster."""
    with pytest.raises(GraphError, match=r"cluster-a is a model cluster.*--encoder-site URL"):
        k8s.render(graph_of("model-cluster"))
    assert k8s.main(["model-cluster"]) == 2
    assert "--encoder-site URL" in capsys.readouterr().err
    out = tmp_path / "a.yaml"
    assert k8s.main(["model-cluster", "--encoder-site", "http://encoders.example.com:8090", "-o", str(out)]) == 0
    _, tier = parse_args(tier_args([d for d in yaml.safe_load_all(out.read_text()) if d], "cluster-a-cluster"))
    assert tier.next == ("encoders.example.com:8090",)
    assert k8s.main(["model-cluster", "--encoder-site", SITE]) == 2  # https without the graph's TLS
    assert "https://" in capsys.readouterr().err
    assert k8s.main(["epd", "--encoder-site", SITE]) == 2
    assert "not one (site: cluster)" in capsys.readouterr().err


def test_a_second_model_cluster_from_one_file_is_named_by_name(tmp_path, capsys):
    """--name renders the file as another model cluster (cluster-b, which the shipped site names too): its
    objects and its cluster tier's identity carry the name; a name the graph refuses is refused so."""
    out = tmp_path / "b.yaml"
    assert k8s.main(["model-cluster", "--name", "cluster-b", "--encoder-site", "http://203.0.113.10:8090",
                     "-o", str(out)]) == 0
    docs = [d for d in yaml.safe_load_all(out.read_text()) if d]
    assert one(docs, DGD)["metadata"]["name"] == "cluster-b" and one(docs, "Deployment", "cluster-b-cluster")
    graph = sites.with_options(graph_of("model-cluster", tls=ISSUED), "cluster-b", SITE)
    docs = k8s.render(graph, "mm-b")
    assert one(docs, "Certificate", "cluster-b-cluster-tls")["spec"]["uris"] == [
        "spiffe://mm-encoder.local/cluster-b/cache-cluster/cluster"]
    assert k8s.main(["model-cluster", "--name", "encoder-site", "--encoder-site", "http://203.0.113.10:8090"]) == 2
    assert "differs from its encoder site's graph" in capsys.readouterr().err


def test_site_options_fit_an_encoder_site_only(tmp_path, capsys):
    """--site-host, --site-cidr and --plaintext-site are refused on other graphs, a malformed network or name by
    its option; on an encoder site the command line writes the LoadBalancer as asked."""
    for argv in (["epd", "--site-host", "x.example.com"], ["model-cluster", "--encoder-site",
                                                             "http://203.0.113.10:8090", "--site-cidr", "10.0.0.0/8"]):
        assert k8s.main(argv) == 2
        assert "not one (site: encoder)" in capsys.readouterr().err
    for argv, flag in ((["--site-cidr", "10.0.0.1/8"], "--site-cidr"), (["--site-host", "bad_name"], "--site-host")):
        assert k8s.main(["encoder-site", "--plaintext-site", *argv]) == 2
        assert flag in capsys.readouterr().err
    out = tmp_path / "site.yaml"
    assert k8s.main(["encoder-site", "--plaintext-site", "--site-cidr", "198.51.100.0/24", "-o", str(out)]) == 0
    door = one([d for d in yaml.safe_load_all(out.read_text()) if d], "Service", "encoder-site-router-lb")
    assert door["spec"]["loadBalancerSourceRanges"] == ["198.51.100.0/24"]


def test_single_graphs_expose_nothing_new():
    """A single graph renders no LoadBalancer and no policy by address, as before sites."""
    docs = k8s.render(Graph.model_validate(yaml.safe_load((GRAPHS / "epd.yaml").read_text())))
    assert not any(d["kind"] == "Service" and "type" in d["spec"] for d in docs)
    assert "ipBlock" not in str([d for d in docs if d["kind"] == "NetworkPolicy"])


def test_an_encoder_site_of_two_models_mounts_each_checkpoint_and_routes_its_shards_by_model():
    """A GLM encoder component with its own checkpoint beside the Kimi one: its own claim, mounted at
    /models/glm, its `--model` there; the shards route each model to its encoders' Service."""
    doc = doc_of("encoder-site", tls=ISSUED)
    doc["components"]["encoder"]["serves"] = ["kimi-k2.5-vision"]
    doc["components"]["glm"] = {"kind": "encoder", "checkpoint": "/ck/glm", "serves": ["glm-5.2-vision"]}
    docs = k8s.render(Graph.model_validate(doc), "mm-site")
    dgd = one(docs, DGD)
    assert not errors(dgd, DYNAMO_GRAPH_DEPLOYMENT)
    glm = next(c for c in dgd["spec"]["components"] if c["name"] == "glm")
    pod = glm["podTemplate"]["spec"]
    main = pod["containers"][0]
    assert main["args"][main["args"].index("--model") + 1] == "/models/glm"
    assert {"name": "model", "mountPath": "/models/glm", "readOnly": True} in main["volumeMounts"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "encoder-site-glm-model", "readOnly": True}} \
        in pod["volumes"]
    kimi = next(c for c in dgd["spec"]["components"] if c["name"] == "encoder")["podTemplate"]["spec"]
    assert "/models/glm" not in str(kimi) and "encoder-site-glm-model" in dgd["metadata"]["annotations"][NOTE]
    shard = one(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    routes = [shard[i + 1] for i, a in enumerate(shard) if a == "--next-model"]
    assert routes == ["kimi-k2.5-vision=encoder-site-encoder-http:8090", "glm-5.2-vision=encoder-site-glm-http:8090"]
