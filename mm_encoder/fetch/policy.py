"""What may be fetched: the operator's limits and allow-lists, and what a fetch returns."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .addresses import HOSTNAME, IPAddress, IPNetwork, normalise_host_name, numeric_ipv4_host

ALLOW_HOSTS_ENV = "MM_ENCODER_FETCH_ALLOW_HOSTS"
ALLOW_DIRS_ENV = "MM_ENCODER_FETCH_ALLOW_FILE_DIRS"


class FetchPolicy(BaseModel):
    """Limits for fetching untrusted media URLs. Defaults refuse every internal address and every file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_bytes: int = Field(64 * 1024 * 1024, gt=0)  # body/decoded size cap, enforced while streaming
    timeout_s: float = Field(30.0, gt=0)  # the whole fetch, redirects included
    connect_timeout_s: float = Field(5.0, gt=0)
    max_redirects: int = Field(3, ge=0)
    # Internal hosts reachable despite the address rules: "host", "host:port", "1.2.3.4[:port]",
    # "10.0.0.0/8", "[::1]:8080", "fd00::/8". A hostname entry admits that name (whatever it resolves to);
    # an address/CIDR entry admits any host resolving into it.
    allow_hosts: tuple[str, ...] = ()
    allow_file_dirs: tuple[str, ...] = ()  # file:// only where the real path lies under one of these
    user_agent: str = "mm-encoder/0.1"

    @field_validator("allow_hosts")
    @classmethod
    def _valid_allow_hosts(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for entry in v:
            parse_allow_entry(entry)
        return v


@dataclass(frozen=True)
class Fetched:
    data: bytes
    url: str  # the final URL, after redirects
    content_type: str | None
    redirects: int


@dataclass(frozen=True)
class AllowEntry:
    host: str | None = None  # a hostname (lowercase, no trailing dot): matches that name only
    network: IPNetwork | None = None  # an address or CIDR: matches any host resolving into it
    port: int | None = None  # None: any port


def _parse_port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError("port must be 1-65535")
    return int(text)


def parse_allow_entry(entry: str) -> AllowEntry:
    """Parse one entry: host, host:port, 1.2.3.4[:port], 10.0.0.0/8, ::1, [::1]:8080, fd00::/8."""
    text = entry.strip()
    if not text:
        raise ValueError("allow_hosts entries must not be empty")
    try:
        if "/" in text:
            return AllowEntry(network=ipaddress.ip_network(text, strict=True))
        if text.startswith("["):
            addr, sep, rest = text[1:].partition("]")
            if not sep or (rest and not rest.startswith(":")):
                raise ValueError("expected [ipv6] or [ipv6]:port")
            port = _parse_port(rest[1:]) if rest else None
            return AllowEntry(network=ipaddress.ip_network(ipaddress.IPv6Address(addr)), port=port)
        try:
            return AllowEntry(network=ipaddress.ip_network(ipaddress.ip_address(text)))
        except ValueError:
            pass
        name, _, port_text = text.rpartition(":") if ":" in text else (text, "", "")
        port = _parse_port(port_text) if ":" in text else None
        try:
            return AllowEntry(network=ipaddress.ip_network(ipaddress.IPv4Address(name)), port=port)
        except ValueError:
            pass
        host = normalise_host_name(name)
        if not HOSTNAME.fullmatch(host) or numeric_ipv4_host(host):
            raise ValueError("not a hostname, address or CIDR")
        return AllowEntry(host=host, port=port)
    except ValueError as e:
        raise ValueError(f"bad allow_hosts entry {entry!r}: {e}") from None


class AllowList:
    """The parsed `allow_hosts`: which refused addresses an operator has let through anyway."""

    def __init__(self, entries: tuple[str, ...]):
        self.entries = tuple(parse_allow_entry(e) for e in entries)

    def names(self, host: str, port: int) -> bool:
        """Whether a hostname entry admits `host` on `port`."""
        return any(e.host is not None and e.host == host.rstrip(".") and e.port in (None, port) for e in self.entries)

    def admits(self, addr: IPAddress, port: int, reason: str, named: bool) -> bool:
        """Whether `addr` (refused for `reason`) may be reached; `named`: a hostname entry matched."""
        # A hostname entry vouches for that name, but not for cloud metadata: a poisoned answer for an
        # allow-listed name must not hand out credentials. Address/CIDR entries are explicit about addresses.
        if named and not reason.startswith("cloud metadata"):
            return True
        probes = [addr]
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            probes.append(addr.ipv4_mapped)
        if isinstance(addr, ipaddress.IPv6Address) and addr.scope_id:
            probes.append(ipaddress.IPv6Address(int(addr)))
        return any(
            e.network is not None and e.port in (None, port) and p.version == e.network.version and p in e.network
            for e in self.entries
            for p in probes
        )


def shorten(url: str, limit: int = 200) -> str:
    """A URL as error messages show it."""
    return url if len(url) <= limit else url[: limit - 3] + "..."


def too_large(shown: str, what: str, cap: int) -> str:
    return (
        f"{shown!r}: {what} is over the limit of {cap} bytes; send a smaller file (or raise MM_ENCODER_FETCH_MAX_BYTES)"
    )
