"""Certificates for tests: a deployment's CA and its components' certificates in a temporary
directory, and the bad ones red-team tests present (another CA's, expired, not yet valid, the wrong
role). Each is an `Issued` (`cert`, `key`, `identity`) from `mm_encoder.security.pki`; the bad ones
live in their own folders, so a component's good files are never replaced by them. `identity_of`
reads back whom a certificate (a file's bytes, or a peer's in a handshake) names.

    certs = Certs(tmp_path)
    server = certs.issue("encoder", "encoder")
    ctx.load_verify_locations(certs.ca_file)
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mm_encoder.security.pki import DEFAULT_HOSTS, Authority, Identity, Issued, PkiError


def identity_of(cert: bytes) -> Identity:
    """Whom a certificate names (its one CN and one OU), from PEM or DER bytes (what a handshake's
    `getpeercert(binary_form=True)` gives): read with cryptography, not with the package's readers."""
    c = x509.load_pem_x509_certificate(cert) if cert.lstrip().startswith(b"-----BEGIN") else \
        x509.load_der_x509_certificate(cert)
    cn, ou = (c.subject.get_attributes_for_oid(oid) for oid in (NameOID.COMMON_NAME, NameOID.ORGANIZATIONAL_UNIT_NAME))
    if len(cn) != 1 or len(ou) != 1:
        raise PkiError(f"certificate {c.subject.rfc4514_string()!r} names no component (it needs one CN and one OU)")
    return Identity(str(cn[0].value), str(ou[0].value))


class Certs:
    """The deployment's CA in `root/ca` (made on first use) and certificates from it or for it."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._ca: Authority | None = None
        self._others: dict[str, Authority] = {}
        self._issued: dict[str, Identity] = {}  # name -> the identity its good certificate names

    @property
    def ca(self) -> Authority:
        if self._ca is None:
            self._ca = Authority.create(self.root / "ca")
        return self._ca

    @property
    def ca_file(self) -> Path:
        """The CA certificate every component trusts (`--tls-ca`)."""
        return self.ca.cert_path

    def issue(self, name: str, role: str, *, hosts: Sequence[str] = DEFAULT_HOSTS, replace: bool = False) -> Issued:
        """A component's good certificate (`root/ca/<name>.pem`, `.key`)."""
        issued = self.ca.issue(Identity(name, role), hosts=hosts, replace=replace)
        self._issued[name] = issued.identity
        return issued

    def _identity(self, who: Identity | str) -> Identity:
        if isinstance(who, Identity):
            return who
        if who not in self._issued:
            raise KeyError(f"no certificate was issued for {who!r}: give an Identity, or issue() it first")
        return self._issued[who]

    def other_ca(self, who: Identity | str, ca: str = "other") -> Issued:
        """The same identity (or that of the name `issue` gave a certificate) from a CA the deployment
        does not trust (`root/ca-<ca>`)."""
        if ca not in self._others:
            self._others[ca] = Authority.create(self.root / f"ca-{ca}", name=f"mm-encoder-{ca}")
        return self._others[ca].issue(self._identity(who), replace=True)

    def expired(self, who: Identity | str) -> Issued:
        """From the deployment's CA, valid until a day ago (`root/expired`)."""
        now = datetime.now(timezone.utc)
        return self.ca.issue(self._identity(who), self.root / "expired", not_before=now - timedelta(days=10),
                             not_after=now - timedelta(days=1), replace=True)

    def not_yet_valid(self, who: Identity | str) -> Issued:
        """From the deployment's CA, valid from tomorrow (`root/not-yet-valid`)."""
        now = datetime.now(timezone.utc)
        return self.ca.issue(self._identity(who), self.root / "not-yet-valid", not_before=now + timedelta(days=1),
                             not_after=now + timedelta(days=10), replace=True)

    def forged(self, name: str, role: str, uris: Sequence[str] = ()) -> Issued:
        """From the deployment's CA, OU `role` but exactly the URI SANs `uris` (none, another graph's, two):
        what a certificate request that names its own subject gets. Built here with cryptography, not by
        the package's issuer, which never makes one (`root/forged`)."""
        ca_key = serialization.load_pem_private_key(self.ca.key_path.read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate(self.ca.cert_path.read_bytes())
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(timezone.utc)
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
        names += [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "mm-encoder"),
                                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                                         x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(hours=1))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
        folder = self.root / "forged"
        folder.mkdir(mode=0o700, exist_ok=True)
        cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        key_path.chmod(0o600)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return Issued(cert_path, key_path, Identity(name, role))

    def forgeries(self, role: str) -> dict[str, Issued]:
        """The forged certificates of `role` every hop must refuse, by what is wrong with each."""
        own = f"spiffe://mm-encoder.local/mm-encoder/{role}/x"
        return {"no URI": self.forged("no-uri", role),
                "another graph's URI": self.forged("other-graph", role, [f"spiffe://mm-encoder.local/other/{role}/x"]),
                "another trust domain's URI": self.forged("other-domain", role, [f"spiffe://example.org/mm-encoder/{role}/x"]),
                "two URIs": self.forged("two-uris", role, [own, f"spiffe://mm-encoder.local/mm-encoder/{role}/y"]),
                "a URI that is not an ID": self.forged("not-an-id", role, [own + "/extra"])}

    def wrong_role(self, name: str, role: str) -> Issued:
        """From the deployment's CA, for `name` but with `role` in its OU (`root/wrong-role`)."""
        return self.ca.issue(Identity(name, role), self.root / "wrong-role", replace=True)
