"""Embeddings by handle: what travels between components instead of the embeddings themselves.

An encode answer is a `MediaHandle` per item: a few hundred bytes of JSON with what a frontend
needs to splice and route (mm_hash, grids, token counts, dtype, shape, timestamps) and what an
engine needs to get the body (the encode request that produced it, its cache key, the cache chain
to ask, Dynamo RPC as the fallback). The engine pulls the wire-v1 body itself. A level that has
evicted the entry forwards the request and the encoder re-encodes it to the same bytes, so a
handle never points at nothing: eviction costs one re-encode, not a failure.

`EncoderChain` is the one client for both questions any component asks the encoders:
- `describe`: the header only (HEAD through the tiers, which fetch and cache the body on a miss
  without sending it; over RPC, `header_only`), for the frontend;
- `fetch`: the body (POST `/v1/encode/fetch` through the tiers, which never wait on another
  request's fill of the entry; over RPC, the reply's body), for the engine.
`resolve` checks a fetched body against its handle: a body whose mm_hash or grids differ (the
URL now serves other bytes, or the handle was tampered with) is refused, never spliced.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from typing import Any, Literal

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import wire
from .dynamo import TOO_LARGE_HINT, call_encode, is_too_large
from .errors import EncoderUnavailable, HandleError, RemoteError, RequestTooLarge, WireError
from .requests import ProcessorOverrides

log = logging.getLogger(__name__)

HANDLE_VERSION: Literal[1] = 1
ROUTE = re.compile(r"[a-z]+(,[a-z]+){0,3}")  # X-Cache-Route: the tier names to visit, e.g. "cluster,shared"
# Response headers may carry a video's grids and timestamps (X-MM-Meta): nginx and aiohttp default to 4-8 KB.
MAX_HEADER_BYTES = 64 << 10


def cache_key(model: str, processor: dict[str, Any] | None, url: str, scope: str, modality: str | None = None,
              revision: str | None = None) -> str:
    """The tiers' key for one item: everything the encoder's answer depends on, nothing else (the
    model's revision, when the request names one: another checkpoint is another answer)."""
    ref = url if url[:5].lower() != "data:" else "sha256:" + hashlib.sha256(url.encode()).hexdigest()
    parts = [model, processor or {}, ref, scope, modality] + ([revision] if revision else [])
    doc = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()


def chain_url(url: str) -> str:
    """A chain's address as handles carry it: the first level's `/v1/encode` URL."""
    url = url.rstrip("/")
    return url if url.endswith("/v1/encode") else url + "/v1/encode"


class Source(BaseModel):
    """The encode request that made the body: re-sent as is when the body must be fetched again."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, max_length=512)
    url: str = Field(min_length=1)
    modality: Literal["image", "video"] | None = None
    scope: str = Field("", max_length=256)
    processor: ProcessorOverrides | None = None
    revision: str | None = Field(None, max_length=64)  # the checkpoint's; the encoder refuses another

    def request(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)

    def key(self) -> str:
        processor = self.processor.model_dump(exclude_none=True) if self.processor else None
        return cache_key(self.model, processor, self.url, self.scope, self.modality, self.revision)


class MediaHandle(BaseModel):
    """One media item's embeddings, by reference (JSON-valued: it rides in Dynamo's typed fields)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = HANDLE_VERSION
    mm_hash: str = Field(min_length=1, max_length=128)
    meta: dict[str, Any]  # the wire header's fields (`wire.WireHeader.to_meta`)
    num_tokens: list[int]  # per grid: an image has one, a video one per chunk
    source: Source
    key: str = Field(pattern=r"^[0-9a-f]{64}$")
    chain: str | None = Field(None, max_length=2048)  # the first tier's /v1/encode URL; None: RPC only
    route: str = Field("cluster,shared", pattern=f"^{ROUTE.pattern}$")
    rpc: str | None = Field(None, max_length=256)  # the encode workers' Dynamo endpoint path

    @classmethod
    def build(cls, header: wire.WireHeader, source: Source, *, chain: str | None, route: str,
              rpc: str | None) -> MediaHandle:
        return cls(mm_hash=header.mm_hash, meta=header.to_meta(), num_tokens=header.tokens_per_grid,
                   source=source, key=source.key(), chain=chain, route=route, rpc=rpc)

    @classmethod
    def parse(cls, obj: Any) -> MediaHandle:
        """A peer's handle, checked: its key must be its source's key (so a fetch can never store
        one request's answer under another's key) and its header must be a valid wire header."""
        try:
            handle = cls.model_validate(obj)
        except ValidationError as e:
            raise HandleError(f"malformed media handle: {e.errors(include_url=False)[0]['msg']}") from None
        if handle.key != handle.source.key():
            raise HandleError(f"media handle {handle.mm_hash[:12]}: its key is not its source's key")
        try:
            header = handle.header
        except WireError as e:
            raise HandleError(f"media handle {handle.mm_hash[:12]}: {e.message}") from None
        if header.mm_hash != handle.mm_hash or header.tokens_per_grid != handle.num_tokens:
            raise HandleError(f"media handle {handle.mm_hash[:12]}: its fields disagree with its header")
        return handle

    @property
    def header(self) -> wire.WireHeader:
        return wire.WireHeader.from_meta(self.meta)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


class EncoderChain:
    """The encoders as one component reaches them: the HTTP cache chain first (`http_url`, the first
    tier or a worker), Dynamo RPC (`rpc_client`) when the chain itself fails or is not configured."""

    def __init__(self, *, http_url: str | None = None, route: str = "cluster,shared", rpc_client: Any = None,
                 timeout_s: float = 600.0):
        if http_url is None and rpc_client is None:
            raise ValueError("EncoderChain needs an HTTP cache chain, a Dynamo RPC client, or both")
        if not ROUTE.fullmatch(route):
            raise ValueError(f"cache route {route!r} is not a comma-separated list of tier names")
        self.http_url = chain_url(http_url) if http_url else None
        self.route = route
        self.rpc_client = rpc_client
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5)
        self._session: aiohttp.ClientSession | None = None
        self.fallbacks = 0
        self.body_bytes = 0  # wire bodies this process received: stays 0 where only `describe` is used

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def describe(self, source: Source) -> tuple[wire.WireHeader, str]:
        """The item's header (its body is computed and cached on the way, never sent here)."""
        header, where = await self._call(source, header_only=True)
        if not isinstance(header, wire.WireHeader):
            raise RemoteError("the encoder answered a body where a header was asked for")
        return header, where

    async def fetch(self, source: Source) -> tuple[bytes, str]:
        """The item's wire-v1 body; any level that lacks it forwards, the encoder re-encodes."""
        body, where = await self._call(source, header_only=False)
        if not isinstance(body, bytes):
            raise RemoteError("the encoder answered a header where a body was asked for")
        return body, where

    async def _call(self, source: Source, *, header_only: bool) -> tuple[wire.WireHeader | bytes, str]:
        if self.http_url is not None:
            try:
                return await self._http(self.http_url, source, header_only)
            except EncoderUnavailable as e:
                if self.rpc_client is None:
                    raise
                self.fallbacks += 1
                log.warning("cache chain failed (%s); falling back to direct RPC", e.message)
        return await self._rpc(source, header_only)

    async def _http(self, chain: str, source: Source, header_only: bool) -> tuple[wire.WireHeader | bytes, str]:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout, max_field_size=MAX_HEADER_BYTES)
        headers = {"Accept": wire.CONTENT_TYPE, "X-Cache-Key": source.key(), "X-Cache-Route": self.route}
        method, url = ("HEAD", chain) if header_only else ("POST", chain + "/fetch")
        try:
            async with self._session.request(method, url, json=source.request(), headers=headers) as r:
                body = b"" if header_only else await r.read()
                status, rh = r.status, r.headers
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
        raise RemoteError(rh.get("X-MM-Error", f"encoder answered {status}"), code, status)

    async def _rpc(self, source: Source, header_only: bool) -> tuple[wire.WireHeader | bytes, str]:
        client = self.rpc_client
        if client is None or not client.instance_ids():
            raise EncoderUnavailable("no encode worker is registered")
        try:
            reply = await call_encode(client, source.request(), header_only=header_only)
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


class HandleResolver:
    """An engine's side of handles: each body fetched from the chain its handle names, when this
    engine trusts that chain (an engine never fetches from an address a message picked), with this
    engine's own RPC client to the encode workers as the fallback."""

    def __init__(self, trusted_chains: list[str] | tuple[str, ...] = (), rpc_client: Any = None,
                 timeout_s: float = 600.0):
        self.trusted = {chain_url(c) for c in trusted_chains}
        self.rpc_client = rpc_client
        self.timeout_s = timeout_s
        self._chains: dict[tuple[str | None, str], EncoderChain] = {}
        self.fetches = 0

    def chain_for(self, handle: MediaHandle) -> EncoderChain:
        chain = chain_url(handle.chain) if handle.chain else None
        if chain is not None and chain not in self.trusted:
            raise HandleError(f"media handle {handle.mm_hash[:12]} names cache chain {chain!r}, which this engine "
                              f"does not trust (its chains: {sorted(self.trusted) or 'none'})")
        if chain is None and self.rpc_client is None:
            raise HandleError(f"media handle {handle.mm_hash[:12]} names no cache chain and this engine has no RPC "
                              "client to the encode workers")
        key = (chain, handle.route)
        if key not in self._chains:
            self._chains[key] = EncoderChain(http_url=chain, route=handle.route, rpc_client=self.rpc_client,
                                             timeout_s=self.timeout_s)
        return self._chains[key]

    async def body(self, handle: MediaHandle) -> bytes:
        self.fetches += 1
        return await resolve(handle, self.chain_for(handle))

    async def close(self) -> None:
        for chain in self._chains.values():
            await chain.close()


async def resolve(handle: MediaHandle, chain: EncoderChain) -> bytes:
    """The handle's body, fetched and checked against what the handle announced."""
    body, _ = await chain.fetch(handle.source)
    return check_body(handle, body)


def check_body(handle: MediaHandle, body: bytes) -> bytes:
    """`body`, if it is the one `handle` announced (mm_hash, grids, shape, dtype); else HandleError."""
    got = wire.peek(body)
    want = handle.header
    if (got.mm_hash, got.grid_thws, got.shape, got.dtype) != (want.mm_hash, want.grid_thws, want.shape, want.dtype):
        raise HandleError(f"media handle {handle.mm_hash[:12]}: the fetched body is {got.mm_hash[:12]} "
                          f"{list(got.shape)}, not what the handle announced; refusing to splice it")
    return body


def _json_error(body: bytes) -> dict[str, Any] | None:
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return err if isinstance(err, dict) else None


# --- Dynamo's encoder handoff ---------------------------------------------------------------
# Dynamo forwards an Encode worker's `encoder_result` (a JSON object it treats as opaque) to the
# downstream worker. Ours: `{"mm_encoder": 1, "image": [handle, ...], "video": [handle, ...]}`, each
# list in the order of the request's `multi_modal_data` (which is the prompt's order per modality).
ENCODER_RESULT_VERSION = 1


def encoder_result(handles: dict[str, list[MediaHandle]]) -> dict[str, Any]:
    return {"mm_encoder": ENCODER_RESULT_VERSION, **{m: [h.to_dict() for h in hs] for m, hs in handles.items()}}


def parse_encoder_result(obj: Any) -> dict[str, list[MediaHandle]]:
    """A forwarded `encoder_result` -> handles per modality (empty when the request had no media)."""
    if obj is None:
        return {}
    if not isinstance(obj, dict) or obj.get("mm_encoder") != ENCODER_RESULT_VERSION:
        raise HandleError("encoder_result is not an mm-encoder result (is another encode worker in this namespace?)")
    if "error" in obj:  # the encode worker refused the media: its own code, status and message
        raise RemoteError.from_dict(obj["error"], "the encode worker failed without a message")
    unknown = sorted(k for k in obj if k not in ("mm_encoder", "image", "video"))
    if unknown or not all(isinstance(obj.get(m, []), list) for m in ("image", "video")):
        raise HandleError(f"encoder_result has unexpected fields {unknown} or non-list items")
    return {m: [MediaHandle.parse(h) for h in obj.get(m, [])] for m in ("image", "video") if obj.get(m)}
