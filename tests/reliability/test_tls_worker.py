"""Red team at the encode worker's hop with TLS (issue 33): a real worker process serving HTTPS with
client certificates from a deployment CA (`security.pki`), reached by real clients. A caller with
a certificate of an admitted role (an engine, through the package's own `EncoderChain`) is
answered; plaintext, no client certificate, a certificate from another CA, an expired one and one
whose role may not call the worker are each refused, in the handshake or with 403
`forbidden_peer`, and none of them causes an encode (the worker's own counters, read in plaintext
on its ops port, which serves nothing else)."""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
import urllib.error
import urllib.request

import pytest

from harness.certs import Certs
from harness.media_factory import image_bytes, natural_image
from harness.serve_fixtures import data_url
from harness.topology import Tls, start_worker
from mm_encoder.client.chain import EncoderChain
from mm_encoder.core.errors import EncoderUnavailable
from mm_encoder.core.requests import EncodeRequest
from mm_encoder.security.pki import Identity
from mm_encoder.security.tls import TlsOptions

PNG = image_bytes(natural_image(64, 48, seed=3))
REQUEST = {"model": "tiny", "url": data_url(PNG)}


def _client(files, ca) -> ssl.SSLContext:
    """A client context presenting `files` (None: no certificate), trusting `ca`."""
    ctx = ssl.create_default_context(cafile=str(ca))
    if files is not None:
        ctx.load_cert_chain(files.cert, files.key)
    return ctx


def _post(port: int, ctx: ssl.SSLContext) -> tuple[int, dict]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)
    try:
        conn.request("POST", "/v1/encode", body=json.dumps(REQUEST), headers={"Content-Type": "application/json",
                                                                              "Accept": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def _refused_in_handshake(port: int, ctx: ssl.SSLContext) -> None:
    """The connection fails before any answer: the server's handshake refuses the client (TLS 1.3
    reports a client certificate the server rejects on the first read, hence the request)."""
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
        _post(port, ctx)


def _metric(ops_port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{ops_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
               or line.startswith(name + " "))


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls-worker")
    certs = Certs(tmp / "pki")
    with start_worker(tls=Tls.issue(certs, "encoder", "encoder"), name="tls worker", log=tmp / "worker.log",
                      timeout=120) as w:
        yield certs, w.http_port, w.ops_port


def test_an_admitted_role_is_answered_through_the_packages_own_client(worker):
    certs, port, ops = worker
    engine = certs.issue("engine-0", "engine")
    tls = TlsOptions(tls_cert=engine.cert, tls_key=engine.key, tls_ca=certs.ca_file)

    async def fetch() -> bytes:
        chain = EncoderChain(http_url=f"https://127.0.0.1:{port}", tls=tls.client_context())
        try:
            body, _ = await chain.fetch(EncodeRequest(model="tiny", url=REQUEST["url"]))
            return body
        finally:
            await chain.close()

    assert len(asyncio.run(fetch())) > 0
    assert _metric(ops, "dynamo_component_encode_forward_items_total") == 1


def test_every_unauthenticated_or_unadmitted_caller_is_refused_before_any_work(worker):
    certs, port, ops = worker
    before = (_metric(ops, "dynamo_component_encode_forward_items_total"),
              _metric(ops, "dynamo_component_encode_requests_total"))
    # plaintext to the HTTPS port: no answer
    with pytest.raises((urllib.error.URLError, http.client.RemoteDisconnected, ConnectionError)):
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/encode",
                                                      data=json.dumps(REQUEST).encode()), timeout=10)
    _refused_in_handshake(port, _client(None, certs.ca_file))  # no client certificate
    _refused_in_handshake(port, _client(certs.other_ca(Identity("engine-0", "engine")), certs.ca_file))
    _refused_in_handshake(port, _client(certs.expired(Identity("engine-0", "engine")), certs.ca_file))
    # a valid certificate whose role may not call the worker: 403, by name, before the request is read
    status, body = _post(port, _client(certs.issue("frontend", "frontend"), certs.ca_file))
    assert status == 403 and body["error"]["code"] == "forbidden_peer" and "frontend" in body["error"]["message"]
    # none of them reached the encode service: no request counted, no encode
    assert (_metric(ops, "dynamo_component_encode_forward_items_total"),
            _metric(ops, "dynamo_component_encode_requests_total")) == before


def test_the_ops_port_serves_probes_and_metrics_only(worker):
    _, _, ops = worker
    with urllib.request.urlopen(f"http://127.0.0.1:{ops}/health", timeout=10) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{ops}/v1/encode",
                                                      data=json.dumps(REQUEST).encode()), timeout=10)
    assert e.value.code in (404, 405)


def test_a_client_refuses_a_server_from_another_ca(worker, tmp_path):
    """The package's client checks the server too: the worker's CA is not another deployment's."""
    _, port, _ = worker
    stranger = Certs(tmp_path / "other")  # another deployment: its CA, its engine
    engine = stranger.issue("engine-0", "engine")
    tls = TlsOptions(tls_cert=engine.cert, tls_key=engine.key, tls_ca=stranger.ca_file)

    async def fetch() -> None:
        chain = EncoderChain(http_url=f"https://127.0.0.1:{port}", tls=tls.client_context())
        try:
            await chain.fetch(EncodeRequest(model="tiny", url=REQUEST["url"]))
        finally:
            await chain.close()

    with pytest.raises(EncoderUnavailable, match=r"(?i)certificate"):
        asyncio.run(fetch())


def test_a_caller_is_admitted_by_its_uri_never_by_its_ou(worker):
    """Certificates from the deployment's own CA, OU `engine` (an admitted role), whose URI is missing,
    another graph's or trust domain's, doubled or not an ID: each refused with 403 `forbidden_peer`
    before any work (what any namespace could get from a shared issuer that does not police URIs)."""
    certs, port, ops = worker
    before = _metric(ops, "dynamo_component_encode_requests_total")
    for why, forged in certs.forgeries("engine").items():
        status, body = _post(port, _client(forged, certs.ca_file))
        assert (status, body["error"]["code"]) == (403, "forbidden_peer"), why
    assert _metric(ops, "dynamo_component_encode_requests_total") == before


def _fetch(port: int, client: TlsOptions) -> bytes:
    async def go() -> bytes:
        chain = EncoderChain(http_url=f"https://127.0.0.1:{port}", tls=client.client_context())
        try:
            return (await chain.fetch(EncodeRequest(model="tiny", url=REQUEST["url"])))[0]
        finally:
            await chain.close()

    return asyncio.run(go())


def test_each_client_checks_the_server_it_reached_by_its_uri(worker, tmp_path):
    """The engine calls encoders: the worker (an encoder of its graph) answers it. The frontend calls only
    its cluster tier, so its client refuses this worker inside the handshake, request unsent; so does an
    engine of another graph under the same CA, and one whose server presents a forged certificate."""
    certs, port, ops = worker
    engine = certs.issue("engine-0", "engine", replace=True)
    assert len(_fetch(port, TlsOptions(tls_cert=engine.cert, tls_key=engine.key, tls_ca=certs.ca_file))) > 0
    before = _metric(ops, "dynamo_component_encode_requests_total")
    frontend = certs.issue("frontend", "frontend", replace=True)
    other = certs.ca.issue(Identity("engine-0", "engine", graph="other"), tmp_path, replace=True)
    for client in (frontend, other):
        with pytest.raises(EncoderUnavailable, match=r"expected spiffe://mm-encoder\.local/"):
            _fetch(port, TlsOptions(tls_cert=client.cert, tls_key=client.key, tls_ca=certs.ca_file))
    assert _metric(ops, "dynamo_component_encode_requests_total") == before
