"""`mm-encoder serve` as a subprocess: the EPD graph and the aggregated baseline come up, answer a
multimodal request (the repeat from cache), report status and a dead component, and stop on
SIGTERM leaving no process. Real processes throughout (Dynamo file discovery + TCP, nginx, the
encode worker, reference engines, the frontend)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest
from nginx_fixtures import free_port, require_nginx
from serve_fixtures import IMAGE_TOKENS, ROOT, SAMPLE, TEXT_TOKENS, Served, chat

from mm_encoder.core.errors import GraphError
from mm_encoder.deploy.graph import load_graph
from mm_encoder.deploy.local import listeners
from mm_encoder.deploy.status import collect


@pytest.mark.slow  # a whole graph of subprocesses; `make test-quick` skips it
@pytest.mark.parametrize("graph", ["graphs/epd.yaml", "graphs/agg.yaml"])
def test_serve_graph_answers_and_stops_clean(graph, tmp_path):
    if "epd" in graph:
        require_nginx()
    port = free_port()
    served = Served(graph, tmp_path / "run", port, *(["--restart"] if "agg" in graph else []))
    try:
        served.wait_for("ready: OpenAI base URL", 240)
        first = chat(port)
        assert first["usage"]["prompt_tokens"] == IMAGE_TOKENS + TEXT_TOKENS  # the image's placeholders, spliced
        again = chat(port)
        assert again["usage"] == first["usage"]
        status = {c["name"]: c for c in collect(tmp_path / "run")["components"]}
        assert all(c["up"] for c in status.values())
        if "epd" in graph:
            # every listener of every process of the graph binds loopback, none a wildcard address
            state = json.loads((tmp_path / "run" / "state.json").read_text())
            sockets = listeners({c["pid"] for c in state["components"]})
            assert len({pid for pid, _, _ in sockets}) >= len(state["components"])  # each listens on something
            assert {addr for _, addr, _ in sockets} == {"127.0.0.1"}, sockets
            assert status["encoder"]["encodes"] == 1  # the repeat came from a cache, not the encoder
            # per request the frontend's HEAD and the engine's body fetch: MISS, HIT, then HIT, HIT
            assert status["cluster"]["hit_ratio"] == 0.75
            assert status["frontend"]["requests"] == 2
            # a component that dies is reported with the tail of its log
            engine = next(c for c in json.loads((tmp_path / "run" / "state.json").read_text())["components"]
                          if c["name"] == "engine-1")
            os.killpg(engine["pid"], signal.SIGKILL)
            report = served.wait_for("engine-1 exited", 30)
            assert "last log lines" in report and "engine ready" in report.split("engine-1 exited")[1]
        else:  # --restart: a dead engine comes back and the graph answers again
            engine = next(c for c in json.loads((tmp_path / "run" / "state.json").read_text())["components"]
                          if c["kind"] == "engine")
            os.killpg(engine["pid"], signal.SIGKILL)
            served.wait_for("restarted (restart 1)", 120)
            # Dynamo's file discovery drops the killed instance only after its lease runs out (~30 s);
            # until the frontend sees the new one, requests fail fast with 503: poll until it answers.
            deadline = time.monotonic() + 120
            while True:
                try:
                    assert chat(port)["usage"] == first["usage"]
                    break
                except urllib.error.HTTPError as e:
                    assert e.code == 503 and time.monotonic() < deadline, e
                    time.sleep(0.5)
    finally:
        if served.proc.poll() is None:
            served.stop()


@pytest.mark.parametrize("graph", ["graphs/epd.yaml", "graphs/agg.yaml"])
def test_sample_token_count(graph):
    """The arithmetic behind IMAGE_TOKENS, from the image's size and the graph's vision model."""
    from PIL import Image

    from mm_encoder.core.registry import get_spec
    from mm_encoder.model.preprocess import num_tokens

    spec = get_spec(load_graph(ROOT / graph).llm.vision_model)
    assert num_tokens(*Image.open(SAMPLE).size, spec.preprocess, spec.tower.patch_size) == IMAGE_TOKENS


def test_graph_errors_name_their_path(tmp_path):
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
