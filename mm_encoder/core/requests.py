"""The encode worker's messages, defined once for both sides of the call.

Any client -> encode worker: `EncodeRequest` (HTTP JSON/msgpack bodies and Dynamo RPC dicts
alike; a `MediaHandle` carries the one that made its body, `core.handle`); the answer is a wire-v1
body (`core.wire`), over Dynamo inside `EncodeReply`; errors are `{"error": {"code", "message"[,
"status"]}}` (`MMEncoderError.to_dict`). The frontend's message to an engine is
`core.engine_request`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json as stdlib_json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import BadRequest, RemoteError
from .spec import PreprocessConfig
from .wire_schema import WireDtype


@dataclass(frozen=True)
class MediaRef:
    """One media item as a chat message names it: what the frontend asks the encoders for."""

    modality: str  # image | video
    url: str


class ProcessorOverrides(BaseModel):
    """Per-request processor settings. Each may only lower the model's own value: a client can ask
    for fewer pixels (cheaper), never for more work than the operator configured. Part of mm_hash.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    in_patch_limit: int | None = Field(None, ge=4)
    patch_limit_on_one_side: int | None = Field(None, ge=2)
    in_patch_limit_each_frame: int | None = Field(None, ge=4)
    video_fps: float | None = Field(None, gt=0)

    def apply(self, base: PreprocessConfig) -> PreprocessConfig:
        update = self.model_dump(exclude_none=True)
        for key, value in update.items():
            limit = getattr(base, key)
            if value > limit:
                raise BadRequest(f"processor.{key}={value} is above this model's {limit}; it may only be lowered")
        return base.model_copy(update=update) if update else base


def cache_key(model: str, processor: dict[str, Any] | None, url: str, scope: str, modality: str | None = None,
              revision: str | None = None, dtype: str | None = None) -> str:
    """0.2's key for one item, from the request's fields: what a 0.1 handle's `key` field holds, checked
    against its source (`core.handle`). The tiers' key is now `EncodeRequest.key`, the sha256 of the
    body, which a tier computes itself and checks a caller's key against."""
    ref = url if url[:5].lower() != "data:" else "sha256:" + hashlib.sha256(url.encode()).hexdigest()
    parts = [model, processor or {}, ref, scope, modality] + ([revision] if revision else [])
    parts += [{"dtype": dtype}] if dtype else []
    doc = stdlib_json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()


class EncodeRequest(BaseModel):
    """One media item to encode: exactly one of `url` (http, https or data:) and `data` (raw bytes,
    msgpack bodies and Dynamo only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # strict: a msgpack `bin` (bytes) is not a name or a URL, and a JSON string is not raw bytes
    model: str = Field(min_length=1, max_length=512, strict=True)
    url: str | None = Field(None, min_length=1, strict=True)  # bounded by the body cap; the fetcher caps http(s) URLs
    data: bytes | None = Field(None, strict=True)
    modality: Literal["image", "video"] | None = None  # None: sniffed from the bytes
    processor: ProcessorOverrides | None = None
    scope: str = Field("", max_length=256, strict=True, description="tenant: URL aliases never answer across scopes")
    revision: str | None = Field(None, max_length=64, strict=True,
                                 description="the model revision the caller expects (its checkpoint's): 409 if not")
    dtype: WireDtype | None = Field(None, description="the rows' dtype the caller's engines take: 409 if the "
                                                     "worker packs another")

    @model_validator(mode="after")
    def _one_source(self) -> EncodeRequest:
        if (self.url is None) == (self.data is None):
            raise ValueError("give exactly one of `url` and `data`")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The request as a body or an RPC dict (what a handle re-sends to fetch its body again)."""
        return self.model_dump(exclude_none=True)

    def body(self) -> bytes:
        """The request by URL as the cache chain is sent it: JSON, canonical (keys sorted, no spaces,
        ASCII), so one request is always the same bytes whoever sends it (the frontend's HEAD, an
        engine's fetch of a handle's source). A tier keys its entry by these bytes' sha256."""
        if self.url is None:
            raise ValueError("a request with raw `data` has no JSON body: the tiers cache requests by URL")
        return stdlib_json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    def key(self) -> str:
        """The cache tiers' key (`X-Cache-Key`) for a request by URL: the sha256 of its `body`, as a tier
        computes it from the body it receives (a key that differs is refused: 400 `bad_cache_key`), so
        the tiers key an entry by what was asked, never by what a caller claims. Everything the answer
        depends on is in the body (the model, its revision, the rows' dtype, the URL, the scope ...)."""
        return hashlib.sha256(self.body()).hexdigest()

    def legacy_key(self) -> str:
        """0.2's key (`cache_key`, from the fields): what a 0.1 handle's `key` field holds."""
        if self.url is None:
            raise ValueError("a request with raw `data` has no cache key: the tiers cache by URL")
        processor = self.processor.model_dump(exclude_none=True) if self.processor else None
        return cache_key(self.model, processor, self.url, self.scope, self.modality, self.revision, self.dtype)

    @classmethod
    def parse(cls, body: object, *, json: bool = False) -> EncodeRequest:
        """Validate a decoded body (or raw JSON bytes); pydantic's errors become one 400 that lists them."""
        try:
            return cls.model_validate_json(_unique_json(body)) if json else cls.model_validate(body)
        except ValidationError as e:
            raise BadRequest(_describe(e)) from None


def unique_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A decoded map that names a key twice is refused: readers disagree on which one counts (the
    last here, the first in some proxies), which is how a request says one thing and does another."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[Any] = set()
        for key, _ in pairs:
            if key in seen:
                raise BadRequest(f"the body names {key!r} more than once")
            seen.add(key)
    return out


def _unique_json(body: Any) -> Any:
    """The body unchanged, once its maps are checked for repeated keys (pydantic's parser keeps the last)."""
    with contextlib.suppress(ValueError, RecursionError):  # pydantic reports malformed JSON itself, with a position
        stdlib_json.loads(body, object_pairs_hook=unique_keys)
    return body


def _describe(e: ValidationError) -> str:
    parts = []
    for err in e.errors(include_url=False, include_input=False):
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "invalid encode request: " + "; ".join(parts)


@dataclass
class EncodeReply:
    """The encode worker's Dynamo RPC answer: `body` is byte-for-byte what `POST /v1/encode` returns;
    a `header_only` request gets `header` (the wire header's fields) and an empty body."""

    body: bytes  # wire v1
    mm_hash: str
    source: str  # the level that answered: alias, mm_hash, coalesced or forward
    timings_ms: dict[str, float] = field(default_factory=dict)
    header: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"body": self.body, "mm_hash": self.mm_hash, "source": self.source, "timings_ms": self.timings_ms}
        if self.header is not None:
            d["header"] = self.header
        return d

    @classmethod
    def from_dict(cls, reply: Any, *, header_only: bool = False) -> EncodeReply:
        """A reply message -> EncodeReply; an error reply raises RemoteError with the worker's code."""
        if not isinstance(reply, dict):
            raise RemoteError(f"the encode worker answered a {type(reply).__name__}, not a reply map")
        if "error" in reply:
            raise RemoteError.from_dict(reply["error"], "the encode worker failed without a message")
        if header_only and not isinstance(reply.get("header"), dict):
            raise RemoteError("the encode worker's reply has no header")
        if not header_only and not isinstance(reply.get("body"), bytes):
            raise RemoteError("the encode worker's reply has no body")
        return cls(reply.get("body") or b"", str(reply.get("mm_hash", "")), str(reply.get("source", "")),
                   dict(reply.get("timings_ms") or {}), reply.get("header"))
