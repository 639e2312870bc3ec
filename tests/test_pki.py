"""The deployment's CA and components' certificates (`mm_encoder.security.pki`), checked by the
standard library's TLS in memory (real handshakes over `ssl.MemoryBIO` pairs, no servers) and by
the `openssl` CLI where it is installed: who a certificate names, what verifies and what does not,
and how the key files are written."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import ssl
import stat
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from harness.certs import Certs, identity_of
from mm_encoder.security import pki
from mm_encoder.security.pki import ROLES, Authority, Identity, PkiError, describe

ENCODER = Identity("encoder", "encoder")


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    return Certs(tmp_path / "pki")


def _server(ca: Path, issued: pki.Issued) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT  # RFC 5280's rules (Python 3.13's default context has them)
    ctx.load_cert_chain(issued.cert, issued.key)
    ctx.load_verify_locations(cafile=ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _client(ca: Path, issued: pki.Issued | None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, check_hostname
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    ctx.load_verify_locations(cafile=ca)
    if issued is not None:
        ctx.load_cert_chain(issued.cert, issued.key)
    return ctx


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext,
               host: str = "localhost") -> tuple[ssl.SSLObject, ssl.SSLObject]:
    """A whole handshake in memory, then one byte each way (TLS 1.3 checks the client's certificate
    after the client's side is done); the first side's error is raised."""
    s_in, s_out, c_in, c_out = (ssl.MemoryBIO() for _ in range(4))
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=host)
    pending = [client, server]
    for _ in range(10):
        for side in list(pending):
            try:
                side.do_handshake()
                pending.remove(side)
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if not pending:
            break
    assert not pending, "the handshake did not finish"
    client.write(b"?")
    s_in.write(c_out.read())
    assert server.read(1) == b"?"
    server.write(b"!")
    c_in.write(s_out.read())
    assert client.read(1) == b"!"
    return server, client


def _subject(peer: ssl.SSLObject) -> dict[str, str]:
    cert = peer.getpeercert()
    assert cert
    return {k: v for rdn in cert["subject"] for k, v in rdn}


# --- handshakes --------------------------------------------------------------------------------


def test_component_certificates_verify_both_ways_and_carry_their_role(certs: Certs):
    server, client = _handshake(_server(certs.ca_file, certs.issue("encoder", "encoder")),
                                _client(certs.ca_file, certs.issue("shared-0", "cache-shared")))
    assert _subject(client) == {"organizationName": "mm-encoder", "organizationalUnitName": "encoder",
                                "commonName": "encoder"}
    assert _subject(server)["organizationalUnitName"] == "cache-shared"
    assert identity_of(server.getpeercert(binary_form=True)) == Identity("shared-0", "cache-shared")


def test_ip_addresses_are_ip_sans_and_other_hosts_are_refused(certs: Certs):
    server = _server(certs.ca_file, certs.issue("encoder", "encoder", hosts=["encoder.svc", "10.1.2.3", "::1"]))
    for host in ("encoder.svc", "10.1.2.3", "::1"):
        _handshake(server, _client(certs.ca_file, certs.issue("frontend", "frontend", replace=True)), host)
    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
        _handshake(server, _client(certs.ca_file, None), "localhost")
    san = x509.load_pem_x509_certificate(certs.ca.cert_path.with_name("encoder.pem").read_bytes()).extensions \
        .get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["encoder.mm-encoder.mm-encoder.local", "encoder.svc"]
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://mm-encoder.local/mm-encoder/encoder/encoder"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.1.2.3", "::1"]


def test_another_cas_certificate_fails_the_handshake_either_way(certs: Certs):
    good_server, good_client = certs.issue("encoder", "encoder"), certs.issue("engine-1", "engine")
    with pytest.raises(ssl.SSLCertVerificationError) as e:
        _handshake(_server(certs.ca_file, certs.other_ca("encoder")), _client(certs.ca_file, good_client))
    assert e.value.verify_code == 20  # unable to get local issuer certificate
    with pytest.raises(ssl.SSLError, match="certificate verify failed"):
        _handshake(_server(certs.ca_file, good_server), _client(certs.ca_file, certs.other_ca("engine-1")))


@pytest.mark.parametrize(("bad", "code", "reason"), [("expired", 10, "certificate has expired"),
                                                     ("not_yet_valid", 9, "certificate is not yet valid")])
def test_an_expired_or_future_certificate_fails_with_its_reason(certs: Certs, bad: str, code: int, reason: str):
    issued = getattr(certs, bad)(ENCODER)
    with pytest.raises(ssl.SSLCertVerificationError) as e:
        _handshake(_server(certs.ca_file, issued), _client(certs.ca_file, certs.issue("frontend", "frontend")))
    assert (e.value.verify_code, e.value.verify_message) == (code, reason)
    with pytest.raises(ssl.SSLError, match="certificate verify failed"):  # presented by a client
        _handshake(_server(certs.ca_file, certs.issue("encoder", "encoder")),
                   _client(certs.ca_file, getattr(certs, bad)(Identity("frontend", "frontend"))))


def test_a_wrong_role_chains_to_the_ca_so_the_role_is_what_authorization_reads(certs: Certs):
    good = certs.issue("frontend", "frontend")
    wrong = certs.wrong_role("frontend", "client")
    server, _ = _handshake(_server(certs.ca_file, certs.issue("encoder", "encoder")), _client(certs.ca_file, wrong))
    assert _subject(server)["organizationalUnitName"] == "client"
    assert wrong.cert.parent != good.cert.parent and identity_of(good.cert.read_bytes()).role == "frontend"


# --- files ---------------------------------------------------------------------------------------


def test_keys_are_0600_and_the_directory_0700_from_creation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    opened: dict[str, tuple[int, int]] = {}
    real_open = os.open

    def spy(path, flags, mode=0o777, *args, **kwargs):
        opened[os.fspath(path)] = (flags, mode)
        return real_open(path, flags, mode, *args, **kwargs)

    def no_chmod(*args, **kwargs):
        raise AssertionError("a mode set after creation")

    monkeypatch.setattr(pki.os, "open", spy)
    for name in ("chmod", "fchmod", "lchmod"):
        monkeypatch.setattr(pki.os, name, no_chmod, raising=False)
    old = os.umask(0)  # the modes come from the creating calls alone
    try:
        ca = Authority.create(tmp_path / "pki")
        issued = ca.issue(ENCODER)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "pki").st_mode) == 0o700
    for key in (ca.key_path, issued.key):
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
        flags, mode = opened[str(key)]
        assert (flags & (os.O_CREAT | os.O_EXCL), mode) == (os.O_CREAT | os.O_EXCL, 0o600)
    for cert in (ca.cert_path, issued.cert):
        assert stat.S_IMODE(os.stat(cert).st_mode) == 0o644


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777, 0o722])
def test_a_directory_others_may_write_in_is_refused(tmp_path: Path, mode: int):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(PkiError, match="writable by its group or others"):
        Authority.create(shared)
    ca = Authority.create(tmp_path / "ca")
    with pytest.raises(PkiError, match="writable by its group or others"):
        ca.issue(ENCODER, shared)
    assert list(shared.iterdir()) == []


def test_existing_files_are_kept_unless_replaced_and_rotation_is_atomic(certs: Certs):
    first = certs.issue("encoder", "encoder")
    key, cert = first.key.read_bytes(), first.cert.read_bytes()
    with pytest.raises(PkiError, match="exists: pass replace=True"):
        certs.issue("encoder", "encoder")
    with pytest.raises(PkiError, match="exists"):
        Authority.create(certs.ca.cert_path.parent)
    assert (first.key.read_bytes(), first.cert.read_bytes()) == (key, cert)
    second = certs.issue("encoder", "encoder", replace=True)
    assert second.key.read_bytes() != key and second.cert.read_bytes() != cert
    assert stat.S_IMODE(os.stat(second.key).st_mode) == 0o600
    assert not [p.name for p in second.key.parent.iterdir() if p.name.endswith(".tmp")]
    _handshake(_server(certs.ca_file, second), _client(certs.ca_file, certs.issue("frontend", "frontend")))


def test_a_component_cannot_overwrite_the_cas_files(certs: Certs):
    with pytest.raises(PkiError, match="CA's files"):
        certs.ca.issue(Identity("ca", "client"), replace=True)


def test_the_files_hold_one_certificate_and_an_unencrypted_pkcs8_p256_key(certs: Certs):
    issued = certs.issue("encoder", "encoder")
    assert issued.cert.read_text().count("BEGIN CERTIFICATE") == 1
    pem = issued.key.read_bytes()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----\n")  # PKCS8, not "EC PRIVATE KEY", not "ENCRYPTED"
    key = serialization.load_pem_private_key(pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"


def test_the_extensions_of_the_ca_and_a_component(certs: Certs):
    ca = x509.load_pem_x509_certificate(certs.ca_file.read_bytes())
    leaf = x509.load_pem_x509_certificate(certs.issue("engine-1", "engine").cert.read_bytes())
    ext = ca.extensions.get_extension_for_class
    assert ext(x509.BasicConstraints).critical and ext(x509.BasicConstraints).value.ca
    assert ext(x509.BasicConstraints).value.path_length == 0
    usage = ext(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign and not usage.digital_signature
    ext = leaf.extensions.get_extension_for_class
    assert not ext(x509.BasicConstraints).value.ca and ext(x509.KeyUsage).value.digital_signature
    assert list(ext(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value.digest
    assert ext(x509.AuthorityKeyIdentifier).value.key_identifier == ca_ski
    assert ext(x509.SubjectKeyIdentifier).value.digest != ca_ski
    assert leaf.issuer == ca.subject


# --- identities and descriptions -------------------------------------------------------------------


def test_identities_are_validated():
    assert ROLES == ("frontend", "cache-cluster", "cache-router", "cache-shared", "encoder", "engine", "planner",
                     "client", "etcd", "nats")
    for name, role in [("encoder", "admin"), ("Encoder", "encoder"), ("shared_0", "cache-shared"),
                       ("-x", "engine"), ("x-", "engine"), ("", "engine"), ("a" * 64, "engine"), ("a.b", "engine")]:
        with pytest.raises(PkiError):
            Identity(name, role)
    assert Identity("a" * 63, "engine").name == "a" * 63


def test_identity_of_and_describe_read_back_what_was_issued(certs: Certs):
    issued = certs.issue("cluster", "cache-cluster")
    pem = issued.cert.read_bytes()
    assert identity_of(pem) == issued.identity == Identity("cluster", "cache-cluster")
    info = describe(issued.cert)
    assert (info["name"], info["role"], info["hosts"]) == \
        ("cluster", "cache-cluster", "cache-cluster.mm-encoder.mm-encoder.local,localhost,127.0.0.1")
    assert info["uri"] == "spiffe://mm-encoder.local/mm-encoder/cache-cluster/cluster"
    assert info["subject"] == "CN=cluster,OU=cache-cluster,O=mm-encoder"
    assert info["issuer"] == "CN=mm-encoder,O=mm-encoder"
    der = ssl.PEM_cert_to_DER_cert(pem.decode())
    assert identity_of(der) == issued.identity
    assert info["fingerprint_sha256"] == hashlib.sha256(der).digest().hex(":").upper()
    not_after = datetime.fromisoformat(info["not_after"])
    assert timedelta(hours=23) < not_after - datetime.now(timezone.utc) <= timedelta(hours=24)  # LEAF_LIFETIME
    for facts in (info, describe(certs.ca_file)):
        assert "PRIVATE" not in json.dumps(facts)
    with pytest.raises(PkiError, match="names no component"):
        identity_of(certs.ca_file.read_bytes())


def test_validity_overrides_are_checked(certs: Certs):
    now = datetime.now(timezone.utc)
    with pytest.raises(PkiError, match="is not after"):
        certs.ca.issue(ENCODER, not_before=now, not_after=now - timedelta(seconds=1))
    with pytest.raises(PkiError, match="no time zone"):
        certs.ca.issue(ENCODER, not_after=datetime.now() + timedelta(days=1))  # naive: refused
    with pytest.raises(PkiError, match="neither an IP address nor a DNS name"):
        certs.ca.issue(ENCODER, hosts=["bad host"])


# --- the operator's own CA ---------------------------------------------------------------------------


def test_an_existing_ca_is_loaded_and_checked(certs: Certs, tmp_path: Path):
    ca_dir = certs.ca.cert_path.parent
    loaded = Authority.load(ca_dir)
    issued = loaded.issue(ENCODER, tmp_path / "issued")
    _handshake(_server(certs.ca_file, issued), _client(certs.ca_file, loaded.issue(Identity("frontend", "frontend"))))
    mixed = tmp_path / "mixed"
    mixed.mkdir(mode=0o700)
    shutil.copy(certs.ca_file, mixed / "ca.pem")
    shutil.copy(issued.key, mixed / "ca.key")
    with pytest.raises(PkiError, match="is not the key of"):
        Authority.load(mixed)
    leaf_as_ca = tmp_path / "leaf"
    leaf_as_ca.mkdir(mode=0o700)
    shutil.copy(issued.cert, leaf_as_ca / "ca.pem")
    shutil.copy(issued.key, leaf_as_ca / "ca.key")
    with pytest.raises(PkiError, match="not a CA certificate"):
        Authority.load(leaf_as_ca)


def test_errors_name_files_never_their_contents(tmp_path: Path, certs: Certs):
    broken = tmp_path / "broken"
    broken.mkdir(mode=0o700)
    shutil.copy(certs.ca_file, broken / "ca.pem")
    (broken / "ca.key").write_text("-----BEGIN PRIVATE KEY-----\nU0VDUkVUU0VDUkVU\n-----END PRIVATE KEY-----\n")
    with pytest.raises(PkiError) as e:
        Authority.load(broken)
    assert "U0VDUkVU" not in str(e.value) and e.value.__cause__ is None and e.value.__suppress_context__


def test_the_module_has_no_logging_or_printing():
    tree = ast.parse(Path(pki.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)
                for a in ([ast.alias(n.module or "")] if isinstance(n, ast.ImportFrom) else n.names)}
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not imported & {"logging", "warnings", "sys"} and not called & {"print", "repr"}


# --- the openssl CLI -------------------------------------------------------------------------------------

OPENSSL = shutil.which("openssl")


@pytest.mark.skipif(OPENSSL is None, reason="the openssl CLI is not installed")
def test_openssl_verifies_and_reads_the_role(certs: Certs):
    issued = certs.issue("encoder", "encoder")

    def openssl(*args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(OPENSSL), *map(str, args)], capture_output=True, text=True, timeout=30)

    done = openssl("verify", "-x509_strict", "-purpose", "sslserver", "-CAfile", certs.ca_file, issued.cert)
    assert done.returncode == 0 and done.stdout.strip() == f"{issued.cert}: OK", done.stderr
    done = openssl("verify", "-purpose", "sslclient", "-CAfile", certs.ca_file, issued.cert)
    assert done.returncode == 0, done.stderr
    subject = openssl("x509", "-noout", "-subject", "-in", issued.cert).stdout
    assert "OU = encoder" in subject and "CN = encoder" in subject and "O = mm-encoder" in subject
    assert openssl("pkey", "-noout", "-in", issued.key).returncode == 0
    done = openssl("verify", "-CAfile", certs.ca_file, certs.expired(ENCODER).cert)
    assert done.returncode != 0 and "certificate has expired" in done.stdout + done.stderr
    done = openssl("verify", "-CAfile", certs.ca_file, certs.other_ca(ENCODER).cert)
    assert done.returncode != 0


def test_every_graph_kind_is_a_role():
    """`serve --tls` and render-k8s name each component's role after its kind."""
    from typing import get_args

    from mm_encoder.core.topology import Kind

    assert set(get_args(Kind)) <= set(ROLES)


def test_a_missing_tls_file_is_named_by_its_option(tmp_path):
    """A component whose certificate, key or CA file is missing (a Secret without ca.crt) says which
    option names which missing path, on both ends of a handshake and for the launcher's client."""
    from mm_encoder.security.tls import TlsOptions, tls_client

    certs = Certs(tmp_path)
    issued = certs.issue("encoder", "encoder")
    opts = TlsOptions(tls_cert=issued.cert, tls_key=issued.key, tls_ca=tmp_path / "gone" / "ca.crt")
    for make in (opts.server_context, opts.client_context):
        with pytest.raises(PkiError) as e:
            make()
        assert e.value.message == f"no such file: --tls-ca {tmp_path / 'gone' / 'ca.crt'}"
    with pytest.raises(PkiError, match=f"no such file: the CA certificate {tmp_path / 'nope.pem'}"):
        tls_client(tmp_path / "nope.pem")
    assert opts.model_copy(update={"tls_ca": certs.ca_file}).server_context() is not None


def test_make_ca_writes_a_ca_once_and_never_overwrites_it(tmp_path):
    from mm_encoder.security import make_ca

    target = tmp_path / "ca"
    assert make_ca.main([str(target), "--days", "30"]) == 0
    ca = Authority.load(target)
    assert (ca.not_after - pki.utc_now()).days in (29, 30)
    assert oct((target / "ca.key").stat().st_mode & 0o777) == "0o600" and oct(target.stat().st_mode & 0o777) == "0o700"
    before = (target / "ca.key").read_bytes()
    assert make_ca.main([str(target)]) == 2
    assert (target / "ca.key").read_bytes() == before
