"""The kinds of component a deployment has and who may call whom: the one hop policy.

A graph's plan (`graph.plan`) gives each component the callers its kind admits in that graph; the
servers (the encode worker, the nginx tiers) take the same set as their default; with TLS they
refuse any other caller's certificate role, and on Kubernetes the NetworkPolicies admit only
those callers' pods. Written here once, so the three can never disagree.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

Kind = Literal["frontend", "encoder", "engine", "cache-cluster", "cache-router", "cache-shared", "planner"]
CACHE_TIERS: tuple[Kind, ...] = ("cache-shared", "cache-router", "cache-cluster")
# Start order: each kind only calls kinds before it.
ORDER: tuple[Kind, ...] = ("encoder", "cache-shared", "cache-router", "cache-cluster", "engine", "frontend", "planner")

# The roles each HTTP hop admits wherever it runs: the frontend and the engines ask the chain's
# outer tier (describe, fetch by handle), a tier asks the next level, engines may fetch a body from
# an encoder a handle names.
_CALLERS: dict[str, frozenset[str]] = {
    "cache-cluster": frozenset({"frontend", "engine"}),
    "cache-router": frozenset({"cache-cluster"}),
    "cache-shared": frozenset({"cache-router", "cache-cluster"}),
    "encoder": frozenset({"cache-shared", "engine"}),
}


def callers(kind: str, graph_kinds: Collection[str] = ()) -> frozenset[str]:
    """The roles that may call a `kind`'s HTTP port (empty: a kind with no HTTP hop of ours). In a
    graph with a cluster tier (`graph_kinds`), the encoders admit it as well: its direct route."""
    out = _CALLERS.get(kind, frozenset())
    if kind == "encoder" and "cache-cluster" in graph_kinds:
        out |= {"cache-cluster"}
    return out


def callees(role: str) -> frozenset[str]:
    """The kinds whose HTTP port a `role` calls (what its client accepts as a server), in any graph."""
    return frozenset(k for k in _CALLERS if role in callers(k, ("cache-cluster",)))
