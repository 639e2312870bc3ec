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

from harness.k8s_schema import (
    CERTIFICATE,
    CERTIFICATE_REQUEST_POLICY,
    DYNAMO_GRAPH_DEPLOYMENT,
    NETWORK_POLICY,
    POD_DISRUPTION_BUDGET,
    errors,
)
from mm_encoder.core.errors import GraphError
from mm_encoder.dashboards.grafana import FLEET
from mm_encoder.graph.schema import Graph, load_graph
from mm_encoder.k8s import dgd as dgd_objects
from mm_encoder.k8s import names as k8s_names
from mm_encoder.k8s import render as k8s
from mm_encoder.k8s.names import UNEXPOSED, Exposure
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


def docs_of(graph: Graph, exposure: Exposure = UNEXPOSED) -> list[dict]:
    """Rendered to text and parsed back, as kubectl would read it."""
    return [d for d in yaml.safe_load_all(k8s.render_yaml(graph, exposure=exposure)) if d]


def as_rendered(doc: dict) -> tuple[Graph, Exposure]:
    """A shipped graph's document as render-k8s takes it: a model cluster with its encoder site's URL
    (--encoder-site), an encoder site without TLS exposed anyway (--plaintext-site)."""
    tls = doc.get("tls", {}).get("enabled", False)
    if doc.get("site") == "cluster":
        doc["encoder_site"]["url"] = f"{'https' if tls else 'http'}://203.0.113.10:8090"
    return Graph.model_validate(doc), Exposure(plaintext=doc.get("site") == "encoder" and not tls)


def shipped(name: str) -> tuple[Graph, Exposure]:
    return as_rendered(yaml.safe_load((GRAPHS / f"{name}.yaml").read_text()))


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
    graph, exposure = shipped(name)
    dgd = one(docs_of(graph, exposure), "DynamoGraphDeployment")
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
        assert main["image"] == (graph.vllm_image if c.backend == "vllm" else graph.image)
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
    assert [c["type"] for c in comps.values()].count("frontend") == (0 if graph.site == "encoder" else 1)


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
    """The cluster tier fronts the router (and the encoders directly) and names its graph as the calling
    cluster; the frontend reaches it with the planned route, on the operator's frontend port, with the
    graph's own args."""
    cluster = one(epd_docs, "Deployment", "epd-cluster")
    pod = cluster["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert opt(args, "--next") == ["epd-router:8080"]
    assert opt(args, "--direct") == ["epd-encoder-http:8090"]
    assert opt(args, "--cluster-name") == ["epd"]  # the calling cluster the levels behind count it as
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
    assert [d["kind"] for d in docs] == ["DynamoGraphDeployment", *["NetworkPolicy"] * 3, *["PodDisruptionBudget"] * 2]
    comps = components(docs[0])
    assert list(comps) == ["engine", "frontend"]
    engine = main_of(comps["engine"])["args"]
    assert "--encode-inline" in engine and "--encoder-chain" not in engine
    assert opt(engine, "--checkpoint") == [k8s_names.MODEL_DIR] and opt(engine, "--dtype") == ["fp32"]
    frontend = main_of(comps["frontend"])["args"]
    assert "--inline-media" in frontend and "--encoder-http" not in frontend
    epd_engine = main_of(components(one(docs_of(load_graph(GRAPHS / "epd.yaml")), DGD))["engine"])["args"]
    assert "--encode-inline" not in epd_engine and opt(epd_engine, "--encoder-chain") == ["http://epd-cluster:8080"]


def _images(docs: list[dict]) -> dict[str, set[str]]:
    """Every container's image, by the object (a DGD component by its name) that runs it."""
    out: dict[str, set[str]] = {}
    for doc in docs:
        if doc["kind"] == DGD:
            for comp in doc["spec"]["components"]:
                pod = comp["podTemplate"]["spec"]
                out[comp["name"]] = {c["image"] for c in pod["containers"] + pod.get("initContainers", [])}
        elif doc["kind"] in ("Deployment", "StatefulSet"):
            pod = doc["spec"]["template"]["spec"]
            out[doc["metadata"]["name"]] = {c["image"] for c in pod["containers"] + pod.get("initContainers", [])}
    return out


def test_the_vllm_engine_runs_the_vllm_image_and_every_other_container_the_main_one():
    """graphs/epd-vllm.yaml: the engine's `main` container runs the graph's `vllm_image` (vLLM in an image
    of its own: docker/Dockerfile.vllm, `make images`), every other container the graph's `image`, the
    engine's `make-checkpoint` init container included (it needs the main image's transformers). A
    component's own `image` wins over both; a transformers engine runs the main image."""
    graph = load_graph(GRAPHS / "epd-vllm.yaml")
    assert graph.vllm_image == f"mm-encoder-vllm:{graph.image.split(':')[1]}-cpu"
    docs = docs_of(graph)
    engine = components(one(docs, DGD))["engine"]
    assert main_of(engine)["image"] == graph.vllm_image
    assert [c["image"] for c in engine["podTemplate"]["spec"]["initContainers"]] == [graph.image]
    images = _images(docs)
    assert len(images) >= 4 and "epd-vllm-cluster" in images, images
    assert {n: i for n, i in images.items() if n != "engine"} == {n: {graph.image} for n in images if n != "engine"}
    moved = graph.model_copy(update={"image": "reg.example/mm-encoder:0.3.0-cpu",
                                     "vllm_image": "reg.example/mm-encoder-vllm:0.3.0-cpu"})
    images = _images(docs_of(moved))
    assert images.pop("engine") == {"reg.example/mm-encoder-vllm:0.3.0-cpu", "reg.example/mm-encoder:0.3.0-cpu"}
    assert set().union(*images.values()) == {"reg.example/mm-encoder:0.3.0-cpu"}
    doc = yaml.safe_load((GRAPHS / "epd-vllm.yaml").read_text())
    doc["components"]["engine"]["image"] = "reg.example/own-vllm:1"
    engine = components(one(docs_of(Graph.model_validate(doc)), DGD))["engine"]
    assert main_of(engine)["image"] == "reg.example/own-vllm:1"
    transformers_engine = components(one(docs_of(load_graph(GRAPHS / "epd.yaml")), DGD))["engine"]
    assert main_of(transformers_engine)["image"] == graph.image


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
    """Every component gets its certificate, key and the CA from one mount of its own Secret,
    `<graph>-<component>-tls` (its replicas share it), read-only, 0400; the DGD still passes the CRD schema.
    Without `tls.issuer` the note says what each Secret's certificate must carry: its URI and DNS names."""
    assert errors(one(tls_docs, DGD), SCHEMA) == []
    for name, (spec, container) in pods(tls_docs).items():
        args = container["args"]
        assert [opt(args, f)[0] for f in ("--tls-cert", "--tls-key", "--tls-ca")] == TLS_FILES, name
        (volume,) = [v for v in spec["volumes"] if v["name"] == "tls"]
        assert volume == {"name": "tls", "secret": {"secretName": f"epd-{name}-tls", "defaultMode": 0o400}}
        assert {"name": "tls", "mountPath": "/etc/mm-encoder/tls", "readOnly": True} in container["volumeMounts"]
    assert not any(d["kind"] in ("Certificate", "CertificateRequestPolicy") for d in tls_docs)  # the operator's
    note = one(tls_docs, DGD)["metadata"]["annotations"][k8s_names.NOTE]
    assert ("epd-shared-tls (CN shared, OU cache-shared, URI spiffe://mm-encoder.local/epd/cache-shared/shared, "
            "DNS epd-shared, epd-shared-0.epd-shared, epd-shared-1.epd-shared, cache-shared.epd.mm-encoder.local)"
            ) in note
    assert ("epd-engine-tls (CN engine, OU engine, URI spiffe://mm-encoder.local/epd/engine/engine, DNS "
            "engine.epd.mm-encoder.local, request-plane.epd.mm-encoder.local)") in note
    assert "kubectl create secret generic" in note and "exactly the URI and DNS names below" in note
    assert "CNI" in note


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


ROLES = {"encoder": "encoder", "shared": "cache-shared", "router": "cache-router", "cluster": "cache-cluster",
         "engine": "engine", "frontend": "frontend"}
PLANE = "request-plane.epd.mm-encoder.local"
OWN_NAMES = {  # the Service names each component is dialled by, its role's name, and Dynamo's request plane's
    "encoder": ["epd-encoder-http", "encoder.epd.mm-encoder.local", PLANE],
    "shared": ["epd-shared", "epd-shared-0.epd-shared", "epd-shared-1.epd-shared", "cache-shared.epd.mm-encoder.local"],
    "router": ["epd-router", "cache-router.epd.mm-encoder.local"],
    "cluster": ["epd-cluster", "cache-cluster.epd.mm-encoder.local"],
    "engine": ["engine.epd.mm-encoder.local", PLANE],
    "frontend": ["epd-frontend", "frontend.epd.mm-encoder.local", PLANE],
}


@pytest.fixture(scope="module")
def issued_docs() -> list[dict]:
    graph = graph_of(tls={"enabled": True, "issuer": "ClusterIssuer/ca-issuer"})
    return [d for d in yaml.safe_load_all(k8s.render_yaml(graph, namespace="team-a")) if d]


def test_each_certificate_carries_its_own_identity_and_no_other_components_name(issued_docs):
    """With `tls.issuer`, one Certificate per component: CN its name, OU its role, the one URI
    `spiffe://<trust domain>/<graph>/<role>/<component>`, as DNS names only its own (the Service names it is
    dialled by, its role's name, the request plane's on a Dynamo component); a tier checks its next level by
    that level's role name, which each server it reaches carries. Lifetimes: the graph's (a tier re-reads its
    files on renewal; a Dynamo component's plane reads them once, so it gets Dynamo's planes' lifetime)."""
    from mm_encoder.cache_tiers.cli import parse_args
    from mm_encoder.encode_worker.settings import WorkerSettings
    from mm_encoder.engines.process import EngineSettings
    from mm_encoder.frontend.settings import FrontendSettings

    certs = {d["metadata"]["name"]: d for d in issued_docs if d["kind"] == "Certificate"}
    assert sorted(certs) == sorted(f"epd-{n}-tls" for n in ROLES)
    for name, role in ROLES.items():
        cert = certs[f"epd-{name}-tls"]
        assert errors(cert, CERTIFICATE) == [], name
        spec = cert["spec"]
        assert (spec["secretName"], spec["commonName"], spec["subject"]) == (
            f"epd-{name}-tls", name, {"organizations": ["mm-encoder"], "organizationalUnits": [role]})
        assert spec["uris"] == [f"spiffe://mm-encoder.local/epd/{role}/{name}"]
        assert spec["dnsNames"] == OWN_NAMES[name], name
        assert spec["usages"] == ["server auth", "client auth", "digital signature"]
        assert spec["privateKey"] == {"algorithm": "ECDSA", "size": 256, "encoding": "PKCS8"}
        assert spec["issuerRef"] == {"name": "ca-issuer", "kind": "ClusterIssuer", "group": "cert-manager.io"}
        tier = role.startswith("cache-")
        assert (spec["duration"], spec["renewBefore"]) == (("24h", "8h") if tier else ("168h", "56h")), name
    for name, names in OWN_NAMES.items():  # no name of one component in another's certificate
        others = {n for other, ns in OWN_NAMES.items() if other != name for n in ns} - {PLANE}
        assert not set(names) & others, name

    parts = pods(issued_docs)
    by_host = {"epd-encoder-http": "encoder", "epd-router": "router", "epd-cluster": "cluster",
               **{f"epd-shared-{i}.epd-shared": "shared" for i in range(2)}}
    for name, upstream in (("shared", "encoder"), ("router", "shared"), ("cluster", "router")):
        _, cfg = parse_args(parts[name][1]["args"])
        assert cfg.tls and cfg.tls_server_name == f"{ROLES[upstream]}.epd.mm-encoder.local"
        for address in (*cfg.next, *cfg.shards):
            assert cfg.tls_server_name in OWN_NAMES[by_host[address.rsplit(":", 1)[0]]], (name, address)
    worker = WorkerSettings(_cli_parse_args=parts["encoder"][1]["args"])
    assert worker.tls and worker.ops_port == 9091 and sorted(worker.tls_allow) == ["cache-cluster", "cache-shared",
                                                                                  "engine"]
    frontend = FrontendSettings(_cli_parse_args=parts["frontend"][1]["args"])
    engine = EngineSettings(_cli_parse_args=parts["engine"][1]["args"])
    assert frontend.https and frontend.tls and frontend.encoder_http == "https://epd-cluster:8080"
    assert engine.tls and engine.encoder_chain == ("https://epd-cluster:8080",)


def _hours(duration: str) -> float:
    return float(duration[:-1]) * {"h": 1.0, "m": 1 / 60, "s": 1 / 3600}[duration[-1]]


def _permits(policy: dict, request: dict, namespace: str) -> bool | None:
    """approver-policy's decision on one request (a Certificate's spec, from `namespace`): None if the policy
    does not select it (issuer, namespace), else whether every requested attribute is allowed (exact strings:
    the rendered policies use no wildcards), each required one present, the usages a subset, the key and the
    duration within the constraints. Written from approver-policy's documentation, not from the renderer."""
    spec = policy["spec"]
    if any(request["issuerRef"].get(k) != v for k, v in spec["selector"]["issuerRef"].items()):
        return None
    if namespace not in spec["selector"]["namespace"]["matchNames"]:
        return None
    allowed, constraints = spec["allowed"], spec["constraints"]

    def strings(rule: dict | None, values: list[str]) -> bool:
        if rule is None:  # an omitted attribute must be empty
            return not values
        listed = rule["values"] if "values" in rule else [rule["value"]]
        return set(values) <= set(listed) and (bool(values) or not rule.get("required", False))

    subject, key = request.get("subject", {}), constraints["privateKey"]
    return (strings(allowed.get("commonName"), [request["commonName"]] if "commonName" in request else [])
            and strings(allowed.get("dnsNames"), request.get("dnsNames", []))
            and strings(allowed.get("uris"), request.get("uris", []))
            and strings(allowed["subject"].get("organizations"), subject.get("organizations", []))
            and strings(allowed["subject"].get("organizationalUnits"), subject.get("organizationalUnits", []))
            and set(request["usages"]) <= set(allowed["usages"]) and not request.get("isCA", False)
            and request["privateKey"]["algorithm"] == key["algorithm"]
            and key["minSize"] <= request["privateKey"]["size"] <= key["maxSize"]
            and _hours(request["duration"]) <= _hours(constraints["maxDuration"]))


def test_approver_policy_approves_each_certificate_from_this_namespace_only(issued_docs):
    """One CertificateRequestPolicy per component (cluster-scoped: named after the namespace too) that permits
    its own Certificate and nothing else: not another component's, not one that adds another component's
    name, not a stranger's URI under this graph, not a longer life; and from another namespace not even its
    own (no policy of ours selects it). A Role and RoleBinding in the namespace let cert-manager's controller,
    which requests every Certificate's certificates, use exactly these policies."""
    certs = {d["metadata"]["name"].removeprefix("epd-").removesuffix("-tls"): d["spec"] for d in issued_docs
             if d["kind"] == "Certificate"}
    policies = {d["metadata"]["name"]: d for d in issued_docs if d["kind"] == "CertificateRequestPolicy"}
    assert sorted(policies) == sorted(f"mm-encoder.team-a.epd.{n}" for n in ROLES)
    for name, policy in policies.items():
        assert errors(policy, CERTIFICATE_REQUEST_POLICY) == [], name
        assert policy["spec"]["selector"] == {"issuerRef": {"name": "ca-issuer", "kind": "ClusterIssuer",
                                                            "group": "cert-manager.io"},
                                              "namespace": {"matchNames": ["team-a"]}}
    for name, cert in certs.items():  # exactly one policy, its own, permits each Certificate here
        decisions = {p.rsplit(".", 1)[1]: _permits(policy, cert, "team-a") for p, policy in policies.items()}
        assert {n for n, ok in decisions.items() if ok} == {name}, decisions
        assert all(_permits(policy, cert, "team-b") is None for policy in policies.values())  # another namespace
    mixed = {**certs["encoder"], "dnsNames": [*certs["encoder"]["dnsNames"], "epd-router"]}  # the old hack
    stranger = {**certs["engine"], "uris": ["spiffe://mm-encoder.local/epd/engine/intruder"]}
    longer = {**certs["engine"], "duration": "2000h"}
    for request in (mixed, stranger, longer):
        assert not any(_permits(policy, request, "team-a") for policy in policies.values())
    role, binding = one(issued_docs, "Role"), one(issued_docs, "RoleBinding")
    assert role["metadata"]["name"] == binding["metadata"]["name"] == "epd-certificate-approval"
    assert role["rules"] == [{"apiGroups": ["policy.cert-manager.io"], "resources": ["certificaterequestpolicies"],
                              "verbs": ["use"], "resourceNames": list(policies)}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "cert-manager", "namespace": "cert-manager"}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "epd-certificate-approval"}
    note = one(issued_docs, DGD)["metadata"]["annotations"][k8s_names.NOTE]
    assert "from namespace team-a" in note and "mm-encoder.team-a.epd.encoder" in note
    # the controller's account is the chart's unless given; a malformed one, or no namespace, is refused
    graph = graph_of(tls={"enabled": True, "issuer": "ca-issuer"})
    other = k8s.render(graph, "team-a", "certs/cm-controller")
    assert one(other, "RoleBinding")["subjects"] == [{"kind": "ServiceAccount", "name": "cm-controller",
                                                      "namespace": "certs"}]
    with pytest.raises(GraphError, match="--cert-manager-account"):
        k8s.render(graph, "team-a", "cert-manager")
    with pytest.raises(GraphError, match="--namespace"):
        k8s.render(graph)
    with pytest.raises(GraphError, match="namespace"):
        k8s.render(graph, "Team_A")


def test_dynamos_request_plane_speaks_tls_checked_by_one_name_every_dynamo_component_carries(issued_docs, epd_docs):
    """With TLS every Dynamo component serves and calls its TCP request plane (and the response streams, TCP
    whatever the plane) with its own Secret's certificate, client certificates required, and checks each
    peer, dialled by pod IP, against the one name every Dynamo component's certificate carries. Its listeners
    are on fixed ports, with TLS or without (the NetworkPolicies name them)."""
    certs = {d["spec"]["secretName"]: d["spec"] for d in issued_docs if d["kind"] == "Certificate"}
    crt, key, ca = TLS_FILES
    for docs, tls in ((issued_docs, True), (epd_docs, False)):
        for name, comp in components(one(docs, DGD)).items():
            env = env_of(comp)
            assert (env["DYN_TCP_RPC_PORT"], env["DYN_TCP_RESPONSE_STREAM_PORT"]) == ("9092", "9093")
            tls_env = {k: v for k, v in env.items() if k.startswith("DYN_TCP_TLS_")}
            if not tls:
                assert tls_env == {}, name
                continue
            assert tls_env == {"DYN_TCP_TLS_CERT_PATH": crt, "DYN_TCP_TLS_KEY_PATH": key,
                               "DYN_TCP_TLS_CLIENT_CA_CERT_PATH": ca, "DYN_TCP_TLS_CA_CERT_PATH": ca,
                               "DYN_TCP_TLS_CLIENT_CERT_PATH": crt, "DYN_TCP_TLS_CLIENT_KEY_PATH": key,
                               "DYN_TCP_TLS_SERVER_NAME": PLANE}, name
            assert PLANE in certs[f"epd-{name}-tls"]["dnsNames"], name
    for name in ("shared", "router", "cluster"):  # nginx: no Dynamo
        assert PLANE not in certs[f"epd-{name}-tls"]["dnsNames"]


def test_the_planner_has_a_certificate_for_dynamos_request_plane():
    """The encode planner calls the encoders' load over Dynamo's request plane, so with TLS it mounts its own
    Secret and speaks that plane's TLS; its /status stays plaintext (no --tls-* option)."""
    doc = yaml.safe_load((GRAPHS / "epd-autoscale.yaml").read_text())
    doc["tls"] = {"enabled": True, "issuer": "ca-issuer"}
    docs = k8s.render(Graph.model_validate(doc), "mm")
    planner = components(one(docs, DGD))["planner"]
    spec = one(docs, "Certificate", "epd-autoscale-planner-tls")["spec"]
    assert spec["uris"] == ["spiffe://mm-encoder.local/epd-autoscale/planner/planner"]
    assert spec["dnsNames"] == ["planner.epd-autoscale.mm-encoder.local",
                                "request-plane.epd-autoscale.mm-encoder.local"]
    assert {"name": "tls", "mountPath": "/etc/mm-encoder/tls", "readOnly": True} in main_of(planner)["volumeMounts"]
    assert env_of(planner)["DYN_TCP_TLS_SERVER_NAME"] == "request-plane.epd-autoscale.mm-encoder.local"
    assert not any(a.startswith("--tls") for a in main_of(planner)["args"])
    assert errors(one(docs, DGD), SCHEMA) == []


def test_network_policies_deny_by_default_and_open_each_port_by_name(tls_docs, epd_docs):
    """Every graph, with TLS or without: one default-deny policy for the graph's pods (Ingress, no rule), one
    policy per component selecting its pods; each rule opens one port to named sources (the frontend's OpenAI
    port alone to anyone). Who may reach which port, hop by hop: tests/reliability/test_k8s_isolation.py."""
    for docs in (tls_docs, epd_docs):
        policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
        assert sorted(policies) == sorted(["epd-default-deny", *(f"epd-{n}-ingress" for n in ROLES)])
        assert policies["epd-default-deny"]["spec"] == {"podSelector": {"matchLabels": {"mm-encoder/graph": "epd"}},
                                                        "policyTypes": ["Ingress"]}
        for name in ROLES:
            policy = policies[f"epd-{name}-ingress"]
            assert errors(policy, NETWORK_POLICY) == [], name
            spec = policy["spec"]
            assert spec["podSelector"] == {"matchLabels": {"mm-encoder/graph": "epd", "mm-encoder/component": name}}
            assert spec["policyTypes"] == ["Ingress"]
            assert all(len(rule["ports"]) == 1 and rule["ports"][0]["protocol"] == "TCP" for rule in spec["ingress"])
            open_to_all = [rule["ports"][0]["port"] for rule in spec["ingress"] if "from" not in rule]
            assert open_to_all == ([k8s_names.FRONTEND_PORT] if name == "frontend" else []), name
    selected = {(d["spec"]["template"]["metadata"]["labels"]["mm-encoder/component"]) for d in tls_docs
                if d["kind"] in TIERS}
    pod_labels = {c["name"]: c["podTemplate"]["metadata"]["labels"]
                  for c in one(tls_docs, DGD)["spec"]["components"]}
    assert selected == {"shared", "router", "cluster"}
    assert all(labels["mm-encoder/component"] == name for name, labels in pod_labels.items())  # what the rules select


@pytest.mark.parametrize("name", sorted(p.stem for p in GRAPHS.glob("*.yaml")))
def test_graphs_without_tls_render_no_tls_objects(name):
    """A graph without `tls` gets no Secret volume, ops port, Certificate, approver-policy object or Dynamo
    TLS setting; its NetworkPolicies all the same."""
    graph, exposure = shipped(name)
    docs = docs_of(graph, exposure)
    assert not any(d["kind"] in ("Certificate", "CertificateRequestPolicy") for d in docs)
    assert f"{graph.name}-default-deny" in {d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy"}
    text = json.dumps(docs)
    assert "/etc/mm-encoder/tls" not in text and "--tls-" not in text and "mm-ops" not in text
    assert "DYN_TCP_TLS" not in text


def test_tls_graphs_the_render_cannot_serve_are_refused():
    """`tls.issuer` without TLS, a malformed issuer, and Dynamo's stock frontend (it takes none of the TLS
    options) are refused by name; an Issuer by bare name is a namespaced Issuer."""
    with pytest.raises(ValueError, match=r"tls\.issuer"):
        graph_of(tls={"issuer": "ca-issuer"})
    with pytest.raises(ValueError, match="issuer"):
        graph_of(tls={"enabled": True, "issuer": "Vault/x"})
    with pytest.raises(ValueError, match="stock frontend"):  # the graph itself: serve and render-k8s alike
        graph_of(tls={"enabled": True}, components__frontend={"kind": "frontend", "stock": True})
    docs = k8s.render(graph_of(tls={"enabled": True, "issuer": "ca-issuer"}), "mm")
    assert {d["spec"]["issuerRef"]["kind"] for d in docs if d["kind"] == "Certificate"} == {"Issuer"}


# --- drains and availability ------------------------------------------------------------------

QUIT = "sleep 5; kill -QUIT 1; while kill -0 1 2>/dev/null; do sleep 1; done"


def _stopping(docs: list[dict]) -> dict[str, tuple[list[str] | None, int | None]]:
    """Per component: its preStop command and its pod's grace period (None: Kubernetes' defaults)."""
    return {name: (container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command"),
                   spec.get("terminationGracePeriodSeconds")) for name, (spec, container) in pods(docs).items()}


def test_stopping_pods_finish_their_requests_first(epd_docs):
    """The encoders and the frontend wait 5 s in preStop (serving, while Services and discovery drop them),
    then drain on SIGTERM: their grace period is that wait, their --drain-timeout-s and 10 s more. A tier's
    preStop waits the same, then stops nginx gracefully (QUIT to PID 1) and waits for it: its grace is that
    wait plus its longest request (the cache lock, then the next level's timeout) and 10 s. Engines and the
    planner keep Kubernetes' defaults."""
    assert _stopping(epd_docs) == {
        "encoder": (["sleep", "5"], 45), "frontend": (["sleep", "5"], 45), "engine": (None, None),
        "shared": (["sh", "-c", QUIT], 5 + 600 + 900 + 10), "router": (["sh", "-c", QUIT], 5 + 900 + 10),
        "cluster": (["sh", "-c", QUIT], 5 + 600 + 1500 + 10)}
    # the drain each component is given: its args (which its parser reads), else its env, else the default
    graph = graph_of(components__encoder={"kind": "encoder", "args": ["--drain-timeout-s", "50"]},
                     components__frontend={"kind": "frontend", "env": {"MM_FRONTEND_DRAIN_TIMEOUT_S": "12"}},
                     components__cluster={"kind": "cache-cluster", "args": ["--read-timeout", "1m",
                                                                            "--lock-timeout", "20s"]})
    stopping = _stopping(docs_of(graph))
    assert (stopping["encoder"][1], stopping["frontend"][1], stopping["cluster"][1]) == (65, 27, 5 + 20 + 60 + 10)
    stock = _stopping(docs_of(load_graph(GRAPHS / "epd-stock.yaml")))  # Dynamo's frontend: our default bounds it
    assert stock["frontend"] == (["sleep", "5"], 45)
    assert errors(one(epd_docs, DGD), SCHEMA) == []


def test_every_component_has_a_budget_spreads_over_nodes_and_the_tiers_every_request_passes_run_two():
    """Per component a PodDisruptionBudget (one pod at a time) and a spread over nodes (preferred: a GPU pod
    that fits one node still starts); the router and the cluster tier run at least two replicas on
    Kubernetes (raised, and said so), roll out a new pod before stopping an old one; more stay as given."""
    graph = graph_of(components__router={"kind": "cache-router", "replicas": 3})
    for docs in (docs_of(load_graph(GRAPHS / "epd.yaml")), docs_of(graph)):
        budgets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodDisruptionBudget"}
        assert sorted(budgets) == sorted(f"epd-{n}-pdb" for n in ROLES)
        for name in ROLES:
            budget = budgets[f"epd-{name}-pdb"]
            assert errors(budget, POD_DISRUPTION_BUDGET) == []
            assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {
                "mm-encoder/graph": "epd", "mm-encoder/component": name}}}
        for name, (spec, _) in pods(docs).items():
            assert spec["topologySpreadConstraints"] == [{
                "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"mm-encoder/graph": "epd", "mm-encoder/component": name}}}], name
        assert errors(one(docs, DGD), SCHEMA) == []
    epd = docs_of(load_graph(GRAPHS / "epd.yaml"))
    for name in ("router", "cluster"):
        deployment = one(epd, "Deployment", f"epd-{name}")
        assert deployment["spec"]["replicas"] == 2
        assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                                  "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
        assert "raised from the graph's 1 to 2" in deployment["metadata"]["annotations"][k8s_names.NOTE]
    assert "router 1 -> 2, cluster 1 -> 2" in one(epd, DGD)["metadata"]["annotations"][k8s_names.NOTE]
    router = one(docs_of(graph), "Deployment", "epd-router")
    assert router["spec"]["replicas"] == 3 and "annotations" not in router["metadata"]


# --- every core object, through Kubernetes' own models -------------------------------------------------

CORE_MODELS = {"Service": "V1Service", "Deployment": "V1Deployment", "StatefulSet": "V1StatefulSet",
               "NetworkPolicy": "V1NetworkPolicy", "PodDisruptionBudget": "V1PodDisruptionBudget", "Role": "V1Role",
               "RoleBinding": "V1RoleBinding", "ConfigMap": "V1ConfigMap"}


def _round_trip(value: dict, model: str) -> dict:
    """`value` read into the Kubernetes client's model (its required fields checked) and written back: a field
    the model does not know (misspelled, misplaced) is dropped, so the result differs."""
    from kubernetes.client import ApiClient

    api = ApiClient()
    back: dict = api.sanitize_for_serialization(api._ApiClient__deserialize(value, model))  # type: ignore[attr-defined]
    return back


@pytest.mark.parametrize(("name", "tls"), [(n, t) for n in sorted(p.stem for p in GRAPHS.glob("*.yaml"))
                                           for t in (False, True) if not (t and n in ("epd-stock", "epd-vllm"))])
def test_every_core_object_and_pod_template_is_what_kubernetes_models_read(name, tls):
    """Every Service, Deployment, StatefulSet, NetworkPolicy, PodDisruptionBudget, Role, RoleBinding and
    ConfigMap, and each DGD component's pod template (a core/v1 PodTemplateSpec), comes back unchanged
    through the Kubernetes client's models (kubernetes 32, a dependency of Dynamo's frontend)."""
    doc = yaml.safe_load((GRAPHS / f"{name}.yaml").read_text())
    if tls:
        doc["tls"] = {"enabled": True, "issuer": "ca-issuer"}
    graph, exposure = as_rendered(doc)
    docs = k8s.render(graph, "mm", exposure=exposure)
    checked = Counter()
    for d in docs:
        if d["kind"] in CORE_MODELS:
            assert _round_trip(d, CORE_MODELS[d["kind"]]) == d, (d["kind"], d["metadata"]["name"])
            checked[d["kind"]] += 1
        if d["kind"] == DGD:
            for c in d["spec"]["components"]:
                assert _round_trip(c["podTemplate"], "V1PodTemplateSpec") == c["podTemplate"], c["name"]
    assert checked["NetworkPolicy"] == len(doc["components"]) + 1 and checked["PodDisruptionBudget"] > 0
    broken = copy.deepcopy(one(docs, "NetworkPolicy", f"{doc['name']}-default-deny"))
    broken["spec"]["podSelectr"] = {}  # the check itself: a misspelled field does not come back
    assert _round_trip(broken, "V1NetworkPolicy") != broken


def test_every_tier_serves_metrics_where_the_encoders_do(epd_docs, tls_docs):
    """One PodMonitor (docs/kubernetes.md) scrapes the encoders and the tiers: without TLS each tier's
    /metrics is on its port named as the encoders' (`mm-http`), which admits Prometheus as theirs does;
    with TLS on the plaintext ops port (`mm-ops`), as theirs is."""
    def port_rules(docs: list[dict], component: str) -> dict[int, list[dict]]:
        policy = one(docs, "NetworkPolicy", f"epd-{component}-ingress")
        return {p["port"]: rule.get("from", []) for rule in policy["spec"]["ingress"] for p in rule["ports"]}

    for docs, tls in ((epd_docs, False), (tls_docs, True)):
        found = pods(docs)
        names = {p["name"]: p["containerPort"] for p in found["encoder"][1]["ports"]}
        wanted = "mm-ops" if tls else "mm-http"
        for tier in ("cluster", "router", "shared"):
            ports = {p["name"]: p["containerPort"] for p in found[tier][1]["ports"]}
            assert wanted in ports and wanted in names, (tier, ports)
            assert PROMETHEUS in port_rules(docs, tier)[ports[wanted]], tier
