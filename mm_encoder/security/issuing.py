"""A deployment's certificates in a directory (`mm-encoder serve --tls`): the CA and one certificate
per identity, issued before anything that presents it starts, and renewed while it runs
(docs/security.md).

The CA is a throwaway one made in `<dir>/ca/` on the first start (a later start in the same run
directory keeps it, so clients that trust it keep working), or the operator's own (`ca_dir`: its
`ca.pem` and `ca.key`, read, never written). Either is checked at each start: expired or not yet
valid is refused by name, one within 30 days of its end warned about. Each certificate names its
holder by URI (`spiffe://<trust domain>/<graph>/<role>/<name>`), lives `cert_lifetime_s` and is due
for renewal at two thirds of that (`due`). Dynamo's planes read a certificate once, so a Dynamo
component's plane certificate (`<dir>/dynamo/`) lives longer and is renewed by restarting the
process (`serve.runner`). Keys are 0600 in 0700 directories; the CA's key sits in its own."""

from __future__ import annotations

import functools
import ssl
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path

from ..core.errors import GraphError, PkiError
from .identity import TRUST_DOMAIN, SpiffeId, check_servers
from .pki import (
    CA_CERT,
    CA_KEY,
    CA_LIFETIME,
    DEFAULT_HOSTS,
    LEAF_LIFETIME,
    RENEW_AT,
    Authority,
    Identity,
    private_dir,
    utc_now,
)
from .tls import tls_client

SERVERS = ("etcd", "nats")
LAUNCHER = "mm-encoder-serve"  # the launcher's own certificate, in a folder of its own (no clash with a replica)
Files = tuple[str, str, str]  # a certificate, its key and the CA that signed it


class Issuer:
    """The certificates of graph `graph` in `directory` (`<run_dir>/tls`), from the CA in `ca_dir` (the
    operator's) or a throwaway one in `<directory>/ca`, valid `lifetime` (Dynamo's planes: `plane_lifetime`)."""

    def __init__(self, directory: Path, ca_dir: str | Path | None = None, *, graph: str = "mm-encoder",
                 trust_domain: str = TRUST_DOMAIN, lifetime: timedelta = LEAF_LIFETIME,
                 plane_lifetime: timedelta = 7 * LEAF_LIFETIME, ca_lifetime: timedelta = CA_LIFETIME,
                 hosts: Sequence[str] = ()):
        self.dir = directory
        self.hosts = (*DEFAULT_HOSTS, *hosts)  # every certificate's: loopback, and the host's own address
        self.own_ca = not ca_dir
        self.ca_dir = Path(ca_dir).resolve() if ca_dir else self.dir / "ca"
        self.graph, self.trust_domain = graph, trust_domain
        self.lifetime, self.plane_lifetime, self.ca_lifetime = lifetime, plane_lifetime, ca_lifetime
        self.due: float | None = None  # monotonic: when the HTTP certificates issued last are due for renewal
        self.warning: str | None = None  # the CA's, once checked

    @property
    def ca_file(self) -> Path:
        """The CA certificate clients pass (`curl --cacert`, the `openai` client's `http_client`)."""
        return self.ca_dir / CA_CERT

    def identity(self, name: str, role: str) -> Identity:
        return Identity(name, role, self.graph, self.trust_domain)

    def files(self, name: str) -> Files:
        """Where the certificate of the replica `name` is (issued or not yet)."""
        return str(self.dir / f"{name}.pem"), str(self.dir / f"{name}.key"), str(self.ca_file)

    def plane_files(self, name: str) -> Files:
        """Where the replica's certificate for Dynamo's planes is (read once by Dynamo's runtime)."""
        d = self.dir / "dynamo"
        return str(d / f"{name}.pem"), str(d / f"{name}.key"), str(self.ca_file)

    @property
    def launcher(self) -> tuple[str, str]:
        """The certificate and key `serve` and `mm-encoder status` present (role `client`): a frontend
        with `client_auth` asks for one."""
        return str(self.dir / "launcher" / f"{LAUNCHER}.pem"), str(self.dir / "launcher" / f"{LAUNCHER}.key")

    @property
    def launcher_id(self) -> SpiffeId:
        return self.identity(LAUNCHER, "client").spiffe

    def servers(self) -> dict[str, Files]:
        """etcd's and NATS' certificates, by name."""
        d = self.dir / "servers"
        return {s: (str(d / f"{s}.pem"), str(d / f"{s}.key"), str(self.ca_file)) for s in SERVERS}

    def issue(self, holders: Iterable[tuple[str, str]], *, site: bool = True) -> None:
        """A new certificate for each (name, role), the CA kept; with `site`, the launcher's and the
        servers' too (a start, a renewal), without only those named (a replica added to a running
        deployment). The next renewal is due at two thirds of their life."""
        try:
            authority = self._authority()
            for name, role in holders:
                authority.issue(self.identity(name, role), self.dir, hosts=self.hosts, lifetime=self.lifetime,
                                replace=True)
            if site:
                authority.issue(self.identity(LAUNCHER, "client"), self.dir / "launcher", lifetime=self.lifetime,
                                replace=True)
                for server in SERVERS:  # Dynamo's etcd and NATS: renewed with the rest (they read their files
                    # again), and never shorter-lived than the certificates their clients start with
                    authority.issue(self.identity(server, server), self.dir / "servers",
                                    lifetime=max(self.lifetime, self.plane_lifetime), replace=True)
                if "client_context" in self.__dict__:  # the launcher's live context presents the new one
                    self.client_context.load_cert_chain(*self.launcher)
        except PkiError as e:
            raise GraphError(f"TLS certificates: {e.message}") from None
        if site:  # every certificate renewed: the next round at two thirds of their life
            life = min(self.lifetime, authority.not_after - utc_now())
            self.due = time.monotonic() + RENEW_AT * life.total_seconds()

    def issue_planes(self, holders: Iterable[tuple[str, str]]) -> None:
        """A new certificate for Dynamo's planes for each (name, role): given to a process as it starts."""
        try:
            authority = self._authority()
            for name, role in holders:
                authority.issue(self.identity(name, role), self.dir / "dynamo", hosts=self.hosts,
                                lifetime=self.plane_lifetime, replace=True)
        except PkiError as e:
            raise GraphError(f"TLS certificates: {e.message}") from None

    def _authority(self) -> Authority:
        private_dir(self.dir)  # 0700 before anything is made in it (the CA's own folder included)
        if (self.ca_dir / CA_CERT).is_file() and (self.ca_dir / CA_KEY).is_file():
            authority = Authority.load(self.ca_dir)
        elif not self.own_ca:
            raise GraphError(f"tls.ca_dir {self.ca_dir} has no {CA_CERT} and {CA_KEY}: the operator's CA")
        else:
            authority = Authority.create(self.ca_dir, name="mm-encoder serve", lifetime=self.ca_lifetime)
        self.warning = authority.check()
        return authority

    @functools.cached_property
    def client_context(self) -> ssl.SSLContext:
        """What the launcher checks the deployment's HTTPS ports with (health, status): any server of this
        graph; made once, its certificate loaded again at each renewal (`issue`)."""
        return check_servers(tls_client(self.ca_file, *self.launcher), self.launcher_id, ())

    def state(self) -> dict[str, str]:
        """What a client outside the deployment reaches the frontend with (state.json's `tls`)."""
        cert, key = self.launcher
        return {"ca": str(self.ca_file), "cert": cert, "key": key}

