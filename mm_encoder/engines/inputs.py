"""An `EngineRequest`'s media as an engine takes them: each item's handle (parsed on arrival)
checked against the spans the frontend spliced, its body fetched (`client.HandleResolver`), decoded
once and checked against its handle. A mismatch at any step is refused, never written into the
prompt. One `Media` record per item carries it from there on."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from ..client import HandleResolver
from ..core import wire
from ..core.engine_request import EngineRequest, MediaInput
from ..core.errors import BadRequest
from ..core.handle import check_header
from ..runtime.aio import gather_or_cancel


@dataclass(frozen=True)
class Media:
    """One media item in the engine: where its rows go (`input`: handle and spans) and the rows
    (`message`: its body, decoded once and checked against the handle)."""

    input: MediaInput
    message: wire.WireMessage

    @property
    def mm_hash(self) -> str:
        return self.input.mm_hash

    @property
    def modality(self) -> str:
        return self.message.modality

    @property
    def spans(self) -> list[tuple[int, int]]:
        return self.input.spans

    @property
    def grids(self) -> list[tuple[int, ...]]:
        return [tuple(int(g) for g in grid) for grid in self.message.grid_thws]

    def span_rows(self) -> list[tuple[int, torch.Tensor]]:
        """(offset, rows) per span: an image has one, a video one per chunk."""
        out, start = [], 0
        for offset, n in self.spans:
            out.append((offset, self.message.embeds[start : start + n]))
            start += n
        return out


def check_spans(item: MediaInput, token_ids: list[int] | None) -> None:
    """One span per grid of the item's handle, each as long as its grid's tokens and, given the
    prompt, a run of one placeholder token. Checked before any body is fetched."""
    handle = item.handle
    if [n for _, n in item.spans] != handle.num_tokens:
        raise BadRequest(f"media {handle.mm_hash[:12]}: spans {item.spans} do not match its token counts "
                         f"{handle.num_tokens}")
    if token_ids is None:
        return
    for offset, n in item.spans:
        run = token_ids[offset : offset + n]
        if offset < 0 or len(run) != n or len(set(run)) != 1:
            raise BadRequest(f"media {handle.mm_hash[:12]}: tokens {offset}..{offset + n} are not a placeholder run")


async def fetch_bodies(req: EngineRequest, resolver: HandleResolver) -> list[bytes]:
    """Every item's wire-v1 body (spans checked first), fetched concurrently, not yet read; the
    first failure cancels the rest. A body the frontend sent along (`--media-transport body`) is
    taken as fetched."""
    for item in req.media:
        check_spans(item, req.token_ids)
    return await gather_or_cancel(_given(item.body) if item.body is not None else resolver.fetch(item.handle)
                                  for item in req.media)


async def _given(body: bytes) -> bytes:
    return body


async def decode_media(req: EngineRequest, bodies: list[bytes]) -> list[Media]:
    """Each body decoded once (off the event loop) and checked against its handle."""
    if not bodies:
        return []
    return await asyncio.to_thread(_decode_all, req.media, bodies)


def _decode_all(items: list[MediaInput], bodies: list[bytes]) -> list[Media]:
    out = []
    for item, body in zip(items, bodies, strict=True):
        message = wire.decode(body)
        check_header(item.handle, message)
        out.append(Media(item, message))
    return out


def media_rows(media: list[Media], hidden: int) -> list[tuple[int, torch.Tensor]]:
    """(offset, rows) per span of every item, for writing over the placeholder embeddings."""
    out = []
    for m in media:
        if m.message.shape[1] != hidden:
            raise BadRequest(f"media {m.mm_hash[:12]}: embeddings are {m.message.shape[1]} wide, the model takes "
                             f"{hidden}")
        out.extend(m.span_rows())
    return out
