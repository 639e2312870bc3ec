"""Who a certificate's holder is: a SPIFFE-style ID, `spiffe://<trust domain>/<graph>/<role>/<name>`,
carried as the certificate's one URI subjectAltName (docs/security.md "Identities").

A caller is admitted by its URI (same trust domain, same graph, a role the hop admits), never by the
subject's OU, which any certificate request can set. A client checks the server it reached the same
way: the engine talks only to a tier or an encoder of its own graph. Each certificate also carries
one DNS name made from the same three parts, `<role>.<graph>.<trust domain>`, for the one client
that checks names and not URIs: nginx (a tier checking its next level with `proxy_ssl_name`).

Both ends read their own graph and trust domain from their own certificate, so no option can make a
component disagree with the certificate it presents. Python's clients check the server inside the
handshake (`check_servers`: a hook of `ssl.SSLContext`), so nothing is sent to a server that fails."""

from __future__ import annotations

import re
import ssl
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509

from ..core.errors import ForbiddenPeer, PkiError

TRUST_DOMAIN = "mm-encoder.local"  # the default; a graph's `tls.trust_domain` names its own
SCHEME = "spiffe://"
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


@dataclass(frozen=True)
class SpiffeId:
    """One holder: `name` (its replica or component) with `role` in `graph` of `trust_domain`."""

    trust_domain: str
    graph: str
    role: str
    name: str

    def __post_init__(self) -> None:
        if not _DOMAIN.fullmatch(self.trust_domain) or ".." in self.trust_domain:
            raise PkiError(f"trust domain {self.trust_domain!r} is not a lower-case DNS name")
        for what in ("graph", "role", "name"):
            if not _LABEL.fullmatch(getattr(self, what)):
                raise PkiError(f"{what} {getattr(self, what)!r} is not a DNS-1123 label")

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.trust_domain}/{self.graph}/{self.role}/{self.name}"

    @property
    def host(self) -> str:
        """The DNS name this holder's certificate carries for nginx's server check."""
        return server_host(self.trust_domain, self.graph, self.role)

    def peer(self, other: SpiffeId) -> bool:
        """Whether `other` belongs to this holder's deployment (trust domain and graph)."""
        return (other.trust_domain, other.graph) == (self.trust_domain, self.graph)

    @classmethod
    def parse(cls, uri: str) -> SpiffeId:
        if not uri.startswith(SCHEME):
            raise PkiError(f"{uri!r} is not a spiffe:// ID")
        parts = uri[len(SCHEME):].split("/")
        if len(parts) != 4:
            raise PkiError(f"{uri!r} is not spiffe://<trust domain>/<graph>/<role>/<name>")
        return cls(*parts)


def server_host(trust_domain: str, graph: str, role: str) -> str:
    """The DNS name a certificate of `role` in `graph` carries: what a tier checks its upstream for."""
    return f"{role}.{graph}.{trust_domain}"


def of_certificate(cert: x509.Certificate) -> SpiffeId | None:
    """The certificate's one spiffe:// URI SAN as an ID; None without one; more than one refused."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    return _one([u for u in san.get_values_for_type(x509.UniformResourceIdentifier)])


def of_file(path: str | Path) -> SpiffeId:
    """The ID of the certificate in `path` (a component's own): refused without one."""
    try:
        cert = x509.load_pem_x509_certificate(Path(path).read_bytes())
    except (OSError, ValueError) as e:
        raise PkiError(f"{path}: not a readable PEM certificate ({type(e).__name__})") from None
    found = of_certificate(cert)
    if found is None:
        raise PkiError(f"{path} names no spiffe:// ID (a URI subjectAltName): issue it again "
                       "(mm-encoder serve does; docs/security.md for an operator's own certificates)")
    return found


def of_peer(ssl_object: Any) -> SpiffeId | None:
    """The ID in the certificate the peer presented in a verified handshake; None without one."""
    cert = ssl_object.getpeercert() if ssl_object is not None else None
    uris = [value for kind, value in (cert or {}).get("subjectAltName", ()) if kind == "URI"]
    return _one(uris)


def _one(uris: Iterable[str]) -> SpiffeId | None:
    found = [u for u in uris if u.startswith(SCHEME)]
    if len(found) != 1:
        return None  # none, or two: ambiguous, admitted nowhere
    try:
        return SpiffeId.parse(found[0])
    except PkiError:
        return None


def admit(ssl_object: Any, own: SpiffeId, roles: Collection[str]) -> SpiffeId:
    """The caller's ID if it may call this hop (this deployment, an admitted role); ForbiddenPeer (403)."""
    peer = of_peer(ssl_object)
    if peer is None or not own.peer(peer) or peer.role not in roles:
        who = peer.uri if peer is not None else "a certificate without one spiffe:// ID"
        raise ForbiddenPeer(f"{who} may not call this hop (it admits {SCHEME}{own.trust_domain}/{own.graph}/"
                            f"{{{','.join(sorted(roles))}}}/*)")
    return peer


def check_servers(ctx: ssl.SSLContext, own: SpiffeId, roles: Collection[str]) -> ssl.SSLContext:
    """`ctx` made to refuse, inside the handshake, a server that is not of `own`'s deployment or whose
    role is not in `roles` (any role: empty). The chain is checked as before; the host name is not:
    the ID is the server's name (a local site's certificates all carry loopback)."""
    expected = frozenset(roles)

    def verify(obj: ssl.SSLObject | ssl.SSLSocket) -> None:
        peer = of_peer(obj)
        if peer is None or not own.peer(peer) or (expected and peer.role not in expected):
            who = peer.uri if peer is not None else "a certificate without one spiffe:// ID"
            want = ",".join(sorted(expected)) or "*"
            raise ssl.SSLCertVerificationError(
                f"the server presented {who}; expected {SCHEME}{own.trust_domain}/{own.graph}/{{{want}}}/*")

    class _Object(ssl.SSLObject):
        def do_handshake(self) -> None:
            super().do_handshake()
            verify(self)

    class _Socket(ssl.SSLSocket):
        def do_handshake(self, block: bool = False) -> None:
            super().do_handshake(block)
            verify(self)

    ctx.check_hostname = False
    ctx.sslobject_class = _Object
    ctx.sslsocket_class = _Socket
    return ctx
