"""KV routing with media: (tokens, [(mm_hash, spans)]) -> what Dynamo's KV router hashes.

Two schemes exist in Dynamo 1.6 and they do not interoperate; we use **block_mm_infos**:
each KV block that holds placeholder positions of a media item carries
`{"mm_objects": [{"mm_hash": u64, "offsets": [[start, end], ...]}]}` and Dynamo mixes the
mm_hash into that block's hash. Why not pad-value routing tokens (`1_000_000 + (mm_hash &
(2**30 - 1))` in place of every placeholder): it keeps only 30 bits of the hash, so two
different images collide after ~2**15 distinct images with even odds (a false KV hit serves
the wrong image's prefix), and it needs engines to rewrite their events. block_mm_infos keeps
64 bits, leaves token ids alone, and the same function feeds the router and the engines' KV
events, so both sides hash identically.

`pad_routing_tokens` is kept for Dynamo's mocker (it ignores mm fields): routing scale tests
put pad tokens into the mocker's token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PAD_BASE = 1_000_000
PAD_MASK = (1 << 30) - 1
# One block's media, `{"mm_objects": [...]}` as above: the type Dynamo's router and hash function take.
BlockMMInfo = dict[str, Any]


@dataclass(frozen=True)
class MediaSpan:
    """One media item in a token sequence: its content hash and where its placeholders are."""

    mm_hash: str  # hex (blake3); the first 64 bits become the routing hash
    spans: tuple[tuple[int, int], ...]  # (offset, length) per image or per video chunk

    @property
    def routing_hash(self) -> int:
        return int(self.mm_hash[:16], 16)


def block_mm_infos(num_tokens: int, block_size: int, media: Sequence[MediaSpan]) -> list[BlockMMInfo | None] | None:
    """Per-block media info for `compute_block_hash_for_seq` / `KvRouter.best_worker`.

    One entry per block (full or partial); None for blocks without media, and None overall for
    a text-only request (so it routes exactly as before). Offsets are absolute token positions,
    clipped to the block.
    """
    if not media:
        return None
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n_blocks = (num_tokens + block_size - 1) // block_size
    infos: list[BlockMMInfo | None] = [None] * n_blocks
    for item in media:
        for offset, length in item.spans:
            if offset < 0 or length <= 0 or offset + length > num_tokens:
                raise ValueError(f"media span ({offset}, {length}) outside a {num_tokens}-token sequence")
            first, last = offset // block_size, (offset + length - 1) // block_size
            for b in range(first, last + 1):
                start = max(offset, b * block_size)
                end = min(offset + length, (b + 1) * block_size)
                block = infos[b] or {"mm_objects": []}
                infos[b] = block
                obj = next((o for o in block["mm_objects"] if o["mm_hash"] == item.routing_hash), None)
                if obj is None:
                    obj = {"mm_hash": item.routing_hash, "offsets": []}
                    block["mm_objects"].append(obj)
                obj["offsets"].append([start, end])
    return infos


def pad_routing_tokens(token_ids: Sequence[int], media: Sequence[MediaSpan]) -> list[int]:
    """The other scheme (for the mocker): placeholder positions replaced by pad values."""
    out = list(token_ids)
    for item in media:
        pad = PAD_BASE + (item.routing_hash & PAD_MASK)
        for offset, length in item.spans:
            out[offset : offset + length] = [pad] * length
    return out


def to_signed64(h: int) -> int:
    """KV event block hashes are signed 64-bit; Dynamo computes them unsigned."""
    return h - (1 << 64) if h >= (1 << 63) else h


def block_hashes(token_ids: Sequence[int], block_size: int, infos: list[BlockMMInfo | None] | None,
                 salt: str = "") -> list[int]:
    """The hashes Dynamo's KV router computes for `token_ids`' full blocks (each media block's
    mm_hash mixed in by `infos`, from `block_mm_infos`), signed as KV events carry them: so the
    engines publish exactly what the router looks up. Dynamo's own function, not a copy of it."""
    from dynamo.llm import compute_block_hash_for_seq  # the `dynamo` extra: frontends and engines have it

    # a tenant's blocks (`salt`: its scope) hash in the router's cache_namespace
    return [to_signed64(h) for h in compute_block_hash_for_seq(list(token_ids), block_size, infos,
                                                                cache_namespace=salt or None)]
