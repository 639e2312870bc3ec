"""The deployment's certificate authority and each component's certificate (TLS on every HTTP hop).

One CA per deployment signs one certificate per component. What authorization reads is its one
URI subjectAltName, `spiffe://<trust domain>/<graph>/<role>/<name>` (`security.identity`); the
subject says the same for people and logs: CN its name (`frontend`, `shared-0`, `engine-1`), OU its
role (one of `ROLES`), O `mm-encoder`. Keys are EC P-256. A component's certificate serves both ends
of a handshake (serverAuth and clientAuth): every component calls the next hop, and most are called.

Lifetimes, as workload PKIs keep them: the CA for years (`CA_LIFETIME`), each certificate for hours
(`LEAF_LIFETIME`), never past the CA's own end, and renewed at about two thirds of its life
(`renew_at`) without a restart: a short life is what revokes a certificate (docs/security.md).

Files, in one directory (made 0700; refused if group- or other-writable): `ca.pem`, `ca.key`,
`<name>.pem` (the certificate alone) and `<name>.key` (PKCS8 PEM, unencrypted). A key file is
created 0600 (never written first and narrowed after) and never overwritten unless `replace=True`:
rotation writes the new files beside the old ones (0600 too) and renames them over them. Nothing
here logs or prints key material, and errors name files, never their contents.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..core.errors import PkiError
from .identity import TRUST_DOMAIN, SpiffeId

ROLES: tuple[str, ...] = ("frontend", "cache-cluster", "cache-router", "cache-shared", "encoder", "engine",
                          "planner", "client", "etcd", "nats")  # the last two: Dynamo's servers, on one machine
ORGANIZATION = "mm-encoder"  # every certificate's O
CA_CERT, CA_KEY = "ca.pem", "ca.key"
DEFAULT_HOSTS: tuple[str, ...] = ("localhost", "127.0.0.1")
SKEW = timedelta(minutes=5)  # a new certificate is valid from a little before now: clocks differ
CA_LIFETIME = timedelta(days=10 * 365)  # a throwaway CA outlives any deployment that keeps its run directory
LEAF_LIFETIME = timedelta(hours=24)  # each component's certificate: renewed at two thirds, about every 16 h
RENEW_AT = 2 / 3  # of a certificate's life: renewal leaves a third for retries before it ends
CA_WARNING = timedelta(days=30)  # a CA this close to its end is warned about at start-up

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # DNS-1123 label (Kubernetes' names)
_HOST_LABEL = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?")
_IssuerKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey
_PEM = serialization.Encoding.PEM


@dataclass(frozen=True)
class Identity:
    """Who a certificate says a component is: CN `name` (a DNS-1123 label), OU `role` (one of ROLES),
    and the URI `spiffe://<trust_domain>/<graph>/<role>/<name>` that authorization reads."""

    name: str
    role: str
    graph: str = "mm-encoder"
    trust_domain: str = TRUST_DOMAIN

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise PkiError(f"role {self.role!r} is not one of: {', '.join(ROLES)}")
        if not _LABEL.fullmatch(self.name):
            raise PkiError(f"name {self.name!r} is not a DNS-1123 label (at most 63 of a-z, 0-9 and '-', "
                           "starting and ending with a letter or digit)")
        self.spiffe  # noqa: B018 - the graph and trust domain checked here too

    @property
    def spiffe(self) -> SpiffeId:
        return SpiffeId(self.trust_domain, self.graph, self.role, self.name)


@dataclass(frozen=True)
class Issued:
    """A component's certificate and key files, and whom the certificate names."""

    cert: Path
    key: Path
    identity: Identity


class Authority:
    """A deployment's CA: its certificate and key files, and the key (in memory only) it signs with."""

    cert_path: Path
    key_path: Path

    def __init__(self, cert_path: Path, key_path: Path) -> None:
        self.cert_path, self.key_path = Path(cert_path), Path(key_path)
        self._cert = _load_cert(_read(self.cert_path), self.cert_path)
        self._key = _load_key(self.key_path)
        if _spki(self._key.public_key()) != _spki(self._cert.public_key()):
            raise PkiError(f"{self.key_path} is not the key of {self.cert_path}")
        try:
            ca = self._cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            ca = False
        if not ca:
            raise PkiError(f"{self.cert_path} is not a CA certificate (basicConstraints CA:TRUE)")

    def __repr__(self) -> str:
        return f"Authority({str(self.cert_path)!r})"

    @classmethod
    def create(cls, directory: Path, *, name: str = ORGANIZATION, lifetime: timedelta = CA_LIFETIME) -> Authority:
        """A new CA in `directory` (`ca.pem`, `ca.key`), valid for `lifetime`; refused if either file is there."""
        directory = private_dir(directory)
        cert_path, key_path = directory / CA_CERT, directory / CA_KEY
        _refuse_existing(cert_path, key_path)
        if not name or len(name) > 64:
            raise PkiError(f"CA name {name!r}: 1 to 64 characters")
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                             x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = utc_now()
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (x509.CertificateBuilder()
                .subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - SKEW).not_valid_after(now + _lifetime(lifetime))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
                .add_extension(ski, critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
                .sign(key, hashes.SHA256()))
        _write([(key_path, _key_pem(key), 0o600), (cert_path, cert.public_bytes(_PEM), 0o644)], replace=False)
        return cls(cert_path, key_path)

    @classmethod
    def load(cls, directory: Path) -> Authority:
        """An existing CA (the operator's own): `ca.pem` and its unencrypted `ca.key` in `directory`."""
        directory = Path(directory)
        return cls(directory / CA_CERT, directory / CA_KEY)

    @property
    def not_after(self) -> datetime:
        return self._cert.not_valid_after_utc

    def check(self, now: datetime | None = None) -> str | None:
        """The CA refused by name if expired or not yet valid; a warning (text) within CA_WARNING of its end."""
        now = now or utc_now()
        start, end = self._cert.not_valid_before_utc, self._cert.not_valid_after_utc
        if now < start:
            raise PkiError(f"the CA {self.cert_path} is not valid before {start.isoformat()} (now {now.isoformat()}): "
                           "check this machine's clock or the CA")
        if now >= end:
            raise PkiError(f"the CA {self.cert_path} expired at {end.isoformat()}: every certificate it signed is "
                           "refused; give a new CA (tls.ca_dir) or remove the run directory's tls/ for a new one")
        if end - now <= CA_WARNING:
            return (f"the CA {self.cert_path} ends at {end.isoformat()}, in {(end - now).days} days: replace it "
                    "before then (no certificate it signs outlives it)")
        return None

    def issue(self, identity: Identity, directory: Path | None = None, *, hosts: Sequence[str] = DEFAULT_HOSTS,
              lifetime: timedelta = LEAF_LIFETIME, not_before: datetime | None = None,
              not_after: datetime | None = None, replace: bool = False) -> Issued:
        """`identity`'s certificate and a new key, as `<name>.pem` and `<name>.key` in `directory` (the
        CA's own by default). Its subjectAltNames: the identity's URI and DNS name (`security.identity`),
        then `hosts` (IP addresses as such, the rest DNS names: the site's names Dynamo's planes check).
        Valid from `not_before` (a few minutes ago) to `not_after` (`lifetime` after now), never past the
        CA's own end. Existing files are refused unless `replace` (rotation)."""
        directory = private_dir(directory if directory is not None else self.cert_path.parent)
        cert_path, key_path = directory / f"{identity.name}.pem", directory / f"{identity.name}.key"
        if {cert_path.resolve(), key_path.resolve()} & {self.cert_path.resolve(), self.key_path.resolve()}:
            raise PkiError(f"a certificate named {identity.name!r} would overwrite the CA's files in {directory}")
        if not replace:
            _refuse_existing(cert_path, key_path)
        now = utc_now()
        start = _utc(not_before, "not_before") if not_before is not None else now - SKEW
        end = _utc(not_after, "not_after") if not_after is not None else (
            start if not_before is not None else now) + _lifetime(lifetime)
        end = min(end, self.not_after)  # a certificate never outlives the CA that vouches for it
        if end <= start:
            raise PkiError(f"not_after ({end.isoformat()}) is not after not_before ({start.isoformat()})")
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                             x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, identity.role),
                             x509.NameAttribute(NameOID.COMMON_NAME, identity.name)])
        builder = (x509.CertificateBuilder()
                   .subject_name(subject).issuer_name(self._cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(_key_usage(digital_signature=True), critical=True)  # EC: no key encipherment
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                   .add_extension(self._authority_key_identifier(), critical=False))
        spiffe = identity.spiffe
        names = [x509.UniformResourceIdentifier(spiffe.uri), *_alt_names([spiffe.host, *hosts])]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        hash_ = None if isinstance(self._key, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey) else hashes.SHA256()
        cert = builder.sign(self._key, hash_)
        _write([(key_path, _key_pem(key), 0o600), (cert_path, cert.public_bytes(_PEM), 0o644)], replace=replace)
        return Issued(cert_path, key_path, identity)

    def _authority_key_identifier(self) -> x509.AuthorityKeyIdentifier:
        try:
            ski = self._cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        except x509.ExtensionNotFound:  # an operator's CA without one
            return x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key())
        return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def describe(cert: Path) -> dict[str, str]:
    """A certificate file's facts for logs and status: subject, identity, validity, hosts, SHA-256 fingerprint."""
    c = _load_cert(_read(Path(cert)), Path(cert))
    try:
        san = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        hosts = [*san.get_values_for_type(x509.DNSName), *map(str, san.get_values_for_type(x509.IPAddress))]
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        hosts, uris = [], []
    return {"path": str(cert), "subject": c.subject.rfc4514_string(), "issuer": c.issuer.rfc4514_string(),
            "name": _attribute(c, NameOID.COMMON_NAME) or "",
            "role": _attribute(c, NameOID.ORGANIZATIONAL_UNIT_NAME) or "", "uri": ",".join(uris),
            "serial": f"{c.serial_number:x}", "not_before": c.not_valid_before_utc.isoformat(),
            "not_after": c.not_valid_after_utc.isoformat(), "hosts": ",".join(hosts),
            "fingerprint_sha256": c.fingerprint(hashes.SHA256()).hex(":").upper()}


def seconds_left(cert: str | Path) -> float | None:
    """Seconds until the certificate in `cert` ends (negative: ended); None if it cannot be read. Read
    each time: a renewal replaces the file."""
    try:
        c = _load_cert(_read(Path(cert)), Path(cert))
    except PkiError:
        return None
    return (c.not_valid_after_utc - datetime.now(timezone.utc)).total_seconds()


# --- certificates and keys -------------------------------------------------------------------


def utc_now() -> datetime:
    """Now, in UTC, to the second (what certificates say)."""
    return datetime.now(timezone.utc).replace(microsecond=0)


def _utc(when: datetime, what: str) -> datetime:
    if when.tzinfo is None:
        raise PkiError(f"{what} {when.isoformat()} has no time zone: give an aware datetime (e.g. UTC)")
    return when.astimezone(timezone.utc)


def _lifetime(lifetime: timedelta) -> timedelta:
    if lifetime < timedelta(seconds=1):
        raise PkiError(f"lifetime {lifetime}: a certificate is valid for at least a second")
    return lifetime


def _key_usage(*, digital_signature: bool = False, key_cert_sign: bool = False,
               crl_sign: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=digital_signature, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, key_cert_sign=key_cert_sign,
                         crl_sign=crl_sign, encipher_only=False, decipher_only=False)


def _alt_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for host in [hosts] if isinstance(hosts, str) else hosts:
        try:
            name: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            labels = host.rstrip(".").split(".")
            if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
                raise PkiError(f"host {host!r} is neither an IP address nor a DNS name") from None
            name = x509.DNSName(host.rstrip(".").lower())
        if name not in out:
            out.append(name)
    return out


def _attribute(cert: x509.Certificate, oid: x509.ObjectIdentifier) -> str | None:
    """The subject's one value of `oid`, None without one; more than one is refused (ambiguous)."""
    values = cert.subject.get_attributes_for_oid(oid)
    if len(values) > 1:
        label = {NameOID.COMMON_NAME: "CN", NameOID.ORGANIZATIONAL_UNIT_NAME: "OU"}.get(oid, oid.dotted_string)
        raise PkiError(f"certificate {cert.subject.rfc4514_string()!r} has {len(values)} {label} values")
    if not values:
        return None
    value = values[0].value
    return value.decode() if isinstance(value, bytes) else value


def _load_cert(data: bytes, path: Path | None) -> x509.Certificate:
    where = str(path) if path is not None else "the bytes given"
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_certificate(data)
        return x509.load_der_x509_certificate(data)
    except ValueError:
        raise PkiError(f"{where}: not a PEM or DER certificate") from None


def _load_key(path: Path) -> _IssuerKey:
    try:
        key = serialization.load_pem_private_key(_read(path), password=None)
    except TypeError:
        raise PkiError(f"{path}: the key is encrypted; give it unencrypted (PKCS8 PEM, mode 0600)") from None
    except (ValueError, UnsupportedAlgorithm):  # never the library's message: it could quote the file
        raise PkiError(f"{path}: not a PEM private key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey
                      | ed448.Ed448PrivateKey):
        raise PkiError(f"{path}: a {type(key).__name__} cannot sign certificates here (EC, RSA, Ed25519, Ed448)")
    return key


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(_PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _spki(public: CertificatePublicKeyTypes) -> bytes:
    return public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


# --- files -----------------------------------------------------------------------------------


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise PkiError(f"{path}: {e.strerror or e}") from None


def private_dir(directory: Path) -> Path:
    """`directory`, made 0700 if absent; refused if it is not a directory or others may write in it."""
    directory = Path(directory)
    if not directory.exists():
        directory.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # made meanwhile: checked below like any other
            os.mkdir(directory, 0o700)
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise PkiError(f"{directory} is not a directory")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PkiError(f"{directory} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o}): "
                       "they could swap certificates or read keys written there; `chmod 700` it or use another")
    return directory


def _refuse_existing(*paths: Path) -> None:
    for path in paths:
        if path.exists() or path.is_symlink():
            raise PkiError(f"{path} exists: pass replace=True to rotate it")


def _create(path: Path, data: bytes, mode: int) -> None:
    """A new file holding `data`, created with `mode` (never an existing file, nor through a symlink)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), mode)
    except FileExistsError:
        raise PkiError(f"{path} exists: pass replace=True to rotate it") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _write(files: list[tuple[Path, bytes, int]], *, replace: bool) -> None:
    """`files` written, all or none; with `replace`, each written beside its target and renamed over it
    (one after the other: a reader between the renames may see the new key with the old certificate)."""
    done: list[Path] = []
    try:
        for path, data, mode in files:
            target = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp") if replace else path
            _create(target, data, mode)
            done.append(target)
        if replace:
            for (path, _, _), temp in zip(files, done, strict=True):
                os.replace(temp, path)
            _fsync_dir(files[0][0].parent)
    except BaseException:
        for path in done:
            path.unlink(missing_ok=True)
        raise
    if not replace:
        _fsync_dir(files[0][0].parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
