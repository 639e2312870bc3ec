"""`EncoderChain`: the one client for both questions a component asks the encoders:
- `describe`: the header only (HEAD through the tiers, which fetch and cache the body on a miss
  without sending it; over RPC, `header_only`), for the frontend;
- `fetch`: the body (POST `/v1/encode/fetch` through the tiers, which never wait on another
  request's fill of the entry; over RPC, the reply's body), for the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import ssl
from typing import Any

import aiohttp

from ..core import wire
from ..core.errors import (
    Draining,
    EncoderSiteUnreachable,
    EncoderUnavailable,
    RemoteError,
    RequestTooLarge,
    WireError,
)
from ..core.handle import MAX_HEADER_BYTES, ROUTE, chain_url
from ..core.requests import EncodeReply, EncodeRequest
from ..runtime import tracing
from ..runtime.dynamo import TOO_LARGE_HINT, is_too_large, payload

log = logging.getLogger(__name__)
# How many times in all one item is asked for while the encoders answer `draining` (`EncoderChain._call`).
DRAINING_TRIES = 3


class EncoderChain:
    """The encoders as one component reaches them: the HTTP cache chain first (`http_url`, the first
    tier or a worker), Dynamo RPC (`rpc_client`) when the chain itself fails or is not configured.
    With `tls` (this component's client context, `security.tls`) the chain is HTTPS, the server
    checked against the deployment's CA and this component's certificate presented."""

    def __init__(self, *, http_url: str | None = None, route: str = "cluster,shared", rpc_client: Any = None,
                 timeout_s: float = 600.0, tls: ssl.SSLContext | None = None):
        if http_url is None and rpc_client is None:
            raise ValueError("EncoderChain needs an HTTP cache chain, a Dynamo RPC client, or both")
        if http_url is not None and (tls is not None) != http_url.startswith("https://"):
            raise ValueError(f"cache chain {http_url}: " + ("with TLS the chain is an https:// URL" if tls else
                                                            "an https:// chain needs this component's TLS files"))
        if not ROUTE.fullmatch(route):
            raise ValueError(f"cache route {route!r} is not a comma-separated list of tier names")
        self.http_url = chain_url(http_url) if http_url else None
        self.route = route
        self.rpc_client = rpc_client
        self.tls = tls
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5)
        self._session: aiohttp.ClientSession | None = None
        self.fallbacks = 0
        self.draining_retries = 0  # answers `draining` asked again (`_call`)
        self.body_bytes = 0  # wire bodies this process received: stays 0 where only `describe` is used

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def describe(self, source: EncodeRequest, route: str | None = None) -> tuple[wire.WireHeader, str]:
        """The item's header (its body is computed and cached on the way, never sent here). `route`:
        this call's X-Cache-Route (a handle's), else the chain's."""
        header, where = await self._call(source, header_only=True, route=route)
        if not isinstance(header, wire.WireHeader):
            raise RemoteError("the encoder answered a body where a header was asked for")
        return header, where

    async def fetch(self, source: EncodeRequest, route: str | None = None) -> tuple[bytes, str]:
        """The item's wire-v1 body; any level that lacks it forwards, the encoder re-encodes. `route`:
        this call's X-Cache-Route (a handle's), else the chain's."""
        body, where = await self._call(source, header_only=False, route=route)
        if not isinstance(body, bytes):
            raise RemoteError("the encoder answered a header where a body was asked for")
        return body, where

    async def _call(self, source: EncodeRequest, *, header_only: bool,
                    route: str | None) -> tuple[wire.WireHeader | bytes, str]:
        """One answer; a `draining` one (a replica leaving on a scale-down or a rollout) is asked again
        at once, `DRAINING_TRIES` in all, instead of failing the request: another replica can answer
        now, and each try reaches another (the tiers retry a 503 on another upstream and never mark one
        down, a draining worker closes the connection it answered on, Dynamo's round robin moves on).
        An `overloaded` 503 is not asked again here: the tiers already tried other encoders, and its
        Retry-After is the caller's to honour."""
        for attempt in range(1, DRAINING_TRIES + 1):
            try:
                return await self._once(source, header_only, route or self.route)
            except RemoteError as e:
                if e.code != Draining.code or attempt == DRAINING_TRIES:
                    raise
                self.draining_retries += 1
                log.info("an encoder is draining (%s); asking again (try %d of %d)", e.message, attempt + 1,
                         DRAINING_TRIES)
        raise AssertionError("not reached: the last try returns or raises")

    async def _once(self, source: EncodeRequest, header_only: bool, route: str) -> tuple[wire.WireHeader | bytes, str]:
        if self.http_url is not None:
            try:
                return await self._http(self.http_url, source, header_only, route)
            except EncoderUnavailable as e:
                if self.rpc_client is None:
                    raise
                self.fallbacks += 1
                if not self.rpc_client.instance_ids():
                    raise  # no encoder over RPC either: the chain's own answer says more (a site unreachable)
                log.warning("cache chain failed (%s); falling back to direct RPC", e.message)
        return await self._rpc(source, header_only)

    async def _http(self, chain: str, source: EncodeRequest, header_only: bool,
                    route: str) -> tuple[wire.WireHeader | bytes, str]:
        if self._session is None or self._session.closed:
            # one pool per chain: connections (and, with TLS, sessions) are kept and reused
            connector = aiohttp.TCPConnector(ssl=self.tls) if self.tls is not None else None
            self._session = aiohttp.ClientSession(timeout=self.timeout, max_field_size=MAX_HEADER_BYTES,
                                                  connector=connector)
        # the canonical body and its sha256 (`source.key()`, without writing the body twice): the tiers
        # hash the body themselves and refuse a key that differs
        body_out = source.body()
        headers = {"Accept": wire.CONTENT_TYPE, "Content-Type": "application/json",
                   "X-Cache-Key": hashlib.sha256(body_out).hexdigest(), "X-Cache-Route": route,
                   "X-MM-Model": source.model}  # an encoder site's shared tier routes by it (several models)
        tracing.inject(headers)  # the tiers pass it on, and the worker continues the caller's trace
        method, url = ("HEAD", chain) if header_only else ("POST", chain + "/fetch")
        for attempt in (1, 2):
            try:
                async with self._session.request(method, url, data=body_out, headers=headers) as r:
                    body = b"" if header_only else await r.read()
                    status, rh = r.status, r.headers
                break
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                # a kept-alive connection the server closed as the request went out (an nginx reload:
                # its old workers close their idle connections). Encode requests are idempotent: once more
                if attempt == 2:
                    raise EncoderUnavailable(f"cache chain {chain} unreachable: {type(e).__name__}: {e}") from None
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                raise EncoderUnavailable(f"cache chain {chain} unreachable: {type(e).__name__}: {e}") from None
        where = f"http:{rh.get('X-Cache-Status', '')}"
        if status == 200:
            if header_only:
                try:
                    return wire.WireHeader.from_meta(json.loads(rh.get("X-MM-Meta", ""))), where
                except (ValueError, WireError) as e:
                    raise RemoteError(f"the cache chain's answer has no valid X-MM-Meta header: {e}") from None
            self.body_bytes += len(body)
            return body, where
        code = rh.get("X-MM-Error-Code")
        if code is None:
            error = _json_error(body) if rh.get("Content-Type", "").startswith("application/json") else None
            if error is None and status in (502, 503, 504):  # the chain failed, not the encoder
                raise EncoderUnavailable(f"cache chain answered {status}")
            if error is None:
                raise RemoteError(f"encoder answered {status}")
            raise RemoteError.from_dict({**error, "status": status}, f"encoder answered {status}")
        message = rh.get("X-MM-Error", f"encoder answered {status}")
        if code == EncoderSiteUnreachable.code:  # the cluster tier's breaker: RPC may still reach an encoder
            raise EncoderSiteUnreachable(message)
        raise RemoteError(message, code, status)

    async def _rpc(self, source: EncodeRequest, header_only: bool) -> tuple[wire.WireHeader | bytes, str]:
        client = self.rpc_client
        if client is None or not client.instance_ids():
            raise EncoderUnavailable("no encode worker is registered")
        try:
            reply = await call_encode(client, source.to_dict(), header_only=header_only)
        except RemoteError:
            raise
        except Exception as e:  # Dynamo transport errors: the worker went away mid-call
            if is_too_large(e):
                raise RequestTooLarge(f"the encode request is above the request plane's message limit; "
                                      f"{TOO_LARGE_HINT}") from None
            raise EncoderUnavailable(f"encode worker unreachable over RPC: {type(e).__name__}: {e}") from None
        if header_only:
            return wire.WireHeader.from_meta(reply.header), "rpc"
        self.body_bytes += len(reply.body)
        return reply.body, "rpc"


def _json_error(body: bytes) -> dict[str, Any] | None:
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return err if isinstance(err, dict) else None


async def call_encode(client: Any, request: dict[str, Any], *, header_only: bool = False) -> EncodeReply:
    """One encode request through a Dynamo client (round robin over the encode workers); the
    worker's reply (with `header_only`, its header and no body), or RemoteError with the worker's
    own code and status. Transport failures are Dynamo's exceptions, raised as they come."""
    reply = None
    async for msg in await client.round_robin({**request, "header_only": True} if header_only else request):
        reply = payload(msg)
    if reply is None:
        raise RemoteError("the encode worker closed the stream without a response", "no_response", 502)
    return EncodeReply.from_dict(reply, header_only=header_only)
