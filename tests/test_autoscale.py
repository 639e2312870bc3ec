"""`mm-encoder serve graphs/epd-autoscale.yaml` carries out encode-planner decisions on a real
graph (etcd, NATS, nginx tiers, encode workers, engines, the frontend, the planner), under a steady
load of unique images: a decision published through Dynamo's VirtualConnector starts a second
encoder (the shared tier reloads its upstreams and sends it work), the next drains it back out; a
killed planner is restarted and a killed encoder leaves the fleet serving; no request is lost
(every one answered 200, or 503 with Retry-After). The planner runs in `--dry-run` here, so the
decisions are the test's (the load-driven ones: `make bench`'s ramp, BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from harness.autoscale import Load, deciding, wait_until
from harness.serve_fixtures import Served
from harness.topology import free_port, require_nginx
from mm_encoder.serve.status import collect, samples, total


def _encoders(served: Served) -> dict[str, dict]:
    return {c["name"]: c for c in served.state["components"] if c["kind"] == "encoder"}


def _planner(status: dict) -> dict:
    return next(c for c in status["components"] if c["kind"] == "planner")


def _upstreams(run, tier: str) -> str:
    return (run / f"nginx-{tier}" / "nginx.conf").read_text()


def _encoded(url: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        return total(samples(r.read().decode()), "dynamo_component_encode_requests_total")


@pytest.mark.slow  # a whole graph of subprocesses; `make test-quick` skips it
def test_serve_scales_the_encoders_up_and_drains_them_down_with_no_request_lost(tmp_path):
    require_nginx()
    run, port = tmp_path / "run", free_port()
    with Served("graphs/epd-autoscale.yaml", run, port, "--restart", env={"MM_PLANNER_DRY_RUN": "true"}) as served:
        served.wait_for("ready: OpenAI base URL", 240)
        namespace, rt = served.state["namespace"], served.state["runtime"]
        runtime_env = {k: v for k, v in rt.items() if k in ("ETCD_ENDPOINTS", "NATS_SERVER")}
        assert list(_encoders(served)) == ["encoder-0"]
        load = Load(port, clients=2)
        try:
            wait_until("answers before scaling", lambda: load.count() >= 4, 120)
            with deciding(namespace, 2, runtime_env):
                served.wait_for("encoder: 2 running (started encoder-1)", 180)
            encoders = _encoders(served)
            assert list(encoders) == ["encoder-0", "encoder-1"]
            new = encoders["encoder-1"]["url"].removeprefix("http://")
            assert all(f"server {new} max_fails=0;" in _upstreams(run, s) for s in ("shared-0", "shared-1"))
            # the new worker gets a share of the unique images through the reloaded tier
            wait_until("encoder-1 serving", lambda: _encoded(encoders["encoder-1"]["url"]) >= 2, 120)
            # the planner sees both in discovery (its next rounds); `mm-encoder status --json` shows it
            wait_until("the planner seeing 2", lambda: _planner(collect(run)).get("running") == 2, 60)
            status = json.loads(subprocess.run(
                [sys.executable, "-m", "mm_encoder.cli", "status", "--run-dir", str(run), "--json"],
                capture_output=True, text=True, check=True).stdout)
            planner = _planner(status)
            assert planner["up"] and planner["running"] == 2 and planner["wanted"] == 1  # dry run: its own stays
            assert planner["decision"]["action"] in ("hold", "up", "down") and planner["decision"]["reason"]
            assert status["scaling"]["running"] == 2 and status["scaling"]["started"] == ["encoder-1"]

            # a killed planner comes back (--restart), and so does a killed encoder: the fleet keeps its size
            os.killpg(served.component("planner")["pid"], signal.SIGKILL)
            served.wait_for("planner restarted", 120)
            os.killpg(served.component("encoder-1")["pid"], signal.SIGKILL)
            served.wait_for("encoder-1 restarted", 120)
            assert list(_encoders(served)) == ["encoder-0", "encoder-1"]

            before = load.count()
            with deciding(namespace, 1, runtime_env):
                served.wait_for("encoder: 1 running (drained encoder-1)", 180)
            assert list(_encoders(served)) == ["encoder-0"]
            assert f"server {new} max_fails=0;" not in _upstreams(run, "shared-0")
            wait_until("answers after the drain", lambda: load.count() >= before + 4, 120)
        finally:
            answers = load.stop()
    lost = [a for a in answers if a.status is None]
    refused = [a for a in answers if a.status == 503]
    other = [a for a in answers if a.status not in (200, 503, None)]
    assert not lost and not other, (lost, other)
    assert all(a.retry_after for a in refused), refused
    assert len(answers) >= 8
