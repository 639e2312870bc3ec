"""Embeddings by handle: what travels between components instead of the embeddings themselves.

An encode answer is a `MediaHandle` per item: a few hundred bytes of JSON with what a frontend
needs to splice and route (mm_hash and the wire header: grids, dtype, shape, timestamps) and what
an engine needs to get the body (the `EncodeRequest` that produced it, the cache chain to ask,
Dynamo RPC as the fallback). The engine pulls the wire-v1 body itself. A level that has evicted
the entry forwards the request and the encoder re-encodes it to the same bytes, so a handle never
points at nothing: eviction costs one re-encode, not a failure.

A handle is the item's one description: `parse` checks a peer's once, and holds its `header`
(parsed once per process; the frontend builds a handle from a header it already checked). Everything
else (its mm_hash, token counts per grid, the tiers' cache key) is derived from it, never held twice;
the JSON form (`_HandleForm`) writes the mm_hash beside the header's fields for readers of the wire.

The network client that asks the encoders for headers and bodies is `mm_encoder.client`.
`check_body` checks a fetched body against its handle: a body whose mm_hash or grids differ (the
URL now serves other bytes, or the handle was tampered with) is refused, never spliced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

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


class _HandleForm(BaseModel):
    """A handle as it travels (JSON): what `MediaHandle.parse` validates and `to_dict` writes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = HANDLE_VERSION
    mm_hash: str = Field(min_length=1, max_length=128)
    meta: dict[str, Any]  # the wire header's fields (`wire.WireHeader.to_meta`)
    source: EncodeRequest  # by URL: re-sent as is when the body must be fetched again
    chain: str | None = Field(None, max_length=2048)  # the first tier's /v1/encode URL; None: RPC only
    route: str = Field("cluster,shared", pattern=f"^{ROUTE.pattern}$")
    rpc: str | None = Field(None, max_length=256)  # the encode workers' Dynamo endpoint path

    @field_validator("source")
    @classmethod
    def _by_url(cls, source: EncodeRequest) -> EncodeRequest:
        if source.url is None:
            raise ValueError("a handle's source names its media by `url`, never by raw `data`")
        return source


@dataclass(frozen=True)
class MediaHandle:
    """One media item's embeddings, by reference: its wire header (mm_hash, grids, dtype, shape,
    timestamps: what a frontend splices and routes on), held once, and where its body is."""

    header: wire.WireHeader
    source: EncodeRequest  # by URL: re-sent as is when the body must be fetched again
    chain: str | None = None  # the first tier's /v1/encode URL; None: RPC only
    route: str = "cluster,shared"  # X-Cache-Route
    rpc: str | None = None  # the encode workers' Dynamo endpoint path

    @classmethod
    def build(cls, header: wire.WireHeader, source: EncodeRequest, *, chain: str | None, route: str,
              rpc: str | None) -> MediaHandle:
        """The handle for an item whose header this process has (checked by whoever made it); the
        rest is checked as a peer's would be."""
        _HandleForm.model_validate({"mm_hash": header.mm_hash, "meta": {}, "source": source, "chain": chain,
                                    "route": route, "rpc": rpc})
        return cls(header, source, chain, route, rpc)

    @classmethod
    def parse(cls, obj: Any) -> MediaHandle:
        """A peer's handle, checked once: its header must be a valid wire header with the handle's
        mm_hash; the legacy fields of a 0.1 peer must agree with what they are derived from."""
        legacy = {}
        if isinstance(obj, dict) and any(k in obj for k in _LEGACY_FIELDS):
            obj = dict(obj)
            legacy = {k: obj.pop(k) for k in _LEGACY_FIELDS if k in obj}
        try:
            form = _HandleForm.model_validate(obj)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            where = ".".join(str(x) for x in err["loc"])
            raise HandleError(f"malformed media handle: {where + ': ' if where else ''}{err['msg']}") from None
        try:
            header = wire.WireHeader.from_meta(form.meta)
        except WireError as e:
            raise HandleError(f"media handle {form.mm_hash[:12]}: {e.message}") from None
        tokens = header.tokens_per_grid
        if header.mm_hash != form.mm_hash or legacy.get("num_tokens", tokens) != tokens:
            raise HandleError(f"media handle {form.mm_hash[:12]}: its fields disagree with its header")
        if "key" in legacy and legacy["key"] != form.source.legacy_key():  # a 0.2 tier stored it under this
            raise HandleError(f"media handle {form.mm_hash[:12]}: its key is not its source's key")
        return cls(header, form.source, form.chain, form.route, form.rpc)

    @property
    def mm_hash(self) -> str:
        return self.header.mm_hash

    @property
    def num_tokens(self) -> list[int]:
        """Rows per grid: an image has one grid, a video one per chunk."""
        return self.header.tokens_per_grid

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (`_HandleForm`): the header's fields under `meta`, its mm_hash also on top."""
        d: dict[str, Any] = {"v": HANDLE_VERSION, "mm_hash": self.mm_hash, "meta": self.header.to_meta(),
                             "source": self.source.model_dump(mode="json", exclude_none=True),
                             "chain": self.chain, "route": self.route, "rpc": self.rpc}
        return {k: v for k, v in d.items() if v is not None}


def check_body(handle: MediaHandle, body: bytes) -> bytes:
    """`body`, if it is the one `handle` announced (mm_hash, grids, shape, dtype); else HandleError.
    Reads only the body's header (`wire.peek`); an engine that decodes the body anyway checks the
    decoded message with `check_header` instead, reading it once."""
    check_header(handle, wire.peek(body))
    return body


def check_header(handle: MediaHandle, got: wire.WireHeader) -> None:
    """A fetched body's header (or its decoded message) is the one `handle` announced; else HandleError."""
    want = handle.header
    if (got.mm_hash, got.grid_thws, got.shape, got.dtype) != (want.mm_hash, want.grid_thws, want.shape, want.dtype):
        raise HandleError(f"media handle {handle.mm_hash[:12]}: the fetched body is {got.mm_hash[:12]} "
                          f"{list(got.shape)}, not what the handle announced; refusing to splice it")


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
