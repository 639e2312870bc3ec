"""Fetching media from untrusted URLs without becoming a proxy into the private network.

Threat model: users hand us URLs. Fetched naively, those URLs reach whatever the worker can reach (SSRF):
loopback admin ports, the pod network, and cloud metadata services that hand out credentials. So:

* Only http(s) and data: are fetched; file:// only under operator-approved directories (checked on the real
  path, so symlinks and ``..`` cannot escape); every other scheme is refused.
* Hosts are resolved once, here; every returned address is vetted by `check_ip`, and the connection goes to
  exactly those vetted addresses (a pinned resolver handed to aiohttp). A second lookup at connect time
  would let DNS rebinding swap a public answer for 127.0.0.1 after the check.
* Numeric spellings the C library still accepts (``2130706433``, ``0x7f.1``, ``0177.0.0.1``) are decoded
  the way a browser and ``inet_aton`` would, so they are vetted as the address they really are.
* Redirects are followed by hand, each hop re-vetted (a redirect to file:, data: or a private address is
  refused); bodies are streamed against a byte cap; the whole fetch has one deadline.
* Internal hosts can be allow-listed (`FetchPolicy.allow_hosts`); nothing internal is reachable by default.

Every refusal is a `FetchError` with a stable ``code`` and an HTTP status (`FETCH_ERROR_STATUS`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextvars
import ipaddress
import os
import re
import socket
import stat
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from pydantic import BaseModel, ConfigDict, Field, field_validator
from yarl import URL

from .errors import MMEncoderError

__all__ = [
    "FETCH_ERROR_STATUS",
    "FetchError",
    "FetchPolicy",
    "Fetched",
    "Fetcher",
    "check_ip",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

FETCH_ERROR_STATUS: dict[str, int] = {
    "bad_url": 400,  # unparsable URL, userinfo, empty host, bad port, malformed data: URL
    "forbidden_scheme": 400,  # not http/https/data/file (or a redirect to anything but http/https)
    "forbidden_address": 403,  # the host is or resolves to an internal address that is not allow-listed
    "forbidden_path": 403,  # file:// outside allow_file_dirs (or file:// disabled), or not a regular file
    "dns_failure": 422,  # the host does not resolve
    "too_many_redirects": 422,
    "too_large": 413,  # Content-Length or streamed/decoded bytes over max_bytes
    "fetch_timeout": 504,  # whole fetch (or connect) over its deadline
    "upstream_status": 422,  # the origin answered >= 400 (or a 3xx without Location)
    "fetch_failed": 502,  # connection refused/reset, TLS error, broken HTTP, unreadable allowed file
}

_ALLOW_HOSTS_ENV = "MM_ENCODER_FETCH_ALLOW_HOSTS"
_ALLOW_DIRS_ENV = "MM_ENCODER_FETCH_ALLOW_FILE_DIRS"
_MAX_URL_CHARS = 16 * 1024  # for http(s)/file URLs; data: URLs are bounded by max_bytes instead
_CHUNK = 64 * 1024


class FetchError(MMEncoderError):
    """A URL we refuse or could not fetch. `code` is one of FETCH_ERROR_STATUS; the message says what to change."""

    code = "fetch_failed"
    http_status = 502

    def __init__(self, code: str, message: str):
        if code not in FETCH_ERROR_STATUS:
            raise ValueError(f"unknown fetch error code {code!r}")
        super().__init__(message, code, FETCH_ERROR_STATUS[code])


# --------------------------------------------------------------------------------------------- address rules

# Why explicit tables and not just `ip.is_global`: the stdlib answer changes between Python versions (3.11.10
# and 3.12.4 rewrote it), and it says "global" for several ranges we must refuse: multicast (224.0.0.1),
# IPv4-compatible (::7f00:1), site-local (fec0::/10), local-use NAT64 (64:ff9b:1::/48), unallocated IPv6
# outside 2000::/3, and public-but-dangerous addresses (Azure's 168.63.129.16). The tables give a named reason;
# `is_global` stays as a backstop for whatever special-purpose range they miss.

_METADATA: dict[IPAddress, str] = {
    ipaddress.ip_address("169.254.169.254"): "AWS/GCP/Azure/OpenStack/DigitalOcean instance metadata",
    ipaddress.ip_address("169.254.170.2"): "AWS ECS task metadata",
    ipaddress.ip_address("169.254.170.23"): "AWS EKS pod identity agent",
    ipaddress.ip_address("100.100.100.200"): "Alibaba Cloud metadata",
    ipaddress.ip_address("168.63.129.16"): "Azure WireServer",
    ipaddress.ip_address("fd00:ec2::254"): "AWS instance metadata over IPv6",
    ipaddress.ip_address("fd00:ec2::23"): "AWS EKS pod identity agent over IPv6",
}

_V4_RULES: tuple[tuple[ipaddress.IPv4Network, str], ...] = tuple(
    (ipaddress.IPv4Network(net), reason)
    for net, reason in (
        ("0.0.0.0/8", "unspecified (this network)"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local"),
        ("10.0.0.0/8", "private"),
        ("172.16.0.0/12", "private"),
        ("192.168.0.0/16", "private"),
        ("100.64.0.0/10", "CGNAT (shared address space)"),
        ("192.0.0.0/24", "IETF protocol assignments"),
        ("192.0.2.0/24", "documentation"),
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("198.18.0.0/15", "benchmarking"),
        ("192.88.99.0/24", "6to4 relay anycast (deprecated)"),
        ("224.0.0.0/4", "multicast"),
        ("255.255.255.255/32", "broadcast"),
        ("240.0.0.0/4", "reserved"),
    )
)

_V6_RULES: tuple[tuple[ipaddress.IPv6Network, str], ...] = tuple(
    (ipaddress.IPv6Network(net), reason)
    for net, reason in (
        ("2001::/32", "Teredo tunnel"),  # the client address inside is obfuscated; never needed for media
        ("64:ff9b:1::/48", "NAT64 local-use"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local (deprecated)"),
        ("fc00::/7", "private (unique local)"),
        ("ff00::/8", "multicast"),
        ("2001:db8::/32", "documentation"),
        ("3fff::/20", "documentation"),
        ("2001:2::/48", "benchmarking"),
        ("100::/64", "discard-only"),
        ("2001::/23", "IETF protocol assignments"),
    )
)
_V6_COMPAT = ipaddress.IPv6Network("::/96")
_V6_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_V6_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")


def check_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """None if `ip` is a public unicast address we may connect to; else a short reason why not.

    IPv6 forms that carry an IPv4 address (IPv4-mapped, NAT64, 6to4) are judged by the IPv4 address inside,
    because that is what a dual-stack socket or a translator would end up talking to.
    """
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        ip = ipaddress.IPv6Address(int(ip))  # fe80::1%eth0 -> fe80::1
    if ip in _METADATA:
        return f"cloud metadata ({_METADATA[ip]})"
    if isinstance(ip, ipaddress.IPv4Address):
        for net, reason in _V4_RULES:
            if ip in net:
                return reason
        return None if ip.is_global else "non-global (special-purpose)"

    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.ipv4_mapped is not None:
        inner = check_ip(ip.ipv4_mapped)
        return f"IPv4-mapped {ip.ipv4_mapped}: {inner}" if inner else None
    if ip in _V6_COMPAT:
        return "IPv4-compatible (deprecated)"
    if ip in _V6_NAT64:
        v4 = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        inner = check_ip(v4)
        return f"NAT64 of {v4}: {inner}" if inner else None
    if ip.sixtofour is not None:
        inner = check_ip(ip.sixtofour)
        if inner:
            return f"6to4 of {ip.sixtofour}: {inner}"
    for net, reason in _V6_RULES:
        if ip in net:
            return reason
    if ip not in _V6_GLOBAL_UNICAST:
        return "reserved"
    return None if ip.is_global else "non-global (special-purpose)"


# --------------------------------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class _AllowEntry:
    host: str | None = None  # a hostname (lowercase, no trailing dot): matches that name only
    network: IPNetwork | None = None  # an address or CIDR: matches any host resolving into it
    port: int | None = None  # None: any port


def _parse_port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError("port must be 1-65535")
    return int(text)


def _parse_allow_entry(entry: str) -> _AllowEntry:
    """Parse one entry: host, host:port, 1.2.3.4[:port], 10.0.0.0/8, ::1, [::1]:8080, fd00::/8."""
    text = entry.strip()
    if not text:
        raise ValueError("allow_hosts entries must not be empty")
    try:
        if "/" in text:
            return _AllowEntry(network=ipaddress.ip_network(text, strict=True))
        if text.startswith("["):
            addr, sep, rest = text[1:].partition("]")
            if not sep or (rest and not rest.startswith(":")):
                raise ValueError("expected [ipv6] or [ipv6]:port")
            port = _parse_port(rest[1:]) if rest else None
            return _AllowEntry(network=ipaddress.ip_network(ipaddress.IPv6Address(addr)), port=port)
        try:
            return _AllowEntry(network=ipaddress.ip_network(ipaddress.ip_address(text)))
        except ValueError:
            pass
        name, _, port_text = text.rpartition(":") if ":" in text else (text, "", "")
        port = _parse_port(port_text) if ":" in text else None
        try:
            return _AllowEntry(network=ipaddress.ip_network(ipaddress.IPv4Address(name)), port=port)
        except ValueError:
            pass
        host = _normalise_host_name(name)
        if not _HOSTNAME.fullmatch(host) or _numeric_ipv4_host(host):
            raise ValueError("not a hostname, address or CIDR")
        return _AllowEntry(host=host, port=port)
    except ValueError as e:
        raise ValueError(f"bad allow_hosts entry {entry!r}: {e}") from None


def _normalise_host_name(name: str) -> str:
    name = name.lower().rstrip(".")
    try:
        return name.encode("idna").decode("ascii") if not name.isascii() else name
    except UnicodeError:
        return name


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
            _parse_allow_entry(entry)
        return v


@dataclass(frozen=True)
class Fetched:
    data: bytes
    url: str  # the final URL, after redirects
    content_type: str | None
    redirects: int


# ------------------------------------------------------------------------------------------------ host parsing

_HOSTNAME = re.compile(
    r"(?=.{1,253}\Z)[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?(?:\.[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?)*"
)
_ENDS_IN_NUMBER = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]*")
_HEX_LABEL = re.compile(r"0[xX][0-9a-fA-F]*")
_OCT_LABEL = re.compile(r"0[0-7]+")
_DEC_LABEL = re.compile(r"0|[1-9][0-9]*")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _numeric_ipv4_host(host: str) -> bool:
    """Whether a browser (WHATWG "ends in a number") would read `host` as an IPv4 address."""
    labels = host.split(".")
    if len(labels) > 1 and labels[-1] == "":
        labels.pop()
    return bool(_ENDS_IN_NUMBER.fullmatch(labels[-1]))


def _parse_numeric_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """Decode decimal/octal/hex IPv4 spellings (``2130706433``, ``0x7f.1``, ``0177.0.0.1``) like inet_aton.

    None if the host is malformed as a number (``1.2.3.4.5``, ``09.1``, ``4294967296``).
    """
    labels = host.split(".")
    if len(labels) > 1 and labels[-1] == "":
        labels.pop()
    if not 1 <= len(labels) <= 4:
        return None
    parts: list[int] = []
    for label in labels:
        if _HEX_LABEL.fullmatch(label):
            parts.append(int(label[2:] or "0", 16))
        elif _OCT_LABEL.fullmatch(label):
            parts.append(int(label, 8))
        elif _DEC_LABEL.fullmatch(label):
            parts.append(int(label, 10))
        else:  # empty, signs, underscores, non-ASCII digits, 08/09: int() would take some of these; we do not
            return None
    *head, last = parts
    if any(p > 255 for p in head) or last >= 256 ** (5 - len(parts)):
        return None
    value = last
    for i, p in enumerate(head):
        value += p << (8 * (3 - i))
    return ipaddress.IPv4Address(value)


@dataclass(frozen=True)
class _Target:
    url: URL
    host: str  # what aiohttp passes to the resolver: the IDNA (ASCII) host, as in the URL
    port: int
    literal: IPAddress | None  # the host is an IP literal aiohttp connects to without resolving
    odd_spelling: bool = False  # a numeric IPv4 host not in dotted-quad form: vetted, then refused as bad_url


def _http_target(url: URL, shown: str) -> _Target:
    """Validate an http(s) URL's authority; raise bad_url naming what is wrong."""
    if url.user is not None or url.password is not None:
        raise FetchError(
            "bad_url", f"URL {shown!r} carries credentials (user:pass@); remove them, credentials are never sent"
        )
    raw_host = url.raw_host
    if not raw_host:
        raise FetchError("bad_url", f"URL {shown!r} has no host; use http(s)://host/path")
    try:
        port = url.port
    except ValueError:
        port = None
    if not port:
        raise FetchError("bad_url", f"URL {shown!r} has an invalid port; use 1-65535 or leave it out")
    if ":" in raw_host:
        try:
            literal: IPAddress = ipaddress.IPv6Address(url.host or raw_host)
        except ValueError:
            raise FetchError("bad_url", f"host {raw_host!r} of {shown!r} is not a valid IPv6 address") from None
        return _Target(url, raw_host, port, literal)
    host = raw_host.lower()
    if _numeric_ipv4_host(host):
        v4 = _parse_numeric_ipv4(host)
        if v4 is None:
            raise FetchError("bad_url", f"host {raw_host!r} of {shown!r} is not a valid IPv4 address")
        # Vetted as the address it denotes (forbidden_address says what it really is), then refused as
        # bad_url anyway if allowed: aiohttp 3.14 rejects such hosts, older ones hand them to getaddrinfo.
        return _Target(url, host, port, v4, odd_spelling=str(v4) != host)
    if not _HOSTNAME.fullmatch(host[:-1] if host.endswith(".") else host):  # one trailing dot: an FQDN
        raise FetchError("bad_url", f"host {raw_host!r} of {shown!r} is not a valid hostname")
    return _Target(url, host, port, None)


# --------------------------------------------------------------------------------------------- pinned resolver

# The vetted addresses of the request in flight, set around each hop. A context variable, so concurrent
# fetches on one session each see their own pin (aiohttp resolves inside the requesting task).
_PIN: contextvars.ContextVar[tuple[str, int, tuple[IPAddress, ...]] | None] = contextvars.ContextVar(
    "mm_encoder_fetch_pin", default=None
)


class _PinnedResolver(AbstractResolver):
    """Hands aiohttp the addresses `Fetcher` already vetted for this host; never performs a lookup itself.

    Anything else (a host not pinned by the current hop) fails closed.
    """

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        pin = _PIN.get()
        if pin is None or pin[0] != host.lower() or pin[1] != port:
            raise OSError(f"refusing to resolve unvetted host {host!r}")
        return [
            ResolveResult(
                hostname=host,
                host=str(addr),
                port=port,
                family=socket.AF_INET6 if addr.version == 6 else socket.AF_INET,
                proto=socket.IPPROTO_TCP,
                flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
            )
            for addr in pin[2]
        ]

    async def close(self) -> None:
        return None


# ----------------------------------------------------------------------------------------------------- fetcher

_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class Fetcher:
    """Fetches media URLs under a `FetchPolicy`. One shared aiohttp session, created lazily in the running loop."""

    def __init__(self, policy: FetchPolicy | None = None):
        self.policy = policy or FetchPolicy()
        self._allow = tuple(_parse_allow_entry(e) for e in self.policy.allow_hosts)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> Fetcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is not None and not self._session.closed and self._loop is not loop:
            raise RuntimeError("a Fetcher is bound to the event loop that first used it; make one per loop")
        if self._session is None or self._session.closed:
            self._loop = loop
            connector = aiohttp.TCPConnector(resolver=_PinnedResolver(), use_dns_cache=False)
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,  # no *_PROXY variables, no .netrc
                headers={"User-Agent": self.policy.user_agent, "Accept-Encoding": "identity"},
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.policy.connect_timeout_s),
            )
        return self._session

    async def fetch(self, url: str) -> Fetched:
        """Fetch `url` (http, https, data:, or file:// under allow_file_dirs); raise FetchError on refusal/failure."""
        try:
            return await asyncio.wait_for(self._fetch(url), self.policy.timeout_s)
        except asyncio.TimeoutError:
            raise FetchError(
                "fetch_timeout",
                f"fetching {_shorten(url)!r} took longer than {self.policy.timeout_s:g} s; "
                "use a faster origin or raise the fetch timeout (MM_ENCODER_FETCH_TIMEOUT_S)",
            ) from None

    async def _fetch(self, url: str) -> Fetched:
        if not isinstance(url, str):
            raise FetchError("bad_url", f"URL must be a string, got {type(url).__name__}")
        url = url.strip(" \t\r\n\f")
        shown = _shorten(url)
        if _CONTROL.search(url):
            raise FetchError("bad_url", f"URL {shown!r} contains control characters; percent-encode them")
        m = _SCHEME.match(url)
        if m is None:
            raise FetchError("forbidden_scheme", f"URL {shown!r} has no scheme; use http(s)://, or a data: URL")
        scheme = m.group(1).lower()
        if scheme == "data":  # big ones are decoded off the event loop
            return self._data(url) if len(url) < _CHUNK else await asyncio.to_thread(self._data, url)
        if len(url) > _MAX_URL_CHARS:
            raise FetchError("bad_url", f"URL {shown!r} is longer than {_MAX_URL_CHARS} characters")
        if scheme == "file":
            return await self._file(url)
        if scheme not in ("http", "https"):
            raise FetchError(
                "forbidden_scheme", f"scheme {scheme!r} of {shown!r} is not fetched; use http(s)://, or a data: URL"
            )
        try:
            parsed = URL(url)
        except (ValueError, TypeError) as e:
            raise FetchError("bad_url", f"URL {shown!r} does not parse: {e}") from None
        return await self._http(parsed)

    # -------------------------------------------------------------------------------------------------- http

    async def _http(self, url: URL) -> Fetched:
        session = self._get_session()
        redirects = 0
        while True:
            target = _http_target(url, _shorten(str(url)))
            addrs = await self._vet(target)
            token = _PIN.set((target.host, target.port, addrs))
            try:
                location = await self._request(session, target)
            finally:
                _PIN.reset(token)
            if isinstance(location, Fetched):
                return Fetched(location.data, location.url, location.content_type, redirects)
            if redirects >= self.policy.max_redirects:
                raise FetchError(
                    "too_many_redirects",
                    f"{_shorten(str(url))!r} redirects again after {redirects} redirect(s), over the limit of "
                    f"{self.policy.max_redirects}; link the final URL (or raise MM_ENCODER_FETCH_MAX_REDIRECTS)",
                )
            redirects += 1
            try:
                nxt = url.join(URL(location))
            except (ValueError, TypeError) as e:
                raise FetchError(
                    "bad_url", f"{_shorten(str(url))!r} redirects to unparsable {location!r}: {e}"
                ) from None
            if nxt.scheme not in ("http", "https"):
                raise FetchError(
                    "forbidden_scheme",
                    f"{_shorten(str(url))!r} redirects to a {nxt.scheme or 'scheme-less'}: URL; "
                    "only redirects to http(s) are followed",
                )
            url = nxt.with_fragment(None)

    async def _vet(self, t: _Target) -> tuple[IPAddress, ...]:
        """Resolve once and vet every address; return the addresses to connect to."""
        if t.literal is not None:
            addrs: tuple[IPAddress, ...] = (t.literal,)
        else:
            loop = asyncio.get_running_loop()
            try:
                infos = await loop.getaddrinfo(t.host, t.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
            except (socket.gaierror, UnicodeError) as e:
                raise FetchError(
                    "dns_failure", f"host {t.host!r} does not resolve ({e}); check the hostname in the URL"
                ) from None
            found: dict[IPAddress, None] = {}
            for family, _, _, _, sockaddr in infos:
                if family in (socket.AF_INET, socket.AF_INET6):
                    found[ipaddress.ip_address(sockaddr[0])] = None
            addrs = tuple(found)
            if not addrs:
                raise FetchError("dns_failure", f"host {t.host!r} has no IPv4/IPv6 address; check the hostname")
        name_entry = any(
            e.host is not None and e.host == t.host.rstrip(".") and e.port in (None, t.port) for e in self._allow
        )
        for addr in addrs:
            reason = check_ip(addr)
            if reason is None or self._allowed(addr, t.port, reason, name_entry):
                continue
            what = f"host {t.host!r}" if t.literal is None else "the URL"
            if t.odd_spelling:
                what = f"the URL (host {t.host!r})"
            if reason.startswith("cloud metadata"):
                raise FetchError(
                    "forbidden_address",
                    f"address {addr} of {what} is {reason}; it is only reachable if that address is "
                    f"allow-listed explicitly ({_ALLOW_HOSTS_ENV})",
                )
            raise FetchError(
                "forbidden_address",
                f"address {addr} of {what} is {reason}; internal hosts must be allow-listed ({_ALLOW_HOSTS_ENV})",
            )
        if t.odd_spelling:
            raise FetchError(
                "bad_url", f"host {t.host!r} is a non-canonical spelling of IPv4 address {t.literal}; write {t.literal}"
            )
        return addrs

    def _allowed(self, addr: IPAddress, port: int, reason: str, name_entry: bool) -> bool:
        # A hostname entry vouches for that name, but not for cloud metadata: a poisoned answer for an
        # allow-listed name must not hand out credentials. Address/CIDR entries are explicit about addresses.
        if name_entry and not reason.startswith("cloud metadata"):
            return True
        probes = [addr]
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            probes.append(addr.ipv4_mapped)
        if isinstance(addr, ipaddress.IPv6Address) and addr.scope_id:
            probes.append(ipaddress.IPv6Address(int(addr)))
        return any(
            e.network is not None and e.port in (None, port) and p.version == e.network.version and p in e.network
            for e in self._allow
            for p in probes
        )

    async def _request(self, session: aiohttp.ClientSession, t: _Target) -> Fetched | str:
        """One hop: the body as Fetched, or the Location of a redirect."""
        shown = _shorten(str(t.url))
        cap = self.policy.max_bytes
        try:
            async with session.get(t.url, allow_redirects=False) as resp:
                if resp.status in _REDIRECTS:
                    location = resp.headers.get("Location")
                    if location:
                        return location
                if resp.status >= 300:
                    detail = "without a Location header" if resp.status < 400 else "an error"
                    raise FetchError(
                        "upstream_status",
                        f"origin answered {resp.status} {resp.reason or ''}".rstrip()
                        + f" ({detail}) for {shown!r}; check that the URL is reachable and public",
                    )
                if resp.content_length is not None and resp.content_length > cap:
                    resp.close()
                    raise FetchError("too_large", _too_large(shown, f"Content-Length {resp.content_length}", cap))
                chunks: list[bytes] = []
                total = 0
                async for chunk in resp.content.iter_chunked(_CHUNK):
                    total += len(chunk)
                    if total > cap:
                        resp.close()  # drop the connection instead of draining the rest
                        raise FetchError("too_large", _too_large(shown, f"more than {cap} bytes", cap))
                    chunks.append(chunk)
                ctype = resp.headers.get("Content-Type")
                return Fetched(b"".join(chunks), str(resp.url), ctype.strip() if ctype else None, 0)
        except FetchError:
            raise
        except (aiohttp.ClientSSLError, aiohttp.ServerFingerprintMismatch) as e:
            raise FetchError(
                "fetch_failed", f"TLS to {shown!r} failed: {e}; the origin needs a valid certificate"
            ) from None
        except aiohttp.ClientConnectorDNSError as e:
            raise FetchError("dns_failure", f"host of {shown!r} does not resolve: {e}") from None
        except aiohttp.ServerTimeoutError as e:  # includes the connect timeout
            raise FetchError(
                "fetch_timeout", f"{shown!r} timed out ({e}); use a faster origin or raise the fetch timeouts"
            ) from None
        except aiohttp.InvalidURL as e:
            raise FetchError("bad_url", f"URL {shown!r} is invalid: {e}") from None
        except (aiohttp.ClientError, OSError) as e:
            raise FetchError(
                "fetch_failed", f"fetching {shown!r} failed: {type(e).__name__}: {e}; check that the origin is up"
            ) from None

    # -------------------------------------------------------------------------------------------------- data

    def _data(self, url: str) -> Fetched:
        """RFC 2397: data:[<mediatype>][;base64],<data>. Malformed ones are refused, not guessed at."""
        shown = _shorten(url)
        cap = self.policy.max_bytes
        meta, sep, payload = url[5:].partition(",")
        if not sep:
            raise FetchError("bad_url", f"data: URL {shown!r} has no ','; use data:[<type>][;base64],<data>")
        params = meta.split(";")
        is_b64 = len(params) > 1 and params[-1].strip().lower() == "base64"
        if is_b64:
            params.pop()
        mime = params[0].strip().lower()
        if mime and not _MIME.fullmatch(mime):
            raise FetchError("bad_url", f"data: URL {shown!r} has a malformed media type {params[0]!r}")
        for p in params[1:]:
            if not _MIME_PARAM.fullmatch(p.strip()):
                raise FetchError("bad_url", f"data: URL {shown!r} has a malformed parameter {p!r}; use name=value")
        if _BAD_PERCENT.search(payload):
            raise FetchError("bad_url", f"data: URL {shown!r} has a malformed %-escape; use %XX with two hex digits")
        if len(payload) > 3 * cap + 3:  # even all-%XX or base64 decodes to more than the cap
            raise FetchError("too_large", _too_large(shown, "the decoded data: URL", cap))
        if is_b64:
            if (len(payload) - payload.count("%") * 2) * 3 // 4 > cap + 3:
                raise FetchError("too_large", _too_large(shown, "the decoded data: URL", cap))
            raw = unquote_to_bytes(payload).replace(b" ", b"")
            if len(raw) % 4 == 1:
                raise FetchError("bad_url", f"data: URL {shown!r} is not valid base64 (bad length)")
            raw += b"=" * (-len(raw) % 4) if not raw.endswith(b"=") else b""
            try:
                data = base64.b64decode(raw, validate=True)
            except (binascii.Error, ValueError):
                raise FetchError("bad_url", f"data: URL {shown!r} is not valid base64") from None
        else:
            data = unquote_to_bytes(payload)
        if len(data) > cap:
            raise FetchError("too_large", _too_large(shown, f"{len(data)} decoded bytes", cap))
        extra = [p.strip() for p in params[1:]]
        ctype = ";".join([mime or "text/plain", *extra]) if mime or extra else "text/plain;charset=US-ASCII"
        return Fetched(data, url, ctype, 0)

    # -------------------------------------------------------------------------------------------------- file

    async def _file(self, url: str) -> Fetched:
        shown = _shorten(url)
        if not self.policy.allow_file_dirs:
            raise FetchError(
                "forbidden_path",
                f"file:// URLs are disabled ({shown!r}); upload the bytes, or allow a directory ({_ALLOW_DIRS_ENV})",
            )
        try:
            parsed = URL(url)
        except (ValueError, TypeError) as e:
            raise FetchError("bad_url", f"URL {shown!r} does not parse: {e}") from None
        if parsed.host not in (None, "", "localhost") or parsed.user is not None:
            raise FetchError("bad_url", f"file URL {shown!r} names a host; use file:///absolute/path")
        path = parsed.path
        if not path.startswith("/") or "\x00" in path:
            raise FetchError("bad_url", f"file URL {shown!r} needs an absolute path: file:///absolute/path")
        real = os.path.realpath(path)
        roots = [os.path.realpath(d) for d in self.policy.allow_file_dirs]
        if not any(_under(real, root) for root in roots):
            raise FetchError(
                "forbidden_path",
                # the resolved path is not echoed: it would disclose symlink targets to the user
                f"{path!r} resolves outside the allowed directories; move the file under one of them or allow "
                f"its directory ({_ALLOW_DIRS_ENV})",
            )
        return await asyncio.to_thread(self._read_file, real, roots, url, shown)

    def _read_file(self, real: str, roots: list[str], url: str, shown: str) -> Fetched:
        cap = self.policy.max_bytes
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(real, flags)
        except FileNotFoundError:
            raise FetchError("fetch_failed", f"no file at {real!r} ({shown!r}); check the path") from None
        except OSError as e:
            raise FetchError("forbidden_path", f"cannot open {real!r} ({shown!r}): {e.strerror}") from None
        try:
            # The path was checked before opening; re-check what was actually opened (a directory swapped
            # for a symlink in between would show here).
            opened = _fd_path(fd)
            if opened is not None and not any(_under(opened, root) for root in roots):
                raise FetchError("forbidden_path", f"{real!r} changed while opening; refused")
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FetchError("forbidden_path", f"{real!r} is not a regular file; only regular files are read")
            if st.st_size > cap:
                raise FetchError("too_large", _too_large(shown, f"{st.st_size} bytes", cap))
            chunks: list[bytes] = []
            total = 0
            while chunk := os.read(fd, min(_CHUNK * 16, cap + 1 - total)):
                chunks.append(chunk)
                total += len(chunk)
                if total > cap:
                    raise FetchError("too_large", _too_large(shown, f"more than {cap} bytes", cap))
        except OSError as e:
            raise FetchError("fetch_failed", f"reading {real!r} failed: {e.strerror}") from None
        finally:
            os.close(fd)
        return Fetched(b"".join(chunks), url, None, 0)


_MIME = re.compile(r"[a-z0-9!#$&^_.+-]+/[a-z0-9!#$&^_.+-]+")
_MIME_PARAM = re.compile(r"[A-Za-z0-9!#$&^_.+-]+=(?:[A-Za-z0-9!#$&^_.+%-]+|\"[^\"]*\")")
_BAD_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _fd_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _too_large(shown: str, what: str, cap: int) -> str:
    return (
        f"{shown!r}: {what} is over the limit of {cap} bytes; send a smaller file (or raise MM_ENCODER_FETCH_MAX_BYTES)"
    )


def _shorten(url: str, limit: int = 200) -> str:
    return url if len(url) <= limit else url[: limit - 3] + "..."
