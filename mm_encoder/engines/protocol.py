"""The frontend -> engine request: token ids with placeholder runs, plus each media item's
wire-v1 body and where its rows go. Travels as msgpack over Dynamo RPC on our own endpoint
(bytes stay bytes; Dynamo's Rust-typed request fields are JSON-only, so they are not used).

Response stream: `{"token_ids": [int], "finish_reason": None | "stop" | "length"}` per step;
the first item comes right after prefill, which is when the frontend drops the embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import wire
from ..routing import MediaSpan


@dataclass
class MediaInput:
    mm_hash: str
    body: bytes  # wire v1: rows in span order
    spans: list[tuple[int, int]]  # (offset, length) in token_ids, one per image or video chunk

    def to_dict(self) -> dict[str, Any]:
        return {"mm_hash": self.mm_hash, "body": self.body, "spans": [list(s) for s in self.spans]}


@dataclass
class EngineRequest:
    request_id: str
    token_ids: list[int]
    max_tokens: int
    eos_token_ids: list[int] = field(default_factory=list)
    media: list[MediaInput] = field(default_factory=list)
    ignore_eos: bool = False
    # The aggregated baseline (no encode worker): text segments around media the engine fetches,
    # encodes and splices itself; token_ids is then empty and the engine reports prompt_tokens.
    segments: list[list[int]] | None = None
    media_refs: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "request_id": self.request_id,
            "token_ids": self.token_ids,
            "max_tokens": self.max_tokens,
            "eos_token_ids": self.eos_token_ids,
            "ignore_eos": self.ignore_eos,
            "media": [m.to_dict() for m in self.media],
        }
        if self.segments is not None:
            d["segments"] = self.segments
            d["media_refs"] = self.media_refs
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineRequest:
        media = [MediaInput(m["mm_hash"], m["body"], [tuple(s) for s in m["spans"]]) for m in d.get("media", [])]
        return cls(d["request_id"], list(d["token_ids"]), int(d["max_tokens"]), list(d.get("eos_token_ids", [])),
                   media, bool(d.get("ignore_eos", False)), d.get("segments"), list(d.get("media_refs", [])))

    def media_spans(self) -> list[MediaSpan]:
        return [MediaSpan(m.mm_hash, tuple(tuple(s) for s in m.spans)) for m in self.media]


def media_rows(item: MediaInput, hidden: int) -> list[tuple[int, torch.Tensor]]:
    """Decode one item's body and pair each span's offset with its rows (checked against spans)."""
    msg = wire.decode(item.body)
    if msg.shape[1] != hidden:
        raise ValueError(f"media {item.mm_hash[:12]}: embeddings are {msg.shape[1]} wide, the model takes {hidden}")
    if sum(n for _, n in item.spans) != msg.length:
        raise ValueError(f"media {item.mm_hash[:12]}: spans cover {sum(n for _, n in item.spans)} tokens, "
                         f"the body has {msg.length}")
    out, start = [], 0
    for offset, n in item.spans:
        out.append((offset, msg.embeds[start : start + n]))
        start += n
    return out
