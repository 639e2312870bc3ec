"""One plan for both deployments: `mm-encoder serve` and `render-k8s` run the same components, in
the same order, with the same options; only the site's addresses, ports and paths differ."""

from __future__ import annotations

from pathlib import Path

import pytest

from mm_encoder.core.dynamo import MAX_MESSAGE_SIZE
from mm_encoder.deploy.graph import load_graph
from mm_encoder.deploy.k8s_site import K8sNames, K8sSite
from mm_encoder.deploy.local import LocalSite
from mm_encoder.deploy.plan import ORDER, GeneratedLLM, plan

GRAPHS = Path(__file__).resolve().parents[1] / "graphs"
# Flags whose values are the site's (an address, a port, a path), not the component's options.
SITE_VALUES = {"--http-host", "--http-port", "--listen", "--run-dir", "--cache-dir", "--next", "--direct", "--shard",
               "--encoder-http", "--encoder-chain", "--stock-model-dir", "--handle-chain", "--model-dir",
               "--checkpoint", "--encoder-checkpoint"}


def shape(argv: tuple[str, ...]) -> list[str]:
    """argv with the site's values blanked out."""
    return [("<site>" if i and argv[i - 1] in SITE_VALUES else a) for i, a in enumerate(argv)]


def opt(argv, flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


@pytest.fixture(params=["epd", "agg", "epd-stock"])
def graph(request):
    return load_graph(GRAPHS / f"{request.param}.yaml")


def test_local_and_kubernetes_plans_differ_only_in_the_site(graph, tmp_path):
    local = plan(graph, LocalSite(graph, tmp_path))
    k8s = plan(graph, K8sSite(K8sNames(graph)))
    assert [(c.name, c.kind, c.module, len(c.replicas), c.health_path, c.uses) for c in local] == \
           [(c.name, c.kind, c.module, len(c.replicas), c.health_path, c.uses) for c in k8s]
    assert [c.kind for c in local] == sorted((c.kind for c in local), key=ORDER.index)  # start order
    for a, b in zip(local, k8s, strict=True):
        assert {tuple(shape(r.argv)) for r in a.replicas} == {tuple(shape(r.argv)) for r in b.replicas}
        args = a.component.args  # the graph's own args come last, as given, everywhere
        assert all(r.argv[len(r.argv) - len(args):] == args for r in (*a.replicas, *b.replicas))
        shared = {k: v for k, v in a.env.items() if not k.startswith("DYN_") or k in ("DYN_REQUEST_PLANE",
                                                                                       "DYN_EVENT_PLANE")}
        assert shared == {k: v for k, v in b.env.items() if k in shared}


def test_local_site_wires_the_chain_by_loopback_ports(tmp_path):
    g = load_graph(GRAPHS / "epd.yaml")
    by_kind = {c.kind: c for c in plan(g, LocalSite(g, tmp_path))}
    encoder, shared, router = by_kind["encoder"], by_kind["cache-shared"], by_kind["cache-router"]
    cluster, frontend = by_kind["cache-cluster"], by_kind["frontend"]
    encoders = [f"127.0.0.1:{r.port}" for r in encoder.replicas]
    shards = [f"127.0.0.1:{r.port}" for r in shared.replicas]
    assert [r.name for r in shared.replicas] == ["shared-0", "shared-1"]
    assert all(opt(r.argv, "--next") == encoders for r in shared.replicas)
    assert opt(router.replicas[0].argv, "--shard") == shards
    assert opt(cluster.replicas[0].argv, "--next") == [f"127.0.0.1:{router.replicas[0].port}"]
    assert opt(cluster.replicas[0].argv, "--direct") == encoders
    assert opt(frontend.replicas[0].argv, "--encoder-http") == [f"http://127.0.0.1:{cluster.replicas[0].port}"]
    assert opt(frontend.replicas[0].argv, "--encoder-route") == ["cluster,shared"]
    assert frontend.replicas[0].port == g.frontend_port
    ports = [r.port for c in by_kind.values() for r in c.replicas if r.port]
    assert len(ports) == len(set(ports))  # every replica on its own port
    assert {r.name: opt(r.argv, "--run-dir") for r in shared.replicas} == {
        "shared-0": [str(tmp_path / "nginx-shared-0")], "shared-1": [str(tmp_path / "nginx-shared-1")]}
    engine = by_kind["engine"]
    assert opt(engine.replicas[0].argv, "--name") == [g.llm.name] and engine.health_path is None
    assert engine.env["DYN_DISCOVERY_BACKEND"] == "file" and engine.env["DYN_FILE_KV"] == str(tmp_path / "dynamo-store")
    assert engine.env["DYN_TCP_MAX_MESSAGE_SIZE"] == str(MAX_MESSAGE_SIZE)
    assert "DYN_TCP_MAX_MESSAGE_SIZE" not in by_kind["frontend"].env  # it sends handles, never bodies
    # engines trust exactly the chain the frontend's handles name
    assert opt(engine.replicas[0].argv, "--encoder-chain") == opt(frontend.replicas[0].argv, "--encoder-http")


def test_the_generated_llm_is_one_call_on_both_sites(tmp_path):
    g = load_graph(GRAPHS / "epd.yaml")
    llm = GeneratedLLM.of(g)
    assert llm.argv("/x") == ["--make-model-dir", "/x", "--model", g.llm.vision_model, "--name", g.llm.name,
                              "--context-length", str(g.llm.context_length)]
    from mm_encoder.engines.reference import EngineSettings

    s = EngineSettings(_cli_parse_args=llm.argv(str(tmp_path / "a")))  # the engine's own parser takes it
    assert (s.model, s.name, s.context_length) == (g.llm.vision_model, g.llm.name, g.llm.context_length)
    llm.write(tmp_path / "b")
    assert (tmp_path / "b" / "config.json").is_file()
    assert GeneratedLLM.of(g.model_copy(update={"llm": g.llm.model_copy(update={"model_dir": "/m"})})) is None
