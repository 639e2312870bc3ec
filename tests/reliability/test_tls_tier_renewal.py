"""A renewed certificate is served in place (issue 43, finding 4): on Kubernetes the kubelet rewrites a
mounted Secret when cert-manager renews it, by writing a new timestamped directory and swapping the
`..data` symlink onto it. A real nginx tier with TLS (`mm-encoder cache up --tls-cert ...`), reading its
certificate through such a directory, is given a new certificate that way while a client keeps making
new handshakes: every request answers 200, the new serial is served within the bound, nginx's master is
the same process before and after (a reload, not a restart), and it reloaded once; serve's reload of a
tier's configuration still reaches nginx behind its supervisor. Then QUIT stops it gracefully through
its supervisor, which exits with nginx's status and leaves nothing behind.

The change detection itself (contents, not modification times) is checked on files alone."""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import ssl
import time
from pathlib import Path

from cryptography import x509

from harness.certs import Certs
from harness.topology import Tls, require_nginx, start_tier
from mm_encoder.cache_tiers.config import TierConfig
from mm_encoder.cache_tiers.reload import nginx_master, reload_tier
from mm_encoder.cache_tiers.supervise import Watch
from mm_encoder.runtime.procfs import leftover_pids
from mm_encoder.security.pki import Issued

FILES = ("tls.crt", "tls.key", "ca.crt")


def kubelet_writes(secret: Path, version: str, cert: Path, key: Path, ca: Path) -> None:
    """A Secret volume's update as the kubelet makes it: the files in a new `..<version>` directory, the
    `..data` symlink swapped onto it atomically (rename), the previous directory removed; each file is a
    symlink through `..data`, made once."""
    new = secret / f"..{version}"
    new.mkdir()
    for name, source in zip(FILES, (cert, key, ca), strict=True):
        shutil.copyfile(source, new / name)
    old = os.readlink(secret / "..data") if (secret / "..data").is_symlink() else None
    (secret / "..data_tmp").symlink_to(new.name)
    os.replace(secret / "..data_tmp", secret / "..data")
    for name in FILES:
        if not (secret / name).is_symlink():
            (secret / name).symlink_to(f"..data/{name}")
    if old is not None:
        shutil.rmtree(secret / old)


def serial(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


def test_content_not_mtime_decides_a_change(tmp_path):
    """A touch is no change; a new certificate through `..data` is, once; a file missing for an instant is
    no change (the next reading decides)."""
    certs = Certs(tmp_path / "pki")
    first = certs.issue("router", "cache-router")
    secret = tmp_path / "secret"
    secret.mkdir()
    kubelet_writes(secret, "v1", first.cert, first.key, certs.ca_file)
    watch = Watch([secret / name for name in FILES])
    os.utime((secret / "tls.crt").resolve(), (1, 1))
    assert not watch.changed()
    second = certs.issue("router", "cache-router", replace=True)
    kubelet_writes(secret, "v2", second.cert, second.key, certs.ca_file)
    assert watch.changed() and not watch.changed()
    (secret / "tls.key").unlink()
    assert not watch.changed()


def test_a_tier_serves_a_renewed_certificate_without_a_restart_or_a_failed_request(tmp_path):
    require_nginx()
    certs = Certs(tmp_path / "pki")
    first = certs.issue("router", "cache-router")
    secret = tmp_path / "secret"
    secret.mkdir()
    kubelet_writes(secret, "v1", first.cert, first.key, certs.ca_file)
    tls = Tls(certs, Issued(secret / "tls.crt", secret / "tls.key", first.identity))
    run_dir = tmp_path / "nginx-router"
    tier = start_tier(tmp_path, "router", "router", "--shard", "127.0.0.1:9", "--tls-watch-s", "0.2", tls=tls,
                      run_dir=run_dir)
    try:
        caller = certs.issue("cluster", "cache-cluster")  # the role a router admits
        ctx = ssl.create_default_context(cafile=str(certs.ca_file))
        ctx.load_cert_chain(caller.cert, caller.key)

        def request() -> int:
            """One request on a new connection (a new handshake): the serial the tier presented; raises unless 200."""
            conn = http.client.HTTPSConnection("127.0.0.1", tier.port, context=ctx, timeout=10)
            try:
                conn.connect()
                assert conn.sock is not None
                der = conn.sock.getpeercert(binary_form=True)
                assert der is not None
                conn.request("GET", "/_cache/health")
                reply = conn.getresponse()
                body = reply.read()
                assert reply.status == 200 and body == b"ok router\n", (reply.status, body)
            finally:
                conn.close()
            return x509.load_der_x509_certificate(der).serial_number

        old = serial(first.cert)
        assert [request() for _ in range(10)] == [old] * 10
        cfg = TierConfig(tier="router", listen=f"127.0.0.1:{tier.port}", shards=("127.0.0.1:9",), run_dir=run_dir,
                         workers="1", tls_cert=tls.cert, tls_key=tls.key, tls_ca=tls.ca,
                         ops_listen=f"127.0.0.1:{tier.ops_port}")  # what start_tier gave it
        master = nginx_master(tier.pid, cfg)
        assert master != tier.pid  # with TLS the tier supervises nginx, its child
        renewed = certs.issue("router", "cache-router", replace=True)
        new = serial(renewed.cert)
        assert new != old
        kubelet_writes(secret, "v2", renewed.cert, renewed.key, certs.ca_file)
        served: list[int] = []
        failed: list[str] = []
        deadline = time.monotonic() + 30
        while served[-20:] != [new] * 20:  # the new serial, and 20 handshakes in a row past the reload
            assert time.monotonic() < deadline, (served[-5:], failed[:3])
            try:
                served.append(request())
            except Exception as e:  # counted: the test asserts there are none
                failed.append(repr(e))
        assert failed == [] and set(served) <= {old, new}
        assert nginx_master(tier.pid, cfg) == master and tier.proc.poll() is None  # reloaded, not restarted
        assert tier.proc.text.count("changed: reloading nginx") == 1
        # serve's own reload (new upstreams) finds nginx behind its supervisor and sees a new worker serve
        assert reload_tier(tier.pid, cfg, tmp_path, old_gone=True) and request() == new

        tier.proc.send_signal(signal.SIGQUIT)  # what the pod's preStop sends PID 1
        assert tier.proc.popen.wait(timeout=20) == 0
        assert leftover_pids({tier.pid}) == []  # nginx's master and workers are gone too
    finally:
        tier.stop()
