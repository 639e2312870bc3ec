"""`mm-encoder serve graphs/epd-autoscale.yaml --tls` (issue 43): TLS and autoscaling together, and
certificates that renew themselves. Every component's certificate lives 15 s here, so `serve` renews
all of them every 10 s (two thirds of their life) while two clients send unique images over HTTPS;
meanwhile a decision scales the encoders 1 -> 2 (the new replica gets its own certificate before it
starts) and the next one drains them back to 1. No request is lost (each answered 200, or 503 with
Retry-After), new handshakes at the encoder present new serials, and `mm-encoder status` shows each
certificate's time left. Real processes throughout (etcd, NATS, nginx, workers, engines, planner)."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from harness.autoscale import Load, deciding, wait_until
from harness.serve_fixtures import Served
from harness.topology import free_port, require_nginx
from mm_encoder.graph.planned import TlsFiles
from mm_encoder.security.tls import tls_client
from mm_encoder.serve.status import collect

ROOT = Path(__file__).resolve().parents[2]
LIFETIME_S = 15


def _serial(url: str, ctx: ssl.SSLContext) -> int:
    """The serial of the certificate a server presents to a new handshake."""
    host, port = url.removeprefix("https://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw, ctx.wrap_socket(raw) as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


@pytest.mark.slow
def test_tls_autoscale_scales_and_renews_under_load_with_no_request_lost(tmp_path):
    require_nginx()
    graph = yaml.safe_load((ROOT / "graphs" / "epd-autoscale.yaml").read_text())
    graph["tls"] = {"enabled": True, "cert_lifetime_s": LIFETIME_S}
    path = tmp_path / "epd-autoscale-tls.yaml"
    path.write_text(yaml.safe_dump(graph))
    run, port = tmp_path / "run", free_port()
    with Served(str(path), run, port, "--restart", env={"MM_PLANNER_DRY_RUN": "true"}) as served:
        served.wait_for("ready: OpenAI base URL", 240)
        state = served.state
        tls = state["tls"]
        client = tls_client(tls["ca"], tls["cert"], tls["key"])
        peer = tls_client(tls["ca"], tls["cert"], tls["key"])
        peer.check_hostname = False
        encoder = served.component("encoder-0")["url"]
        first = _serial(encoder, peer)
        runtime_env = {k: v for k, v in state["runtime"].items() if k in ("ETCD_ENDPOINTS", "NATS_SERVER")}
        launcher = TlsFiles(str(run / "tls" / "dynamo" / "mm-encoder-serve.pem"),
                            str(run / "tls" / "dynamo" / "mm-encoder-serve.key"), tls["ca"])
        planes = launcher.dynamo_env(runtime_env)
        load = Load(port, clients=2, tls=client)
        try:
            wait_until("answers before scaling", lambda: load.count() >= 4, 180)
            wait_until("two renewals", lambda: served.text.count("rotation: new certificates") >= 2, 60)
            assert _serial(encoder, peer) != first  # a new handshake: the renewed certificate
            with deciding(state["namespace"], 2, runtime_env, planes):
                served.wait_for("encoder: 2 running (started encoder-1)", 180)
            before = load.count()
            wait_until("answers with two encoders", lambda: load.count() >= before + 4, 180)
            status = collect(run)
            for row in status["components"]:  # every replica's certificate, the new encoder's too
                assert 0 < row["cert_expires_in_s"] <= LIFETIME_S, row
            with deciding(state["namespace"], 1, runtime_env, planes):
                served.wait_for("encoder: 1 running (drained encoder-1)", 180)
            before = load.count()
            wait_until("answers after the drain", lambda: load.count() >= before + 4, 180)
            renewals = served.text.count("rotation: new certificates")
            wait_until("a renewal after the drain",
                       lambda: served.text.count("rotation: new certificates") > renewals, 60)
        finally:
            answers = load.stop()
    lost = [a for a in answers if a.status is None]
    refused = [a for a in answers if a.status == 503]
    other = [a for a in answers if a.status not in (200, 503, None)]
    assert not lost and not other, (lost, other)
    assert all(a.retry_after for a in refused), refused
    assert len([a for a in answers if a.status == 200]) >= 12
