"""`mm-encoder serve` with TLS (a graph's `tls`, `--tls`): the deployment's CA and one certificate
per replica, issued into the run directory before anything starts (docs/security.md).

The CA is a throwaway one made in `<run_dir>/tls` on the first start (a later start in the same run
directory keeps it, so clients that trust it keep working), or the operator's own (`ca_dir`: its
`ca.pem` and `ca.key`, read, never written). Each replica's certificate names it (CN) and its
kind's role (OU), for loopback (`localhost`, 127.0.0.1); keys are 0600 in a 0700 directory. The
same CA signs etcd's and NATS' certificates when serve runs them, and each Dynamo process presents
its own certificate to them and on the TCP request plane (`dynamo_env`)."""

from __future__ import annotations

import functools
import ssl
from collections.abc import Mapping
from pathlib import Path

from ..core.errors import GraphError
from ..security.pki import CA_CERT, CA_KEY, Authority, Identity, PkiError
from ..security.tls import tls_client
from .infra import ServerTls
from .plan import ComponentPlan

SERVERS = ("etcd", "nats")
LAUNCHER = "mm-encoder-serve"  # the launcher's own certificate, in a folder of its own (no clash with a replica)


def ready_note(tls: LocalTls | None) -> str:
    """What serve's ready line says of TLS: the CA clients pass, or that the graph runs without."""
    if tls is None:
        return "without TLS (loopback only; --tls for certificates on every hop)"
    return f"TLS on every hop; clients pass its CA: curl --cacert {tls.ca_file}"


class LocalTls:
    def __init__(self, run_dir: Path, ca_dir: str | None = None):
        self.dir = run_dir / "tls"
        self.ca_dir = Path(ca_dir).resolve() if ca_dir else self.dir

    @property
    def ca_file(self) -> Path:
        """The CA certificate clients pass (`curl --cacert`, the `openai` client's `http_client`)."""
        return self.ca_dir / CA_CERT

    def files(self, replica: str) -> tuple[str, str, str]:
        return str(self.dir / f"{replica}.pem"), str(self.dir / f"{replica}.key"), str(self.ca_file)

    @property
    def launcher(self) -> tuple[str, str]:
        """The certificate and key `serve` and `mm-encoder status` present (role `client`): a frontend
        with `client_auth` asks for one."""
        return str(self.dir / "launcher" / f"{LAUNCHER}.pem"), str(self.dir / "launcher" / f"{LAUNCHER}.key")

    def issue(self, plans: list[ComponentPlan]) -> None:
        """Every replica's certificate, and the launcher's, new on each start (the CA kept)."""
        try:
            if (self.ca_dir / CA_CERT).is_file() and (self.ca_dir / CA_KEY).is_file():
                authority = Authority.load(self.ca_dir)
            elif self.ca_dir != self.dir:
                raise GraphError(f"tls.ca_dir {self.ca_dir} has no {CA_CERT} and {CA_KEY}: the operator's CA")
            else:
                authority = Authority.create(self.dir, name="mm-encoder serve")
            for cp in plans:
                for r in cp.replicas:
                    authority.issue(Identity(r.name, cp.kind), self.dir, replace=True)  # a kind is its role
            authority.issue(Identity(LAUNCHER, "client"), self.dir / "launcher", replace=True)
            for server in SERVERS:  # Dynamo's etcd and NATS, when the graph's runtime runs them
                authority.issue(Identity(server, server), self.dir / "servers", replace=True)
        except PkiError as e:
            raise GraphError(f"TLS certificates: {e.message}") from None

    def servers(self) -> dict[str, ServerTls]:
        """etcd's and NATS' certificates (`infra.servers_for`)."""
        d = self.dir / "servers"
        return {s: (str(d / f"{s}.pem"), str(d / f"{s}.key"), str(self.ca_file)) for s in SERVERS}

    def dynamo_env(self, files: tuple[str, str, str], runtime: Mapping[str, str], request_plane: str) -> dict[str, str]:
        """Dynamo's own TLS settings for a process presenting `files` (cert, key, CA): its etcd and NATS
        clients where serve runs those over TLS (`runtime`: their addresses), and the TCP request
        plane both ways (client certificates required). etcd's three take the PEM text itself,
        not paths (Dynamo 1.6.1): they live in the process's environment only, never in state.json."""
        cert, key, ca = files
        env: dict[str, str] = {}
        if runtime.get("NATS_SERVER", "").startswith("tls://"):
            env |= {"NATS_TLS_CA_CERT_PATH": ca, "NATS_TLS_CLIENT_CERT_PATH": cert, "NATS_TLS_CLIENT_KEY_PATH": key}
        if runtime.get("ETCD_ENDPOINTS", "").startswith("https://"):
            env |= {"ETCD_AUTH_CA": Path(ca).read_text(), "ETCD_AUTH_CLIENT_CERT": Path(cert).read_text(),
                    "ETCD_AUTH_CLIENT_KEY": Path(key).read_text()}
        if request_plane == "tcp":
            env |= {"DYN_TCP_TLS_CERT_PATH": cert, "DYN_TCP_TLS_KEY_PATH": key, "DYN_TCP_TLS_CLIENT_CA_CERT_PATH": ca,
                    "DYN_TCP_TLS_CA_CERT_PATH": ca, "DYN_TCP_TLS_CLIENT_CERT_PATH": cert,
                    "DYN_TCP_TLS_CLIENT_KEY_PATH": key}
        return env

    @functools.cached_property
    def client_context(self) -> ssl.SSLContext:
        """What the launcher checks the graph's HTTPS ports with (health, status); made once (the CA is
        kept across rotations, and the launcher's old certificate stays valid until it expires)."""
        return tls_client(self.ca_file, *self.launcher)

    def state(self) -> dict[str, str]:
        """state.json's `tls`: what `mm-encoder status` reaches the frontend with."""
        cert, key = self.launcher
        return {"ca": str(self.ca_file), "cert": cert, "key": key}
