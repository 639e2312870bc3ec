"""`mm-encoder render-k8s`: graphs/*.yaml as a DynamoGraphDeployment plus the nginx tiers.

Checked against the Dynamo operator's v1beta1 DynamoGraphDeployment CRD (`spec.components[]`: `name`, `type`,
`replicas`, `runtimeVersionOverride`, `podTemplate` with the container `main`), field by field through
tests/k8s_schema.py. Schema source: ai-dynamo/dynamo
`deploy/operator/config/crd/bases/nvidia.com_dynamographdeployments.yaml` at commit
01cc1c3b677b20c5dd72d9eb76962dc04b55b8be (`versions[name=v1beta1].schema.openAPIV3Schema`), with the Go types
`deploy/operator/api/v1beta1/{dynamographdeployment_types.go@0fddc01b, dynamocomponentdeployment_types.go@006b6e10,
common.go@02911c80}` and the Dynamo v1.6.x API reference (DCD Reference). The rendered command lines are fed to
the real parsers of the worker, the frontend and `mm-encoder cache`.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml
from k8s_schema import DYNAMO_GRAPH_DEPLOYMENT, errors

from mm_encoder.core.errors import GraphError
from mm_encoder.deploy import k8s
from mm_encoder.deploy.graph import Graph, load_graph

GRAPHS = Path(__file__).resolve().parents[1] / "graphs"
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
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


def components(dgd: dict) -> dict[str, dict]:
    return {c["name"]: c for c in dgd["spec"]["components"]}


def main_of(component: dict) -> dict:
    (main,) = [c for c in component["podTemplate"]["spec"]["containers"] if c["name"] == "main"]
    return main


def env_of(component: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in main_of(component)["env"]}


def test_schema_check_refuses_misspelled_and_v1alpha1_fields(epd_docs):
    """The checker is strict: an unknown field, a wrong enum, a v1alpha1 field or a bad type is an error."""
    dgd = one(epd_docs, "DynamoGraphDeployment")
    assert errors(dgd, DYNAMO_GRAPH_DEPLOYMENT) == []
    for path, value, message in [
        (("spec", "components", 0, "componentType"), "worker", "unknown field 'componentType'"),
        (("spec", "components", 0, "type"), "encode", "is not one of"),
        (("spec", "services"), {}, "unknown field 'services'"),
        (("spec", "components", 0, "replicas"), "1", "is not an integer"),
        (("spec", "components", 0, "podTemplate", "spec", "containers", 0, "volumeMount"), [], "unknown field"),
        (("spec", "components", 1, "name"), "encoder", "duplicate name"),
        (("apiVersion",), "nvidia.com/v1alpha1", "is not 'nvidia.com/v1beta1'"),
    ]:
        broken = copy.deepcopy(dgd)
        node = broken
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
        assert any(message in e for e in errors(broken, DYNAMO_GRAPH_DEPLOYMENT)), (path, value)


@pytest.mark.parametrize("name", ["epd", "agg", "epd-stock"])
def test_graph_deployment_has_the_crd_shape(name):
    graph = load_graph(GRAPHS / f"{name}.yaml")
    dgd = one(docs_of(graph), "DynamoGraphDeployment")
    assert errors(dgd, DYNAMO_GRAPH_DEPLOYMENT) == []
    assert dgd["apiVersion"] == "nvidia.com/v1beta1"
    assert dgd["metadata"]["name"] == graph.name
    comps = components(dgd)
    dynamo_components = {n: c for n, c in graph.components.items() if c.kind in MODULES}
    assert list(comps) == [n for n in comps if n in dynamo_components] and set(comps) == set(dynamo_components)
    for cname, c in dynamo_components.items():
        comp = comps[cname]
        assert comp["type"] == ("frontend" if c.kind == "frontend" else "worker")  # the CRD has no encode type
        assert type(comp["replicas"]) is int and comp["replicas"] == c.replicas
        assert comp["runtimeVersionOverride"] == k8s.DYNAMO_VERSION
        main = main_of(comp)
        assert main["image"] == graph.image
        assert main["command"] == ["python", "-m", "dynamo.frontend" if c.stock else MODULES[c.kind]]
        assert all(isinstance(a, str) for a in main["args"])
        env = env_of(comp)
        # bodies fetched over RPC (the chain's fallback) are the embeddings' size; the frontend sends handles
        assert env.get("DYN_TCP_MAX_MESSAGE_SIZE") == ("268435456" if c.kind in ("encoder", "engine") else None)
        assert env["DYN_NAMESPACE"] == graph.namespace
        assert "DYN_DISCOVERY_BACKEND" not in env  # runtime.discovery default: the operator's own
        assert opt(main["args"], "--namespace") == [graph.namespace]
        if graph.stock_frontend and c.kind == "encoder":  # Dynamo's Encode worker; handles name the chain
            assert opt(main["args"], "--stock-model-dir") == [k8s.LLM_DIR]
            assert opt(main["args"], "--handle-chain") == [f"http://{graph.name}-cluster:{k8s.TIER_PORT}"]
        if graph.stock_frontend and c.kind == "engine":
            assert opt(main["args"], "--frontend") == ["stock"]
    assert [c["type"] for c in comps.values()].count("frontend") == 1


def test_runtime_field_sets_discovery_and_planes():
    graph = graph_of(runtime={"discovery": "etcd", "request_plane": "nats", "event_plane": "nats"})
    dgd = one(docs_of(graph), "DynamoGraphDeployment")
    assert errors(dgd, DYNAMO_GRAPH_DEPLOYMENT) == []
    for comp in dgd["spec"]["components"]:
        env = env_of(comp)
        planes = env["DYN_DISCOVERY_BACKEND"], env["DYN_REQUEST_PLANE"], env["DYN_EVENT_PLANE"]
        assert planes == ("etcd", "nats", "nats")
        assert "ETCD_ENDPOINTS" not in env and "NATS_SERVER" not in env  # the operator's platform sets them
    note = dgd["metadata"]["annotations"]["mm-encoder/note"]
    assert "ETCD_ENDPOINTS" in note and "NATS_SERVER" in note
    with pytest.raises(GraphError, match=r"runtime\.discovery"):
        k8s.render(graph_of(runtime={"discovery": "file"}))


def test_every_name_is_a_dns1123_label(epd_docs, agg):
    for docs in (epd_docs, docs_of(agg)):
        for d in docs:
            assert DNS1123.match(d["metadata"]["name"]) and len(d["metadata"]["name"]) <= 63
            if d["kind"] == "DynamoGraphDeployment":  # the operator names its objects <graph>-<component>
                for comp in d["spec"]["components"]:
                    assert DNS1123.match(f"{d['metadata']['name']}-{comp['name']}")
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
    fargs = main_of(components(one(epd_docs, "DynamoGraphDeployment"))["frontend"])["args"]
    assert opt(fargs, "--encoder-http") == ["http://epd-cluster:8080"]
    assert opt(fargs, "--encoder-route") == ["cluster,shared"]
    assert opt(fargs, "--http-port") == [str(k8s.FRONTEND_PORT)]
    assert opt(fargs, "--max-inflight-media") == ["8"]  # the graph's args come through
    assert "--inline-media" not in fargs


def test_encoder_service_selects_the_encoder_pods(epd_docs):
    svc = one(epd_docs, "Service", "epd-encoder-http")
    assert svc["spec"]["ports"][0]["port"] == svc["spec"]["ports"][0]["targetPort"] == 8090
    comps = components(one(epd_docs, "DynamoGraphDeployment"))
    encoder = comps["encoder"]
    assert svc["spec"]["selector"].items() <= encoder["podTemplate"]["metadata"]["labels"].items()
    for other in ("frontend", "engine"):  # and nothing else
        assert not svc["spec"]["selector"].items() <= comps[other]["podTemplate"]["metadata"]["labels"].items()
    assert "nvidia.com/dynamo-component" in svc["metadata"]["annotations"]["mm-encoder/note"]
    assert env_of(encoder)["DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS"] == '["encode"]'
    assert main_of(encoder)["ports"] == [{"name": "mm-http", "containerPort": 8090, "protocol": "TCP"}]
    # Resources from the graph, in Kubernetes' own names (v1beta1 takes the native container resources).
    assert main_of(encoder)["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"},
                                             "limits": {"nvidia.com/gpu": "1"}}


def test_agg_renders_no_nginx_objects_and_engines_encode_inline(agg):
    docs = docs_of(agg)
    assert [d["kind"] for d in docs] == ["DynamoGraphDeployment"]
    comps = components(docs[0])
    assert opt(main_of(comps["engine"])["args"], "--encoder-model") == [agg.llm.vision_model]
    frontend = main_of(comps["frontend"])["args"]
    assert "--inline-media" in frontend and "--encoder-http" not in frontend


def test_generated_llm_dir_is_made_by_an_init_container(epd_docs, epd):
    comps = components(one(epd_docs, "DynamoGraphDeployment"))
    for name in ("frontend", "engine"):
        pod = comps[name]["podTemplate"]["spec"]
        init = pod["initContainers"][0]
        assert init["command"] == ["python", "-m", "mm_encoder.engines.reference", "--make-model-dir", k8s.LLM_DIR,
                                   "--model", epd.llm.vision_model, "--name", epd.llm.name,
                                   "--context-length", str(epd.llm.context_length)]
        assert {"name": "llm", "emptyDir": {}} in pod["volumes"]
        assert {"name": "llm", "mountPath": k8s.LLM_DIR} in main_of(comps[name])["volumeMounts"]
        assert opt(main_of(comps[name])["args"], "--model-dir") == [k8s.LLM_DIR]
    assert "initContainers" not in comps["encoder"]["podTemplate"]["spec"]


def test_real_model_and_checkpoint_come_from_claims():
    graph = graph_of(llm__model_dir="/data/kimi", llm__checkpoint="/data/vision")
    dgd = one(docs_of(graph), "DynamoGraphDeployment")
    assert errors(dgd, DYNAMO_GRAPH_DEPLOYMENT) == []
    comps = components(dgd)
    engine, encoder = comps["engine"]["podTemplate"]["spec"], comps["encoder"]["podTemplate"]["spec"]
    assert engine["volumes"] == [{"name": "llm", "persistentVolumeClaim": {"claimName": "epd-llm", "readOnly": True}}]
    assert main_of(comps["engine"])["volumeMounts"] == [{"name": "llm", "mountPath": k8s.LLM_DIR, "readOnly": True}]
    assert encoder["volumes"] == [{"name": "vision",
                                   "persistentVolumeClaim": {"claimName": "epd-vision", "readOnly": True}}]
    assert main_of(comps["encoder"])["volumeMounts"] == [{"name": "vision", "mountPath": k8s.VISION_DIR,
                                                         "readOnly": True}]
    assert opt(main_of(comps["encoder"])["args"], "--checkpoint") == [k8s.VISION_DIR]
    assert "initContainers" not in comps["frontend"]["podTemplate"]["spec"]


def test_component_image_env_and_resources_override_the_defaults():
    graph = graph_of(components__engine={"kind": "engine", "replicas": 3, "image": "reg.example/mm:2",
                                         "env": {"DYN_EVENT_PLANE": "nats", "EXTRA": "1"},
                                         "resources": {"limits": {"nvidia.com/gpu": "2", "example.com/nic": "1"}}},
                     components__shared={"kind": "cache-shared", "replicas": 3,
                                         "resources": {"limits": {"memory": "9Gi"}}})
    docs = docs_of(graph)
    dgd = one(docs, "DynamoGraphDeployment")
    assert errors(dgd, DYNAMO_GRAPH_DEPLOYMENT) == []
    engine = components(dgd)["engine"]
    main = main_of(engine)
    assert engine["replicas"] == 3 and main["image"] == "reg.example/mm:2"
    env = env_of(engine)
    assert env["DYN_EVENT_PLANE"] == "nats" and env["EXTRA"] == "1" and env["DYN_TCP_MAX_MESSAGE_SIZE"] == "268435456"
    assert main["resources"] == {"limits": {"nvidia.com/gpu": "2", "example.com/nic": "1"}}
    sts = one(docs, "StatefulSet")
    assert sts["spec"]["template"]["spec"]["containers"][0]["resources"] == {"limits": {"memory": "9Gi"}}
    router = one(docs, "Deployment", "epd-router")
    assert len(opt(router["spec"]["template"]["spec"]["containers"][0]["args"], "--shard")) == 3
    with pytest.raises(GraphError, match=r"components\.engine\.resources"):
        k8s.render(graph_of(components__engine={"kind": "engine", "resources": {"claims": {"a": "b"}}}))


def test_rendered_command_lines_parse_with_the_real_parsers(epd, epd_docs, capsys):
    from mm_encoder.deploy.cache_tiers import main as cache_main
    from mm_encoder.engines.reference import EngineSettings
    from mm_encoder.frontend.settings import FrontendSettings
    from mm_encoder.service.settings import WorkerSettings

    comps = components(one(epd_docs, "DynamoGraphDeployment"))
    worker = WorkerSettings(_cli_parse_args=main_of(comps["encoder"])["args"])
    assert worker.dynamo and worker.http_port == 8090 and worker.http_host == "0.0.0.0" and worker.namespace == "mm"
    frontend = FrontendSettings(_cli_parse_args=main_of(comps["frontend"])["args"])
    assert frontend.encoder_http == "http://epd-cluster:8080" and frontend.http_port == k8s.FRONTEND_PORT
    engine = EngineSettings(_cli_parse_args=main_of(comps["engine"])["args"])
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
    doc["components"]["enc"] = doc["components"].pop("encoder")  # its HTTP Service is epd-enc-http ...
    doc["components"]["enc-http"] = doc["components"].pop("engine")  # ... and so would the operator name this
    with pytest.raises(GraphError, match="epd-enc-http"):
        k8s.render(Graph.model_validate(doc))


def test_main_writes_yaml_and_refuses_bad_graphs(tmp_path, capsys):
    assert k8s.main([str(GRAPHS / "agg.yaml")]) == 0
    out = capsys.readouterr().out
    assert "apiVersion: nvidia.com/v1beta1\nkind: DynamoGraphDeployment\n" in out
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
