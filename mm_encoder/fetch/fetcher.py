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

Every refusal is a `FetchError` (core.errors) with a stable ``code`` and its HTTP status. The address rules
are `addresses.py`, the operator's limits `policy.py`, and the other schemes `data_url.py` and `files.py`.
"""

from __future__ import annotations

import asyncio
import contextvars
import ipaddress
import re
import socket
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from ..core.errors import FetchError
from .addresses import HOSTNAME, IPAddress, check_ip, numeric_ipv4_host, parse_numeric_ipv4
from .data_url import parse_data_url
from .files import read_file_url
from .policy import ALLOW_HOSTS_ENV, AllowList, Fetched, FetchPolicy, shorten, too_large

_MAX_URL_CHARS = 16 * 1024  # for http(s)/file URLs; data: URLs are bounded by max_bytes instead
_CHUNK = 64 * 1024
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


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
    if numeric_ipv4_host(host):
        v4 = parse_numeric_ipv4(host)
        if v4 is None:
            raise FetchError("bad_url", f"host {raw_host!r} of {shown!r} is not a valid IPv4 address")
        # Vetted as the address it denotes (forbidden_address says what it really is), then refused as
        # bad_url anyway if allowed: aiohttp 3.14 rejects such hosts, older ones hand them to getaddrinfo.
        return _Target(url, host, port, v4, odd_spelling=str(v4) != host)
    if not HOSTNAME.fullmatch(host[:-1] if host.endswith(".") else host):  # one trailing dot: an FQDN
        raise FetchError("bad_url", f"host {raw_host!r} of {shown!r} is not a valid hostname")
    return _Target(url, host, port, None)


# --- pinned resolver --------------------------------------------------------------------------------

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


# --- fetcher ----------------------------------------------------------------------------------------

_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class Fetcher:
    """Fetches media URLs under a `FetchPolicy`. One shared aiohttp session, created lazily in the running loop."""

    def __init__(self, policy: FetchPolicy | None = None):
        self.policy = policy or FetchPolicy()
        self._allow = AllowList(self.policy.allow_hosts)
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
                f"fetching {shorten(url)!r} took longer than {self.policy.timeout_s:g} s; "
                "use a faster origin or raise the fetch timeout (MM_ENCODER_FETCH_TIMEOUT_S)",
            ) from None

    async def _fetch(self, url: str) -> Fetched:
        if not isinstance(url, str):
            raise FetchError("bad_url", f"URL must be a string, got {type(url).__name__}")
        url = url.strip(" \t\r\n\f")
        shown = shorten(url)
        if _CONTROL.search(url):
            raise FetchError("bad_url", f"URL {shown!r} contains control characters; percent-encode them")
        m = _SCHEME.match(url)
        if m is None:
            raise FetchError("forbidden_scheme", f"URL {shown!r} has no scheme; use http(s)://, or a data: URL")
        scheme = m.group(1).lower()
        if scheme == "data":  # big ones are decoded off the event loop
            cap = self.policy.max_bytes
            return parse_data_url(url, cap) if len(url) < _CHUNK else await asyncio.to_thread(parse_data_url, url, cap)
        if len(url) > _MAX_URL_CHARS:
            raise FetchError("bad_url", f"URL {shown!r} is longer than {_MAX_URL_CHARS} characters")
        if scheme == "file":
            return await read_file_url(url, self.policy)
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
            target = _http_target(url, shorten(str(url)))
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
                    f"{shorten(str(url))!r} redirects again after {redirects} redirect(s), over the limit of "
                    f"{self.policy.max_redirects}; link the final URL (or raise MM_ENCODER_FETCH_MAX_REDIRECTS)",
                )
            redirects += 1
            try:
                nxt = url.join(URL(location))
            except (ValueError, TypeError) as e:
                raise FetchError(
                    "bad_url", f"{shorten(str(url))!r} redirects to unparsable {location!r}: {e}"
                ) from None
            if nxt.scheme not in ("http", "https"):
                raise FetchError(
                    "forbidden_scheme",
                    f"{shorten(str(url))!r} redirects to a {nxt.scheme or 'scheme-less'}: URL; "
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
        named = self._allow.names(t.host, t.port)
        for addr in addrs:
            reason = check_ip(addr)
            if reason is None or self._allow.admits(addr, t.port, reason, named):
                continue
            what = f"host {t.host!r}" if t.literal is None else "the URL"
            if t.odd_spelling:
                what = f"the URL (host {t.host!r})"
            if reason.startswith("cloud metadata"):
                raise FetchError(
                    "forbidden_address",
                    f"address {addr} of {what} is {reason}; it is only reachable if that address is "
                    f"allow-listed explicitly ({ALLOW_HOSTS_ENV})",
                )
            raise FetchError(
                "forbidden_address",
                f"address {addr} of {what} is {reason}; internal hosts must be allow-listed ({ALLOW_HOSTS_ENV})",
            )
        if t.odd_spelling:
            raise FetchError(
                "bad_url", f"host {t.host!r} is a non-canonical spelling of IPv4 address {t.literal}; write {t.literal}"
            )
        return addrs

    async def _request(self, session: aiohttp.ClientSession, t: _Target) -> Fetched | str:
        """One hop: the body as Fetched, or the Location of a redirect."""
        shown = shorten(str(t.url))
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
                    raise FetchError("too_large", too_large(shown, f"Content-Length {resp.content_length}", cap))
                chunks: list[bytes] = []
                total = 0
                async for chunk in resp.content.iter_chunked(_CHUNK):
                    total += len(chunk)
                    if total > cap:
                        resp.close()  # drop the connection instead of draining the rest
                        raise FetchError("too_large", too_large(shown, f"more than {cap} bytes", cap))
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
