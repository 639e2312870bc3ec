"""`HandleResolver`: an engine's side of handles, from handle to body."""

from __future__ import annotations

import ssl
from typing import Any

from ..core.errors import HandleError
from ..core.handle import MediaHandle, chain_url, check_body
from .chain import EncoderChain


class HandleResolver:
    """An engine's side of handles: each body fetched from the chain its handle names, when this
    engine trusts that chain (an engine never fetches from an address a message picked), with this
    engine's own RPC client to the encode workers as the fallback. One `EncoderChain` (one connection
    pool) per trusted chain, and one for RPC only: a handle's route, which a request chooses, is a
    header of each call, never a pool of its own (pools kept per route grew with every route a
    request named, for ever)."""

    def __init__(self, trusted_chains: list[str] | tuple[str, ...] = (), rpc_client: Any = None,
                 timeout_s: float = 600.0, tls: ssl.SSLContext | None = None):
        self.trusted = {chain_url(c) for c in trusted_chains}
        self.rpc_client = rpc_client
        self.tls = tls  # this engine's client context, for https:// chains
        self.timeout_s = timeout_s
        self._chains: dict[str | None, EncoderChain] = {}  # by chain URL: at most len(trusted) + 1
        self.fetches = 0

    def chain_for(self, handle: MediaHandle) -> EncoderChain:
        chain = chain_url(handle.chain) if handle.chain else None
        if chain is not None and chain not in self.trusted:
            raise HandleError(f"media handle {handle.mm_hash[:12]} names cache chain {chain!r}, which this engine "
                              f"does not trust (its chains: {sorted(self.trusted) or 'none'})")
        if chain is None and self.rpc_client is None:
            raise HandleError(f"media handle {handle.mm_hash[:12]} names no cache chain and this engine has no RPC "
                              "client to the encode workers")
        if chain not in self._chains:
            self._chains[chain] = EncoderChain(http_url=chain, rpc_client=self.rpc_client, timeout_s=self.timeout_s,
                                               tls=self.tls)
        return self._chains[chain]

    async def body(self, handle: MediaHandle) -> bytes:
        """The handle's body, checked against it (its header read)."""
        return check_body(handle, await self.fetch(handle))

    async def fetch(self, handle: MediaHandle) -> bytes:
        """The handle's body, not yet checked: for a caller that decodes it and checks the decoded
        message (`core.handle.check_header`), reading it once."""
        self.fetches += 1
        body, _ = await self.chain_for(handle).fetch(handle.source, route=handle.route)
        return body

    async def close(self) -> None:
        for chain in self._chains.values():
            await chain.close()
