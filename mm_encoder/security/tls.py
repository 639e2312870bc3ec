"""TLS with client certificates on the package's own HTTP hops: the options every component takes
and the standard library's SSL contexts from them (who may call whom: `core.topology`).

Every component has a certificate from the deployment's one CA (`security.pki`) whose URI names it
(`security.identity`). A server requires a client certificate that chains to the CA (the handshake
refuses plaintext, none, another CA's, an expired one), then `allowed` checks the caller's ID (this
deployment, a role the hop admits) before any work (a 403 `forbidden_peer`). A client verifies the
server's chain and ID inside the handshake (a server of its own deployment, of a role it calls) and
presents its own certificate."""

from __future__ import annotations

import functools
import ssl
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings
from typing_extensions import TypeAliasType

from ..core.errors import PkiError
from ..core.topology import callees
from .identity import SpiffeId, admit, check_servers, of_file

PATH = TypeAliasType("PATH", Path)  # what --help shows for a file's path


class TlsOptions(BaseSettings):
    """A component's certificate, key and the deployment's CA: all three or none (plaintext)."""

    tls_cert: PATH | None = Field(None, description="this component's certificate (PEM), from the deployment's CA")
    tls_key: PATH | None = Field(None, description="its private key (PEM; mode 0600)")
    tls_ca: PATH | None = Field(None, description="the deployment's CA certificate (PEM): peers must chain to it")

    @model_validator(mode="after")
    def _all_or_none(self) -> TlsOptions:
        given = [n for n in ("tls_cert", "tls_key", "tls_ca") if getattr(self, n) is not None]
        if given and len(given) != 3:
            missing = sorted({"tls_cert", "tls_key", "tls_ca"} - set(given))
            raise ValueError("TLS needs --tls-cert, --tls-key and --tls-ca together; missing: "
                             + ", ".join("--" + m.replace("_", "-") for m in missing))
        return self  # the files are read when a context is made (a path may name a file in another machine's pod)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @functools.cached_property
    def identity(self) -> SpiffeId:
        """Who this component's own certificate says it is: its trust domain and graph are those of its peers."""
        assert self.tls_cert is not None
        _require({"--tls-cert": self.tls_cert})
        return of_file(self.tls_cert)

    def allowed(self, ssl_object: Any, roles: Collection[str]) -> SpiffeId:
        """The caller's ID if it may call this hop (this deployment, one of `roles`); ForbiddenPeer (403)."""
        return admit(ssl_object, self.identity, roles)

    def server_context(self) -> ssl.SSLContext:
        """A server's context: its certificate, and a client certificate required, chaining to the CA."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        assert self.tls_cert is not None and self.tls_key is not None and self.tls_ca is not None
        _require({"--tls-cert": self.tls_cert, "--tls-key": self.tls_key, "--tls-ca": self.tls_ca})
        ctx.load_cert_chain(self.tls_cert, self.tls_key)
        ctx.load_verify_locations(cafile=self.tls_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """A client's context: the server's certificate checked against the CA, and its ID for a server
        of this deployment in a role this component calls (`core.topology.callees`); this component's
        own certificate presented."""
        assert self.tls_cert is not None and self.tls_key is not None and self.tls_ca is not None
        ctx = tls_client(self.tls_ca, self.tls_cert, self.tls_key, names=("--tls-ca", "--tls-cert", "--tls-key"))
        return check_servers(ctx, self.identity, callees(self.identity.role))

    def client_tls(self) -> ssl.SSLContext | None:
        """The client context with TLS configured, else None (plaintext)."""
        return self.client_context() if self.tls else None

    def reload(self, ctx: ssl.SSLContext) -> None:
        """The certificate and key files read again into a live context (rotation): new handshakes
        present the new certificate; connections already open keep theirs. The two files are
        replaced one after the other (`pki`): a pair read between the two renames does not match,
        and is read again."""
        assert self.tls_cert is not None and self.tls_key is not None
        for attempt in range(3):
            try:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
                return
            except ssl.SSLError:
                if attempt == 2:
                    raise
                time.sleep(0.05)


def tls_client(ca: str | Path, cert: str | Path | None = None, key: str | Path | None = None, *,
               names: tuple[str, str, str] = ("the CA certificate", "the certificate", "its key")) -> ssl.SSLContext:
    """A client of the deployment's HTTPS ports from outside it (the launcher, `mm-encoder status`):
    its CA trusted, and a certificate presented where one is given."""
    _require({names[0]: ca, **({names[1]: cert, names[2]: key} if cert and key else {})})  # as the caller names them
    ctx = ssl.create_default_context(cafile=str(ca))  # the server checked, for the host dialled; TLS 1.2+
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert is not None and key is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


def _require(files: dict[str, str | Path]) -> None:
    """Each file there, or a PkiError naming the option and the path (a mounted Secret without
    `ca.crt`, a run directory whose tls/ was removed), before OpenSSL's bare errno."""
    missing = [f"{what} {path}" for what, path in files.items() if not Path(path).is_file()]
    if missing:
        raise PkiError(f"no such file: {'; '.join(missing)}")
