"""`mm-encoder render-k8s`: graphs/*.yaml as a DynamoGraphDeployment plus the nginx tiers.

Checked against the Dynamo operator's v1beta1 DynamoGraphDeployment CRD (`spec.components[]`: `name`, `type`,
`replicas`, `runtimeVersionOverride`, `podTemplate` with the container `main`), field by field through
harness/k8s_schema.py. Schema source: ai-dynamo/dynamo
`deploy/operator/config/crd/bases/nvidia.com_dynamographdeployments.yaml` at commit
01cc1c3b677b20c5dd72d9eb76962dc04b55b8be (`versions[name=v1beta1].schema.openAPIV3Schema`), with the Go types
`deploy/operator/api/v1beta1/{dynamographdeployment_types.go@0fddc01b, dynamocomponentdeployment_types.go@006b6e10,
common.go@02911c80}` and the Dynamo v1.6.x API reference (DCD Reference). The rendered command lines are fed to
the real parsers of the worker, the frontend, the encode planner and `mm-encoder cache`.
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml

from harness.k8s_schema import CERTIFICATE, DYNAMO_GRAPH_DEPLOYMENT, NETWORK_POLICY, errors
from mm_encoder.core.errors import GraphError
from mm_encoder.dashboards.grafana import FLEET
from mm_encoder.graph.schema import Graph, load_graph
from mm_encoder.k8s import dgd as dgd_objects
from mm_encoder.k8s import names as k8s_names
from mm_encoder.k8s import render as k8s
from mm_encoder.planner.settings import check_args

GRAPHS = Path(__file__).resolve().parents[1] / "graphs"
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MODULES = {"frontend": "mm_encoder.frontend", "encoder": "mm_encoder.encode_worker", "engine": "mm_encoder.engines",
           "planner": "mm_encoder.planner"}
MODEL_FLAGS = {"encoder": ("--model", "--stock-model-dir"), "engine": ("--checkpoint",),
               "frontend": ("--model-dir",)}
DGD = "DynamoGraphDeployment"
GENERATED = ["python", "-m", "mm_encoder.engines.tiny_checkpoint", "/models/model", "--preset", "tiny"]
SCHEMA = DYNAMO_GRAPH_DEPLOYMENT


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
    assert errors(dgd, SCHEMA) == []
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
        assert any(message in e for e in errors(broken, SCHEMA)), (path, value)


@pytest.mark.parametrize("name", sorted(p.stem for p in GRAPHS.glob("*.yaml")))
def test_graph_deployment_has_the_crd_shape(name):
    """Every graph file renders a DynamoGraphDeployment the v1beta1 schema accepts, with one component
    per frontend / encoder / engine / planner, its module, replicas, Dynamo env and model flags."""
    graph = load_graph(GRAPHS / f"{name}.yaml")
    dgd = one(docs_of(graph), "DynamoGraphDeployment")
    assert errors(dgd, SCHEMA) == []
    assert dgd["apiVersion"] == "nvidia.com/v1beta1"
    assert dgd["metadata"]["name"] == graph.name
    comps = components(dgd)
    dynamo_components = {n: c for n, c in graph.components.items() if c.kind in MODULES}
    assert list(comps) == [n for n in comps if n in dynamo_components] and set(comps) == set(dynamo_components)
    for cname, c in dynamo_components.items():
        comp = comps[cname]
        # the CRD has no encode type; with an encode planner the engines are decode (docs/kubernetes.md)
        assert comp["type"] == {"frontend": "frontend", "planner": "planner", "encoder": "worker",
                                "engine": "decode" if graph.planner else "worker"}[c.kind]
        assert type(comp["replicas"]) is int and comp["replicas"] == c.replicas
        assert comp["runtimeVersionOverride"] == dgd_objects.DYNAMO_VERSION
        main = main_of(comp)
        assert main["image"] == graph.image
        module = "dynamo.frontend" if c.stock else "mm_encoder.engines.vllm" if c.backend == "vllm" else MODULES[c.kind]
        assert main["command"] == ["python", "-m", module]
        assert all(isinstance(a, str) for a in main["args"])
        env = env_of(comp)
        # bodies fetched over RPC (the chain's fallback) are the embeddings' size; the frontend sends handles
        assert env.get("DYN_TCP_MAX_MESSAGE_SIZE") == ("268435456" if c.kind in ("encoder", "engine") else None)
        assert env["DYN_NAMESPACE"] == graph.namespace
        # runtime.discovery default: the operator's own (unset); another (epd-etcd: etcd) is set
        rt = graph.runtime.discovery
        assert env.get("DYN_DISCOVERY_BACKEND") == (None if rt == "default" else rt)
        assert opt(main["args"], "--namespace") == [graph.namespace]
        if graph.stock_frontend and c.kind == "encoder":  # Dynamo's Encode worker; handles name the chain
            assert opt(main["args"], "--stock-model-dir") == [k8s_names.MODEL_DIR]
            assert opt(main["args"], "--stock-name") == [graph.llm.served_name] == ["kimi-k2.5-tiny"]
            assert opt(main["args"], "--handle-chain") == [f"http://{graph.name}-cluster:{k8s_names.TIER_PORT}"]
        if graph.stock_frontend and c.kind == "engine":
            assert opt(main["args"], "--frontend") == ["stock"]
    assert [c["type"] for c in comps.values()].count("frontend") == 1


def test_runtime_field_sets_discovery_and_planes():
    """The graph's `runtime` becomes DYN_DISCOVERY_BACKEND / planes on every Dynamo container; the servers'
    addresses are left to the operator's platform (the note says so); file discovery is refused."""
    graph = graph_of(runtime={"discovery": "etcd", "request_plane": "nats", "event_plane": "nats"})
    dgd = one(docs_of(graph), "DynamoGraphDeployment")
    assert errors(dgd, SCHEMA) == []
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
    """Every object name, and each name the operator derives (`<graph>-<component>`), is a DNS-1123 label,
    and no two objects of a kind share a name."""
    for docs in (epd_docs, docs_of(agg)):
        for d in docs:
            assert DNS1123.match(d["metadata"]["name"]) and len(d["metadata"]["name"]) <= 63
            if d["kind"] == "DynamoGraphDeployment":  # the operator names its objects <graph>-<component>
                for comp in d["spec"]["components"]:
                    assert DNS1123.match(f"{d['metadata']['name']}-{comp['name']}")
        names = Counter((d["kind"], d["metadata"]["name"]) for d in docs)
        assert max(names.values()) == 1


def test_shared_tier_is_a_statefulset_behind_a_headless_service(epd, epd_docs):
    """The shared tier: a StatefulSet behind a headless Service that selects its pods, on a tmpfs above
    --max-size, fronting the encoders' Service and probed on /_cache/health."""
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
    assert pod["containers"][0]["command"] == ["python", "-m", "mm_encoder.cache_tiers"]
    args = pod["containers"][0]["args"]
    assert args[:3] == ["up", "--tier", "shared"]
    assert opt(args, "--max-size") == ["2g"]  # the graph's value replaces the default, once
    assert _bytes(cache["emptyDir"]["sizeLimit"]) > 2 << 30
    assert opt(args, "--next") == [f"epd-encoder-http:{k8s_names.ENCODER_PORT}"]
    probe = pod["containers"][0]["readinessProbe"]["httpGet"]
    assert probe["path"] == "/_cache/health"


def _bytes(quantity: str) -> int:
    m = re.match(r"^(\d+)(Mi|Gi)$", quantity)
    assert m, quantity
    return int(m.group(1)) << (20 if m.group(2) == "Mi" else 30)


def test_router_shards_are_exactly_the_statefulset_pods(epd_docs):
    """The router's --shard list is exactly the StatefulSet pods' stable DNS names."""
    sts = one(epd_docs, "StatefulSet")
    router = one(epd_docs, "Deployment", "epd-router")
    shards = opt(router["spec"]["template"]["spec"]["containers"][0]["args"], "--shard")
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert shards == [f"{name}-{i}.{service}:{k8s_names.TIER_PORT}" for i in range(sts["spec"]["replicas"])]
    one(epd_docs, "Service", "epd-router")


def test_cluster_tier_and_frontend_are_wired_to_the_chain(epd_docs):
    """The cluster tier fronts the router (and the encoders directly); the frontend reaches it with the
    planned route, on the operator's frontend port, with the graph's own args."""
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
    assert opt(fargs, "--http-port") == [str(k8s_names.FRONTEND_PORT)]
    assert opt(fargs, "--max-inflight-media") == ["8"]  # the graph's args come through
    assert "--inline-media" not in fargs


def test_encoder_service_selects_the_encoder_pods(epd_docs):
    """The encoders' HTTP Service selects the encoder pods and nothing else; the encoder gates readiness
    on its `encode` endpoint and takes the graph's resources unchanged."""
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
    """The aggregated graph is only the DynamoGraphDeployment: its engine runs the whole model
    (`--encode-inline`, no `--encoder-chain`) and the frontend sends media inline."""
    docs = docs_of(agg)
    assert [d["kind"] for d in docs] == ["DynamoGraphDeployment"]
    comps = components(docs[0])
    assert list(comps) == ["engine", "frontend"]
    engine = main_of(comps["engine"])["args"]
    assert "--encode-inline" in engine and "--encoder-chain" not in engine
    assert opt(engine, "--checkpoint") == [k8s_names.MODEL_DIR] and opt(engine, "--dtype") == ["fp32"]
    frontend = main_of(comps["frontend"])["args"]
    assert "--inline-media" in frontend and "--encoder-http" not in frontend
    epd_engine = main_of(components(one(docs_of(load_graph(GRAPHS / "epd.yaml")), DGD))["engine"])["args"]
    assert "--encode-inline" not in epd_engine and opt(epd_engine, "--encoder-chain") == ["http://epd-cluster:8080"]


@pytest.mark.parametrize("name", ["epd", "agg", "epd-stock"])
def test_generated_checkpoint_is_written_by_an_init_container(name):
    """Without `llm.checkpoint`, every pod that reads the model gets an emptyDir `model` at /models/model,
    filled by the init container `make-checkpoint` (the exact call serve makes), and its own argv names
    that directory; Dynamo's stock frontend and the nginx tiers mount nothing of it."""
    graph = load_graph(GRAPHS / f"{name}.yaml")
    docs = docs_of(graph)
    dgd = one(docs, DGD)
    assert errors(dgd, SCHEMA) == []
    readers = [n for n, c in graph.components.items() if c.kind in MODEL_FLAGS and not c.stock]
    comps = components(dgd)
    for cname, comp in comps.items():
        pod, main = comp["podTemplate"]["spec"], main_of(comp)
        if cname not in readers:
            assert "initContainers" not in pod and "volumes" not in pod and "volumeMounts" not in main
            continue
        assert pod["initContainers"] == [{"name": "make-checkpoint", "image": main["image"], "command": GENERATED,
                                          "volumeMounts": [{"name": "model", "mountPath": "/models/model"}]}]
        assert pod["volumes"] == [{"name": "model", "emptyDir": {}}]
        assert main["volumeMounts"] == [{"name": "model", "mountPath": "/models/model"}]
        kind = graph.components[cname].kind
        assert {v for flag in MODEL_FLAGS[kind] for v in opt(main["args"], flag)} == {"/models/model"}
    assert sorted(readers) == sorted(n for n in comps if "initContainers" in comps[n]["podTemplate"]["spec"])
    for d in docs:  # the tiers never see the model
        if d["kind"] in ("StatefulSet", "Deployment"):
            assert all(v["name"] != "model" for v in d["spec"]["template"]["spec"]["volumes"])
    note = dgd["metadata"]["annotations"]["mm-encoder/note"]
    assert "an init container writes the generated tiny Kimi-K2.5 checkpoint to /models/model" in note
    small = components(one(docs_of(graph_of(llm__preset="small")), DGD))["engine"]["podTemplate"]["spec"]
    assert small["initContainers"][0]["command"] == [*GENERATED[:-1], "small"]


@pytest.mark.parametrize("name", ["epd", "agg", "epd-stock"])
def test_a_named_checkpoint_comes_from_one_read_only_claim(name):
    """With `llm.checkpoint` set, the same model readers mount the PersistentVolumeClaim `<graph>-model`
    read-only at /models/model (pod volume and container mount), with no init container; the served
    name is the checkpoint directory's name."""
    doc = yaml.safe_load((GRAPHS / f"{name}.yaml").read_text())
    doc["llm"]["checkpoint"] = "/data/Kimi-K2.5"
    graph = Graph.model_validate(doc)
    dgd = one(docs_of(graph), DGD)
    assert errors(dgd, SCHEMA) == []
    readers = {n for n, c in graph.components.items() if c.kind in MODEL_FLAGS and not c.stock}
    for cname, comp in components(dgd).items():
        pod, main = comp["podTemplate"]["spec"], main_of(comp)
        assert "initContainers" not in pod
        if cname not in readers:
            assert "volumes" not in pod and "volumeMounts" not in main
            continue
        assert pod["volumes"] == [{"name": "model", "persistentVolumeClaim": {"claimName": f"{name}-model",
                                                                              "readOnly": True}}]
        assert main["volumeMounts"] == [{"name": "model", "mountPath": "/models/model", "readOnly": True}]
        kind = graph.components[cname].kind
        assert {v for flag in MODEL_FLAGS[kind] for v in opt(main["args"], flag)} == {"/models/model"}
        if kind == "engine":
            assert opt(main["args"], "--name") == ["Kimi-K2.5"]
        if kind == "encoder" and graph.stock_frontend:
            assert opt(main["args"], "--stock-name") == ["Kimi-K2.5"]
    note = dgd["metadata"]["annotations"]["mm-encoder/note"]
    assert (f"the PersistentVolumeClaim {name}-model must hold the checkpoint directory (llm.checkpoint "
            "/data/Kimi-K2.5), mounted at /models/model") in note


def test_dtype_is_passed_to_encoders_and_engines_only_when_set():
    """`llm.dtype` reaches the encoder's and engines' args on Kubernetes too; unset, no `--dtype` at all."""
    for dtype in ("bf16", None):
        comps = components(one(docs_of(graph_of(llm__dtype=dtype)), DGD))
        for cname in ("encoder", "engine", "frontend"):
            args = main_of(comps[cname])["args"]
            assert opt(args, "--dtype") == ([dtype] if dtype and cname != "frontend" else []), (dtype, cname)


def test_component_image_env_and_resources_override_the_defaults():
    """A component's image, env and resources in the graph override the defaults; unknown resource keys
    are refused by path."""
    graph = graph_of(components__engine={"kind": "engine", "replicas": 3, "image": "reg.example/mm:2",
                                         "env": {"DYN_EVENT_PLANE": "nats", "EXTRA": "1"},
                                         "resources": {"limits": {"nvidia.com/gpu": "2", "example.com/nic": "1"}}},
                     components__shared={"kind": "cache-shared", "replicas": 3,
                                         "resources": {"limits": {"memory": "9Gi"}}})
    docs = docs_of(graph)
    dgd = one(docs, "DynamoGraphDeployment")
    assert errors(dgd, SCHEMA) == []
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
    """The encode worker's, the frontend's, the engine's and `mm-encoder cache`'s own parsers accept
    the rendered args, and read back the one checkpoint directory, dtype, name and chain."""
    from mm_encoder.cache_tiers.cli import main as cache_main
    from mm_encoder.encode_worker.settings import WorkerSettings
    from mm_encoder.engines.process import EngineSettings
    from mm_encoder.frontend.settings import FrontendSettings

    comps = components(one(epd_docs, DGD))
    worker = WorkerSettings(_cli_parse_args=main_of(comps["encoder"])["args"])
    assert worker.dynamo and worker.http_port == 8090 and worker.http_host == "0.0.0.0" and worker.namespace == "mm"
    assert (worker.model, worker.dtype, worker.checkpoint) == (k8s_names.MODEL_DIR, "fp32", None)
    frontend = FrontendSettings(_cli_parse_args=main_of(comps["frontend"])["args"])
    assert frontend.encoder_http == "http://epd-cluster:8080" and frontend.http_port == k8s_names.FRONTEND_PORT
    assert str(frontend.model_dir) == k8s_names.MODEL_DIR
    engine = EngineSettings(_cli_parse_args=main_of(comps["engine"])["args"])
    assert (str(engine.checkpoint), engine.dtype, engine.name, engine.namespace) == (
        k8s_names.MODEL_DIR, "fp32", epd.llm.served_name, "mm")
    assert engine.encoder_chain == ("http://epd-cluster:8080",) and not engine.encode_inline
    agg_engine = main_of(components(one(docs_of(load_graph(GRAPHS / "agg.yaml")), DGD))["engine"])["args"]
    assert EngineSettings(_cli_parse_args=agg_engine).encode_inline
    for d in epd_docs:
        if d["kind"] in ("StatefulSet", "Deployment"):
            args = d["spec"]["template"]["spec"]["containers"][0]["args"]
            assert args[0] == "up"
            assert cache_main(["render", *args[1:]]) == 0, capsys.readouterr().err
    capsys.readouterr()


def test_names_that_kubernetes_would_refuse_are_graph_errors():
    """Names Kubernetes would refuse, or that would collide with the operator's, are GraphErrors."""
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
    """`render-k8s` writes YAML to stdout or -o, and exits 2 with a message on a bad or missing graph."""
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


# --- the encode planner (graphs/epd-autoscale.yaml): docs/kubernetes.md "Autoscaling the encoders" ---

@pytest.fixture(scope="module")
def autoscale() -> Graph:
    return load_graph(GRAPHS / "epd-autoscale.yaml")


def test_the_encode_planner_is_a_planner_component_with_the_kubernetes_connector(autoscale):
    """epd-autoscale renders its planner as a v1beta1 `planner` component (one replica, no model) running
    `python -m mm_encoder.planner` with `--connector kubernetes` on this graph's encoder, its own args after,
    and the DGD's name for the connector; the encoder is the `worker` with a scaling adapter, the engines
    `decode`, and the whole DGD passes the CRD schema."""
    docs = docs_of(autoscale)
    dgd = one(docs, DGD)
    assert errors(dgd, SCHEMA) == []
    comps = components(dgd)
    assert {n: c["type"] for n, c in comps.items()} == {"encoder": "worker", "engine": "decode",
                                                         "frontend": "frontend", "planner": "planner"}
    assert [n for n, c in comps.items() if "scalingAdapter" in c] == ["encoder"]
    assert comps["encoder"]["scalingAdapter"] == {}  # the operator's DGDSA epd-autoscale-encoder
    assert comps["encoder"]["replicas"] == autoscale.components["encoder"].replicas  # where the fleet starts
    planner = comps["planner"]
    assert planner["replicas"] == 1
    main = main_of(planner)
    assert main["command"] == ["python", "-m", "mm_encoder.planner"]
    s = check_args(main["args"])  # the planner's own parser
    assert (s.connector, s.component, s.namespace, s.model_name) == ("kubernetes", "encoder", autoscale.namespace,
                                                                    autoscale.llm.served_name)
    assert (s.min_replicas, s.max_replicas, s.http_host, s.http_port) == (1, 3, "0.0.0.0", k8s_names.PLANNER_PORT)
    assert main["args"][-len(autoscale.components["planner"].args):] == list(autoscale.components["planner"].args)
    assert main["ports"] == [{"name": "mm-http", "containerPort": k8s_names.PLANNER_PORT, "protocol": "TCP"}]
    env = env_of(planner)
    assert env["DYN_PARENT_DGD_K8S_NAME"] == dgd["metadata"]["name"] == "epd-autoscale"
    assert env["DYN_NAMESPACE"] == autoscale.namespace and "DYN_TCP_MAX_MESSAGE_SIZE" not in env
    pod = planner["podTemplate"]["spec"]
    assert "volumes" not in pod and "initContainers" not in pod and "serviceAccountName" not in pod  # the operator's
    note = dgd["metadata"]["annotations"]["mm-encoder/note"]
    assert "scaling adapter epd-autoscale-encoder" in note and k8s_names.PLANNER_SERVICE_ACCOUNT in note


def test_the_planner_gets_a_role_to_scale_this_graphs_encoder_only(autoscale):
    """A Role (and its RoleBinding to the operator's planner ServiceAccount, no namespace: the graph's)
    allowing exactly the KubernetesConnector's calls on this graph's objects: get/patch the DGD, get/patch the
    encoder adapter's Scale, list pods. No ServiceAccount of ours (the operator runs planners as its own)."""
    docs = docs_of(autoscale)
    role, binding = one(docs, "Role"), one(docs, "RoleBinding")
    assert role["metadata"]["name"] == binding["metadata"]["name"] == "epd-autoscale-planner-connector"
    assert role["rules"] == [
        {"apiGroups": ["nvidia.com"], "resources": ["dynamographdeployments"], "resourceNames": ["epd-autoscale"],
         "verbs": ["get", "patch"]},
        {"apiGroups": ["nvidia.com"], "resources": ["dynamographdeploymentscalingadapters/scale"],
         "resourceNames": ["epd-autoscale-encoder"], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    ]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "planner-serviceaccount"}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "epd-autoscale-planner-connector"}
    assert all("namespace" not in d["metadata"] for d in docs)  # kubectl apply -n NS places them all
    assert not [d for d in docs if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")]
    for name in ("epd", "agg", "epd-stock"):  # graphs without a planner render as before
        plain = docs_of(load_graph(GRAPHS / f"{name}.yaml"))
        assert not [d for d in plain if d["kind"] in ("Role", "RoleBinding")]
        comps = components(one(plain, DGD))
        assert all("scalingAdapter" not in c and c["type"] in ("frontend", "worker") for c in comps.values())


def test_a_planner_graph_whose_decode_slot_would_be_ambiguous_is_refused(monkeypatch, autoscale):
    """Two engine components would be two `decode` components: Dynamo's planner connector resolves the decode
    slot to none of them (DuplicateSubComponentError), so render-k8s refuses the graph by the planner's name
    (`serve` runs it: the slots are Kubernetes'). A `prefill` component would take the encoder's count: never
    rendered, and refused should the types ever say so."""
    doc = yaml.safe_load((GRAPHS / "epd-autoscale.yaml").read_text())
    doc["components"]["engine-b"] = {"kind": "engine", "replicas": 1}
    graph = Graph.model_validate(doc)
    with pytest.raises(GraphError, match=r"components\.planner: .*decode.*: engine, engine-b would make it ambiguous"):
        k8s.render(graph)
    monkeypatch.setitem(dgd_objects.PLANNED_TYPES, "engine", "prefill")
    with pytest.raises(GraphError, match=r"encoder count would reach \['engine'\], not the worker component encoder"):
        k8s.render(autoscale)


def test_the_encoder_fleet_dashboard_is_a_configmap_for_grafanas_sidecar(epd_docs, agg):
    """A graph with encoders renders the shipped dashboard as a ConfigMap labelled for
    kube-prometheus-stack's Grafana sidecar (`grafana_dashboard: "1"`), the JSON under one key whatever
    the graph (two graphs' ConfigMaps are one dashboard); a graph without encoders renders none."""
    cm = one(epd_docs, "ConfigMap", "epd-grafana-dashboard")
    assert cm["apiVersion"] == "v1" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["labels"]["mm-encoder/graph"] == "epd"
    assert list(cm["data"]) == ["mm-encoder-fleet.json"]
    assert json.loads(cm["data"]["mm-encoder-fleet.json"]) == json.loads(FLEET.read_text())
    assert cm["data"]["mm-encoder-fleet.json"] == FLEET.read_text()  # byte for byte what the wheel ships
    assert not [d for d in docs_of(agg) if d["kind"] == "ConfigMap"]
    doc = yaml.safe_load((GRAPHS / "epd.yaml").read_text())
    doc["components"]["grafana-dashboard"] = doc["components"].pop("cluster")  # its objects' name is taken
    with pytest.raises(GraphError, match="Grafana dashboard"):
        k8s.render(Graph.model_validate(doc))


def test_a_component_with_an_otlp_endpoint_is_traced_as_serve_traces_it():
    """A component whose env names a collector gets, as under `mm-encoder serve`, its service name
    (`<graph>/<component>`), Dynamo's own tracing switch and one OTLP protocol; what it sets wins.
    Without an endpoint nothing is added."""
    graph = graph_of(components__engine={"kind": "engine", "env": {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318"}},
                     components__frontend={"kind": "frontend", "env": {
                         "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                         "OTEL_SERVICE_NAME": "edge"}})
    parts = components(one(docs_of(graph), "DynamoGraphDeployment"))
    engine, frontend, encoder = env_of(parts["engine"]), env_of(parts["frontend"]), env_of(parts["encoder"])
    assert {k: v for k, v in engine.items() if k.startswith("OTEL_")} == {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318", "OTEL_SERVICE_NAME": "epd/engine",
        "OTEL_EXPORT_ENABLED": "true", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert (frontend["OTEL_SERVICE_NAME"], frontend["OTEL_EXPORTER_OTLP_PROTOCOL"]) == ("edge", "grpc")
    assert not any(k.startswith("OTEL_") for k in encoder)


# --- a graph with `tls` ---------------------------------------------------------------------

TLS_FILES = ["/etc/mm-encoder/tls/tls.crt", "/etc/mm-encoder/tls/tls.key", "/etc/mm-encoder/tls/ca.crt"]
TIERS = ("StatefulSet", "Deployment")
PROMETHEUS = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


@pytest.fixture(scope="module")
def tls_docs() -> list[dict]:
    return docs_of(graph_of(tls={"enabled": True}))


def pods(docs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """Every component's (pod spec, its one container) by component name: the DGD's and the tiers'."""
    out = {c["name"]: (c["podTemplate"]["spec"], main_of(c)) for c in one(docs, DGD)["spec"]["components"]}
    for d in docs:
        if d["kind"] in TIERS:
            spec = d["spec"]["template"]["spec"]
            out[d["spec"]["template"]["metadata"]["labels"]["mm-encoder/component"]] = (spec, spec["containers"][0])
    return out


def test_a_tls_graph_mounts_each_components_own_secret_read_only(tls_docs):
    """Every component but the planner gets its certificate, key and the CA from one mount of its own Secret,
    `<graph>-<component>-tls` (its replicas share it), read-only, 0400; the DGD still passes the CRD schema."""
    assert errors(one(tls_docs, DGD), SCHEMA) == []
    for name, (spec, container) in pods(tls_docs).items():
        args = container["args"]
        assert [opt(args, f)[0] for f in ("--tls-cert", "--tls-key", "--tls-ca")] == TLS_FILES, name
        (volume,) = [v for v in spec["volumes"] if v["name"] == "tls"]
        assert volume == {"name": "tls", "secret": {"secretName": f"epd-{name}-tls", "defaultMode": 0o400}}
        assert {"name": "tls", "mountPath": "/etc/mm-encoder/tls", "readOnly": True} in container["volumeMounts"]
    assert not any(d["kind"] == "Certificate" for d in tls_docs)  # without tls.issuer: the operator's Secrets
    note = one(tls_docs, DGD)["metadata"]["annotations"][k8s_names.NOTE]
    assert ("epd-shared-tls (CN shared, OU cache-shared, URI spiffe://mm-encoder.local/epd/cache-shared/shared, "
            "DNS epd-shared, epd-shared-0.epd-shared") in note
    assert "kubectl create secret generic" in note and "CNI" in note


def test_probes_that_hold_no_certificate_stay_off_the_https_ports(tls_docs):
    """Tiers are probed on their plaintext ops port; an encoder keeps the operator's probes (Dynamo's
    plaintext system port) and names its ops port for Prometheus; the frontend's probes speak HTTPS."""
    parts = pods(tls_docs)
    for name in ("shared", "router", "cluster"):
        container = parts[name][1]
        assert opt(container["args"], "--ops-listen") == ["0.0.0.0:9091"]
        assert {"name": "mm-ops", "containerPort": 9091, "protocol": "TCP"} in container["ports"]
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/_cache/health", "port": "mm-ops"}, (name, probe)
    encoder = parts["encoder"][1]
    assert opt(encoder["args"], "--ops-port") == ["9091"] and "readinessProbe" not in encoder
    assert [p["containerPort"] for p in encoder["ports"]] == [k8s_names.ENCODER_PORT, 9091]
    frontend = parts["frontend"][1]
    assert "--https" in frontend["args"] and "--https-client-auth" not in frontend["args"]
    assert {k: frontend[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")} == {
        "startupProbe": {"path": "/live", "port": 8000, "scheme": "HTTPS"},
        "livenessProbe": {"path": "/live", "port": 8000, "scheme": "HTTPS"},
        "readinessProbe": {"path": "/health", "port": 8000, "scheme": "HTTPS"}}
    assert not any("Probe" in k for name in ("engine",) for k in parts[name][1])


def test_with_client_auth_the_frontends_probe_presents_the_pods_own_certificate(tmp_path):
    """The kubelet has no client certificate: with `tls.client_auth` the frontend's probes run Python with the
    pod's certificate; the command, run against a server that requires one, passes on 200 and fails otherwise."""
    import http.server
    import ssl
    import subprocess
    import sys
    import threading

    from mm_encoder.security.pki import Authority, Identity

    docs = docs_of(graph_of(tls={"enabled": True, "client_auth": True}))
    frontend = main_of(components(one(docs, DGD))["frontend"])
    assert "--https-client-auth" in frontend["args"] and errors(one(docs, DGD), SCHEMA) == []
    command = frontend["readinessProbe"]["exec"]["command"]
    assert command[0] == "python" and command[3:6] == TLS_FILES and command[6] == "https://127.0.0.1:8000/health"

    ca = Authority.create(tmp_path)
    server, client = (ca.issue(Identity(n, "frontend"), tmp_path, hosts=["epd-frontend"]) for n in ("fe", "probe"))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(server.cert, server.key)
    ctx.load_verify_locations(tmp_path / "ca.pem")
    ctx.verify_mode = ssl.CERT_REQUIRED
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"https://127.0.0.1:{httpd.server_address[1]}"
        files = [str(client.cert), str(client.key), str(tmp_path / "ca.pem")]
        run = [sys.executable, *command[1:3], *files]
        assert subprocess.run([*run, f"{base}/health"], capture_output=True).returncode == 0
        assert subprocess.run([*run, f"{base}/live"], capture_output=True).returncode != 0
    finally:
        httpd.shutdown()


def test_the_chain_is_https_and_each_tier_checks_a_name_its_upstreams_carry():
    """Frontend and engines dial the cluster tier over https; each tier's --tls-server-name is its next level's
    Service name, and every component it reaches (--next, --direct, --shard) has that name in its Certificate,
    which names the component (CN), its role (OU) and the Service names it is dialled by."""
    from mm_encoder.cache_tiers.cli import parse_args
    from mm_encoder.encode_worker.settings import WorkerSettings
    from mm_encoder.engines.process import EngineSettings
    from mm_encoder.frontend.settings import FrontendSettings

    docs = docs_of(graph_of(tls={"enabled": True, "issuer": "ClusterIssuer/ca-issuer"}))
    certs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Certificate"}
    assert sorted(certs) == sorted(f"epd-{n}-tls" for n in ("encoder", "shared", "router", "cluster", "engine",
                                                              "frontend"))  # not the planner: it has no TLS
    roles = {"encoder": "encoder", "shared": "cache-shared", "router": "cache-router", "cluster": "cache-cluster",
             "engine": "engine", "frontend": "frontend"}
    for name, role in roles.items():
        cert = certs[f"epd-{name}-tls"]
        assert errors(cert, CERTIFICATE) == [], name
        spec = cert["spec"]
        assert (spec["secretName"], spec["commonName"], spec["subject"]) == (
            f"epd-{name}-tls", name, {"organizations": ["mm-encoder"], "organizationalUnits": [role]})
        assert spec["usages"] == ["server auth", "client auth", "digital signature"]
        assert spec["privateKey"]["algorithm"] == "ECDSA" and spec["privateKey"]["size"] == 256
        assert spec["issuerRef"] == {"name": "ca-issuer", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    hosts = {name: certs[f"epd-{name}-tls"]["spec"].get("dnsNames", []) for name in roles}
    assert hosts["engine"] == ["engine.epd.mm-encoder.local"]
    assert hosts["frontend"] == ["epd-frontend", "frontend.epd.mm-encoder.local"]
    for name, role in roles.items():  # its identity, and no other component's name
        assert certs[f"epd-{name}-tls"]["spec"]["uris"] == [f"spiffe://mm-encoder.local/epd/{role}/{name}"]
        assert [h for h in hosts[name] if h.endswith(".mm-encoder.local")] == [f"{role}.epd.mm-encoder.local"]

    parts = pods(docs)
    by_host = {"epd-encoder-http": "encoder", "epd-router": "router", "epd-cluster": "cluster",
               **{f"epd-shared-{i}.epd-shared": "shared" for i in range(2)}}
    for name in ("shared", "router", "cluster"):
        args = parts[name][1]["args"]
        _, cfg = parse_args(args)
        assert cfg.tls and cfg.tls_server_name == {"shared": "encoder", "router": "cache-shared",
                                                   "cluster": "cache-router"}[name] + ".epd.mm-encoder.local"
        for address in (*cfg.next, *cfg.shards):  # each upstream carries the name its tier checks it for
            assert cfg.tls_server_name in hosts[by_host[address.rsplit(":", 1)[0]]], (name, address)
        for address in cfg.direct:
            assert cfg.tls_direct_server_name in hosts[by_host[address.rsplit(":", 1)[0]]], (name, address)
    worker = WorkerSettings(_cli_parse_args=parts["encoder"][1]["args"])
    assert worker.tls and worker.ops_port == 9091 and sorted(worker.tls_allow) == ["cache-cluster", "cache-shared",
                                                                                  "engine"]
    frontend = FrontendSettings(_cli_parse_args=parts["frontend"][1]["args"])
    engine = EngineSettings(_cli_parse_args=parts["engine"][1]["args"])
    assert frontend.https and frontend.tls and frontend.encoder_http == "https://epd-cluster:8080"
    assert engine.tls and engine.encoder_chain == ("https://epd-cluster:8080",)
    assert "epd-cluster" in hosts["cluster"]  # the host both dial, which their clients check


def test_network_policies_let_only_each_hops_callers_in(tls_docs):
    """One NetworkPolicy per encoder and tier (Ingress only): its HTTPS port from the pods of the roles it
    admits, its ops port from Prometheus only; an encoder's other ports (Dynamo's system port, its request
    plane) stay open to the namespace. Each rule names its sources (an empty `from` would admit anyone)."""
    policies = {d["metadata"]["name"]: d for d in tls_docs if d["kind"] == "NetworkPolicy"}
    assert sorted(policies) == sorted(f"epd-{n}-ingress" for n in ("encoder", "shared", "router", "cluster"))
    callers = {"cluster": {"frontend", "engine"}, "router": {"cluster"}, "shared": {"router", "cluster"},
               "encoder": {"shared", "cluster", "engine"}}
    for name, admitted in callers.items():
        policy = policies[f"epd-{name}-ingress"]
        assert errors(policy, NETWORK_POLICY) == [], name
        spec = policy["spec"]
        assert spec["podSelector"] == {"matchLabels": {"mm-encoder/graph": "epd", "mm-encoder/component": name}}
        assert spec["policyTypes"] == ["Ingress"]
        port = k8s_names.ENCODER_PORT if name == "encoder" else k8s_names.TIER_PORT
        https, ops, *rest = spec["ingress"]
        assert https["ports"] == [{"protocol": "TCP", "port": port}]
        assert {p["podSelector"]["matchLabels"]["mm-encoder/component"] for p in https["from"]} == admitted
        assert all(p["podSelector"]["matchLabels"]["mm-encoder/graph"] == "epd" for p in https["from"])
        assert ops == {"from": [PROMETHEUS], "ports": [{"protocol": "TCP", "port": 9091}]}
        assert all(rule.get("from") for rule in spec["ingress"])
        if name != "encoder":
            assert rest == []
            continue
        (other,) = rest
        assert other["from"] == [{"podSelector": {}}, PROMETHEUS]
        tcp = {p for r in other["ports"] if r["protocol"] == "TCP"
               for p in range(r["port"], r.get("endPort", r["port"]) + 1)}
        assert tcp == set(range(1, 65536)) - {port, 9091}  # the system port 9090 among them
        assert {"protocol": "UDP", "port": 1, "endPort": 65535} in other["ports"]
    selected = {(d["spec"]["template"]["metadata"]["labels"]["mm-encoder/component"]) for d in tls_docs
                if d["kind"] in TIERS}
    pod_labels = {c["name"]: c["podTemplate"]["metadata"]["labels"]
                  for c in one(tls_docs, DGD)["spec"]["components"]}
    assert selected == {"shared", "router", "cluster"}
    assert all(labels["mm-encoder/component"] == name for name, labels in pod_labels.items())  # what the rules select


@pytest.mark.parametrize("name", sorted(p.stem for p in GRAPHS.glob("*.yaml")))
def test_graphs_without_tls_render_no_tls_objects(name):
    """A graph without `tls` gets no Secret volume, ops port, NetworkPolicy or Certificate."""
    docs = docs_of(load_graph(GRAPHS / f"{name}.yaml"))
    assert not any(d["kind"] in ("NetworkPolicy", "Certificate") for d in docs)
    text = json.dumps(docs)
    assert "/etc/mm-encoder/tls" not in text and "--tls-" not in text and "mm-ops" not in text


def test_tls_graphs_the_render_cannot_serve_are_refused():
    """`tls.issuer` without TLS, a malformed issuer, and Dynamo's stock frontend (it takes none of the TLS
    options) are refused by name; an Issuer by bare name is a namespaced Issuer."""
    with pytest.raises(ValueError, match=r"tls\.issuer"):
        graph_of(tls={"issuer": "ca-issuer"})
    with pytest.raises(ValueError, match="issuer"):
        graph_of(tls={"enabled": True, "issuer": "Vault/x"})
    with pytest.raises(ValueError, match="stock frontend"):  # the graph itself: serve and render-k8s alike
        graph_of(tls={"enabled": True}, components__frontend={"kind": "frontend", "stock": True})
    docs = k8s.render(graph_of(tls={"enabled": True, "issuer": "ca-issuer"}))
    assert {d["spec"]["issuerRef"]["kind"] for d in docs if d["kind"] == "Certificate"} == {"Issuer"}
