"""Sites as graphs (docs/sites.md): what each kind of site may run, refused by name before anything
starts, and what the plan gives the one hop between sites: a model cluster's tier calls its encoder
site's router and checks it by the site's name; the router admits the clusters the site names."""

from __future__ import annotations

from pathlib import Path

import pytest

from mm_encoder.core.errors import GraphError
from mm_encoder.graph.plan import plan
from mm_encoder.graph.schema import Graph, load_graph
from mm_encoder.serve.cli import ServeOptions
from mm_encoder.serve.site import LocalSite

GRAPHS = Path(__file__).resolve().parents[1] / "graphs"


def graph(shipped: str, **update) -> dict:
    doc = load_graph(GRAPHS / f"{shipped}.yaml").model_dump()
    doc.update(update)
    return doc


def refused(doc: dict) -> str:
    with pytest.raises(ValueError) as e:
        Graph.model_validate(doc)
    return str(e.value)


def tiers(g: Graph, tmp_path: Path, bind: str = "127.0.0.1") -> dict:
    return {r.name: r.tier for cp in plan(g, LocalSite(g, tmp_path, bind)) for r in cp.replicas if r.tier}


def test_each_kind_of_site_refuses_the_other_kinds_components_by_name():
    site, cluster = graph("encoder-site"), graph("model-cluster")
    frontend = {"kind": "frontend"}
    assert "an encoder site runs encoders, a router and shared shards, not frontend" in refused(
        {**site, "components": {**site["components"], "frontend": frontend}})
    assert "an encoder site needs an encoder, a cache-router" in refused(
        {**site, "components": {k: v for k, v in site["components"].items() if k != "router"}})
    assert "a model cluster sends its misses to its encoder site; it runs no cache-router" in refused(
        {**cluster, "components": {**cluster["components"], "router": {"kind": "cache-router"}}})
    # an encoder there is the cluster's fallback (docs/cache-tiers.md, "An encoder site's faults")
    Graph.model_validate({**cluster, "components": {**cluster["components"], "fallback": {"kind": "encoder"}}})
    assert "through its cluster tier" in refused(
        {**cluster, "components": {k: v for k, v in cluster["components"].items() if k != "cluster"}})
    assert "only a graph with site: encoder takes it" in refused({**cluster, "clusters": ["x"]})


def test_tls_sites_name_each_other_consistently():
    tls = {"enabled": True}
    assert "admits the model clusters it names: set `clusters`" in refused(
        graph("encoder-site", tls=tls, clusters=()))
    assert "with TLS the encoder site is an https:// URL" in refused(
        graph("model-cluster", tls=tls, encoder_site={"url": "http://198.18.0.1:8090"}))
    assert "needs the graph's TLS" in refused(graph("model-cluster", encoder_site={"url": "https://198.18.0.1:8090"}))
    assert "differs from its encoder site's graph" in refused(graph("model-cluster", name="encoder-site"))


def test_the_hop_between_sites_is_planned_with_its_names(tmp_path):
    site = Graph.model_validate(graph("encoder-site", tls={"enabled": True}))
    router = tiers(site, tmp_path / "site", "198.18.0.1")["router"]
    assert router.listen == "198.18.0.1:8090" and router.tls_allow_graphs == ("cluster-a", "cluster-b")
    assert router.callers == ("cache-cluster",)
    assert all(t.listen.startswith("127.0.0.1:") for n, t in tiers(site, tmp_path / "s2").items() if n != "router")

    cluster = Graph.model_validate(graph("model-cluster", name="cluster-b", tls={"enabled": True},
                                         encoder_site={"url": "https://198.18.0.1:8090", "graph": "encoder-site"}))
    tier = tiers(cluster, tmp_path / "cluster")["cluster"]
    assert tier.next == tier.direct == ("198.18.0.1:8090",)
    assert tier.tls_server_name == "cache-router.encoder-site.mm-encoder.local"
    frontend = next(cp for cp in plan(cluster, LocalSite(cluster, tmp_path / "c2")) if cp.kind == "frontend")
    assert frontend.chain is not None and frontend.chain.route == "cluster,shared"


def test_a_model_cluster_without_its_sites_url_is_refused_before_it_starts(tmp_path):
    g = load_graph(GRAPHS / "model-cluster.yaml")
    with pytest.raises(GraphError, match="name its encoder site"):
        plan(g, LocalSite(g, tmp_path))


def test_serve_options_name_the_site_and_refuse_what_does_not_fit():
    g = ServeOptions("model-cluster", encoder_site="http://198.18.0.1:8090", name="cluster-b",
                     bind="127.0.0.1").apply(load_graph(GRAPHS / "model-cluster.yaml"))
    assert (g.name, g.encoder_site.url) == ("cluster-b", "http://198.18.0.1:8090")
    with pytest.raises(GraphError, match="--encoder-site names a model cluster's encoder site"):
        ServeOptions("epd", encoder_site="http://x:1").apply(load_graph(GRAPHS / "epd.yaml"))
    with pytest.raises(GraphError, match=r"--bind 198\.18\.0\.1 serves other hosts: with TLS"):
        ServeOptions("epd", bind="198.18.0.1").apply(load_graph(GRAPHS / "epd.yaml"))
    loud = ServeOptions("epd", bind="198.18.0.1", plaintext_off_loopback=True).apply(load_graph(GRAPHS / "epd.yaml"))
    assert not loud.tls.enabled
    assert ServeOptions("encoder-site", port=9100).apply(load_graph(GRAPHS / "encoder-site.yaml")).site_port == 9100


def test_one_machine_runs_an_encoder_sites_door_as_one_router():
    from mm_encoder.serve.cli import check_local

    doc = graph("encoder-site")
    doc["components"]["router"]["replicas"] = 2
    with pytest.raises(GraphError, match="its door, one port on one machine"):
        check_local(Graph.model_validate(doc))


def test_several_models_make_an_encoder_site_each_encoder_naming_its_own(tmp_path):
    site = graph("encoder-site")
    two = {**site["components"], "glm": {"kind": "encoder", "checkpoint": "/ck/glm", "serves": ["glm-5.2-vision"]}}
    assert "name the models each one serves" in refused({**site, "components": two})
    two["encoder"] = {**two["encoder"], "serves": ["Kimi-K2.5", "GLM-5.2-VISION"]}
    assert "glm-5.2-vision is served by encoder too" in refused({**site, "components": two})
    epd = load_graph(GRAPHS / "epd.yaml").model_dump()
    assert "make an encoder site" in refused({**epd, "components": {**epd["components"], "glm": two["glm"]}})
    assert "`checkpoint` and `serves` are an encoder component's" in refused(
        {**epd, "components": {**epd["components"], "shared": {**epd["components"]["shared"], "serves": ["x"]}}})
    two["encoder"] = {**two["encoder"], "serves": ["Kimi-K2.5"]}
    g = Graph.model_validate({**site, "components": two})
    plans = {cp.name: cp for cp in plan(g, LocalSite(g, tmp_path))}
    assert plans["glm"].replicas[0].argv[:2] == ("--model", "/ck/glm")
    shard = plans["shared"].replicas[0].tier
    glm, kimi = (f"{r.http[0]}:{r.http[1]}" for name in ("glm", "encoder") for r in plans[name].replicas)
    assert shard.models == {"kimi-k2.5": (kimi,), "glm-5.2-vision": (glm,)}
