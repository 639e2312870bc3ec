"""EncoderClient: one encoder call per media item, all items of a request concurrently.

Each call asks the encoders for the item's header only (`EncoderChain.describe`: HEAD through the
cache chain, whose tiers fetch and cache the body on a miss; or Dynamo RPC with `header_only`) and
returns a `MediaHandle`: what the processor needs to splice and route, and what the engine needs
to fetch the body itself. No embeddings pass through the frontend.

`send_bodies=True` is the old way, kept as the baseline benchmarks compare against: the body is fetched
here (POST through the chain) and sent to the engine with the handle.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

from ..core import wire
from ..core.errors import DtypeMismatch, RemoteError
from ..core.handle import MediaHandle
from ..core.requests import EncodeRequest, MediaRef
from ..core.wire_schema import WireDtype
from ..runtime import tracing
from ..runtime.aio import gather_or_cancel
from ..runtime.dynamo import ENCODE_ENDPOINT, ENCODER_COMPONENT, endpoint_path
from .chain import EncoderChain


@dataclass
class Encoded:
    handle: MediaHandle  # its `header`: what the processor splices and routes on
    source: str  # "http:<X-Cache-Status>" or "rpc"
    body: bytes | None = None  # send_bodies only


class EncoderClient:
    def __init__(self, model: str, *, http_url: str | None = None, route: str = "cluster,shared",
                 rpc_client: Any = None, timeout_s: float = 600.0, scope: str = "", namespace: str | None = None,
                 send_bodies: bool = False, revision: str | None = None, dtype: WireDtype | None = None,
                 tls: ssl.SSLContext | None = None):
        self.model = model
        self.revision = revision  # the checkpoint's: an encoder serving another refuses, a tier never mixes them
        self.dtype = dtype  # the engines' rows: likewise
        self.send_bodies = send_bodies
        self.scope = scope
        self.chain = EncoderChain(http_url=http_url, route=route, rpc_client=rpc_client, timeout_s=timeout_s, tls=tls)
        self.rpc_path = endpoint_path(namespace, ENCODER_COMPONENT, ENCODE_ENDPOINT) if namespace else None
        self.calls = 0

    @property
    def fallbacks(self) -> int:
        return self.chain.fallbacks

    @property
    def body_bytes(self) -> int:
        return self.chain.body_bytes

    async def close(self) -> None:
        await self.chain.close()

    async def embed_all(self, media: list[MediaRef], scope: str | None = None) -> list[Encoded]:
        """All items concurrently; the first failure cancels the rest and is raised."""
        return await gather_or_cancel(self.embed(m, scope if scope is not None else self.scope) for m in media)

    async def embed(self, item: MediaRef, scope: str = "") -> Encoded:
        """One item's header and handle: one call, traced as a client span with the level that
        answered (`X-Cache-Status` through the tiers, or rpc)."""
        self.calls += 1
        source = EncodeRequest(model=self.model, url=item.url, modality=item.modality, scope=scope,
                               revision=self.revision, dtype=self.dtype)
        body = None
        with tracing.span("encode", kind="client", attributes={"mm_encoder.modality": item.modality}) as span:
            if self.send_bodies:
                body, where = await self.chain.fetch(source)
                header = wire.peek(body)
            else:
                header, where = await self.chain.describe(source)
            span.set_attributes({"mm_encoder.mm_hash": header.mm_hash, "mm_encoder.cache": where,
                                 "mm_encoder.tokens": header.length})
        if self.dtype is not None and header.dtype != self.dtype:  # an encoder older than the `dtype` field
            raise RemoteError(f"the encoder answered {header.dtype} rows for a request that asks {self.dtype}",
                              DtypeMismatch.code, DtypeMismatch.http_status)
        handle = MediaHandle.build(header, source, chain=self.chain.http_url, route=self.chain.route,
                                   rpc=self.rpc_path)
        return Encoded(handle, where, body)
