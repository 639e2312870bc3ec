"""The tenant scope (`--tenant-header`, docs/tenants.md): with it, every cache entry below the
frontend belongs to one tenant.

The operator's gateway names each request's tenant in one header. Dynamo 1.6.1's HTTP frontend
hands a processor no request headers; it copies those whose names start with `DYN_METADATA_HEADER`
into the request context's metadata, keyed by the rest of the name. So the frontend sets that
variable to the tenant header (before Dynamo's runtime starts) and reads the entry with the empty
key: the header itself, and no other header that merely starts with its name.

The tenant becomes the encode request's `scope`: `HMAC-SHA256(key, tenant)`, hex. The scope is part
of the body every cache tier keys by and of the worker's URL-alias and mm_hash keys
(`encode_worker.caches.body_key`), and handles carry their source request, scope included: two
tenants share no entry anywhere, so neither can tell by timing what the other asked. Keyed, so
the caches, logs and stats hold no tenant's name and a caller who knows one cannot make its
scope; one key across a fleet's frontends lets a tenant's entries be shared between its clusters.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from ..core.errors import BadTenant, MissingTenant

METADATA_HEADER = "DYN_METADATA_HEADER"  # Dynamo's HTTP frontend: the prefix of headers copied to metadata
HEADER_NAME = r"^[A-Za-z0-9][A-Za-z0-9-]{1,62}[A-Za-z0-9]$"  # an HTTP field name of letters, digits, '-'
MAX_TENANT = 256  # characters of a tenant's name
MIN_KEY_BYTES = 32


class Tenants:
    """Request context -> the scope of its cache entries; "" (no scope) when tenants are off."""

    def __init__(self, header: str | None = None, key: bytes = b"") -> None:
        if header is not None and not re.fullmatch(HEADER_NAME, header):
            raise ValueError(f"--tenant-header {header!r}: an HTTP header name of letters, digits and '-'")
        if header is not None and len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the tenant key has {len(key)} bytes; it needs at least {MIN_KEY_BYTES}")
        self.header = header
        self._key = key

    @classmethod
    def from_files(cls, header: str | None, key_file: Path | None) -> Tenants:
        if header is None:
            return cls()
        if key_file is None:
            raise ValueError("--tenant-header needs --tenant-key FILE: the secret the scopes are keyed by")
        return cls(header, read_key(key_file))

    def scope(self, context: Any) -> str:
        """The request's scope, from the header its context carries; refused by name without it."""
        if self.header is None:
            return ""
        metadata = getattr(context, "metadata", None)
        tenant = metadata.get("") if metadata is not None else None
        if not tenant:
            raise MissingTenant(f"this frontend serves tenants: the request needs the {self.header} header, "
                                "set by the gateway")
        if len(tenant) > MAX_TENANT or not (tenant.isascii() and tenant.isprintable()):
            raise BadTenant(f"the {self.header} header is not a tenant's name (printable ASCII, at most "
                            f"{MAX_TENANT} characters)")
        return self.scope_of(tenant)

    def scope_of(self, tenant: str) -> str:
        """HMAC-SHA256(key, tenant), hex: a tenant's scope."""
        return hmac.new(self._key, tenant.encode(), hashlib.sha256).hexdigest()


def forward_header(header: str | None, env: MutableMapping[str, str] = os.environ) -> None:
    """Tell Dynamo's HTTP frontend (before its runtime starts) to pass the tenant header on."""
    if header is None:
        return
    current = env.get(METADATA_HEADER)
    if current and current.lower() != header.lower():
        raise ValueError(f"{METADATA_HEADER}={current} is set, and --tenant-header {header} needs it: "
                         "Dynamo's frontend passes one header prefix to the processor")
    env[METADATA_HEADER] = header.lower()


def check_forwarded(header: str | None, env: MutableMapping[str, str] = os.environ) -> None:
    """Under Dynamo's own frontend, whose runtime started before the processor loads: the variable
    must already name the tenant header (set by the operator), or the header never arrives."""
    if header and env.get(METADATA_HEADER, "").lower() != header.lower():
        raise ValueError(f"tenant_header {header}: Dynamo's frontend passes that header on only with "
                         f"{METADATA_HEADER}={header.lower()} in its environment")


def read_key(path: Path) -> bytes:
    """The tenant key: a file of at least 32 random bytes that other users may not read (its group
    may: Kubernetes mounts a Secret's files for the pod's fsGroup)."""
    try:
        mode = path.stat().st_mode
        key = path.read_bytes()
    except OSError as e:
        raise ValueError(f"tenant key {path}: {e.strerror}") from None
    if mode & stat.S_IRWXO:
        raise ValueError(f"tenant key {path}: other users may read it (mode {stat.S_IMODE(mode):o}); chmod 600 it")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"tenant key {path}: {len(key)} bytes; it needs at least {MIN_KEY_BYTES} random bytes")
    return key


def make_key(path: Path) -> Path:
    """A new random key at `path` (mode 600), unless one is there: kept across restarts, so a
    tenant's cached entries stay its own."""
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(MIN_KEY_BYTES))
    return path
