"""The encode planner on Kubernetes: Dynamo's own `KubernetesConnector` (through `runtime.dynamo`'s seam)
against an in-process fake API server that serves the DynamoGraphDeployment `render-k8s
graphs/epd-autoscale.yaml` renders, answers only what the rendered Role allows, and records every request.

The connector's client is synchronous (the kubernetes package over urllib3) and is called from the
planner's event loop, so the fake runs as a ThreadingHTTPServer in its own thread. What is asserted is
the exact request that changes the encoder count: the Scale patch on the encoder's scaling adapter
`<graph>-encoder` when it exists, else Dynamo's JSON patch on `/spec/components/<i>/replicas` at the
encoder's index (guarded by a `test` of its name), never at an engine's.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from mm_encoder.graph.schema import Graph, load_graph
from mm_encoder.k8s import render as k8s
from mm_encoder.k8s.names import PLANNER_SERVICE_ACCOUNT, Exposure
from mm_encoder.runtime.dynamo import encoder_target, planner_connector

pytest.importorskip("kubernetes")
try:  # Dynamo's planner package (ai-dynamo, the `stock` extra's install)
    encoder_target("encoder", 1)
except ImportError as e:
    pytest.skip(f"Dynamo's planner is not installed: {e}", allow_module_level=True)

GRAPH = Path(__file__).resolve().parents[1] / "graphs" / "epd-autoscale.yaml"
DGD_LABEL, COMPONENT_LABEL = "nvidia.com/dynamo-graph-deployment-name", "nvidia.com/dynamo-component"
TOKEN = "fake-planner-token"
_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")  # the connector's namespace, if any
NS = _SA_NAMESPACE.read_text().strip() if _SA_NAMESPACE.is_file() else "default"
API = f"/apis/nvidia.com/v1beta1/namespaces/{NS}"
_PATH = re.compile(r"^/(?:apis/(?P<group>[^/]+)/(?P<version>[^/]+)|api/(?P<core>v1))/namespaces/(?P<ns>[^/]+)/"
                   r"(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$")


def rendered() -> tuple[dict[str, Any], dict[str, Any]]:
    """The DynamoGraphDeployment and the connector's Role, as `render-k8s` writes them."""
    docs = [d for d in yaml.safe_load_all(k8s.render_yaml(load_graph(GRAPH))) if d]
    (dgd,) = [d for d in docs if d["kind"] == "DynamoGraphDeployment"]
    (role,) = [d for d in docs if d["kind"] == "Role"]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": PLANNER_SERVICE_ACCOUNT}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    return dgd, role


def allows(role: dict[str, Any], verb: str, group: str, resource: str, name: str | None) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
               and (name in r["resourceNames"] if "resourceNames" in r else True) for r in role["rules"])


class FakeApiServer:
    """One DynamoGraphDeployment (Ready, status caught up with its spec), its pods, and optionally the encoder's
    scaling adapter. A replica change is reconciled at once, as an operator would (generation, status, pods)."""

    def __init__(self, dgd: dict[str, Any], role: dict[str, Any] | None, adapter: str | None, ready: bool = True):
        self.ready = ready
        self.dgd = copy.deepcopy(dgd)
        self.dgd["metadata"] |= {"namespace": NS, "generation": 1, "uid": "fake-uid"}
        self.role, self.adapter = role, adapter
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self._reconcile()
        fake = self

        class Handler(BaseHTTPRequestHandler):  # HTTP/1.0: one request per connection, no lingering thread
            def do_GET(self) -> None:
                fake.handle(self, None)

            def do_PATCH(self) -> None:
                fake.handle(self, json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="fake-kube-apiserver")

    def __enter__(self) -> FakeApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def components(self) -> dict[str, dict[str, Any]]:
        return {c["name"]: c for c in self.dgd["spec"]["components"]}

    def _reconcile(self) -> None:
        """The operator's part: status observes the spec; every replica ready."""
        meta = self.dgd["metadata"]
        self.dgd["status"] = {
            "state": "successful", "observedGeneration": meta["generation"],
            "conditions": [{"type": "Ready", "status": "True" if self.ready else "False",
                            "reason": "AllComponentsReady" if self.ready else "ComponentsNotReady"}],
            "components": {n: {"componentKind": "Deployment", "replicas": c["replicas"],
                               "updatedReplicas": c["replicas"], "readyReplicas": c["replicas"],
                               "availableReplicas": c["replicas"]} for n, c in self.components().items()},
        }

    def _scale(self, name: str) -> dict[str, Any]:
        replicas = self.components()["encoder"]["replicas"]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": name, "namespace": NS},
                "spec": {"replicas": replicas}, "status": {"replicas": replicas}}

    def _pods(self, selector: str) -> dict[str, Any]:
        wanted = dict(kv.split("=", 1) for kv in selector.split(",") if kv)
        pods = [{"metadata": {"name": f"{self.dgd['metadata']['name']}-{n}-{i}", "namespace": NS,
                              "labels": {DGD_LABEL: self.dgd["metadata"]["name"], COMPONENT_LABEL: n}},
                 "status": {"phase": "Running"}}
                for n, c in self.components().items() for i in range(c["replicas"])]
        items = [p for p in pods if wanted.items() <= p["metadata"]["labels"].items()]
        return {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}

    def _json_patch(self, ops: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        doc = copy.deepcopy(self.dgd)
        for op in ops:
            *parents, last = op["path"].strip("/").split("/")
            node: Any = doc
            for p in parents:
                node = node[int(p)] if isinstance(node, list) else node[p]
            if op["op"] == "test" and node.get(last) != op["value"]:
                return 422, {"kind": "Status", "code": 422, "message": f"test failed at {op['path']}"}
            if op["op"] in ("add", "replace"):
                node[last] = op["value"]
        doc["metadata"]["generation"] += 1
        self.dgd = doc
        self._reconcile()
        return 200, self.dgd

    def handle(self, h: BaseHTTPRequestHandler, body: Any) -> None:
        url = urlsplit(h.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        with self.lock:
            status, answer = self._answer(h.command, url.path, query, body)
            self.requests.append({"method": h.command, "path": url.path, "query": query, "status": status,
                                  "content_type": h.headers.get("Content-Type"), "body": body,
                                  "authorization": h.headers.get("Authorization")})
        data = json.dumps(answer).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _answer(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, dict[str, Any]]:
        m = _PATH.match(path)
        if m is None:
            return 404, {"kind": "Status", "code": 404, "message": f"no route {path}"}
        group = "" if m["core"] else m["group"]
        resource = m["plural"] + (f"/{m['sub']}" if m["sub"] else "")
        verb = {"PATCH": "patch"}.get(method, "get" if m["name"] else "list")
        if self.role is not None and not allows(self.role, verb, group, resource, m["name"]):
            return 403, {"kind": "Status", "code": 403, "message": f"forbidden: {verb} {resource} {m['name']}"}
        dgd_name = self.dgd["metadata"]["name"]
        if resource == "dynamographdeployments" and m["name"] == dgd_name:
            return self._json_patch(body) if method == "PATCH" else (200, self.dgd)
        if resource == "dynamographdeploymentscalingadapters/scale" and m["name"] == self.adapter:
            if method == "PATCH":  # the adapter owns the encoder's replicas: it writes them into the DGD
                encoder = next(i for i, c in enumerate(self.dgd["spec"]["components"]) if c["name"] == "encoder")
                self._json_patch([{"op": "add", "path": f"/spec/components/{encoder}/replicas",
                                   "value": body["spec"]["replicas"]}])
            return 200, self._scale(m["name"])
        if resource == "pods" and verb == "list":
            return 200, self._pods(query.get("labelSelector", ""))
        return 404, {"kind": "Status", "code": 404, "reason": "NotFound",
                     "message": f"{resource} {m['name']} not found"}


@pytest.fixture
def kube(tmp_path, monkeypatch):
    """A kubeconfig for a fake API server (no in-cluster config), restored afterwards; yields a factory."""
    import kubernetes

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("DYN_PARENT_DGD_K8S_NAME", "epd-autoscale")
    monkeypatch.setattr(kubernetes.client.Configuration, "_default", None)  # load_kube_config sets the default
    before = set(threading.enumerate())
    servers: list[FakeApiServer] = []

    def start(dgd: dict[str, Any], role: dict[str, Any] | None, adapter: str | None,
              ready: bool = True) -> FakeApiServer:
        fake = FakeApiServer(dgd, role, adapter, ready).__enter__()
        servers.append(fake)
        config = tmp_path / "kubeconfig"
        config.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
            "users": [{"name": "planner", "user": {"token": TOKEN}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "planner"}}],
        }))
        monkeypatch.setenv("KUBECONFIG", str(config))  # read when kubernetes.config is first imported ...
        monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(config))  # ... or later
        return fake

    yield start
    for fake in servers:
        fake.__exit__()
        assert all(r["status"] != 403 for r in fake.requests), "a call the rendered Role does not allow"
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()], "a thread was left behind"


def connector():
    graph = load_graph(GRAPH)
    return planner_connector("kubernetes", None, graph.namespace, graph.llm.served_name, "encoder")


def changes(fake: FakeApiServer) -> list[dict[str, Any]]:
    return [r for r in fake.requests if r["method"] == "PATCH"]


@pytest.mark.parametrize("order", ["rendered", "reversed"])
async def test_without_a_scaling_adapter_the_replica_patch_is_at_the_encoders_index(kube, order):
    """No DGDSA (404 on its Scale): Dynamo's connector patches the DGD at the encoder's index, found by name
    (the JSON patch tests the name first), not an engine's; up 1 -> 3, then down 3 -> 2 once the pods show
    nothing pending or terminating. Every call is one the rendered Role allows."""
    dgd, role = rendered()
    if order == "reversed":  # the index follows the encoder's name, wherever it sits
        dgd["spec"]["components"].reverse()
    index = {c["name"]: i for i, c in enumerate(dgd["spec"]["components"])}
    fake = kube(dgd, role, adapter=None)
    c = connector()
    await c.set_component_replicas([encoder_target("encoder", 3)], blocking=False)
    scale, patch = changes(fake)
    assert scale["path"] == f"{API}/dynamographdeploymentscalingadapters/epd-autoscale-encoder/scale"
    assert scale["status"] == 404 and scale["body"] == {"spec": {"replicas": 3}}
    i = index["encoder"]
    assert patch["path"] == f"{API}/dynamographdeployments/epd-autoscale" and patch["status"] == 200
    assert patch["content_type"] == "application/json-patch+json"
    assert patch["body"] == [{"op": "test", "path": f"/spec/components/{i}/name", "value": "encoder"},
                             {"op": "add", "path": f"/spec/components/{i}/replicas", "value": 3}]
    assert i != index["engine"] and f"/spec/components/{index['engine']}/" not in json.dumps(patch["body"])
    assert {n: x["replicas"] for n, x in fake.components().items()} == {"encoder": 3, "engine": 2, "frontend": 1,
                                                                       "planner": 1}
    assert all(r["authorization"] == f"Bearer {TOKEN}" for r in fake.requests)
    assert not [r for r in fake.requests if r["method"] == "GET" and "pods" in r["path"]]  # up: no pod check

    fake.requests.clear()
    await c.set_component_replicas([encoder_target("encoder", 2)], blocking=False)
    pods = [r for r in fake.requests if r["path"].endswith("/pods")]
    assert [p["query"] for p in pods] == [{"labelSelector": f"{DGD_LABEL}=epd-autoscale"}]  # before a scale-down
    assert changes(fake)[-1]["body"] == [{"op": "test", "path": f"/spec/components/{i}/name", "value": "encoder"},
                                         {"op": "add", "path": f"/spec/components/{i}/replicas", "value": 2}]
    assert fake.components()["encoder"]["replicas"] == 2 and fake.components()["engine"]["replicas"] == 2


async def test_with_the_scaling_adapter_the_connector_scales_it(kube):
    """With the encoder's DGDSA (`scalingAdapter: {}` makes the operator create `<graph>-encoder`), the change is
    one merge patch of its Scale subresource and the DGD itself is never patched by the connector."""
    dgd, role = rendered()
    assert next(c for c in dgd["spec"]["components"] if c["name"] == "encoder")["scalingAdapter"] == {}
    fake = kube(dgd, role, adapter="epd-autoscale-encoder")
    c = connector()
    for want in (3, 2):
        fake.requests.clear()
        await c.set_component_replicas([encoder_target("encoder", want)], blocking=False)
        (scale,) = changes(fake)
        assert scale["path"] == f"{API}/dynamographdeploymentscalingadapters/epd-autoscale-encoder/scale"
        assert scale["content_type"] == "application/merge-patch+json" and scale["body"] == {"spec": {"replicas": want}}
        assert fake.components()["encoder"]["replicas"] == want and fake.components()["engine"]["replicas"] == 2
    assert all(r["authorization"] == f"Bearer {TOKEN}" for r in fake.requests)


async def test_the_role_is_what_the_connector_needs_and_no_more(kube):
    """The rendered Role names this graph's DGD and the encoder's adapter only, with the verbs the connector
    uses; a scale-up and a scale-down through it get no 403 (the fixture checks every request)."""
    dgd, role = rendered()
    assert allows(role, "patch", "nvidia.com", "dynamographdeployments", "epd-autoscale")
    assert not allows(role, "patch", "nvidia.com", "dynamographdeployments", "another-graph")
    assert not allows(role, "patch", "nvidia.com", "dynamographdeploymentscalingadapters/scale", "epd-autoscale-engine")
    assert not allows(role, "delete", "nvidia.com", "dynamographdeployments", "epd-autoscale")
    assert allows(role, "list", "", "pods", None) and not allows(role, "get", "", "secrets", None)
    fake = kube(dgd, role, adapter="epd-autoscale-encoder")
    c = connector()
    await c.set_component_replicas([encoder_target("encoder", 3)], blocking=False)
    await c.set_component_replicas([encoder_target("encoder", 1)], blocking=False)
    used = {(r["method"], re.sub(r"/namespaces/[^/]+/", "/namespaces/NS/", r["path"])) for r in fake.requests}
    assert used == {("GET", "/apis/nvidia.com/v1beta1/namespaces/NS/dynamographdeployments/epd-autoscale"),
                    ("GET", "/api/v1/namespaces/NS/pods"),
                    ("PATCH", "/apis/nvidia.com/v1beta1/namespaces/NS/dynamographdeploymentscalingadapters/"
                              "epd-autoscale-encoder/scale")}
    assert fake.components()["encoder"]["replicas"] == 1


async def test_dynamo_planners_decode_slot_is_the_engine(kube):
    """Coexistence: in the same DGD, Dynamo's own planner's decode target (by type, no name) reaches the engine
    (typed decode), while the encoder's count (prefill slot, by name) reaches the encoder. Dynamo's planner runs
    with the platform's role, so the fake checks no RBAC here."""
    dgd, _ = rendered()
    index = {c["name"]: i for i, c in enumerate(dgd["spec"]["components"])}
    fake = kube(dgd, None, adapter=None)
    ours = encoder_target("encoder", 2)
    decode = type(ours)(sub_component_type=type(ours.sub_component_type)("decode"), desired_replicas=4)
    await connector().set_component_replicas([decode, ours], blocking=False)
    bodies = [r["body"] for r in changes(fake) if r["path"].endswith("/epd-autoscale")]
    assert bodies == [
        [{"op": "test", "path": f"/spec/components/{index['engine']}/name", "value": "engine"},
         {"op": "add", "path": f"/spec/components/{index['engine']}/replicas", "value": 4}],
        [{"op": "test", "path": f"/spec/components/{index['encoder']}/name", "value": "encoder"},
         {"op": "add", "path": f"/spec/components/{index['encoder']}/replicas", "value": 2}],
    ]


async def test_a_dgd_that_is_not_ready_is_left_alone(kube):
    """While the DGD's Ready condition is False the connector reads it (and its pods), changes nothing and says
    so (the planner builds it with `raise_not_ready`): the planner then holds and decides again next round."""
    dgd, role = rendered()
    fake = kube(dgd, role, adapter="epd-autoscale-encoder", ready=False)
    with pytest.raises(Exception, match="not ready") as e:
        await connector().set_component_replicas([encoder_target("encoder", 3)], blocking=False)
    assert type(e.value).__name__ == "DynamoGraphDeploymentNotReadyError"
    assert [r["method"] for r in fake.requests] == ["GET", "GET"] and not changes(fake)
    assert fake.components()["encoder"]["replicas"] == 1


async def test_an_encoder_sites_planner_scales_its_encoders_without_engines(kube, monkeypatch):
    """An encoder site (graphs/encoder-site.yaml with a planner) renders no engines, so no component is typed
    decode: Dynamo's connector still finds the encoder by name in the prefill slot and scales its adapter,
    with the calls the rendered Role allows."""
    doc = yaml.safe_load((GRAPH.parent / "encoder-site.yaml").read_text())
    doc["components"]["planner"] = {"kind": "planner", "args": ["--min-replicas", "1", "--max-replicas", "3"]}
    graph = Graph.model_validate(doc)
    docs = k8s.render(graph, exposure=Exposure(plaintext=True))
    (dgd,) = [d for d in docs if d["kind"] == "DynamoGraphDeployment"]
    (role,) = [d for d in docs if d["kind"] == "Role"]
    assert {c["name"]: c["type"] for c in dgd["spec"]["components"]} == {"encoder": "worker", "planner": "planner"}
    monkeypatch.setenv("DYN_PARENT_DGD_K8S_NAME", "encoder-site")
    fake = kube(dgd, role, adapter="encoder-site-encoder")
    c = planner_connector("kubernetes", None, graph.namespace, graph.llm.served_name, "encoder")
    await c.set_component_replicas([encoder_target("encoder", 3)], blocking=False)
    (scale,) = changes(fake)
    assert scale["path"] == f"{API}/dynamographdeploymentscalingadapters/encoder-site-encoder/scale"
    assert scale["body"] == {"spec": {"replicas": 3}} and fake.components()["encoder"]["replicas"] == 3
