"""The messages that cross process boundaries, defined once for both sides of each call.

- frontend (or any client) -> encode worker: `EncodeRequest` (HTTP JSON/msgpack bodies and Dynamo
  RPC dicts alike); the answer is a wire-v1 body (`core.wire`), over Dynamo inside `EncodeReply`;
  errors are `{"error": {"code", "message"[, "status"]}}` (`MMEncoderError.to_dict`).
- frontend -> engine: `EngineRequest`, token ids with placeholder runs plus each media item's
  wire-v1 body and where its rows go.
"""

from __future__ import annotations

import contextlib
import json as stdlib_json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import BadRequest, RemoteError
from .spec import PreprocessConfig


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

    @model_validator(mode="after")
    def _one_source(self) -> EncodeRequest:
        if (self.url is None) == (self.data is None):
            raise ValueError("give exactly one of `url` and `data`")
        return self

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


# --- frontend -> engine ---------------------------------------------------------------------
# Travels as msgpack over Dynamo RPC on our own endpoint. Media travel as handles (`core.handle`):
# the engine fetches each body itself, so the message is kilobytes. The engine's response stream:
# `{"token_ids": [int], "finish_reason": None | "stop" | "length"}` per step.


@dataclass
class MediaInput:
    handle: dict[str, Any]  # a MediaHandle's JSON form: the engine fetches and checks the body
    spans: list[tuple[int, int]]  # (offset, length) in token_ids, one per image or video chunk
    body: bytes | None = None  # the body itself: only a frontend in `--media-transport body` sends it

    @property
    def mm_hash(self) -> str:
        return str(self.handle.get("mm_hash", ""))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"handle": self.handle, "spans": [list(s) for s in self.spans]}
        if self.body is not None:
            d["body"] = self.body
        return d


@dataclass
class EngineRequest:
    request_id: str
    token_ids: list[int]
    max_tokens: int
    eos_token_ids: list[int] = field(default_factory=list)
    media: list[MediaInput] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)  # core.sampling.SamplingParams.to_dict()
    # The aggregated baseline (no encode worker): the rendered chat template (one placeholder per
    # media item) and the media the engine fetches, encodes and splices itself; token_ids is then
    # empty and the engine reports prompt_tokens.
    prompt: str | None = None
    media_refs: list[dict[str, str]] = field(default_factory=list)
    # False: the client reads the whole answer at once, so the engine holds every token after the
    # first until the finish (`engines.stream.pacing`); sent only then
    stream: bool = True

    def to_dict(self) -> dict[str, Any]:
        d = {
            "request_id": self.request_id,
            "token_ids": self.token_ids,
            "max_tokens": self.max_tokens,
            "eos_token_ids": self.eos_token_ids,
            "sampling": self.sampling,
            "media": [m.to_dict() for m in self.media],
        }
        if self.prompt is not None:
            d["prompt"] = self.prompt
            d["media_refs"] = self.media_refs
        if not self.stream:
            d["stream"] = False
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineRequest:
        media = [MediaInput(dict(m["handle"]), [tuple(s) for s in m["spans"]], m.get("body"))
                 for m in d.get("media", [])]
        return cls(d["request_id"], list(d["token_ids"]), int(d["max_tokens"]), list(d.get("eos_token_ids", [])),
                   media, dict(d.get("sampling") or {}), d.get("prompt"), list(d.get("media_refs", [])),
                   d.get("stream", True) is not False)
