"""Certificates that live and renew, and the run directory's hygiene (issue 43), without a graph: an
operator CA that has expired or is not valid yet is refused by name, one near its end is warned
about, no certificate outlives its CA, a leaf's renewal falls due at two thirds of its life, and a
run directory another user owns or others may write in is refused. The CAs are built here with
cryptography directly, not by the package's own `Authority`."""

from __future__ import annotations

import os
import stat
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from mm_encoder.core.errors import GraphError
from mm_encoder.security.issuing import Issuer
from mm_encoder.serve.site import private_run_dir


def _operator_ca(directory: Path, start: datetime, end: datetime) -> Path:
    """An operator's CA valid from `start` to `end` (ca.pem, ca.key)."""
    directory.mkdir(mode=0o700, parents=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "operator CA")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    (directory / "ca.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    (directory / "ca.key").chmod(0o600)
    (directory / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return directory


def _not_after(path: str) -> datetime:
    return x509.load_pem_x509_certificate(Path(path).read_bytes()).not_valid_after_utc


NOW = datetime.now(timezone.utc)


def test_an_expired_or_not_yet_valid_operator_ca_is_refused_by_name(tmp_path):
    expired = _operator_ca(tmp_path / "expired", NOW - timedelta(days=400), NOW - timedelta(days=1))
    with pytest.raises(GraphError, match=r"CA .*ca\.pem expired at"):
        Issuer(tmp_path / "run1", expired).issue([("encoder-0", "encoder")])
    later = _operator_ca(tmp_path / "later", NOW + timedelta(days=1), NOW + timedelta(days=400))
    with pytest.raises(GraphError, match=r"CA .*ca\.pem is not valid before"):
        Issuer(tmp_path / "run2", later).issue([("encoder-0", "encoder")])
    assert not (tmp_path / "run1" / "encoder-0.pem").exists() and not (tmp_path / "run2" / "encoder-0.pem").exists()


def test_a_ca_near_its_end_is_warned_about_and_nothing_outlives_it(tmp_path):
    end = (NOW + timedelta(days=10, hours=1)).replace(microsecond=0)
    ca = _operator_ca(tmp_path / "ending", NOW - timedelta(days=300), end)
    issuer = Issuer(tmp_path / "run", ca, lifetime=timedelta(days=30))
    issuer.issue([("encoder-0", "encoder")])
    assert issuer.warning is not None and "in 10 days" in issuer.warning and "replace it" in issuer.warning
    assert _not_after(issuer.files("encoder-0")[0]) == end  # clamped to the CA's end, not 30 days
    fine = _operator_ca(tmp_path / "fine", NOW - timedelta(days=1), NOW + timedelta(days=90))
    healthy = Issuer(tmp_path / "run-2", fine)
    healthy.issue([("encoder-0", "encoder")])
    assert healthy.warning is None


def test_leaves_live_their_lifetime_and_fall_due_at_two_thirds(tmp_path):
    issuer = Issuer(tmp_path / "run", graph="g", lifetime=timedelta(seconds=30))
    t0 = time.monotonic()
    issuer.issue([("engine-0", "engine")])
    left = (_not_after(issuer.files("engine-0")[0]) - datetime.now(timezone.utc)).total_seconds()
    assert 28 <= left <= 30
    assert issuer.due is not None and 19 <= issuer.due - t0 <= 21  # two thirds of 30 s
    ca = x509.load_pem_x509_certificate(issuer.ca_file.read_bytes())
    assert ca.not_valid_after_utc - datetime.now(timezone.utc) > timedelta(days=9 * 365)  # the CA: years
    assert issuer.ca_file.parent == tmp_path / "run" / "ca" and (tmp_path / "run" / "ca" / "ca.key").is_file()
    assert not (tmp_path / "run" / "ca.key").exists()  # the CA's key apart from the components' files
    assert stat.S_IMODE((tmp_path / "run" / "ca").stat().st_mode) == 0o700


def test_a_run_directory_is_private_to_its_user(tmp_path):
    made = private_run_dir(tmp_path / "new")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700 and made.stat().st_uid == os.geteuid()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(GraphError, match="writable by its group or others"):
        private_run_dir(shared)
    link = tmp_path / "link"
    link.symlink_to(made)
    with pytest.raises(GraphError, match="not a directory"):
        private_run_dir(link)
    if os.geteuid() == 0:  # only root can give a directory to another user
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(GraphError, match="belongs to user 65534"):
            private_run_dir(theirs)
