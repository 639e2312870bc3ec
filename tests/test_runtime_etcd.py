"""The EPD graph on Dynamo's production runtime: `mm-encoder serve graphs/epd-etcd.yaml` with etcd
discovery and NATS request and event planes (Debian's etcd-server 3.4 and nats-server 2.9, started
here on loopback with their data in a temp dir, so the tests can kill and restart etcd). Two
encode workers, two engines (the generated tiny Kimi-K2.5's language model), the nginx tiers, the
frontend: all real processes on one checkpoint. Under load: etcd is killed and restarted, and one
encode worker is killed with SIGKILL."""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness.dynamo_probe import Probe
from harness.media_factory import image_bytes, natural_image
from harness.serve_fixtures import MODEL, Served, chat, sample_tokens
from harness.topology import free_port, require_nginx
from mm_encoder.core.errors import GraphError
from mm_encoder.serve import infra

pytest.importorskip("dynamo.runtime")
pytestmark = pytest.mark.slow  # a whole graph of subprocesses; `make test-quick` skips it
NAMESPACE = "mm-etcd"  # graphs/epd-etcd.yaml
RESULTS = Path(os.environ.get("MM_TEST_RESULTS", "/tmp")) / "mm-encoder-etcd-lease.json"


def require(binary: str) -> None:
    try:
        infra.check_install(binary)
    except GraphError as e:
        pytest.fail(e.message, pytrace=False)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    require("etcd")
    require("nats-server")
    root = tmp_path_factory.mktemp("runtime")
    etcd, nats = infra.etcd(root / "etcd"), infra.nats(root / "nats")
    try:
        for s in (etcd, nats):
            s.start(root / f"{s.name}.log")
            s.wait_ready()
        yield {"etcd": etcd, "nats": nats, "root": root}
    finally:
        for s in (etcd, nats):
            s.stop()


@pytest.fixture(scope="module")
def graph(servers, tmp_path_factory):
    require_nginx()
    env = {**servers["etcd"].env, **servers["nats"].env}
    run_dir = tmp_path_factory.mktemp("epd-etcd") / "run"
    port = free_port()
    served = Served("graphs/epd-etcd.yaml", run_dir, port, env=env)
    try:
        served.wait_for("ready: OpenAI base URL", 240)
        served.env = env
        yield served
    finally:
        if served.proc.poll() is None:
            served.stop()


def post(port: int, body: bytes, timeout: float = 60) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def image_request(seed: int) -> bytes:
    url = "data:image/png;base64," + base64.b64encode(image_bytes(natural_image(112, 84, seed=seed))).decode()
    return json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}]}]}).encode()


class Load:
    """Requests one after another, each a new image (a cold encode), until stopped (at most 5,000
    requests or 150 s)."""

    def __init__(self, port: int, first_seed: int):
        self.port, self.seed = port, first_seed
        self.results: list[tuple[float, float, int]] = []  # (start, end, status)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + 150
        for i in range(5000):
            if self.done.is_set() or time.monotonic() > deadline:
                return
            t0 = time.monotonic()
            status = post(self.port, image_request(self.seed + i))
            self.results.append((t0, time.monotonic(), status))

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(120)

    def wait_for(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.results) < n:
            assert time.monotonic() < deadline and self.thread.is_alive(), self.results[-5:]
            time.sleep(0.05)


def test_the_graph_serves_multimodal_requests_on_etcd_and_nats(graph):
    """The sample request is counted exactly and repeats; serve used the given etcd (ran no
    servers of its own); both encode workers and both engines are in etcd discovery."""
    first = chat(graph.port)
    assert first["usage"]["prompt_tokens"] == sample_tokens(graph.run_dir / "checkpoint" / MODEL) == 1223
    assert chat(graph.port)["usage"] == first["usage"]
    state = json.loads((graph.run_dir / "state.json").read_text())
    assert state["runtime"]["ETCD_ENDPOINTS"] == graph.env["ETCD_ENDPOINTS"]  # serve used ours, ran none
    assert state["runtime"]["servers"] == []
    for path in (f"{NAMESPACE}.mm_encoder.encode", f"{NAMESPACE}.engine.generate"):
        with Probe(graph.env, path) as probe:
            assert probe.wait_count(2, 30) is not None, probe.events


def test_etcd_restarted_under_load_the_graph_recovers_without_a_restart(graph, servers):
    """etcd stopped and started again under a stream of cold image requests: every request is a
    200, a new client finds both endpoints' instances again, and no component was restarted."""
    etcd = servers["etcd"]
    pids = {c["name"]: c["pid"] for c in json.loads((graph.run_dir / "state.json").read_text())["components"]}
    with Load(graph.port, 10_000) as load:
        load.wait_for(3)
        etcd.stop()  # SIGTERM: etcd is gone for the next requests
        down = len(load.results)
        load.wait_for(down + 3)  # requests keep being answered while discovery is down
        etcd.start(servers["root"] / "etcd.log")  # same data dir and port
        etcd.wait_ready()
        up = len(load.results)
        load.wait_for(up + 3)
    assert [s for _, _, s in load.results] == [200] * len(load.results)
    for path in (f"{NAMESPACE}.mm_encoder.encode", f"{NAMESPACE}.engine.generate"):
        with Probe(graph.env, path) as probe:  # a new client after the restart still finds both
            assert probe.wait_count(2, 30) is not None, probe.events
    now = {c["name"]: c["pid"] for c in json.loads((graph.run_dir / "state.json").read_text())["components"]}
    assert now == pids  # nothing of ours was restarted


def test_a_killed_encode_worker_leaves_discovery_and_the_survivor_takes_over(graph):
    """SIGKILL to one of two encode workers under load: its instance leaves etcd once its lease
    runs out (the time is recorded), at most the request in flight fails, later ones all succeed."""
    state = json.loads((graph.run_dir / "state.json").read_text())
    victim = next(c for c in state["components"] if c["name"] == "encoder-0")
    with Probe(graph.env, f"{NAMESPACE}.mm_encoder.encode") as probe, Load(graph.port, 20_000) as load:
        assert probe.wait_count(2, 30) is not None
        load.wait_for(4)
        os.killpg(victim["pid"], signal.SIGKILL)
        killed = time.monotonic()
        left = probe.wait_count(1, 90)  # the lease has to run out
        after = len(load.results)
        load.wait_for(after + 4)
    assert left is not None, f"the killed worker never left etcd discovery: {probe.events}"
    gone = left - killed
    RESULTS.write_text(json.dumps({"etcd_instance_gone_after_s": round(gone, 1)}))
    print(f"killed encode worker left etcd discovery after {gone:.1f} s")
    late = [s for t0, _, s in load.results if t0 > killed + 2]  # started once the kill was seen by nginx
    assert late and late == [200] * len(late)
    assert sum(1 for _, _, s in load.results if s != 200) <= 1  # at most the request in flight at the kill
