"""Embeddings by handle: what travels between components instead of the embeddings themselves.

An encode answer is a `MediaHandle` per item: a few hundred bytes of JSON with what a frontend
needs to splice and route (mm_hash, grids, token counts, dtype, shape, timestamps) and what an
engine needs to get the body (the encode request that produced it, its cache key, the cache chain
to ask, Dynamo RPC as the fallback). The engine pulls the wire-v1 body itself. A level that has
evicted the entry forwards the request and the encoder re-encodes it to the same bytes, so a
handle never points at nothing: eviction costs one re-encode, not a failure.

The network client that asks the encoders for headers and bodies is `mm_encoder.client`.
`check_body` checks a fetched body against its handle: a body whose mm_hash or grids differ (the
URL now serves other bytes, or the handle was tampered with) is refused, never spliced.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import wire
from .errors import HandleError, RemoteError, WireError
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
