"""The frontend's message to an engine: token ids with placeholder runs, and per media item its
handle (`core.handle`, parsed once on arrival) and where its rows go.

Travels as msgpack over Dynamo RPC on the engines' `generate` endpoint, which also takes Dynamo's
own preprocessed request (from the stock frontend): ours declares itself (`"protocol": PROTOCOL`),
and `protocol_of` tells the two apart by that declaration. The engine fetches each body itself, so
the message is kilobytes. The engine's answer is a stream of `core.engine_reply` items.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import BadRequest
from .handle import MediaHandle

PROTOCOL = "mm-encoder.engine/1"  # what our frontend's requests declare; another version is refused by name


def protocol_of(request: Any) -> Literal["mm", "dynamo"]:
    """Which protocol a request on the engines' endpoint speaks: ours when it declares `PROTOCOL`
    (or another `protocol`, which `EngineRequest.from_dict` then refuses by name); Dynamo's
    preprocessed request when it declares none and carries Dynamo's `stop_conditions`. A request
    that declares nothing and is not Dynamo's is a 0.2 frontend's, which predates the declaration
    (kept for rolling upgrades; to be removed with 0.4)."""
    if not isinstance(request, dict) or "protocol" in request or "stop_conditions" not in request:
        return "mm"
    return "dynamo"


@dataclass
class MediaInput:
    handle: MediaHandle  # the engine fetches the body it names and checks it against it
    spans: list[tuple[int, int]]  # (offset, length) in token_ids, one per image or video chunk
    body: bytes | None = None  # the body itself: only a frontend in `--media-transport body` sends it

    @property
    def mm_hash(self) -> str:
        return self.handle.mm_hash

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"handle": self.handle.to_dict(), "spans": [list(s) for s in self.spans]}
        if self.body is not None:
            d["body"] = self.body
        return d

    @classmethod
    def from_dict(cls, d: Any) -> MediaInput:
        if not isinstance(d, dict) or not isinstance(d.get("spans"), list):
            raise BadRequest("each media item must be a map with a handle and a list of spans")
        try:
            spans = [(int(o), int(n)) for o, n in d["spans"]]
        except (TypeError, ValueError):
            raise BadRequest("a media item's spans must be (offset, length) pairs of integers") from None
        body = d.get("body")
        if body is not None and not isinstance(body, bytes):
            raise BadRequest("a media item's body must be bytes")
        return cls(MediaHandle.parse(d.get("handle")), spans, body)


@dataclass
class EngineRequest:
    request_id: str
    token_ids: list[int]
    max_tokens: int
    eos_token_ids: list[int] = field(default_factory=list)
    media: list[MediaInput] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)  # core.sampling.SamplingParams.to_dict()
    # False: the client reads the whole answer at once, so the engine holds every token after the
    # first until the finish (`engines.stream.pacing`); sent only then
    stream: bool = True
    # the frontend's trace, as W3C headers (`traceparent`, `tracestate`): the engine's spans continue
    # it (Dynamo's request plane does not carry a Python caller's trace); sent only when traced
    trace: dict[str, str] = field(default_factory=dict)
    # the tenant's scope (`security.tenants`), which salts the prompt's KV block hashes: the engine's
    # prefix store and the KV router share no block between tenants; sent only when set
    cache_salt: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = {
            "protocol": PROTOCOL,
            "request_id": self.request_id,
            "token_ids": self.token_ids,
            "max_tokens": self.max_tokens,
            "eos_token_ids": self.eos_token_ids,
            "sampling": self.sampling,
            "media": [m.to_dict() for m in self.media],
        }
        if not self.stream:
            d["stream"] = False
        if self.trace:
            d["trace"] = self.trace
        if self.cache_salt:
            d["cache_salt"] = self.cache_salt
        return d

    @classmethod
    def from_dict(cls, d: Any) -> EngineRequest:
        """A peer's request, its media handles parsed and checked once (BadRequest or HandleError);
        one that carries a rendered `prompt` is the aggregated baseline's (`InlineRequest`)."""
        if not isinstance(d, dict):
            raise BadRequest(f"an engine request is a map, not a {type(d).__name__}")
        if d.get("protocol", PROTOCOL) != PROTOCOL:
            raise BadRequest(f"this engine speaks {PROTOCOL!r}, not protocol {d['protocol']!r}")
        try:
            media = [MediaInput.from_dict(m) for m in d.get("media", [])]
            args = (str(d["request_id"]), list(d["token_ids"]), int(d["max_tokens"]), list(d.get("eos_token_ids", [])),
                    media, dict(d.get("sampling") or {}), d.get("stream", True) is not False, _trace(d.get("trace")),
                    _salt(d.get("cache_salt")))
            if d.get("prompt") is not None:
                return InlineRequest(*args, prompt=str(d["prompt"]), media_refs=list(d.get("media_refs", [])))
            return EngineRequest(*args)
        except KeyError as e:
            raise BadRequest(f"the engine request has no {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise BadRequest(f"malformed engine request: {e}") from None


MAX_SALT = 256  # a scope is 64 hex characters (security.tenants)


def _salt(value: Any) -> str:
    """A request's `cache_salt`: a short string, or refused by name."""
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_SALT:
        raise BadRequest(f"an engine request's cache_salt is a string of at most {MAX_SALT} characters")
    return value


TRACE_HEADERS = ("traceparent", "tracestate")
_MAX_TRACE_HEADER = 512  # W3C: a traceparent is 55 characters, a tracestate at most 32 entries of 256 bytes: kept short


def _trace(value: Any) -> dict[str, str]:
    """A request's `trace`: at most the W3C headers, as short strings; anything else is refused by name."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(k in TRACE_HEADERS and isinstance(v, str) and len(v) <= _MAX_TRACE_HEADER
                                              for k, v in value.items()):
        raise BadRequest(f"an engine request's trace is a map of {list(TRACE_HEADERS)} to strings of at most "
                         f"{_MAX_TRACE_HEADER} characters")
    return dict(value)


@dataclass
class InlineRequest(EngineRequest):
    """The aggregated baseline's request (no encode worker; an engine started with
    `--encode-inline` takes it): the rendered chat template (one placeholder per media item) and
    the media the engine fetches, encodes and splices itself. `token_ids` is then empty and the
    engine reports the prompt's length in its first item's usage."""

    prompt: str = ""
    media_refs: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "prompt": self.prompt, "media_refs": self.media_refs}
