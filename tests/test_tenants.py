"""The tenant scope's parts (`security.tenants`, docs/tenants.md): the scope of a request from the
header Dynamo's frontend carries in its context, refused by name without one; the key file; the
options as serve, the graph and render-k8s take them. Two tenants on two clusters sharing no entry,
end to end over TLS, is tests/test_sites.py's `test_two_tenants_share_no_entry_at_any_level`; the
worker's scoped caches, tests/test_worker.py's `test_alias_and_mm_hash_hits_skip_their_work`."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import yaml

from mm_encoder.core.engine_request import EngineRequest
from mm_encoder.core.errors import BadRequest, BadTenant, GraphError, MissingTenant
from mm_encoder.frontend.settings import FrontendSettings
from mm_encoder.graph.plan import plan
from mm_encoder.graph.schema import Graph, load_graph
from mm_encoder.k8s.render import render_yaml
from mm_encoder.security.tenants import METADATA_HEADER, Tenants, forward_header, make_key, read_key
from mm_encoder.serve.cli import ServeOptions
from mm_encoder.serve.site import LocalSite

ROOT = Path(__file__).resolve().parents[1]
KEY = bytes(range(32))


class Context:
    """What the processor reads of Dynamo's request context: its propagated metadata, where Dynamo's
    frontend puts the header named by DYN_METADATA_HEADER under the empty key."""

    def __init__(self, **headers: str):
        self.metadata = headers


def tenant_of(tenants: Tenants, value: str | None) -> str:
    return tenants.scope(Context(**({"": value} if value is not None else {})))


def hmac_sha256(key: bytes, message: bytes) -> str:
    """RFC 2104 written out with hashlib alone: the expected side, not the stdlib `hmac` the code uses."""
    block = key.ljust(64, b"\0")
    inner = hashlib.sha256(bytes(b ^ 0x36 for b in block) + message).digest()
    return hashlib.sha256(bytes(b ^ 0x5C for b in block) + inner).hexdigest()


def test_the_scope_is_the_keyed_hash_of_the_tenant():
    tenants = Tenants("X-Tenant", KEY)
    assert tenant_of(tenants, "acme") == hmac_sha256(KEY, b"acme")
    assert tenant_of(tenants, "acme") != tenant_of(tenants, "globex")
    assert tenant_of(Tenants("X-Tenant", bytes(32)), "acme") != tenant_of(tenants, "acme")  # another key
    assert Tenants().scope(Context()) == "" and Tenants().scope(None) == ""  # off: no scope, no header read


@pytest.mark.parametrize("value, error, words", [
    (None, MissingTenant, "needs the X-Tenant header"),
    ("", MissingTenant, "needs the X-Tenant header"),
    ("a\tb", BadTenant, "not a tenant's name"),
    ("é", BadTenant, "not a tenant's name"),
    ("x" * 257, BadTenant, "at most 256"),
])
def test_a_request_without_a_tenant_is_refused_by_name(value, error, words):
    with pytest.raises(error) as refused:
        tenant_of(Tenants("X-Tenant", KEY), value)
    assert refused.value.http_status == 400 and words in refused.value.message
    assert refused.value.code == {MissingTenant: "missing_tenant", BadTenant: "bad_tenant"}[error]


def test_the_engine_request_carries_the_scope_as_its_cache_salt_only_when_set():
    salted = EngineRequest("r", [1, 2], 3, cache_salt="ab" * 32)
    assert EngineRequest.from_dict(salted.to_dict()).cache_salt == "ab" * 32
    assert "cache_salt" not in EngineRequest("r", [1, 2], 3).to_dict()  # tenants off: the request as before
    for bad in (7, "x" * 257):
        with pytest.raises(BadRequest, match="cache_salt is a string of at most 256"):
            EngineRequest.from_dict({**salted.to_dict(), "cache_salt": bad})


def test_the_key_file_is_refused_when_short_or_readable_by_others(tmp_path):
    key = make_key(tmp_path / "tenant.key")
    assert oct(key.stat().st_mode & 0o777) == "0o600" and len(read_key(key)) == 32
    assert make_key(key).read_bytes() == read_key(key)  # kept across restarts
    key.chmod(0o644)
    with pytest.raises(ValueError, match="other users may read it"):
        read_key(key)
    key.chmod(0o440)  # Kubernetes: the pod's fsGroup reads a Secret's file
    assert len(read_key(key)) == 32
    short = tmp_path / "short.key"
    short.write_bytes(b"k" * 16)
    short.chmod(0o600)
    with pytest.raises(ValueError, match="16 bytes"):
        read_key(short)
    with pytest.raises(ValueError, match="No such file"):
        read_key(tmp_path / "missing.key")


def test_dynamo_is_told_to_pass_the_header_on_and_a_conflict_is_refused():
    env: dict[str, str] = {}
    forward_header("X-Tenant", env)
    assert env == {METADATA_HEADER: "x-tenant"}
    forward_header(None, env)  # off: untouched
    with pytest.raises(ValueError, match="passes one header prefix"):
        forward_header("X-Customer", env)
    with pytest.raises(ValueError, match="an HTTP header name"):
        Tenants("X Tenant", KEY)


def test_frontend_options_go_together(tmp_path):
    base = {"model_dir": tmp_path, "_cli_parse_args": []}
    with pytest.raises(ValueError, match="--tenant-header and --tenant-key go together"):
        FrontendSettings(**base, tenant_header="X-Tenant")
    with pytest.raises(ValueError, match="aggregated baseline"):
        FrontendSettings(**base, tenant_header="X-Tenant", tenant_key=tmp_path / "k", inline_media=True)


def frontend_argv(g: Graph, run_dir: Path) -> list[str]:
    return next(list(r.argv) for c in plan(g, LocalSite(g, run_dir)) if c.kind == "frontend" for r in c.replicas)


def test_serve_hands_the_frontend_the_header_and_a_key_of_its_own(tmp_path):
    g = ServeOptions("epd", tenant_header="X-Tenant").apply(load_graph(ROOT / "graphs" / "epd.yaml"))
    argv = frontend_argv(g, tmp_path)
    key = tmp_path / "tenant.key"
    assert argv[argv.index("--tenant-header") + 1] == "X-Tenant" and argv[argv.index("--tenant-key") + 1] == str(key)
    assert len(read_key(key)) == 32
    shared = make_key(tmp_path / "shared.key")
    g = ServeOptions("epd", tenant_header="X-Tenant", tenant_key=shared).apply(load_graph(ROOT / "graphs" / "epd.yaml"))
    argv = frontend_argv(g, tmp_path / "run")
    assert argv[argv.index("--tenant-header"):][:4] == ["--tenant-header", "X-Tenant", "--tenant-key", str(shared)]
    assert "--tenant-header" not in frontend_argv(load_graph(ROOT / "graphs" / "epd.yaml"), tmp_path)  # off


def test_the_graph_refuses_tenants_where_no_frontend_of_ours_reads_them():
    doc = yaml.safe_load((ROOT / "graphs" / "encoder-site.yaml").read_text())
    with pytest.raises(ValueError, match="not on an encoder site"):
        Graph.model_validate({**doc, "tenants": {"header": "X-Tenant"}})
    with pytest.raises(GraphError, match="not on an encoder site"):
        ServeOptions("encoder-site", tenant_header="X-Tenant").apply(Graph.model_validate(doc))


def test_render_k8s_mounts_the_tenant_key_secret_in_the_frontend():
    g = load_graph(ROOT / "graphs" / "epd.yaml")
    g = Graph.model_validate({**g.model_dump(), "tenants": {"header": "X-Tenant"}})
    docs = [d for d in yaml.safe_load_all(render_yaml(g)) if d]
    dgd = next(d for d in docs if d["kind"] == "DynamoGraphDeployment")
    front = next(c for c in dgd["spec"]["components"] if c["name"].endswith("frontend"))
    spec = front["podTemplate"]["spec"]
    main = spec["containers"][0]
    assert main["args"][main["args"].index("--tenant-key") + 1] == "/etc/mm-encoder/tenant/tenant.key"
    assert {"name": "tenant-key", "mountPath": "/etc/mm-encoder/tenant", "readOnly": True} in main["volumeMounts"]
    volume = next(v for v in spec["volumes"] if v["name"] == "tenant-key")
    assert volume["secret"]["secretName"] == "epd-tenant-key" and volume["secret"]["defaultMode"] == 0o400
    assert "Tenants: the frontend takes each request's tenant from the X-Tenant header" in \
        dgd["metadata"]["annotations"]["mm-encoder/note"]
    others = [c for c in dgd["spec"]["components"] if c is not front]
    assert all("--tenant-header" not in c["podTemplate"]["spec"]["containers"][0]["args"] for c in others)
    assert os.environ.get(METADATA_HEADER) is None  # nothing here changed the test process's environment
