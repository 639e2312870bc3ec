"""Certificate rotation under load (issue 33): an encode worker and a cluster tier with TLS, an
engine fetching bodies through the tier on keep-alive connections without pause; mid-load every
certificate is replaced (new keys, the CA kept) and each process gets SIGHUP (the worker reads its
files again, nginx reloads gracefully). Every request answers 200; new handshakes at both servers
present the new certificates. (`mm-encoder serve --tls` doing the same for a whole graph on SIGHUP:
tests/reliability/test_tls_graph.py, on that module's graph.)"""

from __future__ import annotations

import asyncio
import signal
import socket
import ssl
import threading
import time

import pytest

from harness.certs import Certs
from harness.media_factory import image_bytes, natural_image
from harness.serve_fixtures import data_url
from harness.topology import TierProcess, Tls, WorkerProcess, require_nginx, start_tier, start_worker, stop_all
from mm_encoder.client.chain import EncoderChain
from mm_encoder.core.requests import EncodeRequest
from mm_encoder.security.tls import TlsOptions

SOURCE = EncodeRequest(model="tiny", url=data_url(image_bytes(natural_image(64, 40, seed=9))))


def _served_serial(port: int, ca, client) -> int:
    """The serial number of the certificate a server presents to a new handshake."""
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(client.cert, client.key)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    from cryptography import x509

    return x509.load_der_x509_certificate(der).serial_number


def _file_serial(path) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


class Load(threading.Thread):
    """An engine fetching the same body through the chain until stopped (at most 30 s, 2000 requests)."""

    def __init__(self, url: str, tls: ssl.SSLContext):
        super().__init__(daemon=True)
        self.url, self.tls = url, tls
        self.ok, self.failed = 0, []
        self.done = threading.Event()

    def run(self) -> None:
        async def go() -> None:
            chain = EncoderChain(http_url=self.url, tls=self.tls)
            deadline = time.monotonic() + 30
            try:
                while not self.done.is_set() and time.monotonic() < deadline and self.ok + len(self.failed) < 2000:
                    try:
                        await chain.fetch(SOURCE)
                        self.ok += 1
                    except Exception as e:  # counted: the test asserts there are none
                        self.failed.append(repr(e))
            finally:
                await chain.close()

        asyncio.run(go())


@pytest.mark.slow
def test_certificates_rotate_under_load_without_a_failed_request(tmp_path):
    require_nginx()
    certs = Certs(tmp_path / "pki")
    ca = str(certs.ca_file)
    started: list[WorkerProcess | TierProcess] = []
    try:
        worker = start_worker("--tls-allow", "cache-cluster", tls=Tls.issue(certs, "encoder", "encoder"),
                              name="tls worker", log=tmp_path / "w.log", timeout=120)
        started.append(worker)
        wport = worker.http_port
        cl = certs.issue("cluster", "cache-cluster")
        tier = start_tier(tmp_path, "cluster", "cluster", "--next", worker.address, tls=Tls(certs, cl))
        started.append(tier)
        port = tier.port
        engine = certs.issue("engine-0", "engine")
        load = Load(f"https://127.0.0.1:{port}", TlsOptions(tls_cert=engine.cert, tls_key=engine.key,
                                                            tls_ca=certs.ca_file).client_context())
        load.start()
        deadline = time.monotonic() + 20
        while load.ok < 20 and time.monotonic() < deadline:  # under way
            time.sleep(0.05)
        old = (_served_serial(wport, ca, cl), _served_serial(port, ca, engine))
        enc, cl = certs.issue("encoder", "encoder", replace=True), certs.issue("cluster", "cache-cluster", replace=True)
        worker.proc.send_signal(signal.SIGHUP)
        tier.proc.send_signal(signal.SIGHUP)  # nginx's master: a graceful reload (new workers, then the old ones go)
        want = (_file_serial(enc.cert), _file_serial(cl.cert))
        assert want[0] != old[0] and want[1] != old[1]
        deadline = time.monotonic() + 20
        while (new := (_served_serial(wport, ca, cl), _served_serial(port, ca, engine))) != want:  # reloads done
            assert time.monotonic() < deadline, (new, want)
            time.sleep(0.05)
        deadline, before = time.monotonic() + 20, load.ok
        while load.ok < before + 50 and time.monotonic() < deadline:  # and the load goes on past them
            time.sleep(0.05)
        load.done.set()
        load.join(40)
        assert load.failed == [] and load.ok >= before + 50, (load.ok, load.failed[:3])
        assert worker.proc.poll() is None and tier.proc.poll() is None
    finally:
        stop_all(started)



def _kubelet_secret(directory, issued, ca, generation: int) -> None:
    """The files as the kubelet projects a Secret: `tls.crt` -> `..data/tls.crt`, `..data` a symlink to a
    timestamped folder, swapped atomically when the Secret changes (its AtomicWriter)."""
    import os
    import shutil

    folder = directory / f"..2026_12_07_{generation}"
    folder.mkdir()
    for name, src in (("tls.crt", issued.cert), ("tls.key", issued.key), ("ca.crt", ca)):
        shutil.copyfile(src, folder / name)
    link = directory / "..data_tmp"
    link.symlink_to(folder.name)
    os.replace(link, directory / "..data")
    for name in ("tls.crt", "tls.key", "ca.crt"):
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")


def test_a_secret_renewed_in_place_is_read_again_without_a_signal(tmp_path):
    """On Kubernetes nobody sends SIGHUP: cert-manager renews the Secret and the kubelet swaps the mounted
    files. The worker notices the new content (MM_TLS_WATCH_S) and new handshakes present the new serial."""
    import os

    certs = Certs(tmp_path / "pki")
    mount = tmp_path / "secret"
    mount.mkdir()
    _kubelet_secret(mount, certs.issue("encoder", "encoder"), certs.ca_file, 1)
    engine = certs.issue("engine-0", "engine")
    files = [a for flag, name in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key"), ("--tls-ca", "ca.crt"))
             for a in (flag, str(mount / name))]
    with start_worker(*files, "--ops-port", "0", env={**os.environ, "MM_TLS_WATCH_S": "0.2"}, name="watching worker",
                      timeout=120) as worker:
        first = _served_serial(worker.http_port, certs.ca_file, engine)
        assert first == _file_serial(mount / "tls.crt")
        _kubelet_secret(mount, certs.issue("encoder", "encoder", replace=True), certs.ca_file, 2)
        renewed = _file_serial(mount / "tls.crt")
        assert renewed != first
        deadline = time.monotonic() + 30
        while _served_serial(worker.http_port, certs.ca_file, engine) != renewed:
            assert time.monotonic() < deadline, "the worker still serves the old certificate after 30 s"
            time.sleep(0.1)
