"""Dynamo's own planes over TLS (issue 33): `mm-encoder serve graphs/epd-etcd.yaml --tls` runs etcd
(HTTPS client URLs, client certificates required) and nats-server (TLS, `verify`) with certificates
from the graph's CA, and every Dynamo process (encoders, engines, frontend) presents its own
certificate to both. The README's request answers over HTTPS; etcd and NATS refuse a client
without a certificate; etcd's client key, which Dynamo takes as PEM text in the environment, is not
written to state.json or any log. Dynamo's planes read a certificate once (issue 43): with theirs
living 30 s, serve restarts every Dynamo replica, one at a time, with a new one before it ends, and
the graph answers again. Real processes throughout (Debian's etcd and nats-server)."""

from __future__ import annotations

import json
import os
import socket
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from harness.serve_fixtures import Served, chat
from harness.topology import free_port, require_nginx

ROOT = Path(__file__).resolve().parents[2]


def _nats_refuses_without_certificate(address: str, ca: str) -> None:
    """NATS greets in plaintext (INFO), then the client upgrades; without a certificate the server
    refuses the handshake or drops the connection before answering CONNECT."""
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        info = raw.recv(4096)
        assert info.startswith(b"INFO ") and json.loads(info[5:].split(b"\r\n")[0])["tls_verify"] is True
        ctx = ssl.create_default_context(cafile=ca)
        try:
            with ctx.wrap_socket(raw, server_hostname=host) as tls:
                tls.sendall(b'CONNECT {"verbose":false}\r\nPING\r\n')
                assert b"PONG" not in tls.recv(4096)
        except (ssl.SSLError, ConnectionError):
            pass


@pytest.mark.slow  # a whole graph of subprocesses; `make test-quick` skips it
def test_etcd_and_nats_run_with_client_certificates(tmp_path):
    require_nginx()
    port = free_port()
    run = tmp_path / "run"
    # Dynamo's planes' certificates live 30 s (the least allowed): serve renews them by restarting each
    # Dynamo component, one replica at a time, at two thirds of their life
    graph = yaml.safe_load((ROOT / "graphs" / "epd-etcd.yaml").read_text())
    graph["tls"] = {"enabled": True, "dynamo_cert_lifetime_s": 30}
    graph["components"]["engine"]["replicas"] = 1  # one of each Dynamo kind restarts: enough, and cheaper
    (tmp_path / "epd-etcd.yaml").write_text(yaml.safe_dump(graph))
    with Served(str(tmp_path / "epd-etcd.yaml"), run, port) as served:
        served.wait_for("ready: OpenAI base URL", 300)
        ca = str(run / "tls" / "ca" / "ca.pem")
        assert chat(port, ca=ca)["usage"]["prompt_tokens"] == 1223
        runtime = served.state["runtime"]
        etcd, nats = runtime["ETCD_ENDPOINTS"], runtime["NATS_SERVER"]
        assert etcd.startswith("https://127.0.0.1:") and nats.startswith("tls://127.0.0.1:")
        # etcd: no certificate, no answer; the graph's own certificate (any component's) is let in
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(f"{etcd}/health", timeout=10, context=ssl.create_default_context(cafile=ca))
        member = ssl.create_default_context(cafile=ca)
        member.load_cert_chain(run / "tls" / "frontend.pem", run / "tls" / "frontend.key")
        with urllib.request.urlopen(f"{etcd}/health", timeout=10, context=member) as r:
            assert json.loads(r.read())["health"] == "true"
        _nats_refuses_without_certificate(urlsplit(nats).netloc, ca)
        # etcd's client key travels as PEM text in each Dynamo process's environment only
        assert not any(k.startswith("ETCD_AUTH") for k in runtime)
        written = [run / "state.json", *run.glob("*.log")]
        assert not any("PRIVATE KEY" in p.read_text(errors="replace") for p in written)

        # nothing runs past its certificate for Dynamo's planes: each Dynamo replica restarted with a new one,
        # and the graph answers again afterwards
        dynamo = [c["name"] for c in served.state["components"] if c["kind"] in ("encoder", "engine", "frontend")]
        for name in dynamo:
            served.wait_for(f"{name} restarted with a new certificate for Dynamo's planes", 240)
        assert _eventually(lambda: chat(port, ca=ca)["usage"]["prompt_tokens"], 120) == 1223


def _eventually(call, timeout: float):
    """`call()`'s value once it answers (the frontend may be restarting for its own new certificate)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except (OSError, urllib.error.URLError, ssl.SSLError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.mark.slow
def test_serves_scaling_executor_renews_its_certificate_for_dynamos_planes(tmp_path):
    """serve's own Dynamo client (the scaling executor) reads its certificate once too: when it is due, a new
    executor with a new certificate replaces the old one, against the real etcd and NATS over TLS (nothing
    else of the graph is started)."""
    from cryptography import x509

    from mm_encoder.graph.schema import load_graph
    from mm_encoder.serve.runner import GraphRunner

    graph = load_graph(ROOT / "graphs" / "epd-autoscale.yaml")
    graph = graph.model_copy(update={"tls": graph.tls.model_copy(update={"enabled": True})})
    runner = GraphRunner(graph, tmp_path / "run")
    cert = tmp_path / "run" / "tls" / "dynamo" / "mm-encoder-serve.pem"

    def serial() -> int:
        return x509.load_pem_x509_certificate(cert.read_bytes()).serial_number

    environ = dict(os.environ)  # the executor sets Dynamo's planes in this process's environment (serve's)
    try:
        runner.prepare()
        runner._start_servers()
        first = runner.executor()
        assert first is not None and runner.executor_due is not None and serial()
        before = serial()
        renewed = runner._renew_executor(first)
        assert renewed is not None and renewed is not first and runner.scaler is renewed
        assert renewed.error is None and serial() != before
        assert not first._thread.is_alive()  # the old one stopped; the new one holds the connector
    finally:
        if runner.scaler is not None:
            runner.scaler.stop()
        os.environ.clear()  # this pytest process's other tests run Dynamo runtimes of their own
        os.environ.update(environ)
        assert runner.stop() == []
