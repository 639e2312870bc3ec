"""A deployment's certificates in a directory (`mm-encoder serve --tls`): the CA and one certificate
per identity, issued before anything that presents it starts (docs/security.md).

The CA is a throwaway one made in the directory on the first start (a later start in the same run
directory keeps it, so clients that trust it keep working), or the operator's own (`ca_dir`: its
`ca.pem` and `ca.key`, read, never written). Each certificate names its holder (CN) and role (OU),
for loopback (`localhost`, 127.0.0.1); keys are 0600 in a 0700 directory. The same CA signs the
launcher's certificate and those of the servers serve runs (etcd, NATS)."""

from __future__ import annotations

import functools
import ssl
from collections.abc import Iterable
from pathlib import Path

from ..core.errors import GraphError
from .pki import CA_CERT, CA_KEY, Authority, Identity, PkiError
from .tls import tls_client

SERVERS = ("etcd", "nats")
LAUNCHER = "mm-encoder-serve"  # the launcher's own certificate, in a folder of its own (no clash with a replica)
Files = tuple[str, str, str]  # a certificate, its key and the CA that signed it


class Issuer:
    """The certificates of one deployment in `dir` (`<run_dir>/tls`), from the CA in `ca_dir` (default: `dir`)."""

    def __init__(self, directory: Path, ca_dir: str | Path | None = None):
        self.dir = directory
        self.ca_dir = Path(ca_dir).resolve() if ca_dir else self.dir

    @property
    def ca_file(self) -> Path:
        """The CA certificate clients pass (`curl --cacert`, the `openai` client's `http_client`)."""
        return self.ca_dir / CA_CERT

    def files(self, name: str) -> Files:
        """Where the certificate of the replica `name` is (issued or not yet)."""
        return str(self.dir / f"{name}.pem"), str(self.dir / f"{name}.key"), str(self.ca_file)

    @property
    def launcher(self) -> tuple[str, str]:
        """The certificate and key `serve` and `mm-encoder status` present (role `client`): a frontend
        with `client_auth` asks for one."""
        return str(self.dir / "launcher" / f"{LAUNCHER}.pem"), str(self.dir / "launcher" / f"{LAUNCHER}.key")

    def servers(self) -> dict[str, Files]:
        """etcd's and NATS' certificates, by name."""
        d = self.dir / "servers"
        return {s: (str(d / f"{s}.pem"), str(d / f"{s}.key"), str(self.ca_file)) for s in SERVERS}

    def issue(self, identities: Iterable[Identity], *, site: bool = True) -> None:
        """A new certificate for each identity, the CA kept; with `site`, the launcher's and the servers'
        too (a start, a rotation), without only those named (a replica added to a running deployment)."""
        try:
            authority = self._authority()
            for identity in identities:
                authority.issue(identity, self.dir, replace=True)
            if site:
                authority.issue(Identity(LAUNCHER, "client"), self.dir / "launcher", replace=True)
                for server in SERVERS:  # Dynamo's etcd and NATS, when the graph's runtime runs them
                    authority.issue(Identity(server, server), self.dir / "servers", replace=True)
        except PkiError as e:
            raise GraphError(f"TLS certificates: {e.message}") from None

    def _authority(self) -> Authority:
        if (self.ca_dir / CA_CERT).is_file() and (self.ca_dir / CA_KEY).is_file():
            return Authority.load(self.ca_dir)
        if self.ca_dir != self.dir:
            raise GraphError(f"tls.ca_dir {self.ca_dir} has no {CA_CERT} and {CA_KEY}: the operator's CA")
        return Authority.create(self.dir, name="mm-encoder serve")

    @functools.cached_property
    def client_context(self) -> ssl.SSLContext:
        """What the launcher checks the deployment's HTTPS ports with (health, status); made once (the
        CA is kept across rotations, and the launcher's old certificate stays valid until it expires)."""
        return tls_client(self.ca_file, *self.launcher)

    def state(self) -> dict[str, str]:
        """What a client outside the deployment reaches the frontend with (state.json's `tls`)."""
        cert, key = self.launcher
        return {"ca": str(self.ca_file), "cert": cert, "key": key}
