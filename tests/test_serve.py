"""`mm-encoder serve` as a subprocess: the EPD graph and the aggregated baseline come up on the
generated tiny Kimi-K2.5 checkpoint, answer a multimodal request (the repeat from cache and from
the engine's prefix store), report status and a dead component, and stop on SIGTERM leaving no
process. Real processes throughout (Dynamo file discovery + TCP, nginx, the encode worker, the
checkpoint's language model in two engines, the frontend)."""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness.media_factory import k25_image_tokens
from harness.procfs import listeners
from harness.serve_fixtures import MODEL, ROOT, SAMPLE, Served, chat, frontend_stats, sample_tokens
from harness.topology import free_port, require_nginx
from mm_encoder.core.errors import GraphError
from mm_encoder.graph.schema import load_graph
from mm_encoder.serve.status import collect


def _tier_counts(run, name: str) -> tuple[int, int]:
    """(requests, cache hits) a cache tier has counted (its /_cache/stats, through `mm-encoder status`)."""
    row = {c["name"]: c for c in collect(run)["components"]}[name]
    return row["requests"], round((row["hit_ratio"] or 0) * row["requests"])


@pytest.mark.slow  # a whole graph of subprocesses; `make test-quick` skips it
@pytest.mark.parametrize("graph", ["graphs/epd.yaml", "graphs/agg.yaml"])
def test_serve_graph_answers_and_stops_clean(graph, tmp_path):
    """The graph comes up with no checkpoint named (serve writes the tiny Kimi-K2.5 into the run
    directory, served as its directory's name), counts the sample's prompt exactly, answers the
    repeat identically, reports every component up; EPD: loopback-only listeners, one encode for
    two requests, the tier's hits, the repeat's prompt KV reused by the same engine (every full
    block but the last token's), a dead engine reported with its log; agg with --restart: a
    killed engine comes back and answers, and the repeat's reuse shows in /mm/stats as in EPD.
    SIGTERM leaves no process of any session."""
    if "epd" in graph:
        require_nginx()
    port = free_port()
    run = tmp_path / "run"
    served = Served(graph, run, port, *(["--restart"] if "agg" in graph else []))
    try:
        out = served.wait_for("ready: OpenAI base URL", 240)
        assert f"(model {MODEL})" in out and served.state["model"] == MODEL
        assert "without TLS (loopback only" in out  # and says so (docs/security.md: --tls)
        checkpoint = run / "checkpoint" / MODEL  # generated: the graph names no checkpoint
        first = chat(port)
        assert first["model"] == MODEL
        assert first["usage"]["prompt_tokens"] == sample_tokens(checkpoint) == 1223  # 1196 image rows + 27
        assert first["usage"]["completion_tokens"] == 5 and first["choices"][0]["finish_reason"] == "length"
        tier_first = _tier_counts(run, "cluster") if "epd" in graph else None
        again = chat(port)
        assert again["usage"] == first["usage"]
        assert again["choices"][0]["message"] == first["choices"][0]["message"]  # greedy on the same model
        status = {c["name"]: c for c in collect(run)["components"]}
        assert all(c["up"] for c in status.values())
        if "epd" in graph:
            # every listener of every process of the graph binds loopback, none a wildcard address
            sockets = listeners({c["pid"] for c in served.state["components"]})
            assert len({pid for pid, _, _ in sockets}) >= len(served.state["components"])  # each listens
            assert {addr for _, addr, _ in sockets} == {"127.0.0.1"}, sockets
            assert status["encoder"]["encodes"] == 1  # the repeat came from a cache, not the encoder
            # per request the frontend's HEAD and the engine's body fetch. The first HEAD misses; the
            # first fetch hits, unless it came while the tier was still writing the entry that HEAD
            # started: then it asks the next level instead of waiting (configs/nginx/cache-tier.conf),
            # and the encoder still encoded once (above). The repeat's HEAD and fetch both hit.
            assert tier_first is not None and tier_first[0] == 2 and tier_first[1] in (0, 1), tier_first
            assert _tier_counts(run, "cluster") == (4, tier_first[1] + 2)
            assert status["frontend"]["requests"] == 2
            recent = frontend_stats(port)["recent"][-2:]
            # p95 beside p50: the encoder's from its stage histogram, the frontend's from its recent requests,
            # whose slowest is named (the first: it encoded)
            assert status["encoder"]["p95_ms"] >= status["encoder"]["p50_ms"] > 0
            assert status["frontend"]["p95_ms"] >= status["frontend"]["p50_ms"]
            assert status["frontend"]["slowest"]["request_id"] == recent[0]["request_id"]
            assert recent[1]["worker_id"] == recent[0]["worker_id"]  # KV-aware routing: the engine holding it
            assert recent[0]["timings"]["reused_tokens"] == 0
            assert recent[1]["timings"]["reused_tokens"] == (1223 - 1) // 16 * 16 == 1216
            # a component that dies is reported with the tail of its log
            os.killpg(served.component("engine-1")["pid"], signal.SIGKILL)
            report = served.wait_for("engine-1 exited", 30)
            assert "last log lines" in report and "engine ready" in report.split("engine-1 exited")[1]
        else:  # --restart: a dead engine comes back and the graph answers again
            recent = frontend_stats(port)["recent"][-2:]  # the inline engine's prefix store, checked last
            engine = next(c for c in served.state["components"] if c["kind"] == "engine")
            os.killpg(engine["pid"], signal.SIGKILL)
            served.wait_for("restarted (restart 1)", 120)
            # Dynamo's file discovery drops the killed instance only after its lease runs out (~30 s);
            # until the frontend sees the new one, requests fail fast: 503 while the dead instance is
            # listed, 404 if it was dropped before the new one registered (no instance serves the
            # model for that moment). Poll until it answers.
            deadline = time.monotonic() + 120
            while True:
                try:
                    assert chat(port)["usage"] == first["usage"]
                    break
                except urllib.error.HTTPError as e:
                    assert e.code in (503, 404) and time.monotonic() < deadline, e
                    time.sleep(0.5)
            assert recent[0]["timings"]["reused_tokens"] == 0 and recent[0]["timings"]["prompt_tokens"] == 1223
            assert recent[1]["timings"]["reused_tokens"] == (1223 - 1) // 16 * 16
    finally:
        if served.proc.poll() is None:
            served.stop()


def test_sample_token_count(checkpoint):
    """The arithmetic behind the sample's 1223 prompt tokens, independent of the code under test:
    1280x720 needs no resize under the K2.5 policy and pads to 1288x728, 46 x 26 = 1196 rows; the
    checkpoint's template and "What is in this image?" are 27 more (transformers' tokenizer)."""
    from PIL import Image

    assert Image.open(SAMPLE).size == (1280, 720)
    assert k25_image_tokens(1280, 720) == 46 * 26 == 1196
    assert k25_image_tokens(3840, 2160) == 4214  # scaled by sqrt(16384 / 42196) first
    assert sample_tokens(checkpoint) == 1196 + 27


def test_graphs_serve_one_generated_checkpoint():
    """Every shipped graph names no checkpoint (serve generates the tiny one) and runs fp32."""
    for g in ("epd", "agg", "epd-stock", "epd-etcd"):
        llm = load_graph(ROOT / "graphs" / f"{g}.yaml").llm
        assert (llm.checkpoint, llm.dtype, llm.served_name) == (None, "fp32", MODEL)


def test_graph_errors_name_their_path(tmp_path):
    """A graph file's errors name the offending path; every shipped graph loads."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ncomponents:\n  f: {kind: frontend}\n  e: {kind: engine, replicas: 0}\n")
    with pytest.raises(GraphError, match=r"components\.e\.replicas"):
        load_graph(bad)
    bad.write_text("name: x\ncomponents:\n  e: {kind: engine}\n")
    with pytest.raises(GraphError, match="exactly one frontend"):
        load_graph(bad)
    bad.write_text("name: x\ncomponents:\n  f: {kind: frontend}\n  e: {kind: engine, color: red}\n")
    with pytest.raises(GraphError, match=r"components\.e\.color"):
        load_graph(bad)
    bad.write_text("name: x\ncomponents:\n  f: {kind: frontend}\n  e: {kind: engine, stock: true}\n")
    with pytest.raises(GraphError, match="only a frontend"):
        load_graph(bad)
    bad.write_text("name: x\ncomponents:\n  f: {kind: frontend, stock: true}\n  e: {kind: engine}\n")
    with pytest.raises(GraphError, match="Encode worker: add an encoder"):
        load_graph(bad)
    with pytest.raises(GraphError, match="no such graph"):
        load_graph(tmp_path / "missing.yaml")
    for g in ("epd", "agg", "epd-stock"):
        assert load_graph(ROOT / "graphs" / f"{g}.yaml").name == g


def test_a_replica_planned_after_start_gets_its_certificate_before_it_starts(tmp_path):
    """Under `--tls`, the planner's scale-up plans encoder-1, which the start-up issue did not cover:
    serve issues its certificate (CN encoder-1, OU encoder, from the run directory's CA) before the
    process starts, and leaves the others' certificates as they were."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    from mm_encoder.serve.fleet import Proc
    from mm_encoder.serve.runner import GraphRunner

    graph = load_graph(ROOT / "graphs" / "epd-autoscale.yaml")
    graph = graph.model_copy(update={"tls": graph.tls.model_copy(update={"enabled": True})})
    runner = GraphRunner(graph, tmp_path / "run")
    assert runner.site.issuer is not None
    runner.site.issuer.issue([("encoder-0", "encoder")])  # what start-up issued
    first = (tmp_path / "run" / "tls" / "encoder-0.pem").read_bytes()
    encoder = runner._planned("encoder", 2)["encoder"]
    added = Proc(encoder, encoder.replicas[1])
    assert added.replica.tls is not None and not os.path.exists(added.replica.tls.cert)
    runner.launch.prepare(added)
    cert = x509.load_pem_x509_certificate(Path(added.replica.tls.cert).read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "encoder-1"
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == "encoder"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == \
        [f"spiffe://mm-encoder.local/{graph.name}/encoder/encoder-1"]
    plane = x509.load_pem_x509_certificate(Path(added.replica.tls.plane_cert).read_bytes())  # Dynamo's, apart
    assert plane.serial_number != cert.serial_number
    ca = x509.load_pem_x509_certificate(runner.site.issuer.ca_file.read_bytes())
    assert cert.issuer == ca.subject
    assert (tmp_path / "run" / "tls" / "encoder-0.pem").read_bytes() == first


def test_serve_picks_ports_outside_the_kernels_ephemeral_range(monkeypatch):
    """A component's port is chosen seconds before it binds it: below the ephemeral range no client
    connection's local port can take it meanwhile; MM_ENCODER_PORTS sets the range (refused by name if bad)."""
    from mm_encoder.serve.site import free_port, port_range

    monkeypatch.delenv("MM_ENCODER_PORTS", raising=False)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert port_range().start == 10000 and port_range().stop == low
    assert all(10000 <= free_port() < low for _ in range(20))
    monkeypatch.setenv("MM_ENCODER_PORTS", "23000-23009")
    monkeypatch.setattr("mm_encoder.serve.site._HANDED_OUT", set())
    given = []  # never one port twice: each is promised to one component (another test may hold some)
    with pytest.raises(GraphError, match="no free port in 23000-23009"):
        while len(given) <= 10:
            given.append(free_port())
    assert port_range() == range(23000, 23010) and given and len(set(given)) == len(given) <= 10
    assert set(given) <= set(range(23000, 23010))
    for bad in ("23000", "9-10", "30000-20000", "a-b"):
        monkeypatch.setenv("MM_ENCODER_PORTS", bad)
        with pytest.raises(GraphError, match="MM_ENCODER_PORTS"):
            port_range()
