"""Embeddings by handle: what travels between components instead of the embeddings themselves.

An encode answer is a `MediaHandle` per item: a few hundred bytes of JSON with what a frontend
needs to splice and route (mm_hash and the wire header: grids, dtype, shape, timestamps) and what
an engine needs to get the body (the `EncodeRequest` that produced it, the cache chain to ask,
Dynamo RPC as the fallback). The engine pulls the wire-v1 body itself. A level that has evicted
the entry forwards the request and the encoder re-encodes it to the same bytes, so a handle never
points at nothing: eviction costs one re-encode, not a failure.

A handle is the item's one description: `parse` checks a peer's once, and its `header` is parsed
once per process (the frontend builds it from a header it already checked). Everything else (token
counts per grid, the tiers' cache key) is derived from it, never carried twice.

The network client that asks the encoders for headers and bodies is `mm_encoder.client`.
`check_body` checks a fetched body against its handle: a body whose mm_hash or grids differ (the
URL now serves other bytes, or the handle was tampered with) is refused, never spliced.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from . import wire
from .errors import HandleError, RemoteError, WireError
from .requests import EncodeRequest

HANDLE_VERSION: Literal[1] = 1
ROUTE = re.compile(r"[a-z]+(,[a-z]+){0,3}")  # X-Cache-Route: the tier names to visit, e.g. "cluster,shared"
# Response headers may carry a video's grids and timestamps (X-MM-Meta): nginx and aiohttp default to 4-8 KB.
MAX_HEADER_BYTES = 64 << 10
# Fields that 0.1 frontends wrote and nothing reads (both derived from the others): a peer's handle
# may still carry them during a rolling upgrade; they are checked, then dropped.
_LEGACY_FIELDS = ("key", "num_tokens")


def chain_url(url: str) -> str:
    """A chain's address as handles carry it: the first level's `/v1/encode` URL."""
    url = url.rstrip("/")
    return url if url.endswith("/v1/encode") else url + "/v1/encode"


class MediaHandle(BaseModel):
    """One media item's embeddings, by reference (JSON-valued: it rides in Dynamo's typed fields)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = HANDLE_VERSION
    mm_hash: str = Field(min_length=1, max_length=128)
    meta: dict[str, Any]  # the wire header's fields (`wire.WireHeader.to_meta`)
    source: EncodeRequest  # by URL: re-sent as is when the body must be fetched again
    chain: str | None = Field(None, max_length=2048)  # the first tier's /v1/encode URL; None: RPC only
    route: str = Field("cluster,shared", pattern=f"^{ROUTE.pattern}$")
    rpc: str | None = Field(None, max_length=256)  # the encode workers' Dynamo endpoint path
    _header: wire.WireHeader | None = PrivateAttr(None)

    @field_validator("source")
    @classmethod
    def _by_url(cls, source: EncodeRequest) -> EncodeRequest:
        if source.url is None:
            raise ValueError("a handle's source names its media by `url`, never by raw `data`")
        return source

    @classmethod
    def build(cls, header: wire.WireHeader, source: EncodeRequest, *, chain: str | None, route: str,
              rpc: str | None) -> MediaHandle:
        """The handle for an item whose header this process has (checked by whoever made it)."""
        handle = cls(mm_hash=header.mm_hash, meta=header.to_meta(), source=source, chain=chain, route=route, rpc=rpc)
        handle._header = header
        return handle

    @classmethod
    def parse(cls, obj: Any) -> MediaHandle:
        """A peer's handle, checked once: its header must be a valid wire header with the handle's
        mm_hash; the legacy fields of a 0.1 peer must agree with what they are derived from."""
        legacy = {}
        if isinstance(obj, dict) and any(k in obj for k in _LEGACY_FIELDS):
            obj = dict(obj)
            legacy = {k: obj.pop(k) for k in _LEGACY_FIELDS if k in obj}
        try:
            handle = cls.model_validate(obj)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            where = ".".join(str(x) for x in err["loc"])
            raise HandleError(f"malformed media handle: {where + ': ' if where else ''}{err['msg']}") from None
        try:
            header = wire.WireHeader.from_meta(handle.meta)
        except WireError as e:
            raise HandleError(f"media handle {handle.mm_hash[:12]}: {e.message}") from None
        tokens = header.tokens_per_grid
        if header.mm_hash != handle.mm_hash or legacy.get("num_tokens", tokens) != tokens:
            raise HandleError(f"media handle {handle.mm_hash[:12]}: its fields disagree with its header")
        if "key" in legacy and legacy["key"] != handle.source.key():  # a tier would have stored it under this
            raise HandleError(f"media handle {handle.mm_hash[:12]}: its key is not its source's key")
        handle._header = header
        return handle

    @property
    def header(self) -> wire.WireHeader:
        """The wire header, parsed once (a handle made by `parse` or `build` already has it)."""
        if self._header is None:
            self._header = wire.WireHeader.from_meta(self.meta)
        return self._header

    @property
    def num_tokens(self) -> list[int]:
        """Rows per grid: an image has one grid, a video one per chunk."""
        return self.header.tokens_per_grid

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


def check_body(handle: MediaHandle, body: bytes) -> bytes:
    """`body`, if it is the one `handle` announced (mm_hash, grids, shape, dtype); else HandleError."""
    got = wire.peek(body)
    want = handle.header
    if (got.mm_hash, got.grid_thws, got.shape, got.dtype) != (want.mm_hash, want.grid_thws, want.shape, want.dtype):
        raise HandleError(f"media handle {handle.mm_hash[:12]}: the fetched body is {got.mm_hash[:12]} "
                          f"{list(got.shape)}, not what the handle announced; refusing to splice it")
    return body


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
