"""The frontend's message to an engine: token ids with placeholder runs, and per media item its
handle (`core.handle`, parsed once on arrival) and where its rows go.

Travels as msgpack over Dynamo RPC on our own endpoint. The engine fetches each body itself, so
the message is kilobytes. The engine's response stream: `{"token_ids": [int], "finish_reason":
None | "stop" | "length"}` per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import BadRequest
from .handle import MediaHandle


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
    def from_dict(cls, d: Any) -> EngineRequest:
        """A peer's request, its media handles parsed and checked once (BadRequest or HandleError)."""
        if not isinstance(d, dict):
            raise BadRequest(f"an engine request is a map, not a {type(d).__name__}")
        try:
            media = [MediaInput.from_dict(m) for m in d.get("media", [])]
            return cls(str(d["request_id"]), list(d["token_ids"]), int(d["max_tokens"]),
                       list(d.get("eos_token_ids", [])), media, dict(d.get("sampling") or {}), d.get("prompt"),
                       list(d.get("media_refs", [])), d.get("stream", True) is not False)
        except KeyError as e:
            raise BadRequest(f"the engine request has no {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise BadRequest(f"malformed engine request: {e}") from None
