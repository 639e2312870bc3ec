"""The media fetcher against real servers on loopback: SSRF refusals, redirects, caps, timeouts, data:, file://.

A "canary" TCP listener counts every connection it accepts; forbidden URLs point at it and must leave it at
zero. An aiohttp "origin" is allow-listed by address and port only, so the canary (another port) stays
forbidden. No aiohttp mocks; DNS answers are faked only by replacing the running loop's getaddrinfo.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import os
import socket
from dataclasses import dataclass, field
from urllib.parse import quote

import pydantic
import pytest
from aiohttp import web

from mm_encoder.core.errors import FetchError, MMEncoderError
from mm_encoder.fetch import Fetched, Fetcher, FetchPolicy, check_ip

# ------------------------------------------------------------------------------------------------ fixtures


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


HAS_V6 = _has_ipv6_loopback()


@dataclass
class Canary:
    """TCP listeners on 127.0.0.1 (and ::1) that count accepted connections, answer 418 and hang up."""

    port4: int = 0
    port6: int | None = None
    peers: list[tuple] = field(default_factory=list)
    sentinels: set[tuple] = field(default_factory=set)
    waiters: dict[tuple, asyncio.Event] = field(default_factory=dict)

    async def on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = tuple(writer.get_extra_info("peername")[:2])
        self.peers.append(peer)
        if peer in self.waiters:
            self.waiters[peer].set()
        writer.write(b"HTTP/1.1 418 Canary\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        writer.close()

    async def hits(self) -> int:
        """Connections accepted so far, not counting our own probes.

        Barrier instead of a sleep: open a probe connection on each listener and wait until the canary has
        accepted it; accept order is FIFO, so any earlier connection has been counted by then.
        """
        listeners = [("127.0.0.1", self.port4)] + ([("::1", self.port6)] if self.port6 else [])
        for host, port in listeners:
            _, writer = await asyncio.open_connection(host, port)
            me = tuple(writer.get_extra_info("sockname")[:2])
            self.sentinels.add(me)
            if me not in self.peers:
                await asyncio.wait_for(self.waiters.setdefault(me, asyncio.Event()).wait(), 5)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        return sum(p not in self.sentinels for p in self.peers)


@pytest.fixture
async def canary():
    c = Canary()
    servers = [await asyncio.start_server(c.on_connect, "127.0.0.1", 0)]
    c.port4 = servers[0].sockets[0].getsockname()[1]
    if HAS_V6:
        servers.append(await asyncio.start_server(c.on_connect, "::1", 0))
        c.port6 = servers[1].sockets[0].getsockname()[1]
    yield c
    for s in servers:
        s.close()
        await s.wait_closed()


@dataclass
class Origin:
    port: int
    never: asyncio.Event  # the slow handler waits on it; set in teardown only
    stream_done: asyncio.Event  # the chunked handler finished, one way or the other
    stream: dict = field(default_factory=dict)
    seen_headers: list = field(default_factory=list)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@pytest.fixture
async def origin():
    never, stream_done = asyncio.Event(), asyncio.Event()
    state = Origin(0, never, stream_done)

    async def hello(request: web.Request) -> web.Response:
        state.seen_headers.append(dict(request.headers))
        resp = web.Response(body=b"\x89PNG fake image", content_type="image/png")
        resp.set_cookie("session", "secret")
        return resp

    async def redirect(request: web.Request) -> web.Response:
        n = int(request.match_info["n"])
        if n == 0:
            return web.Response(body=b"landed", content_type="text/plain")
        raise web.HTTPFound(f"/redirect/{n - 1}")  # relative: resolved against the current URL

    async def to(request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query["u"])

    async def status(request: web.Request) -> web.Response:
        return web.Response(status=int(request.match_info["code"]), text="nope")

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * int(request.query["n"]))

    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        state.stream["sent"] = 0
        try:
            for _ in range(200):  # 12.5 MiB if nobody hangs up
                await resp.write(b"y" * 65536)
                state.stream["sent"] += 65536
                await asyncio.sleep(0)  # a yield, so the client gets to read and hang up
            state.stream["aborted"] = False
        except ConnectionError:
            state.stream["aborted"] = True
        finally:
            stream_done.set()
        return resp

    async def slow(request: web.Request) -> web.Response:
        await never.wait()
        return web.Response(text="too late")

    app = web.Application()
    app.router.add_get("/hello", hello)
    app.router.add_get("/redirect/{n}", redirect)
    app.router.add_get("/to", to)
    app.router.add_get("/status/{code}", status)
    app.router.add_get("/big", big)
    app.router.add_get("/chunked", chunked)
    app.router.add_get("/slow", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.port = runner.addresses[0][1]
    yield state
    never.set()  # let the slow handler finish, or cleanup waits for it
    await runner.cleanup()


def policy_for(origin: Origin, **kw) -> FetchPolicy:
    return FetchPolicy(allow_hosts=(f"127.0.0.1:{origin.port}",), **kw)


@pytest.fixture
async def fetcher(origin):
    async with Fetcher(policy_for(origin)) as f:
        yield f


async def refused(f: Fetcher, url: str, code: str) -> FetchError:
    """Fetching `url` raises FetchError with `code` (or one of "a|b")."""
    with pytest.raises(FetchError) as info:
        await f.fetch(url)
    assert info.value.code in code.split("|"), str(info.value)
    assert info.value.http_status == FetchError.codes[info.value.code]
    return info.value


class FakeDNS:
    """Replaces the running loop's getaddrinfo for names under .test; counts lookups per name."""

    def __init__(self, loop: asyncio.AbstractEventLoop, answers: dict[str, list[str]], later: dict[str, list[str]]):
        self.answers, self.later, self.calls, self._real = answers, later, [], loop.getaddrinfo

    async def __call__(self, host, port, *args, **kwargs):
        if host not in self.answers:
            return await self._real(host, port, *args, **kwargs)
        self.calls.append(host)
        out = []
        for a in self.answers[host]:
            fam = socket.AF_INET6 if ":" in a else socket.AF_INET
            addr = (a, port) if fam == socket.AF_INET else (a, port, 0, 0)
            out.append((fam, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", addr))
        self.answers[host] = self.later.get(host, self.answers[host])  # a rebinding server changes its mind
        return out


@pytest.fixture
async def fake_dns(monkeypatch):
    loop = asyncio.get_running_loop()

    def install(answers: dict[str, list[str]], later: dict[str, list[str]] | None = None) -> FakeDNS:
        dns = FakeDNS(loop, answers, later or {})
        monkeypatch.setattr(loop, "getaddrinfo", dns)
        return dns

    return install


# ------------------------------------------------------------------------------------------------ check_ip

FORBIDDEN_IPS = [
    ("127.0.0.1", "loopback"),
    ("127.255.255.254", "loopback"),
    ("::1", "loopback"),
    ("10.1.2.3", "private"),
    ("172.16.0.1", "private"),
    ("172.31.255.255", "private"),
    ("192.168.1.1", "private"),
    ("fd12:3456::1", "private"),
    ("fc00::1", "private"),
    ("169.254.1.1", "link-local"),
    ("fe80::1", "link-local"),
    ("fe80::1%eth0", "link-local"),
    ("169.254.169.254", "cloud metadata"),
    ("169.254.170.2", "cloud metadata"),
    ("fd00:ec2::254", "cloud metadata"),
    ("100.100.100.200", "cloud metadata"),
    ("168.63.129.16", "cloud metadata"),  # Azure WireServer: a *public* address, so is_global alone misses it
    ("100.64.0.1", "CGNAT"),
    ("100.127.255.254", "CGNAT"),
    ("224.0.0.1", "multicast"),  # is_global says True for this one
    ("239.255.255.250", "multicast"),
    ("ff02::1", "multicast"),
    ("255.255.255.255", "broadcast"),
    ("240.0.0.1", "reserved"),
    ("0.0.0.0", "unspecified"),
    ("0.1.2.3", "unspecified"),
    ("::", "unspecified"),
    ("198.18.0.1", "benchmarking"),
    ("198.19.255.1", "benchmarking"),
    ("2001:2::1", "benchmarking"),
    ("192.0.2.1", "documentation"),
    ("198.51.100.7", "documentation"),
    ("203.0.113.9", "documentation"),
    ("2001:db8::1", "documentation"),
    ("192.0.0.8", "IETF"),
    ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped: judged by the embedded address
    ("::ffff:169.254.169.254", "cloud metadata"),
    ("::ffff:10.0.0.1", "private"),
    ("::127.0.0.1", "IPv4-compatible"),
    ("::8.8.8.8", "IPv4-compatible"),
    ("64:ff9b::7f00:1", "loopback"),  # NAT64 of 127.0.0.1
    ("64:ff9b::a9fe:a9fe", "cloud metadata"),  # NAT64 of 169.254.169.254
    ("64:ff9b:1::1", "NAT64 local-use"),
    ("2002:7f00:1::1", "loopback"),  # 6to4 of 127.0.0.1
    ("2002:c0a8:101::1", "private"),  # 6to4 of 192.168.1.1
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo"),
    ("fec0::1", "site-local"),
    ("100::1", "discard"),
    ("4000::1", "reserved"),  # outside 2000::/3 (is_global says True)
]


@pytest.mark.parametrize(("addr", "reason"), FORBIDDEN_IPS)
def test_check_ip_refuses(addr: str, reason: str) -> None:
    got = check_ip(ipaddress.ip_address(addr))
    assert got is not None and reason in got, (addr, got)


@pytest.mark.parametrize(
    "addr",
    ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700::1111", "2001:4860:4860::8888", "::ffff:8.8.8.8",
     "64:ff9b::808:808", "2002:808:808::1", "172.32.0.1", "100.128.0.1", "11.0.0.1"],
)  # fmt: skip
def test_check_ip_public(addr: str) -> None:
    assert check_ip(ipaddress.ip_address(addr)) is None


def test_error_codes_and_statuses() -> None:
    assert FetchError.codes == {
        "bad_url": 400,
        "forbidden_scheme": 400,
        "forbidden_address": 403,
        "forbidden_path": 403,
        "dns_failure": 422,
        "too_many_redirects": 422,
        "too_large": 413,
        "fetch_timeout": 504,
        "upstream_status": 422,
        "fetch_failed": 502,
    }
    e = FetchError("too_large", "big")
    assert isinstance(e, MMEncoderError) and e.http_status == 413 and str(e) == "[too_large] big"
    with pytest.raises(ValueError):
        FetchError("nope", "x")


# ------------------------------------------------------------------------------- forbidden URLs vs the canary

F, B = "forbidden_address", "bad_url"
CANARY_URLS = [
    ("http://127.0.0.1:{p4}/", F),
    ("https://127.0.0.1:{p4}/", F),
    ("http://localhost:{p4}/", F),
    ("http://LOCALHOST.:{p4}/", F + "|dns_failure"),  # some resolvers do not map "localhost." via /etc/hosts
    ("http://2130706433:{p4}/", F),  # decimal
    ("http://0x7f000001:{p4}/", F),  # hex
    ("http://017700000001:{p4}/", F),  # octal, one part
    ("http://0177.0.0.1:{p4}/", F),  # octal first octet
    ("http://127.1:{p4}/", F),  # two parts
    ("http://0x7f.1:{p4}/", F),
    ("http://0x7f.0.0.1:{p4}/", F),
    ("http://127.0.0.1.:{p4}/", F),  # trailing dot
    ("http://１２７.０.０.１:{p4}/", F),  # fullwidth digits, IDNA-normalised by yarl
    ("http://0:{p4}/", F),
    ("http://0.0.0.0:{p4}/", F),  # Linux connects 0.0.0.0 to the local host
    ("http://[::ffff:127.0.0.1]:{p4}/", F),
    ("http://[::ffff:7f00:1]:{p4}/", F),
    ("http://[::ffff:0.0.0.0]:{p4}/", F),
    ("http://[::127.0.0.1]:{p4}/", F),  # IPv4-compatible
    ("http://[64:ff9b::127.0.0.1]:{p4}/", F),  # NAT64
    ("http://[2002:7f00:1::1]:{p4}/", F),  # 6to4
    ("http://[::1]:{p6}/", F),
    ("http://[0:0:0:0:0:0:0:1]:{p6}/", F),
    ("http://[::]:{p6}/", F),
    ("http://[fe80::1%25lo]:{p6}/", F),
    ("http://user:pw@127.0.0.1:{p4}/", B),
    ("http://127.0.0.1:{p4}@127.0.0.1:{p4}/", B),
    ("http://%31%32%37.0.0.1:{p4}/", B),
    ("http://0x7f.0.0.0x1.1:{p4}/", B),  # five parts
    ("http://09.0.0.1:{p4}/", B),  # not octal
    ("http://127.0.0.1:{p4}\t/", B),
    ("http://[::1:{p6}/", B),
    ("http://127.0.0.1:99999/", B),
    ("http:///x", B),
]


@pytest.mark.parametrize(("template", "code"), CANARY_URLS)
async def test_forbidden_urls_never_connect(fetcher: Fetcher, canary: Canary, template: str, code: str) -> None:
    url = template.format(p4=canary.port4, p6=canary.port6 or canary.port4)
    err = await refused(fetcher, url, code)
    if err.code == F:
        assert "allow-listed" in err.message or "non-canonical" in err.message or "refused" in err.message
    assert await canary.hits() == 0


async def test_canary_counts_real_connections(origin: Origin, canary: Canary) -> None:
    """Positive control: once the canary's port is allow-listed, the same fetch does connect."""
    assert await canary.hits() == 0
    async with Fetcher(FetchPolicy(allow_hosts=(f"127.0.0.1:{canary.port4}",))) as f:
        err = await refused(f, f"http://127.0.0.1:{canary.port4}/", "upstream_status")
    assert "418" in err.message
    assert await canary.hits() == 1


@pytest.mark.skipif(not HAS_V6, reason="no IPv6 loopback")
async def test_ipv6_allow_entry(canary: Canary) -> None:
    async with Fetcher(FetchPolicy(allow_hosts=(f"[::1]:{canary.port6}",))) as f:
        await refused(f, f"http://[::1]:{canary.port6}/", "upstream_status")
        await refused(f, f"http://127.0.0.1:{canary.port4}/", "forbidden_address")
    assert await canary.hits() == 1


async def test_odd_spelling_of_allowed_address_is_bad_url(fetcher: Fetcher, origin: Origin) -> None:
    err = await refused(fetcher, f"http://0x7f000001:{origin.port}/hello", "bad_url")
    assert "127.0.0.1" in err.message
    assert origin.seen_headers == []


# --------------------------------------------------------------------------------------------- origin fetches


async def test_fetch_ok(fetcher: Fetcher, origin: Origin) -> None:
    got = await fetcher.fetch(origin.url("/hello"))
    assert got == Fetched(b"\x89PNG fake image", origin.url("/hello"), "image/png", 0)


async def test_headers_and_no_cookies(origin: Origin) -> None:
    async with Fetcher(policy_for(origin, user_agent="ua-test/1")) as f:
        await f.fetch(origin.url("/hello"))
        await f.fetch(origin.url("/hello"))  # the first answer set a cookie; it must not come back
    first, second = origin.seen_headers
    assert first["User-Agent"] == "ua-test/1"
    assert "Cookie" not in second and "Authorization" not in second


async def test_redirect_chain_within_limit(fetcher: Fetcher, origin: Origin) -> None:
    got = await fetcher.fetch(origin.url("/redirect/3"))
    assert (got.data, got.url, got.redirects) == (b"landed", origin.url("/redirect/0"), 3)


async def test_too_many_redirects(fetcher: Fetcher, origin: Origin) -> None:
    err = await refused(fetcher, origin.url("/redirect/4"), "too_many_redirects")
    assert "3" in err.message
    async with Fetcher(policy_for(origin, max_redirects=0)) as f:
        await refused(f, origin.url("/redirect/1"), "too_many_redirects")
        assert (await f.fetch(origin.url("/redirect/0"))).redirects == 0


@pytest.mark.parametrize("target", ["http://127.0.0.1:{p4}/", "http://localhost:{p4}/x", "http://2130706433:{p4}/"])
async def test_redirect_to_forbidden_address(fetcher: Fetcher, origin: Origin, canary: Canary, target: str) -> None:
    url = origin.url("/to?u=" + target.format(p4=canary.port4))
    await refused(fetcher, url, "forbidden_address")
    assert await canary.hits() == 0


@pytest.mark.parametrize(
    "target", ["file:///etc/passwd", "data:text/plain,hello", "data:image/png;base64,AAAA", "gopher://x/", "ftp://x/"]
)
async def test_redirect_to_other_schemes_refused(fetcher: Fetcher, origin: Origin, target: str) -> None:
    err = await refused(fetcher, origin.url("/to?u=" + quote(target, safe="")), "forbidden_scheme")
    assert "redirect" in err.message


@pytest.mark.parametrize("code", [404, 500])
async def test_upstream_status(fetcher: Fetcher, origin: Origin, code: int) -> None:
    err = await refused(fetcher, origin.url(f"/status/{code}"), "upstream_status")
    assert str(code) in err.message


async def test_chunked_body_over_cap_is_aborted(origin: Origin) -> None:
    async with Fetcher(policy_for(origin, max_bytes=100_000)) as f:
        await refused(f, origin.url("/chunked"), "too_large")
    await asyncio.wait_for(origin.stream_done.wait(), 5)
    assert origin.stream["aborted"] is True  # the origin saw us hang up before it sent everything
    assert origin.stream["sent"] < 200 * 65536


async def test_content_length_over_cap(origin: Origin) -> None:
    async with Fetcher(policy_for(origin, max_bytes=1000)) as f:
        err = await refused(f, origin.url("/big?n=1001"), "too_large")
        assert "Content-Length 1001" in err.message
        assert len((await f.fetch(origin.url("/big?n=1000"))).data) == 1000


async def test_slow_origin_times_out(origin: Origin) -> None:
    async with Fetcher(policy_for(origin, timeout_s=0.5)) as f:
        err = await refused(f, origin.url("/slow"), "fetch_timeout")
    assert "0.5" in err.message


# ------------------------------------------------------------------------------------------------ allow-list


async def test_hostname_entry(origin: Origin, canary: Canary, fake_dns) -> None:
    dns = fake_dns({"other.test": ["127.0.0.1"]})
    async with Fetcher(FetchPolicy(allow_hosts=(f"localhost:{origin.port}",))) as f:
        assert (await f.fetch(origin.url("/hello", host="localhost"))).data.startswith(b"\x89PNG")
        # The entry names a host, not an address: neither the literal nor another name for it is allowed...
        await refused(f, origin.url("/hello"), "forbidden_address")
        await refused(f, origin.url("/hello", host="other.test"), "forbidden_address")
        # ...nor the same name on another port.
        await refused(f, f"http://localhost:{canary.port4}/", "forbidden_address")
    assert dns.calls == ["other.test"]
    assert len(origin.seen_headers) == 1
    assert await canary.hits() == 0


async def test_cidr_entry_is_address_based(origin: Origin, canary: Canary) -> None:
    async with Fetcher(FetchPolicy(allow_hosts=("127.0.0.0/8",))) as f:
        await f.fetch(origin.url("/hello"))
        await f.fetch(origin.url("/hello", host="localhost"))
    async with Fetcher(FetchPolicy(allow_hosts=("10.0.0.0/8", "fd00::/8"))) as f:
        await refused(f, origin.url("/hello"), "forbidden_address")
    assert len(origin.seen_headers) == 2


async def test_hostname_entry_never_unlocks_metadata(fake_dns) -> None:
    fake_dns({"meta.test": ["169.254.169.254"]})
    async with Fetcher(FetchPolicy(allow_hosts=("meta.test",))) as f:
        err = await refused(f, "http://meta.test/latest/meta-data/", "forbidden_address")
    assert "cloud metadata" in err.message


async def test_any_forbidden_address_refuses_the_host(fake_dns) -> None:
    """One public and one private answer: refused (the connector could pick either)."""
    dns = fake_dns({"mixed.test": ["93.184.216.34", "10.0.0.5"]})
    async with Fetcher() as f:
        err = await refused(f, "http://mixed.test/", "forbidden_address")
    assert "10.0.0.5" in err.message and dns.calls == ["mixed.test"]


@pytest.mark.parametrize(
    "entry", ["localhost", "localhost:8080", "1.2.3.4", "1.2.3.4:80", "10.0.0.0/8", "[::1]:8080", "fd00::/8", "::1"]
)
def test_allow_entry_forms(entry: str) -> None:
    assert FetchPolicy(allow_hosts=(entry,)).allow_hosts == (entry,)


@pytest.mark.parametrize(
    "entry", ["", "10.0.0.1/8", "host:0", "host:http", "[::1", "[::1]x", "a b", "127.1", "::1/200"]
)
def test_allow_entry_invalid(entry: str) -> None:
    with pytest.raises(pydantic.ValidationError):
        FetchPolicy(allow_hosts=(entry,))


# ------------------------------------------------------------------------------------------------ resolve once


async def test_resolves_once_and_connects_to_the_vetted_address(origin: Origin, fake_dns) -> None:
    """A rebinding DNS server: first answer the allowed origin, then 127.0.0.2 (forbidden, nothing listens).

    The fetch must succeed with a single lookup: aiohttp connects to what we vetted, it never asks again.
    """
    dns = fake_dns({"rebind.test": ["127.0.0.1"]}, later={"rebind.test": ["127.0.0.2"]})
    async with Fetcher(policy_for(origin)) as f:
        got = await f.fetch(origin.url("/hello", host="rebind.test"))
        assert got.data.startswith(b"\x89PNG") and dns.calls == ["rebind.test"]
        # The next fetch resolves again (once) and refuses the new answer before connecting.
        err = await refused(f, origin.url("/hello", host="rebind.test"), "forbidden_address")
    assert "127.0.0.2" in err.message and dns.calls == ["rebind.test"] * 2
    assert len(origin.seen_headers) == 1


async def test_one_lookup_per_hop(origin: Origin, fake_dns) -> None:
    dns = fake_dns({"hop.test": ["127.0.0.1"]})
    async with Fetcher(policy_for(origin)) as f:
        got = await f.fetch(origin.url("/redirect/2", host="hop.test"))
    assert got.redirects == 2 and dns.calls == ["hop.test"] * 3


async def test_dns_failure(fake_dns) -> None:
    fake_dns({"empty.test": []})
    async with Fetcher() as f:
        await refused(f, "http://empty.test/", "dns_failure")
        await refused(f, "http://does-not-exist.invalid/", "dns_failure")


async def test_pinned_resolver_fails_closed() -> None:
    from mm_encoder.fetch.fetcher import _PinnedResolver

    with pytest.raises(OSError):
        await _PinnedResolver().resolve("example.com", 80)


# ------------------------------------------------------------------------------------------------------ data:


@pytest.mark.parametrize(
    ("url", "data", "ctype"),
    [
        ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n").decode(), b"\x89PNG\r\n", "image/png"),
        ("DATA:image/png;BASE64,aGVsbG8=", b"hello", "image/png"),
        ("data:;base64,aGVsbG8", b"hello", "text/plain;charset=US-ASCII"),  # unpadded is accepted
        ("data:,hello%20world%00%FF", b"hello world\x00\xff", "text/plain;charset=US-ASCII"),
        ("data:text/plain;charset=utf-8,%E2%9C%93", "✓".encode(), "text/plain;charset=utf-8"),
        ("data:application/octet-stream,", b"", "application/octet-stream"),
    ],
)
async def test_data_urls(url: str, data: bytes, ctype: str) -> None:
    async with Fetcher() as f:
        got = await f.fetch(url)
    assert (got.data, got.content_type, got.redirects, got.url) == (data, ctype, 0, url)


@pytest.mark.parametrize(
    "url",
    [
        "data:text/plain",  # no comma
        "data:image/png;base64,!!!!",
        "data:image/png;base64,aGVsb",  # impossible length
        "data:image/png;base64,aG=Vs",
        "data:,%zz",
        "data:,50%",
        "data:not a type,x",
        "data:text/plain;charset,x",
    ],
)
async def test_data_urls_malformed(url: str) -> None:
    async with Fetcher() as f:
        await refused(f, url, "bad_url")


async def test_data_url_cap_applies_to_decoded_bytes() -> None:
    async with Fetcher(FetchPolicy(max_bytes=10)) as f:
        assert (await f.fetch("data:;base64," + base64.b64encode(b"x" * 10).decode())).data == b"x" * 10
        await refused(f, "data:;base64," + base64.b64encode(b"x" * 11).decode(), "too_large")
        await refused(f, "data:,xxxxxxxxxxx", "too_large")
        assert (await f.fetch("data:," + "%41" * 10)).data == b"A" * 10  # 30 chars, 10 bytes
        await refused(f, "data:;base64," + base64.b64encode(b"x" * 100_000).decode(), "too_large")


# ---------------------------------------------------------------------------------------------------- schemes


@pytest.mark.parametrize(
    "url",
    ["ftp://example.com/x", "gopher://127.0.0.1:70/_x", "javascript:alert(1)", "ws://example.com/", "jar:file:///x!/",
     "example.com/image.png", "//example.com/image.png", "/etc/passwd", "", "dict://127.0.0.1:11211/stat"],
)  # fmt: skip
async def test_other_schemes_refused(url: str) -> None:
    async with Fetcher() as f:
        await refused(f, url, "forbidden_scheme")


# ---------------------------------------------------------------------------------------------------- file://


@pytest.fixture
def files(tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "sub" / "a b.png").write_bytes(b"image bytes")
    (tmp_path / "secret.txt").write_bytes(b"secret")
    (tmp_path / "allowed-evil").mkdir()
    (tmp_path / "allowed-evil" / "x").write_bytes(b"evil")
    (allowed / "link").symlink_to(tmp_path / "secret.txt")
    (allowed / "dirlink").symlink_to(tmp_path)
    (allowed / "inner-link").symlink_to(allowed / "sub" / "a b.png")
    return tmp_path


async def test_file_under_allowed_dir(files) -> None:
    async with Fetcher(FetchPolicy(allow_file_dirs=(str(files / "allowed"),))) as f:
        url = f"file://{files}/allowed/sub/a%20b.png"
        assert await f.fetch(url) == Fetched(b"image bytes", url, None, 0)
        assert (await f.fetch(f"file://localhost{files}/allowed/inner-link")).data == b"image bytes"


@pytest.mark.parametrize(
    "path",
    ["/etc/passwd", "{t}/secret.txt", "{t}/allowed/link", "{t}/allowed/dirlink/secret.txt",
     "{t}/allowed/../secret.txt", "{t}/allowed/sub/../../secret.txt", "{t}/allowed/%2e%2e/secret.txt",
     "{t}/allowed-evil/x", "{t}", "{t}/allowed/sub"],  # the last: inside, but a directory
)  # fmt: skip
async def test_file_outside_refused(files, path: str) -> None:
    async with Fetcher(FetchPolicy(allow_file_dirs=(str(files / "allowed"),))) as f:
        await refused(f, "file://" + path.format(t=files), "forbidden_path")


async def test_file_special_cases(files) -> None:
    allowed = files / "allowed"
    os.mkfifo(allowed / "fifo")
    (allowed / "big").write_bytes(b"z" * 11)
    async with Fetcher(FetchPolicy(allow_file_dirs=(str(allowed),), max_bytes=10)) as f:
        await refused(f, f"file://{allowed}/fifo", "forbidden_path")  # not a regular file; must not block
        await refused(f, f"file://{allowed}/big", "too_large")
        await refused(f, f"file://{allowed}/missing", "fetch_failed")
        await refused(f, f"file://otherhost{allowed}/big", "bad_url")
        await refused(f, "file:relative/path", "bad_url")
    async with Fetcher() as f:  # off by default
        err = await refused(f, f"file://{allowed}/sub/a%20b.png", "forbidden_path")
        assert "disabled" in err.message


# ------------------------------------------------------------------------------------------------- lifecycle


async def test_session_is_shared_and_closed(origin: Origin) -> None:
    f = Fetcher(policy_for(origin))
    await f.fetch(origin.url("/hello"))
    session = f._session
    await f.fetch(origin.url("/hello"))
    assert f._session is session and session is not None
    await f.close()
    assert session.closed and f._session is None
    await f.close()  # idempotent
