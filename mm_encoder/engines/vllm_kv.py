"""vLLM's KV events, relayed to Dynamo's KV router hashed the way the router hashes.

The router hashes a block from its token ids plus, for media rows, the item's mm_hash
(`routing.block_mm_infos`). vLLM's events do not say that for a mixed prompt-embeds request: its
media rows arrive as token id 0 and the block's identity is the sha256 of its embedding rows
(`BlockStored.extra_keys`). Relayed as they are (Dynamo's own ZMQ relay), two prompts that differ
only in their image would hash alike and the router would send a request to an engine that holds
another image's KV. So the adapter subscribes to vLLM's events itself and, per stored block,
restores what the router hashes:

- the adapter registers each mixed prompt's blocks before vLLM sees it: (block index, rows digest)
  -> (the token ids vLLM will report, media rows as 0; the block's real token ids; its media info);
- a `BlockStored` block whose extra key is a digest is looked up by its index (from the parent
  chain) and that digest, among those registrations the one whose reported token ids are the
  event's (the digest alone cannot tell two prompts apart whose blocks differ only in text), and
  published with the real tokens and media info; tokens past the prompt (generated ones) come
  from the event;
- blocks without a digest (token prompts) are relayed as they are; vLLM's block hashes stay the
  external ids, so `BlockRemoved` and parent links pass through unchanged.

A block that cannot be mapped (registration evicted, an unknown extra key) is not published, nor
is anything chained after it in that event: the router then under-counts that engine's cache and
routes as if it were cold, never to the wrong KV. `KvRelay.unmapped` counts such blocks.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cachetools import LRUCache

from ..routing import BlockMMInfo, to_signed64

if TYPE_CHECKING:
    from ..runtime.dynamo import KvEventPublisher

log = logging.getLogger(__name__)

EMPTY_DIGEST = hashlib.sha256(b"").digest()  # a block wholly past the prompt embeddings (generated tokens)


@dataclass(frozen=True)
class Registered:
    reported: tuple[int, ...]  # what vLLM's event says for the block's prompt part: media rows as 0
    token_ids: tuple[int, ...]  # the block's prompt tokens (up to block_size; fewer if the prompt ends in it)
    mm_info: BlockMMInfo | None  # routing.block_mm_infos entry for the block


class KvRelay:
    """Translates vLLM's `KVEventBatch` events into Dynamo `KvEventPublisher` calls."""

    def __init__(self, publisher: KvEventPublisher, block_size: int, max_blocks: int = 1 << 18) -> None:
        self.publisher = publisher
        self.block_size = block_size
        # (block index, rows digest) -> the blocks registered under it (usually one)
        self._registered: LRUCache[tuple[int, bytes], tuple[Registered, ...]] = LRUCache(max_blocks)
        # vLLM block hash -> (block index, its chain's cache salt: a tenant's scope, or "")
        self._index: LRUCache[int, tuple[int, str]] = LRUCache(max_blocks)
        self.stored = self.removed = self.unmapped = 0

    def register(self, token_ids: list[int], is_token_ids: list[bool], digests: list[bytes],
                 mm_infos: list[BlockMMInfo | None] | None) -> None:
        """A mixed prompt's blocks, before vLLM stores them: `digests` as `vllm_inputs.block_digests`
        computes them (one per block, the partial last one included)."""
        bs = self.block_size
        reported = [t if is_tok else 0 for t, is_tok in zip(token_ids, is_token_ids, strict=True)]
        for i, digest in enumerate(digests):
            info = mm_infos[i] if mm_infos is not None and i < len(mm_infos) else None
            reg = Registered(tuple(reported[i * bs : (i + 1) * bs]), tuple(token_ids[i * bs : (i + 1) * bs]), info)
            others = tuple(r for r in self._registered.get((i, digest), ()) if r.reported != reg.reported)
            self._registered[(i, digest)] = (reg, *others[:7])  # the newest first; a few distinct texts kept

    def _lookup(self, index: int, digest: bytes, event_tokens: list[int]) -> Registered | None:
        for reg in self._registered.get((index, digest), ()):
            if tuple(event_tokens[: len(reg.reported)]) == reg.reported:
                return reg
        return None

    def on_events(self, events: Iterable[Any]) -> None:
        """One `KVEventBatch.events` list, in order."""
        for ev in events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                self._stored(ev)
            elif kind == "BlockRemoved":
                hashes = [h for h in ev.block_hashes if self._index.pop(_key(h), None) is not None]
                if hashes:
                    self.publisher.publish_removed([to_signed64(_key(h)) for h in hashes])
                    self.removed += len(hashes)
            elif kind == "AllBlocksCleared":
                if len(self._index):
                    self.publisher.publish_removed([to_signed64(h) for h in self._index])
                    self.removed += len(self._index)
                self._index.clear()

    def _stored(self, ev: Any) -> None:
        bs = self.block_size
        parent = None if ev.parent_block_hash is None else _key(ev.parent_block_hash)
        if parent is not None and parent not in self._index:
            self.unmapped += len(ev.block_hashes)  # its chain was never relayed
            return
        keys = list(ev.extra_keys or [None] * len(ev.block_hashes))
        # a chain's salt is in its first block's keys (vLLM: block 0 only); its later blocks inherit it
        start, salt = (0, _salt(keys[0])) if parent is None else (self._index[parent][0] + 1, self._index[parent][1])
        tokens: list[int] = []
        infos: list[BlockMMInfo | None] = []
        hashes: list[int] = []
        for j, h in enumerate(ev.block_hashes):
            event_tokens = list(ev.token_ids[j * bs : (j + 1) * bs])
            digest = _digest(keys[j])
            if digest is None or digest == EMPTY_DIGEST:  # token ids as they are
                block, info = event_tokens, None
            else:
                reg = self._lookup(start + j, digest, event_tokens)
                if reg is None:
                    self.unmapped += len(ev.block_hashes) - j
                    log.debug("KV block %d of an embeddings prompt is not registered; not relayed", start + j)
                    break
                block = [*reg.token_ids, *event_tokens[len(reg.token_ids):]]
                info = reg.mm_info
            self._index[_key(h)] = (start + j, salt)
            tokens += block
            infos.append(info)
            hashes.append(to_signed64(_key(h)))
        if not hashes:
            return
        parent_id = None if parent is None else to_signed64(parent)
        self.publisher.publish_stored(tokens, [bs] * len(hashes), hashes, parent_id,
                                      infos if any(i is not None for i in infos) else None,
                                      cache_salt=salt or None)  # the router hashes it as the query's cache_namespace
        self.stored += len(hashes)


def _key(block_hash: Any) -> int:
    """vLLM's external block hash (an int, or bytes with a hash function that yields bytes) as an int."""
    return block_hash if isinstance(block_hash, int) else int.from_bytes(bytes(block_hash)[-8:], "big")


def _salt(keys: tuple[object, ...] | None) -> str:
    """A request's cache_salt among its first block's extra keys (the only str key a prompt without
    LoRA or vLLM-processed media has: `to_event_extra_keys` turns ("cache_salt", s) into s)."""
    return next((k for k in keys or () if isinstance(k, str)), "")


def _digest(keys: tuple[object, ...] | None) -> bytes | None:
    """The prompt-embeds digest among a block's untagged extra keys (the only bytes key vLLM sets)."""
    for k in keys or ():
        if isinstance(k, bytes | bytearray) and len(k) == 32:
            return bytes(k)
    return None
