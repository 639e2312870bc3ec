"""Prompt KV kept for reuse, so a repeated prefix is not prefilled again.

KV-aware routing sends a request to the engine that holds the longest run of its prompt's blocks
(Dynamo's block hashes: per block of `block_size` tokens, a media block hashed by its mm_hash). This
is what the engine holds: after each prefill, the KV of the prompt's full blocks, keyed by their
hashes; a new prompt reuses the longest leading run of equal hashes and prefills only the rest.
What is held is what the KV events say: a block hash is `stored` when its first holder arrives and
`removed` when its last holder is evicted. Bounded in tokens; least recently used goes first.
"""

from __future__ import annotations

import copy
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TypeVar

_Cache = TypeVar("_Cache")  # a transformers KV cache (transformers is not analysed by mypy)


@dataclass
class Reuse:
    tokens: int  # prompt positions whose KV comes from the store
    cache: object | None  # a private copy of that KV (a transformers cache), None when nothing matched


class PrefixCache:
    def __init__(self, block_size: int, max_tokens: int):
        self.block_size = block_size
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], object] = OrderedDict()
        self._holders: Counter[int] = Counter()  # block hash -> entries holding it
        self.hits = 0
        self.reused_tokens = 0

    @property
    def tokens(self) -> int:
        return sum(len(k) for k in self._entries) * self.block_size

    def match(self, hashes: list[int], prompt_len: int) -> Reuse:
        """The longest stored run of `hashes` from the start, capped so at least one prompt token
        is left to prefill (its logits start the answer)."""
        best, best_key = 0, None
        for key in self._entries:
            n = 0
            for a, b in zip(key, hashes, strict=False):
                if a != b:
                    break
                n += 1
            if n > best:
                best, best_key = n, key
        usable = min(best, (prompt_len - 1) // self.block_size)
        if usable == 0 or best_key is None:
            return Reuse(0, None)
        self._entries.move_to_end(best_key)
        cache = _cut(self._entries[best_key], usable * self.block_size)  # the request extends its own copy
        self.hits += 1
        self.reused_tokens += usable * self.block_size
        return Reuse(usable * self.block_size, cache)

    def add(self, hashes: list[int], cache: object) -> tuple[list[int], list[int]]:
        """Keep a copy of `cache` cut to the full blocks `hashes` name; returns the block hashes
        newly held (to publish as stored) and those no longer held (removed)."""
        key = tuple(hashes)
        if not key or self.max_tokens < len(key) * self.block_size:
            return [], []
        if key in self._entries:
            self._entries.move_to_end(key)
            return [], []
        kept = _cut(cache, len(key) * self.block_size)
        stored = [h for h in dict.fromkeys(key) if self._holders[h] == 0]
        self._entries[key] = kept
        self._holders.update(set(key))
        removed: list[int] = []
        for shorter in [k for k in self._entries if k != key and key[: len(k)] == k]:  # now redundant
            removed += self._drop(shorter)
        while self.tokens > self.max_tokens:
            removed += self._drop(next(iter(self._entries)))
        return stored, removed

    def _drop(self, key: tuple[int, ...]) -> list[int]:
        del self._entries[key]
        gone = []
        for h in set(key):
            self._holders[h] -= 1
            if self._holders[h] == 0:
                del self._holders[h]
                gone.append(h)
        return gone


def _cut(cache: _Cache, n: int) -> _Cache:
    """A private copy of a transformers KV cache holding its first `n` positions: each layer's keys
    and values are copied once, cut (not the whole cache, then cut)."""
    memo: dict[int, object] = {}
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None and hasattr(t, "shape"):
                memo[id(t)] = t[..., :n, :].clone()
    return copy.deepcopy(cache, memo)
