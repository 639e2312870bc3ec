"""An `EngineRequest`'s media as an engine takes them: each item's handle (parsed on arrival)
checked against the spans the frontend spliced, its body fetched (`client.HandleResolver`) and
decoded. A mismatch at any step is refused, never written into the prompt."""

from __future__ import annotations

import torch

from ..client import HandleResolver
from ..core import wire
from ..core.engine_request import EngineRequest, MediaInput
from ..core.errors import BadRequest
from ..core.handle import MediaHandle, check_body
from ..runtime.aio import gather_or_cancel


def check_spans(item: MediaInput, token_ids: list[int] | None) -> None:
    """One span per grid of the item's handle, each as long as its grid's tokens and, given the
    prompt, a run of one placeholder token. Checked before any body is fetched."""
    handle = item.handle
    if [n for _, n in item.spans] != handle.num_tokens:
        raise BadRequest(f"media {handle.mm_hash[:12]}: spans {item.spans} do not match its token counts "
                         f"{handle.num_tokens}")
    for offset, n in item.spans if token_ids is not None else ():
        run = token_ids[offset : offset + n]
        if offset < 0 or len(run) != n or len(set(run)) != 1:
            raise BadRequest(f"media {handle.mm_hash[:12]}: tokens {offset}..{offset + n} are not a placeholder run")


async def fetch_bodies(req: EngineRequest, resolver: HandleResolver) -> list[bytes]:
    """Every item's wire-v1 body (spans checked first), fetched concurrently; the first failure
    cancels the rest."""
    for item in req.media:
        check_spans(item, req.token_ids)
    return await gather_or_cancel(_given(item.handle, item.body) if item.body is not None
                                  else resolver.body(item.handle) for item in req.media)


async def _given(handle: MediaHandle, body: bytes) -> bytes:
    """A body the frontend sent along (`--media-transport body`), checked like a fetched one."""
    return check_body(handle, body)


def media_rows(req: EngineRequest, bodies: list[bytes], hidden: int) -> list[tuple[int, torch.Tensor]]:
    """(offset, rows) per span of every item, for writing over the placeholder embeddings."""
    out = []
    for item, body in zip(req.media, bodies, strict=True):
        msg = wire.decode(body)
        if msg.shape[1] != hidden:
            raise BadRequest(f"media {item.mm_hash[:12]}: embeddings are {msg.shape[1]} wide, the model takes {hidden}")
        start = 0
        for offset, n in item.spans:
            out.append((offset, msg.embeds[start : start + n]))
            start += n
    return out
