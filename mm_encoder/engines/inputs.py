"""An `EngineRequest`'s media as an engine takes it: each item's wire-v1 body decoded and checked
against the spans the frontend spliced (a mismatch is refused, never written into the prompt)."""

from __future__ import annotations

import torch

from ..core import wire
from ..core.requests import EngineRequest, MediaInput


def decode_item(item: MediaInput, token_ids: list[int] | None = None) -> wire.WireMessage:
    """The item's body, checked: one span per grid, each span as long as its grid's tokens and,
    given the prompt, a run of one placeholder token."""
    msg = wire.decode(item.body)
    if [n for _, n in item.spans] != msg.tokens_per_grid:
        raise ValueError(f"media {item.mm_hash[:12]}: spans {item.spans} do not match grids {msg.grid_thws}")
    for offset, n in item.spans if token_ids is not None else ():
        run = token_ids[offset : offset + n]
        if len(run) != n or len(set(run)) != 1:
            raise ValueError(f"media {item.mm_hash[:12]}: tokens {offset}..{offset + n} are not a placeholder run")
    return msg


def media_rows(req: EngineRequest, hidden: int) -> list[tuple[int, torch.Tensor]]:
    """(offset, rows) per span of every item, for writing over the placeholder embeddings."""
    out = []
    for item in req.media:
        msg = decode_item(item, req.token_ids)
        if msg.shape[1] != hidden:
            raise ValueError(f"media {item.mm_hash[:12]}: embeddings are {msg.shape[1]} wide, the model takes {hidden}")
        start = 0
        for offset, n in item.spans:
            out.append((offset, msg.embeds[start : start + n]))
            start += n
    return out
