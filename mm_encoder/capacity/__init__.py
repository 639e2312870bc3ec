"""The capacity model (`mm-encoder capacity`, docs/capacity.md): a traffic description run through the
cache hierarchy (cluster tiers, the router's consistent-hash ring, the shared shards, the encode
workers' body caches) over a synthetic trace: hit ratio per tier, the encodes that reach the fleet,
the encoders they need, each tier's memory and the busiest shard's share. Torch-free; numpy."""

from __future__ import annotations

from ..cache_tiers.ring import HashRing
from .simulate import Result, simulate
from .traffic import Traffic

__all__ = ["HashRing", "Result", "Traffic", "simulate"]
