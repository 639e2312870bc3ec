"""`mm-encoder serve graphs/epd-autoscale.yaml --tls` carries out encode-planner decisions on a real
graph (etcd, NATS, nginx tiers, encode workers, engines, the frontend, the planner; every hop HTTPS
with client certificates), under a steady load of unique images: a decision published through
Dynamo's VirtualConnector starts a second encoder (with its own new certificate; the shared tier
reloads its upstreams and sends it work), the next drains it back out; a killed planner is restarted
and a killed encoder leaves the fleet serving; no request is lost (every one answered 200, or 503
with Retry-After). TLS and autoscaling together, and certificates that renew themselves (issue 43):
every certificate lives 15 s here, so serve renews all of them every 10 s throughout, while scaling
too; new handshakes at the encoder present new serials and `mm-encoder status` shows each
certificate's time left. The graph serves tenants (`tenants.header`), each load client one: the scope
composes with scaling, renewals and restarts. The planner runs in `--dry-run` here, so the decisions
are the test's (the load-driven ones: `make bench`'s ramp, BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from harness.autoscale import Load, deciding, wait_until
from harness.serve_fixtures import Served
from harness.topology import free_port, require_nginx
from mm_encoder.graph.planned import TlsFiles
from mm_encoder.security.tls import tls_client
from mm_encoder.serve.status import collect, samples, total

ROOT = Path(__file__).resolve().parents[1]
LIFETIME_S = 15


def _encoders(served: Served) -> dict[str, dict]:
    return {c["name"]: c for c in served.state["components"] if c["kind"] == "encoder"}


def _planner(status: dict) -> dict:
    return next(c for c in status["components"] if c["kind"] == "planner")


def _upstreams(run, tier: str) -> str:
    return (run / f"nginx-{tier}" / "nginx.conf").read_text()


def _encoded(encoder: dict) -> float:
    """The encoder's requests, from its plaintext ops port."""
    with urllib.request.urlopen(f"{encoder['ops_url']}/metrics", timeout=5) as r:
        return total(samples(r.read().decode()), "dynamo_component_encode_requests_total")


def _serial(url: str, ctx: ssl.SSLContext) -> int:
    """The serial of the certificate a server presents to a new handshake."""
    host, port = url.removeprefix("https://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw, ctx.wrap_socket(raw) as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def _renewals(served: Served) -> int:
    return served.text.count("rotation: new certificates")


@pytest.mark.slow  # a whole graph of subprocesses; `make test-quick` skips it
def test_serve_scales_the_encoders_up_and_drains_them_down_with_no_request_lost(tmp_path):
    require_nginx()
    graph = yaml.safe_load((ROOT / "graphs" / "epd-autoscale.yaml").read_text())
    graph["tls"] = {"enabled": True, "cert_lifetime_s": LIFETIME_S}
    graph["tenants"] = {"header": "X-Tenant"}  # and serving tenants: each client is one (tenant-0, tenant-1)
    (tmp_path / "epd-autoscale.yaml").write_text(yaml.safe_dump(graph))
    run, port = tmp_path / "run", free_port()
    with Served(str(tmp_path / "epd-autoscale.yaml"), run, port, "--restart",
                env={"MM_PLANNER_DRY_RUN": "true"}) as served:
        served.wait_for("ready: OpenAI base URL", 240)
        state = served.state
        namespace, tls = state["namespace"], state["tls"]
        runtime_env = {k: v for k, v in state["runtime"].items() if k in ("ETCD_ENDPOINTS", "NATS_SERVER")}
        # the publisher of the test's decisions reaches etcd and NATS as serve's own executor does
        planes = TlsFiles(str(run / "tls" / "dynamo" / "mm-encoder-serve.pem"),
                          str(run / "tls" / "dynamo" / "mm-encoder-serve.key"), tls["ca"]).dynamo_env(runtime_env)
        peer = tls_client(tls["ca"], tls["cert"], tls["key"])
        peer.check_hostname = False
        assert list(_encoders(served)) == ["encoder-0"]
        first = _serial(_encoders(served)["encoder-0"]["url"], peer)
        load = Load(port, clients=2, tls=tls_client(tls["ca"], tls["cert"], tls["key"]), tenant_header="X-Tenant")
        try:
            wait_until("answers before scaling", lambda: load.count() >= 4, 120)
            renewed = _renewals(served)
            wait_until("two renewals under load", lambda: _renewals(served) >= renewed + 2, 60)
            wait_until("the encoder's renewed certificate in a new handshake",
                       lambda: _serial(_encoders(served)["encoder-0"]["url"], peer) != first, 30)
            with deciding(namespace, 2, runtime_env, planes):
                served.wait_for("encoder: 2 running (started encoder-1)", 180)
            encoders = _encoders(served)
            assert list(encoders) == ["encoder-0", "encoder-1"]
            new = encoders["encoder-1"]["url"].removeprefix("https://")
            assert f"server {new}" in _upstreams(run, "shared-0") and f"server {new}" in _upstreams(run, "shared-1")
            # the new worker gets a share of the unique images through the reloaded tier
            wait_until("encoder-1 serving", lambda: _encoded(encoders["encoder-1"]) >= 2, 120)
            # the planner sees both in discovery (its next rounds); `mm-encoder status --json` shows it
            wait_until("the planner seeing 2", lambda: _planner(collect(run)).get("running") == 2, 60)
            status = json.loads(subprocess.run(
                [sys.executable, "-m", "mm_encoder.cli", "status", "--run-dir", str(run), "--json"],
                capture_output=True, text=True, check=True).stdout)
            planner = _planner(status)
            assert planner["up"] and planner["running"] == 2 and planner["wanted"] == 1  # dry run: its own stays
            assert planner["decision"]["action"] in ("hold", "up", "down") and planner["decision"]["reason"]
            assert status["scaling"]["running"] == 2 and status["scaling"]["started"] == ["encoder-1"]
            for row in status["components"]:  # every replica's certificate, the new encoder's too, is current
                assert 0 < row["cert_expires_in_s"] <= LIFETIME_S, row

            # a killed planner comes back (--restart), and so does a killed encoder: the fleet keeps its size
            os.killpg(served.component("planner")["pid"], signal.SIGKILL)
            served.wait_for("planner restarted", 120)
            os.killpg(served.component("encoder-1")["pid"], signal.SIGKILL)
            served.wait_for("encoder-1 restarted", 120)
            assert list(_encoders(served)) == ["encoder-0", "encoder-1"]

            before = load.count()
            with deciding(namespace, 1, runtime_env, planes):
                served.wait_for("encoder: 1 running (drained encoder-1)", 180)
            assert list(_encoders(served)) == ["encoder-0"]
            assert f"server {new}" not in _upstreams(run, "shared-0")
            wait_until("answers after the drain", lambda: load.count() >= before + 4, 120)
            renewed = _renewals(served)
            wait_until("a renewal after the drain", lambda: _renewals(served) > renewed, 60)
        finally:
            answers = load.stop()
    lost = [a for a in answers if a.status is None]
    refused = [a for a in answers if a.status == 503]
    other = [a for a in answers if a.status not in (200, 503, None)]
    assert not lost and not other, (lost, other)
    assert all(a.retry_after for a in refused), refused
    assert len(answers) >= 8
