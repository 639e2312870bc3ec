"""`mm-encoder render-k8s`: graphs/*.yaml as a DynamoGraphDeployment plus the nginx tiers.

Checked against the documented DynamoGraphDeployment shape (nvidia.com/v1alpha1:
`spec.services.<Name>.{componentType, replicas, extraPodSpec.mainContainer}`; componentType one of
the operator's types, of which we use `frontend` and `worker`), and the rendered command lines are
fed to the real parsers of the worker, the frontend and `mm-encoder cache`.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
import yaml

from mm_encoder.core.errors import GraphError
from mm_encoder.deploy import k8s
from mm_encoder.deploy.graph import Graph, load_graph

GRAPHS = Path(__file__).resolve().parents[1] / "graphs"
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# The operator's component types (deploy/operator/internal/consts: planner, frontend, worker,
# prefill, decode, epp, default); the renderer uses the first two.
OPERATOR_COMPONENT_TYPES = {"planner", "frontend", "worker", "prefill", "decode", "epp", "default"}
MODULES = {"frontend": "mm_encoder.frontend", "encoder": "mm_encoder.worker", "engine": "mm_encoder.engines.reference"}


def docs_of(graph: Graph) -> list[dict]:
    """Rendered to text and parsed back, as kubectl would read it."""
    return [d for d in yaml.safe_load_all(k8s.render_yaml(graph)) if d]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def opt(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def graph_of(**changes) -> Graph:
    doc = yaml.safe_load((GRAPHS / "epd.yaml").read_text())
    for path, value in changes.items():
        node = doc
        *parents, last = path.split("__")
        for p in parents:
            node = node[p]
        node[last] = value
    return Graph.model_validate(doc)


@pytest.fixture(scope="module")
def epd() -> Graph:
    return load_graph(GRAPHS / "epd.yaml")


@pytest.fixture(scope="module")
def agg() -> Graph:
    return load_graph(GRAPHS / "agg.yaml")


@pytest.fixture(scope="module")
def epd_docs(epd) -> list[dict]:
    return docs_of(epd)


@pytest.mark.parametrize("name", ["epd", "agg", "epd-stock"])
def test_graph_deployment_has_the_documented_shape(name):
    graph = load_graph(GRAPHS / f"{name}.yaml")
    dgd = one(docs_of(graph), "DynamoGraphDeployment")
    assert dgd["apiVersion"] == "nvidia.com/v1alpha1"
    assert dgd["metadata"]["name"] == graph.name
    services = dgd["spec"]["services"]
    dynamo_components = {n: c for n, c in graph.components.items() if c.kind in MODULES}
    assert set(services) == {k8s.pascal(n) for n in dynamo_components}
    for cname, c in dynamo_components.items():
        svc = services[k8s.pascal(cname)]
        assert svc["componentType"] in OPERATOR_COMPONENT_TYPES
        assert svc["componentType"] == ("frontend" if c.kind == "frontend" else "worker")
        assert type(svc["replicas"]) is int and svc["replicas"] == c.replicas
        main = svc["extraPodSpec"]["mainContainer"]
        assert main["image"] == graph.image
        assert main["command"] == ["python", "-m", "dynamo.frontend" if c.stock else MODULES[c.kind]]
        assert all(isinstance(a, str) for a in main["args"])
        env = {e["name"]: e["value"] for e in main["env"]}
        # bodies fetched over RPC (the chain's fallback) are the embeddings' size; the frontend sends handles
        assert env.get("DYN_TCP_MAX_MESSAGE_SIZE") == ("268435456" if c.kind in ("encoder", "engine") else None)
        assert env["DYN_NAMESPACE"] == graph.namespace
        assert opt(main["args"], "--namespace") == [graph.namespace]
        if graph.stock_frontend and c.kind == "encoder":  # Dynamo's Encode worker; handles name the chain
            assert opt(main["args"], "--stock-model-dir") == [k8s.LLM_DIR]
            assert opt(main["args"], "--handle-chain") == [f"http://{graph.name}-cluster:{k8s.TIER_PORT}"]
        if graph.stock_frontend and c.kind == "engine":
            assert opt(main["args"], "--frontend") == ["stock"]
    assert [s["componentType"] for s in services.values()].count("frontend") == 1


def test_every_name_is_a_dns1123_label(epd_docs, agg):
    for docs in (epd_docs, docs_of(agg)):
        for d in docs:
            assert DNS1123.match(d["metadata"]["name"]) and len(d["metadata"]["name"]) <= 63
            if d["kind"] == "DynamoGraphDeployment":  # the operator names its objects <graph>-<service lowercased>
                for svc in d["spec"]["services"]:
                    assert DNS1123.match(f"{d['metadata']['name']}-{svc.lower()}")
        names = Counter((d["kind"], d["metadata"]["name"]) for d in docs)
        assert max(names.values()) == 1


def test_shared_tier_is_a_statefulset_behind_a_headless_service(epd, epd_docs):
    sts = one(epd_docs, "StatefulSet")
    headless = one(epd_docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert sts["spec"]["replicas"] == epd.components["shared"].replicas == 2
    assert sts["metadata"]["name"] == "epd-shared"
    pod = sts["spec"]["template"]["spec"]
    cache = next(v for v in pod["volumes"] if v["name"] == "cache")
    assert cache["emptyDir"]["medium"] == "Memory"
    assert pod["containers"][0]["command"] == ["python", "-m", "mm_encoder.deploy.cache_tiers"]
    args = pod["containers"][0]["args"]
    assert args[:3] == ["up", "--tier", "shared"]
    assert opt(args, "--max-size") == ["2g"]  # the graph's value replaces the default, once
    assert _bytes(cache["emptyDir"]["sizeLimit"]) > 2 << 30
    assert opt(args, "--next") == [f"epd-encoder-http:{k8s.ENCODER_PORT}"]
    probe = pod["containers"][0]["readinessProbe"]["httpGet"]
    assert probe["path"] == "/_cache/health"


def _bytes(quantity: str) -> int:
    m = re.match(r"^(\d+)(Mi|Gi)$", quantity)
    assert m, quantity
    return int(m.group(1)) << (20 if m.group(2) == "Mi" else 30)


def test_router_shards_are_exactly_the_statefulset_pods(epd_docs):
    sts = one(epd_docs, "StatefulSet")
    router = one(epd_docs, "Deployment", "epd-router")
    shards = opt(router["spec"]["template"]["spec"]["containers"][0]["args"], "--shard")
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert shards == [f"{name}-{i}.{service}:{k8s.TIER_PORT}" for i in range(sts["spec"]["replicas"])]
    one(epd_docs, "Service", "epd-router")


def test_cluster_tier_and_frontend_are_wired_to_the_chain(epd_docs):
    cluster = one(epd_docs, "Deployment", "epd-cluster")
    pod = cluster["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert opt(args, "--next") == ["epd-router:8080"]
    assert opt(args, "--direct") == ["epd-encoder-http:8090"]
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])
    one(epd_docs, "Service", "epd-cluster")
    frontend = one(epd_docs, "DynamoGraphDeployment")["spec"]["services"]["Frontend"]
    fargs = frontend["extraPodSpec"]["mainContainer"]["args"]
    assert opt(fargs, "--encoder-http") == ["http://epd-cluster:8080"]
    assert opt(fargs, "--encoder-route") == ["cluster,shared"]
    assert opt(fargs, "--http-port") == [str(k8s.FRONTEND_PORT)]
    assert opt(fargs, "--max-inflight-media") == ["8"]  # the graph's args come through
    assert "--inline-media" not in fargs


def test_encoder_service_selects_the_encoder_pods(epd_docs):
    svc = one(epd_docs, "Service", "epd-encoder-http")
    assert svc["spec"]["ports"][0]["port"] == svc["spec"]["ports"][0]["targetPort"] == 8090
    encoder = one(epd_docs, "DynamoGraphDeployment")["spec"]["services"]["Encoder"]
    pod_labels = encoder["extraPodMetadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    for other in ("Frontend", "Engine"):  # and nothing else
        labels = one(epd_docs, "DynamoGraphDeployment")["spec"]["services"][other]["extraPodMetadata"]["labels"]
        assert not svc["spec"]["selector"].items() <= labels.items()
    assert "nvidia.com/dynamo-component" in svc["metadata"]["annotations"]["mm-encoder/note"]
    env = {e["name"]: e["value"] for e in encoder["extraPodSpec"]["mainContainer"]["env"]}
    assert env["DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS"] == '["encode"]'
    # Resources from the graph, in the DynamoGraphDeployment's own vocabulary.
    assert encoder["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"gpu": "1"}}


def test_agg_renders_no_nginx_objects_and_engines_encode_inline(agg):
    docs = docs_of(agg)
    assert [d["kind"] for d in docs] == ["DynamoGraphDeployment"]
    services = docs[0]["spec"]["services"]
    engine = services["Engine"]["extraPodSpec"]["mainContainer"]["args"]
    assert opt(engine, "--encoder-model") == [agg.llm.vision_model]
    frontend = services["Frontend"]["extraPodSpec"]["mainContainer"]["args"]
    assert "--inline-media" in frontend and "--encoder-http" not in frontend


def test_generated_llm_dir_is_made_by_an_init_container(epd_docs, epd):
    services = one(epd_docs, "DynamoGraphDeployment")["spec"]["services"]
    for name in ("Frontend", "Engine"):
        pod = services[name]["extraPodSpec"]
        init = pod["initContainers"][0]
        assert init["command"] == ["python", "-m", "mm_encoder.engines.reference", "--make-model-dir", k8s.LLM_DIR,
                                   "--model", epd.llm.vision_model, "--name", epd.llm.name,
                                   "--context-length", str(epd.llm.context_length)]
        assert {"name": "llm", "emptyDir": {}} in pod["volumes"]
        assert opt(pod["mainContainer"]["args"], "--model-dir") == [k8s.LLM_DIR]
    assert "Encoder" not in [n for n, s in services.items() if "initContainers" in s["extraPodSpec"]]


def test_real_model_and_checkpoint_come_from_claims():
    graph = graph_of(llm__model_dir="/data/kimi", llm__checkpoint="/data/vision")
    dgd = one(docs_of(graph), "DynamoGraphDeployment")
    assert dgd["spec"]["pvcs"] == [{"name": "epd-llm", "create": False}, {"name": "epd-vision", "create": False}]
    services = dgd["spec"]["services"]
    assert services["Engine"]["volumeMounts"] == [{"name": "epd-llm", "mountPoint": k8s.LLM_DIR}]
    assert services["Encoder"]["volumeMounts"] == [{"name": "epd-vision", "mountPoint": k8s.VISION_DIR}]
    assert opt(services["Encoder"]["extraPodSpec"]["mainContainer"]["args"], "--checkpoint") == [k8s.VISION_DIR]
    assert "initContainers" not in services["Frontend"]["extraPodSpec"]


def test_component_image_env_and_resources_override_the_defaults():
    graph = graph_of(components__engine={"kind": "engine", "replicas": 3, "image": "reg.example/mm:2",
                                         "env": {"DYN_EVENT_PLANE": "nats", "EXTRA": "1"},
                                         "resources": {"limits": {"nvidia.com/gpu": "2", "example.com/nic": "1"}}},
                     components__shared={"kind": "cache-shared", "replicas": 3,
                                         "resources": {"limits": {"memory": "9Gi"}}})
    docs = docs_of(graph)
    engine = one(docs, "DynamoGraphDeployment")["spec"]["services"]["Engine"]
    main = engine["extraPodSpec"]["mainContainer"]
    assert engine["replicas"] == 3 and main["image"] == "reg.example/mm:2"
    env = {e["name"]: e["value"] for e in main["env"]}
    assert env["DYN_EVENT_PLANE"] == "nats" and env["EXTRA"] == "1" and env["DYN_TCP_MAX_MESSAGE_SIZE"] == "268435456"
    assert engine["resources"] == {"limits": {"gpu": "2", "custom": {"example.com/nic": "1"}}}
    sts = one(docs, "StatefulSet")
    assert sts["spec"]["template"]["spec"]["containers"][0]["resources"] == {"limits": {"memory": "9Gi"}}
    router = one(docs, "Deployment", "epd-router")
    assert len(opt(router["spec"]["template"]["spec"]["containers"][0]["args"], "--shard")) == 3


def test_rendered_command_lines_parse_with_the_real_parsers(epd, epd_docs, capsys):
    from mm_encoder.deploy.cache_tiers import main as cache_main
    from mm_encoder.engines.reference import EngineSettings
    from mm_encoder.frontend.settings import FrontendSettings
    from mm_encoder.service.settings import WorkerSettings

    services = one(epd_docs, "DynamoGraphDeployment")["spec"]["services"]
    worker = WorkerSettings(_cli_parse_args=services["Encoder"]["extraPodSpec"]["mainContainer"]["args"])
    assert worker.dynamo and worker.http_port == 8090 and worker.http_host == "0.0.0.0" and worker.namespace == "mm"
    frontend = FrontendSettings(_cli_parse_args=services["Frontend"]["extraPodSpec"]["mainContainer"]["args"])
    assert frontend.encoder_http == "http://epd-cluster:8080" and frontend.http_port == k8s.FRONTEND_PORT
    engine = EngineSettings(_cli_parse_args=services["Engine"]["extraPodSpec"]["mainContainer"]["args"])
    assert (str(engine.model_dir), engine.name, engine.namespace) == (k8s.LLM_DIR, epd.llm.name, "mm")
    for d in epd_docs:
        if d["kind"] in ("StatefulSet", "Deployment"):
            args = d["spec"]["template"]["spec"]["containers"][0]["args"]
            assert args[0] == "up"
            assert cache_main(["render", *args[1:]]) == 0, capsys.readouterr().err
    capsys.readouterr()


def test_names_that_kubernetes_would_refuse_are_graph_errors():
    with pytest.raises(GraphError, match="DNS-1123"):
        k8s.render(graph_of(name="a" * 60))
    doc = yaml.safe_load((GRAPHS / "epd.yaml").read_text())
    doc["components"]["shared-"] = doc["components"].pop("shared")  # fine for a graph, not for Kubernetes
    with pytest.raises(GraphError, match="DNS-1123"):
        k8s.render(Graph.model_validate(doc))
    doc = yaml.safe_load((GRAPHS / "epd.yaml").read_text())
    doc["components"]["my-enc"] = doc["components"].pop("encoder")  # the operator names it epd-myenc ...
    doc["components"]["myenc"] = doc["components"].pop("cluster")  # ... and so would this tier be
    with pytest.raises(GraphError, match="epd-myenc"):
        k8s.render(Graph.model_validate(doc))


def test_main_writes_yaml_and_refuses_bad_graphs(tmp_path, capsys):
    assert k8s.main([str(GRAPHS / "agg.yaml")]) == 0
    out = capsys.readouterr().out
    assert one([d for d in yaml.safe_load_all(out) if d], "DynamoGraphDeployment")["metadata"]["name"] == "agg"
    target = tmp_path / "epd.k8s.yaml"
    assert k8s.main([str(GRAPHS / "epd.yaml"), "-o", str(target)]) == 0
    assert one([d for d in yaml.safe_load_all(target.read_text()) if d], "StatefulSet")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: Bad_Name\ncomponents: {}\n")
    assert k8s.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert "invalid graph" in err and "name" in err
    assert k8s.main([str(tmp_path / "missing.yaml")]) == 2
    assert "no such graph file" in capsys.readouterr().err
