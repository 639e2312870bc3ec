"""`mm-encoder serve graphs/epd.yaml --tls` (issue 33): the whole EPD graph with a throwaway CA in
the run directory and a certificate per replica. The README's request answers over HTTPS (the
ready line names the CA to pass); every internal serving port in state.json (the encoder's and
every tier's) refuses plaintext and a client without a certificate, the frontend's OpenAI port
serves HTTPS only; each component's status is on its plaintext ops port; every private key is 0600
in a 0700 directory and no log holds key material. Then, on SIGHUP, serve replaces every
certificate (the CA kept) and the graph keeps answering on the new ones. Real processes throughout.

One graph for the module; the rotation test runs last (it replaces the certificates the others
read), and the graph stops cleanly at the end (`Served.stop`: exit 0, no process left)."""

from __future__ import annotations

import http.client
import os
import signal
import ssl
import stat
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from harness.serve_fixtures import Served, chat
from harness.topology import free_port, require_nginx
from mm_encoder.serve.status import collect

pytestmark = pytest.mark.slow  # a whole graph of subprocesses; `make test-quick` skips it


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`mm-encoder serve graphs/epd.yaml --tls`, ready; stopped (and checked) after the module's last test."""
    require_nginx()
    run = tmp_path_factory.mktemp("tls-graph") / "run"
    with Served("graphs/epd.yaml", run, free_port(), "--tls") as served:
        served.wait_for("ready: OpenAI base URL", 240)
        yield served


def _refuses_plaintext(url: str) -> None:
    """Plain HTTP to an HTTPS port gets no answer (Python's servers) or nginx's typed 403."""
    plain = url.replace("https://", "http://")
    try:
        urllib.request.urlopen(plain + "/v1/models", timeout=10)
    except urllib.error.HTTPError as e:
        assert e.code == 403 and e.headers["X-MM-Error-Code"] == "https_required", (url, e.code)
    except (urllib.error.URLError, http.client.HTTPException, ConnectionError):
        pass
    else:
        raise AssertionError(f"{plain} answered plaintext")


def _refuses_no_certificate(url: str, ca: str) -> None:
    """TLS without a client certificate: refused in the handshake or with nginx's typed 403."""
    u = urlsplit(url)
    conn = http.client.HTTPSConnection(u.hostname, u.port, context=ssl.create_default_context(cafile=ca), timeout=10)
    try:
        conn.request("POST", "/v1/encode", body=b"{}", headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 403 and r.getheader("X-MM-Error-Code") == "client_certificate_required", (url, r.status)
    except (ssl.SSLError, ConnectionError, http.client.RemoteDisconnected):
        pass
    finally:
        conn.close()


def test_serve_tls_answers_over_https_and_every_internal_port_refuses_strangers(served):
    port, run = served.port, served.run_dir
    out = served.text  # its output so far: the ready line among it
    ca = str(run / "tls" / "ca" / "ca.pem")
    assert f"OpenAI base URL https://127.0.0.1:{port}/v1" in out and f"curl --cacert {ca}" in out
    assert chat(port, ca=ca)["usage"]["prompt_tokens"] == 1223
    state = served.state
    assert state["base_url"].startswith("https://") and state["tls"]["ca"] == ca
    internal = [c for c in state["components"] if c["url"] and c["kind"] != "frontend"]
    assert {c["kind"] for c in internal} == {"encoder", "cache-shared", "cache-router", "cache-cluster"}
    for c in internal:
        assert c["url"].startswith("https://") and c["ops_url"].startswith("http://127.0.0.1:")
        _refuses_plaintext(c["url"])
        _refuses_no_certificate(c["url"], ca)
        health = "/ready" if c["kind"] == "encoder" else "/_cache/health"
        with urllib.request.urlopen(c["ops_url"] + health, timeout=10) as r:
            assert r.status == 200
    _refuses_plaintext(f"https://127.0.0.1:{port}")  # the frontend: HTTPS only
    # keys: 0600 in a 0700 directory; no log holds key material
    tls_dir = run / "tls"
    assert stat.S_IMODE(run.stat().st_mode) == stat.S_IMODE(tls_dir.stat().st_mode) == 0o700
    assert run.stat().st_uid == os.geteuid()
    keys = sorted(tls_dir.rglob("*.key"))
    assert len(keys) >= len(state["components"]) + 1  # every replica's, the CA's (and the launcher's)
    assert all(stat.S_IMODE(k.stat().st_mode) == 0o600 for k in keys)
    assert stat.S_IMODE((tls_dir / "ca").stat().st_mode) == 0o700
    assert [k.name for k in keys if k.name == "ca.key"] == ["ca.key"] and (tls_dir / "ca" / "ca.key").is_file()
    # no process was given the CA's key: each names only its own certificate, key and the CA certificate
    for c in state["components"]:
        cmdline = Path(f"/proc/{c['pid']}/cmdline").read_bytes().decode(errors="replace")
        assert "ca.key" not in cmdline, c["name"]
    logs = [p for p in run.glob("*.log")]
    assert logs and not any("PRIVATE KEY" in p.read_text(errors="replace") for p in logs)


def _file_serial(path) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


def test_serve_rotates_every_certificate_on_sighup(served):
    """Last in the module: the graph's certificates are new afterwards."""
    port, run = served.port, served.run_dir
    before = _file_serial(run / "tls" / "encoder.pem")
    os.kill(served.proc.pid, signal.SIGHUP)
    served.wait_for("rotation: new certificates for", 30)
    assert _file_serial(run / "tls" / "encoder.pem") != before
    assert chat(port, ca=str(run / "tls" / "ca" / "ca.pem"))["usage"]["prompt_tokens"] == 1223  # on the new ones
    assert all(c["up"] for c in collect(run)["components"])
