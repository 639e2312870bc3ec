"""Red team at the cache tiers' hops with TLS (issue 33): real nginx tiers (`mm-encoder cache up
--tls-cert ...`) in front of a real encode worker, all with certificates from one deployment CA.
The frontend's way in (the cluster tier, the router, the shared tier, the worker, each hop HTTPS with
client certificates) answers, the second time from the cluster tier's cache. At each tier,
plaintext, no certificate, another CA's, an expired one and a role the tier does not admit are
each refused with a 403 naming why (`https_required`, `client_certificate_required`,
`bad_client_certificate`, `forbidden_peer`) before the cache is looked at: none of them
reads a cached entry, fills one, or causes an encode (the tiers' request counters and JSON log
lines, the worker's encode counter, all read in plaintext on their ops ports)."""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.autoscale import wait_until
from harness.certs import Certs
from harness.media_factory import image_bytes, natural_image
from harness.serve_fixtures import data_url
from harness.topology import TierProcess, Tls, WorkerProcess, require_nginx, start_tier, start_worker, stop_all
from mm_encoder.client.chain import EncoderChain
from mm_encoder.core.requests import EncodeRequest
from mm_encoder.security.pki import Identity
from mm_encoder.security.tls import TlsOptions

PNG = image_bytes(natural_image(72, 40, seed=5))
SOURCE = EncodeRequest(model="tiny", url=data_url(PNG))


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _stats(ops: int) -> dict:
    return json.loads(_get(f"http://127.0.0.1:{ops}/_cache/stats"))


def _encodes(ops: int) -> float:
    text = _get(f"http://127.0.0.1:{ops}/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dynamo_component_encode_forward_items_total{"))


def _clusters(ops: int) -> dict[str, float]:
    """A tier's requests per calling cluster, from its plaintext /metrics (prometheus_client's parser)."""
    text = _get(f"http://127.0.0.1:{ops}/metrics")
    return {s.labels["cluster"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "dynamo_component_cache_tier_requests_total"}


def _client(issued, ca) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if issued is not None:
        ctx.load_cert_chain(issued.cert, issued.key)
    return ctx


def _head(port: int, ctx: ssl.SSLContext, **headers: str) -> tuple[int, dict[str, str]]:
    """The frontend's question (HEAD /v1/encode with the request in the body), raw."""
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)
    try:
        conn.request("HEAD", "/v1/encode", body=SOURCE.body(),
                     headers={"Content-Type": "application/json", "X-Cache-Key": SOURCE.key(), **headers})
        r = conn.getresponse()
        r.read()
        return r.status, dict(r.getheaders())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """worker <- shared tier <- router <- cluster tier, every hop HTTPS with client certificates."""
    require_nginx()
    tmp = tmp_path_factory.mktemp("tls-tiers")
    certs = Certs(tmp / "pki")
    started: list[WorkerProcess | TierProcess] = []
    try:
        worker = start_worker(tls=Tls.issue(certs, "encoder", "encoder"), name="tls worker", log=tmp / "worker.log",
                              timeout=120)
        started.append(worker)
        ports = {"worker": worker.http_port, "worker_ops": worker.ops_port}
        logs = {}
        upstream, below = worker.address, "encoder"
        for tier in ("shared", "router", "cluster"):
            nxt = ["--shard" if tier == "router" else "--next", upstream,
                   "--tls-server-name", f"{below}.mm-encoder.mm-encoder.local"]  # the level below, by its role
            t = start_tier(tmp, tier, tier, *nxt, tls=Tls.issue(certs, tier, f"cache-{tier}"))
            below = f"cache-{tier}"
            started.append(t)
            ports[tier], ports[f"{tier}_ops"], logs[tier] = t.port, t.ops_port, t.log
            upstream = t.address
        yield certs, ports, logs
    finally:
        stop_all(started)


def _describe(port: int, issued, ca) -> str:
    """The package's own client, as the frontend uses it: the answering levels (X-Cache-Status)."""
    tls = TlsOptions(tls_cert=issued.cert, tls_key=issued.key, tls_ca=ca)

    async def go() -> str:
        chain = EncoderChain(http_url=f"https://127.0.0.1:{port}", tls=tls.client_context())
        try:
            return (await chain.describe(SOURCE))[1]
        finally:
            await chain.close()

    return asyncio.run(go())


def test_the_frontends_way_in_answers_then_hits(chain):
    certs, ports, _ = chain
    frontend = certs.issue("frontend", "frontend")
    assert _describe(ports["cluster"], frontend, certs.ca_file) == "http:cluster=MISS, shared=MISS"
    assert _describe(ports["cluster"], frontend, certs.ca_file) == "http:cluster=HIT"
    assert _encodes(ports["worker_ops"]) == 1


@pytest.mark.parametrize("tier", ["cluster", "router", "shared"])
def test_unauthenticated_or_unadmitted_callers_get_nothing_from_a_tier(chain, tier):
    """Each bad caller asks for the entry the test above cached (and would fill it otherwise)."""
    certs, ports, logs = chain
    port = ports[tier]
    before = (_stats(ports[f"{tier}_ops"]), _encodes(ports["worker_ops"]), logs[tier].read_text())
    # plaintext to the HTTPS port
    with pytest.raises(urllib.error.HTTPError) as plain:
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/encode", method="POST",
                                                      data=json.dumps(SOURCE.to_dict()).encode()), timeout=10)
    assert plain.value.code == 403 and plain.value.headers["X-MM-Error-Code"] == "https_required"
    # no certificate, another CA's, an expired one: nginx completes the handshake and refuses by name
    engine = Identity("engine-0", "engine")
    for bad, code in ((None, "client_certificate_required"), (certs.other_ca(engine), "bad_client_certificate"),
                      (certs.expired(engine), "bad_client_certificate")):
        status, headers = _head(port, _client(bad, certs.ca_file))
        assert (status, headers["X-MM-Error-Code"]) == (403, code), headers
        assert "X-Cache-Status" not in headers  # no cache result: the lookup never ran
    assert "expired" in _head(port, _client(certs.expired(engine), certs.ca_file))[1]["X-MM-Error"]
    # valid certificates of roles this tier does not admit: 403 before the cache is looked at
    others = {"cluster": [], "router": [("frontend", "frontend"), ("engine-0", "engine")],
              "shared": [("frontend", "frontend"), ("engine-0", "engine")]}[tier]
    for name, role in (("encoder", "encoder"), *others):
        status, headers = _head(port, _client(certs.wrong_role(name, role), certs.ca_file))
        assert status == 403 and headers["X-MM-Error-Code"] == "forbidden_peer", (status, headers)
        assert "X-Cache-Status" not in headers
    # the deployment's own CA, an admitted role's OU, but no URI of this graph (peer_id.lua): the same 403
    admitted = {"cluster": "frontend", "router": "cache-cluster", "shared": "cache-router"}[tier]
    for why, forged in certs.forgeries(admitted).items():
        status, headers = _head(port, _client(forged, certs.ca_file))
        assert (status, headers["X-MM-Error-Code"]) == (403, "forbidden_peer"), (why, headers)
    after = (_stats(ports[f"{tier}_ops"]), _encodes(ports["worker_ops"]), logs[tier].read_text())
    assert after == before  # no request reached the cache location: no read, no fill, no log line, no encode


def test_a_tier_refuses_a_next_level_of_another_role(chain, tmp_path):
    """nginx checks its next level by its role's DNS name: a shared tier told its encoders are
    `encoder.<graph>.<trust domain>` reaches the worker; one told to expect another role's name refuses
    the worker's certificate (502), and the worker encodes nothing for it."""
    certs, ports, _ = chain
    before = _encodes(ports["worker_ops"])
    t = start_tier(tmp_path, "strict", "shared", "--next", f"127.0.0.1:{ports['worker']}",
                   "--tls-server-name", "cache-router.mm-encoder.mm-encoder.local",
                   tls=Tls.issue(certs, "strict", "cache-shared"))
    try:
        router = certs.issue("router-x", "cache-router")
        status, _ = _head(t.port, _client(router, certs.ca_file))
        assert status == 502
        # nginx's error line reaches the tier's log after its answer does: waited for, not read at once
        wait_until("the tier's log naming the refused certificate", lambda: "certificate" in t.log.read_text(), 15)
    finally:
        t.stop()
    assert _encodes(ports["worker_ops"]) == before


def _grown(before: dict[str, dict[str, float]], ops: dict[str, int], done) -> dict[str, dict[str, float]]:
    """Each tier's requests per calling cluster since `before`, once `done(grown)` holds (nginx counts a
    request after its answer has gone) or 10 s have passed."""
    deadline = time.monotonic() + 10
    while True:
        after = {t: _clusters(port) for t, port in ops.items()}
        grown = {t: {k: v - before[t].get(k, 0) for k, v in after[t].items() if v != before[t].get(k, 0)}
                 for t in ops}
        if done(grown) or time.monotonic() > deadline:
            return grown
        time.sleep(0.02)


def test_a_calling_cluster_tier_is_named_by_its_certificates_graph(chain, tmp_path):
    """With TLS a router names a calling cluster tier by its certificate's graph, whatever X-MM-Cluster it
    sends, and tells the shard so: an encoder site's router (`--tls-allow-graphs model-a,model-b`) in front
    of the chain's shared tier, called by two model clusters' cluster tiers under the same CA, the first
    claiming to be the second. A graph the router does not name is refused (403 `forbidden_peer`) and
    counted nowhere. The chain's own cluster tier (no --cluster-name) names itself by its own graph."""
    certs, ports, _ = chain
    router = start_tier(tmp_path, "site-router", "router", "--shard", f"127.0.0.1:{ports['shared']}",
                        "--tls-server-name", "cache-shared.mm-encoder.mm-encoder.local",
                        "--tls-allow-graphs", "model-a,model-b", tls=Tls.issue(certs, "site-router", "cache-router"))
    try:
        ops = {"router": router.ops_port, "shared": ports["shared_ops"], "cluster": ports["cluster_ops"]}
        before = {t: _clusters(port) for t, port in ops.items()}
        a, b, c = (certs.ca.issue(Identity(f"cluster-{g}", "cache-cluster", graph=g), certs.root / g)
                   for g in ("model-a", "model-b", "model-c"))
        assert _head(router.port, _client(a, certs.ca_file), **{"X-MM-Cluster": "model-b"})[0] == 200
        assert _head(router.port, _client(b, certs.ca_file))[0] == 200
        status, headers = _head(router.port, _client(c, certs.ca_file), **{"X-MM-Cluster": "model-a"})
        assert (status, headers["X-MM-Error-Code"]) == (403, "forbidden_peer")
        _describe(ports["cluster"], certs.issue("frontend", "frontend", replace=True), certs.ca_file)
        both = {"model-a": 1, "model-b": 1}
        grown = _grown(before, ops, lambda g: g["cluster"] and g["router"] == both
                       and all(g["shared"].get(k) == 1 for k in both))
        assert grown["router"] == both
        assert {k: v for k, v in grown["shared"].items() if k.startswith("model-")} == grown["router"]
        assert grown["cluster"] == {"mm-encoder": 1}  # its own graph; it may have hit, or gone on as such
        assert set(grown["shared"]) <= {"model-a", "model-b", "mm-encoder"}
    finally:
        router.stop()
