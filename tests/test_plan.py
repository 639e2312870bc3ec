"""One plan for both deployments: `mm-encoder serve` and `render-k8s` run the same components, in
the same order, with the same options; only the site's addresses, ports and paths differ. Every
component that runs or describes the model reads one checkpoint directory, the graph's `llm`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mm_encoder.core.errors import GraphError
from mm_encoder.core.topology import ORDER
from mm_encoder.graph.checkpoint import GeneratedCheckpoint
from mm_encoder.graph.plan import plan
from mm_encoder.graph.schema import LLM, Graph, load_graph
from mm_encoder.k8s.names import MODEL_DIR, K8sNames
from mm_encoder.k8s.site import K8sSite
from mm_encoder.runtime.dynamo import MAX_MESSAGE_SIZE
from mm_encoder.serve.site import LocalSite

GRAPHS = Path(__file__).resolve().parents[1] / "graphs"
GRAPH_NAMES = sorted(p.stem for p in GRAPHS.glob("*.yaml"))
# Flags whose values are the site's (an address, a port, a path), not the component's options.
SITE_VALUES = {"--http-host", "--http-port", "--listen", "--run-dir", "--cache-dir", "--next", "--direct", "--shard",
               "--encoder-http", "--encoder-chain", "--stock-model-dir", "--handle-chain", "--model-dir",
               "--checkpoint", "--model", "--connector"}
# Per kind, the flags that name the model's checkpoint directory.
MODEL_FLAGS = {"encoder": ("--model", "--stock-model-dir"), "engine": ("--checkpoint",), "frontend": ("--model-dir",)}
GENERATED_NAME = "kimi-k2.5-tiny"


def shape(argv: tuple[str, ...]) -> list[str]:
    """argv with the site's values blanked out, and a site flag repeated right after itself kept once: how
    many addresses reach N encoders is the site's (N loopback ports here, one Service on Kubernetes)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in SITE_VALUES and i + 1 < len(argv):
            if out[-2:] != [argv[i], "<site>"]:
                out += [argv[i], "<site>"]
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def opt(argv, flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def with_llm(g: Graph, **llm) -> Graph:
    return g.model_copy(update={"llm": g.llm.model_copy(update=llm)})


def sites(g: Graph, run_dir: Path) -> dict:
    return {"local": LocalSite(g, run_dir), "k8s": K8sSite(K8sNames(g))}


SITE_URL = "http://198.18.0.1:8090"  # a model cluster's encoder site, where the file leaves it to serve's option


def shipped(name: str) -> Graph:
    """A shipped graph; a model cluster's with its encoder site named, as `serve --encoder-site` does."""
    g = load_graph(GRAPHS / f"{name}.yaml")
    if g.site == "cluster":
        g = g.model_copy(update={"encoder_site": g.encoder_site.model_copy(update={"url": SITE_URL})})
    return g


@pytest.fixture(params=GRAPH_NAMES)
def graph(request) -> Graph:
    return shipped(request.param)


def test_local_and_kubernetes_plans_differ_only_in_the_site(graph, tmp_path):
    """Same components, order, modules, replica counts, health paths, volumes used and options on
    both sites; the graph's own args come last; the Dynamo planes are the same."""
    local = plan(graph, LocalSite(graph, tmp_path))
    k8s = plan(graph, K8sSite(K8sNames(graph)))
    assert [(c.name, c.kind, c.module, len(c.replicas), c.health_path, c.reads_model) for c in local] == \
           [(c.name, c.kind, c.module, len(c.replicas), c.health_path, c.reads_model) for c in k8s]
    assert [c.kind for c in local] == sorted((c.kind for c in local), key=ORDER.index)  # start order
    for a, b in zip(local, k8s, strict=True):
        assert {tuple(shape(r.argv)) for r in a.replicas} == {tuple(shape(r.argv)) for r in b.replicas}
        args = a.component.args  # the graph's own args come last, as given, everywhere
        assert all(r.argv[len(r.argv) - len(args):] == args for r in (*a.replicas, *b.replicas))
        shared = {k: v for k, v in a.env.items() if not k.startswith("DYN_") or k in ("DYN_REQUEST_PLANE",
                                                                                       "DYN_EVENT_PLANE")}
        assert shared == {k: v for k, v in b.env.items() if k in shared}


def test_local_site_wires_the_chain_by_loopback_ports(tmp_path):
    """On one machine the chain is loopback ports: shards front the encoders, the router the shards,
    the cluster tier the router (and the encoders directly); engines trust the chain the frontend uses."""
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
    assert [r.name for r in engine.replicas] == ["engine-0", "engine-1"]
    assert all(opt(r.argv, "--name") == [GENERATED_NAME] for r in engine.replicas) and engine.health_path is None
    assert all(r.port is None for r in engine.replicas)  # an engine serves no HTTP
    assert engine.module == "mm_encoder.engines"
    assert engine.env["DYN_DISCOVERY_BACKEND"] == "file" and engine.env["DYN_FILE_KV"] == str(tmp_path / "dynamo-store")
    assert engine.env["DYN_TCP_MAX_MESSAGE_SIZE"] == str(MAX_MESSAGE_SIZE)
    assert "DYN_TCP_MAX_MESSAGE_SIZE" not in by_kind["frontend"].env  # it sends handles, never bodies
    # engines trust exactly the chain the frontend's handles name
    assert opt(engine.replicas[0].argv, "--encoder-chain") == opt(frontend.replicas[0].argv, "--encoder-http")


@pytest.mark.parametrize("site", ["local", "k8s"])
def test_every_model_reader_names_the_one_checkpoint_directory(graph, site, tmp_path):
    """Encoders (`--model`, and `--stock-model-dir` for the stock frontend), engines (`--checkpoint`)
    and our frontend (`--model-dir`) all name the site's one checkpoint directory, and exactly those
    components say they use the `model` volume; the cache tiers and Dynamo's stock frontend read none."""
    s = sites(graph, tmp_path)[site]
    generated = graph.llm.served_name  # kimi-k2.5-<preset>
    expected_dir = str(tmp_path / "checkpoint" / generated) if site == "local" else MODEL_DIR
    assert s.checkpoint_dir == expected_dir
    for c in plan(graph, s):
        reads = c.kind in MODEL_FLAGS and not c.component.stock
        assert c.reads_model == reads, c.name
        flags = ("--model",) if c.component.backend == "vllm" else MODEL_FLAGS.get(c.kind, ())  # vLLM's spelling
        for r in c.replicas:
            named = [v for flag in flags for v in opt(r.argv, flag)]
            assert set(named) == ({expected_dir} if reads else set()), (r.name, r.argv)
            want = 2 if c.kind == "encoder" and graph.stock_frontend else 1
            assert len(named) == (want if reads else 0), (r.name, r.argv)
    stock_encoders = [c for c in plan(graph, s) if c.kind == "encoder" and graph.stock_frontend]
    assert all(opt(r.argv, "--stock-name") == [GENERATED_NAME] for c in stock_encoders for r in c.replicas)


def test_a_named_checkpoint_is_read_in_place_by_every_component(tmp_path):
    """With `llm.checkpoint` set, serve passes that very directory to every model reader (nothing is
    generated) and the served name is the directory's name, on the engines and the stock Encode worker."""
    for name in ("epd", "epd-stock", "agg"):
        g = with_llm(load_graph(GRAPHS / f"{name}.yaml"), checkpoint="/data/Kimi-K2.5")
        assert GeneratedCheckpoint.of(g) is None
        site = LocalSite(g, tmp_path)
        assert site.checkpoint_dir == "/data/Kimi-K2.5"
        for c in plan(g, site):
            reads = c.kind in MODEL_FLAGS and not c.component.stock
            for r in c.replicas:
                named = {v for flag in MODEL_FLAGS.get(c.kind, ()) for v in opt(r.argv, flag)}
                assert named == ({"/data/Kimi-K2.5"} if reads else set()), (r.name, r.argv)
                if c.kind == "engine":
                    assert opt(r.argv, "--name") == ["Kimi-K2.5"] and opt(r.argv, "--checkpoint") == ["/data/Kimi-K2.5"]
                if c.kind == "encoder" and g.stock_frontend:
                    assert opt(r.argv, "--stock-name") == ["Kimi-K2.5"]
        if not g.stock_frontend:
            assert all("--stock-name" not in r.argv for c in plan(g, site) for r in c.replicas)


@pytest.mark.parametrize("dtype", [None, "fp32", "bf16"])
def test_dtype_reaches_the_encoders_and_engines_only_when_the_graph_sets_it(graph, dtype, tmp_path):
    """`llm.dtype` becomes `--dtype X` on every encoder and engine replica, once, on both sites; without
    it no component gets `--dtype` (each keeps its own default); the frontend and tiers never get one."""
    g = with_llm(graph, dtype=dtype)
    for s in sites(g, tmp_path).values():
        for c in plan(g, s):
            for r in c.replicas:
                runs_model = c.kind in ("encoder", "engine")
                want = {"fp32": "float32", "bf16": "bfloat16"}.get(dtype) if c.component.backend == "vllm" else dtype
                assert opt(r.argv, "--dtype") == ([want] if dtype and runs_model else []), (r.name, r.argv)


@pytest.mark.parametrize("dtype", [None, "fp32", "bf16"])
def test_the_frontend_names_the_rows_dtype_the_encoders_pack(graph, dtype, tmp_path):
    """The rows' dtype is the graph's `llm.dtype` in torch's spelling (the encode worker packs what its
    model runs in): our frontend gets it as `--wire-dtype`, names it in every encode request and so in
    the tiers' key. No dtype, no flag (the worker's default); an aggregated graph encodes inline."""
    g = with_llm(graph, dtype=dtype)
    want = {"fp32": ["float32"], "bf16": ["bfloat16"]}.get(dtype, [])
    for s in sites(g, tmp_path).values():
        for c in plan(g, s):
            ours = c.kind == "frontend" and not g.stock_frontend and not g.inline_encoding
            for r in c.replicas:
                assert opt(r.argv, "--wire-dtype") == (want if ours else []), (r.name, r.argv)


def test_the_graphs_wire_dtype_wins_and_is_the_graphs_alone(tmp_path):
    """`llm.wire_dtype` overrides `llm.dtype` for the rows: every encoder packs it and the frontend names
    it, on both sites; an encoder's own `--wire-dtype` (one graph, one dtype) or any component's
    `--tls-allow` (the graph's topology decides) is refused by name when the graph is read."""
    g = with_llm(load_graph(GRAPHS / "epd.yaml"), dtype="fp32", wire_dtype="bf16")
    for s in sites(g, tmp_path).values():
        by_kind = {c.kind: c for c in plan(g, s)}
        assert opt(by_kind["frontend"].replicas[0].argv, "--wire-dtype") == ["bfloat16"]
        assert all(opt(r.argv, "--wire-dtype") == ["bfloat16"] for r in by_kind["encoder"].replicas)
        assert all(opt(r.argv, "--dtype") == ["fp32"] for r in by_kind["encoder"].replicas)
    refused = (("encoder", "--wire-dtype=bfloat16"), ("encoder", "--tls-allow"), ("shared", "--tls-allow"))
    for component, flag in refused:
        doc = yaml.safe_load((GRAPHS / "epd.yaml").read_text())
        doc["components"][component]["args"] = [flag, "frontend"] if "=" not in flag else [flag]
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(doc))
        with pytest.raises(GraphError) as e:
            load_graph(path)
        assert f"components.{component}.args: {flag.split('=')[0]} is the graph's to set" in str(e.value)


def test_real_parsers_take_the_dtype_and_checkpoint(tmp_path):
    """The encode worker's and the engine's own settings parse the planned argv into the graph's dtype
    and the one checkpoint directory."""
    from mm_encoder.encode_worker.settings import WorkerSettings
    from mm_encoder.engines.process import EngineSettings

    g = with_llm(load_graph(GRAPHS / "epd.yaml"), dtype="bf16")
    by_kind = {c.kind: c for c in plan(g, K8sSite(K8sNames(g)))}
    worker = WorkerSettings(_cli_parse_args=list(by_kind["encoder"].replicas[0].argv))
    assert (worker.model, worker.dtype, worker.checkpoint) == (MODEL_DIR, "bf16", None)
    engine = EngineSettings(_cli_parse_args=list(by_kind["engine"].replicas[0].argv))
    assert (str(engine.checkpoint), engine.dtype, engine.name) == (MODEL_DIR, "bf16", GENERATED_NAME)
    assert engine.encoder_chain == ("http://epd-cluster:8080",) and engine.encode_inline is False


def test_the_aggregated_engine_encodes_inline_and_trusts_no_chain(tmp_path):
    """agg (no encoder component): engines get `--encode-inline` and no `--encoder-chain`, the frontend
    `--inline-media`. With encoders, engines never encode inline; they trust the chain when there is one."""
    agg = load_graph(GRAPHS / "agg.yaml")
    assert agg.inline_encoding
    by_kind = {c.kind: c for c in plan(agg, LocalSite(agg, tmp_path))}
    assert set(by_kind) == {"engine", "frontend"}
    for r in by_kind["engine"].replicas:
        assert "--encode-inline" in r.argv and "--encoder-chain" not in r.argv
    assert "--inline-media" in by_kind["frontend"].replicas[0].argv
    for name in ("epd", "epd-stock", "epd-etcd"):
        g = load_graph(GRAPHS / f"{name}.yaml")
        engines = [r for c in plan(g, LocalSite(g, tmp_path)) if c.kind == "engine" for r in c.replicas]
        assert engines and all("--encode-inline" not in r.argv and len(opt(r.argv, "--encoder-chain")) == 1
                               for r in engines)
    bare = Graph.model_validate({"name": "bare", "components": {  # encoders but no tiers: RPC only
        "encoder": {"kind": "encoder"}, "engine": {"kind": "engine"}, "frontend": {"kind": "frontend"}}})
    engine = next(c for c in plan(bare, LocalSite(bare, tmp_path)) if c.kind == "engine").replicas[0].argv
    assert "--encode-inline" not in engine and "--encoder-chain" not in engine


def test_served_name_rules(tmp_path, monkeypatch):
    """`llm.name` wins; else the checkpoint directory's name (trailing `/` and `.`/`..` resolved); else
    `kimi-k2.5-<preset>`. Serve generates into `<run_dir>/checkpoint/<served name>`."""
    assert LLM().served_name == "kimi-k2.5-tiny"
    assert LLM(preset="small").served_name == "kimi-k2.5-small"
    assert LLM(checkpoint="/data/Kimi-K2.5").served_name == "Kimi-K2.5"
    assert LLM(checkpoint="/data/Kimi-K2.5/").served_name == "Kimi-K2.5"
    assert LLM(checkpoint="/data/Kimi-K2.5/..").served_name == "data"
    assert LLM(checkpoint="/data/Kimi-K2.5", name="kimi").served_name == "kimi"
    assert LLM(name="mine", preset="small").served_name == "mine"
    (tmp_path / "my-model").mkdir()
    monkeypatch.chdir(tmp_path / "my-model")
    assert LLM(checkpoint=".").served_name == "my-model"
    assert LLM(checkpoint="sub/../").served_name == "my-model"
    g = with_llm(load_graph(GRAPHS / "epd.yaml"), preset="small", name="mine")
    # the generated directory is named by its preset, not the served name: another preset is another
    # directory, never a stale one; a relative checkpoint is resolved (components start elsewhere)
    assert LocalSite(g, tmp_path).checkpoint_dir == str(tmp_path / "checkpoint" / "kimi-k2.5-small")
    rel = with_llm(load_graph(GRAPHS / "epd.yaml"), checkpoint="ckpt")
    assert LocalSite(rel, tmp_path / "run").checkpoint_dir == str(tmp_path / "my-model" / "ckpt")


@pytest.mark.parametrize(("key", "value", "message"), [
    ("model_dir", "/data/llm", "llm.model_dir: Extra inputs are not permitted"),
    ("vision_model", "tiny", "llm.vision_model: Extra inputs are not permitted"),
    ("context_length", 4096, "llm.context_length: Extra inputs are not permitted"),
    ("dtype", "fp16", "llm.dtype: Input should be 'fp32' or 'bf16'"),
    ("preset", "huge", "llm.preset: Input should be 'tiny', 'small' or 'vllm-tiny'"),
])
def test_old_and_bad_llm_keys_are_refused_by_path(tmp_path, key, value, message):
    """The strict schema refuses the old pair's keys (and values outside the new ones), naming the key path."""
    doc = yaml.safe_load((GRAPHS / "epd.yaml").read_text())
    doc["llm"][key] = value
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(GraphError) as e:
        load_graph(path)
    assert str(e.value).splitlines()[1:] == [f"  {message}"]


def _fake_python(tmp_path: Path, body: str) -> str:
    """An executable standing in for the interpreter: GeneratedCheckpoint.write's command, without torch."""
    exe = tmp_path / "python"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(0o755)
    return str(exe)


def test_the_generated_checkpoint_is_one_call_on_both_sites(tmp_path):
    """Without `llm.checkpoint` the graph serves `python -m mm_encoder.engines.tiny_checkpoint TARGET
    --preset P`: the same argv for serve (`write`, a subprocess) and the K8s init container (`argv`);
    a failed write is a GraphError with the target and the tool's stderr."""
    g = load_graph(GRAPHS / "epd.yaml")
    gen = GeneratedCheckpoint.of(g)
    assert gen == GeneratedCheckpoint("tiny") and gen.MODULE == "mm_encoder.engines.tiny_checkpoint"
    assert gen.argv("/x") == ["/x", "--preset", "tiny"]
    assert GeneratedCheckpoint.of(with_llm(g, preset="small")).argv("/y") == ["/y", "--preset", "small"]
    assert GeneratedCheckpoint.of(with_llm(g, checkpoint="/m")) is None
    record = tmp_path / "argv.txt"
    gen.write(tmp_path / "ckpt", python=_fake_python(tmp_path, f"printf '%s\\n' \"$@\" > {record}"))
    assert record.read_text().splitlines() == ["-m", gen.MODULE, str(tmp_path / "ckpt"), "--preset", "tiny"]
    failing = _fake_python(tmp_path, "echo 'no space left' >&2; exit 3")
    with pytest.raises(GraphError) as e:
        gen.write(tmp_path / "ckpt", python=failing)
    assert e.value.message == f"writing the generated tiny checkpoint into {tmp_path / 'ckpt'} failed:\nno space left\n"


def test_a_vllm_engine_runs_the_adapter_with_vllms_flags_under_its_own_python(tmp_path):
    """`backend: vllm`: the engine is `python -m mm_encoder.engines.vllm` with the checkpoint as vLLM's
    `--model`, the router's block size, the dtype in vLLM's spelling, the chain the frontend's handles
    name, then the graph's `args` (vLLM's own flags); `python` is the interpreter serve runs it with."""
    g = load_graph(GRAPHS / "epd-vllm.yaml")
    s = LocalSite(g, tmp_path)
    by_kind = {c.kind: c for c in plan(g, s)}
    engine, frontend = by_kind["engine"], by_kind["frontend"]
    argv = engine.replicas[0].argv
    assert engine.module == "mm_encoder.engines.vllm"
    assert opt(argv, "--model") == [s.checkpoint_dir] and opt(argv, "--name") == ["kimi-k2.5-vllm-tiny"]
    assert opt(argv, "--block-size") == ["32"] and opt(argv, "--dtype") == ["float32"]
    assert opt(argv, "--encoder-chain") == opt(frontend.replicas[0].argv, "--encoder-http")
    assert argv[-len(g.components["engine"].args):] == g.components["engine"].args
    assert engine.component.python == ".venv-vllm/bin/python"
    assert engine.env["VLLM_MLA_DISABLE"] == "1"


@pytest.mark.parametrize(("change", "message"), [
    ({"frontend": {"backend": "vllm"}}, "`backend` names an engine's implementation"),
    ({"frontend": {"stock": True}}, "the vLLM engine takes this project's frontend's requests"),
    ({"encoder": None, "cluster": None}, "the vLLM engine takes this project's frontend's requests"),
])
def test_a_vllm_engine_needs_our_frontend_and_an_encoder(tmp_path, change, message):
    """vLLM's engine takes media by handle from this project's frontend: a stock frontend (preprocessed
    requests) or no encoder (media by URL) is refused when the graph is read, as is `backend` elsewhere."""
    doc = yaml.safe_load((GRAPHS / "epd-vllm.yaml").read_text())
    for name, update in change.items():
        if update is None:
            del doc["components"][name]
        else:
            doc["components"][name].update(update)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(GraphError) as e:
        load_graph(path)
    assert message in str(e.value)


def test_serve_refuses_a_component_python_that_is_not_there(tmp_path, capsys):
    """A graph's `python` that does not exist is refused before anything starts, saying what builds it."""
    from mm_encoder.serve.cli import main

    doc = yaml.safe_load((GRAPHS / "epd-vllm.yaml").read_text())
    doc["components"]["engine"]["python"] = str(tmp_path / "no-venv" / "bin" / "python")
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main([str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"component engine: python {tmp_path}/no-venv/bin/python is not an executable here" in err
    assert "make vllm-venv" in err
    assert not (tmp_path / "run").exists()


def test_with_tls_a_tier_checks_each_upstream_by_its_roles_name_on_every_site(tmp_path):
    """With `tls`, both sites plan the same TLS options: a tier checks its next level's certificate for
    that level's role's DNS name in this graph, `<role>.<graph>.<trust domain>` (nginx checks names, not
    URIs), and a cluster tier its direct route's encoders for theirs; never another component's name."""
    g = load_graph(GRAPHS / "epd.yaml")
    g = g.model_copy(update={"tls": g.tls.model_copy(update={"enabled": True, "trust_domain": "example.org"})})
    local = {c.name: c.replicas[0].argv for c in plan(g, LocalSite(g, tmp_path))}
    k8s = {c.name: c.replicas[0].argv for c in plan(g, K8sSite(K8sNames(g)))}
    for site in (local, k8s):
        assert {n: opt(argv, "--tls-server-name") for n, argv in site.items() if n in ("shared", "router", "cluster")} \
            == {"shared": ["encoder.epd.example.org"], "router": ["cache-shared.epd.example.org"],
                "cluster": ["cache-router.epd.example.org"]}
        assert opt(site["cluster"], "--tls-direct-server-name") == ["encoder.epd.example.org"]
    assert opt(local["frontend"], "--https-cert") == [str(tmp_path / "tls" / "dynamo" / "frontend.pem")]
    assert opt(k8s["frontend"], "--https-cert") == []  # one Secret per component there
    for name, argv in local.items():  # the rest alike; serve's frontend serves HTTPS with its planes' certificate
        flags = [a for a in argv if a.startswith("--") and a not in ("--https-cert", "--https-key")]
        assert flags == [a for a in k8s[name] if a.startswith("--")], name
