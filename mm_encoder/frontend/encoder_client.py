"""EncoderClient: one encoder call per media item, all items of a request concurrently.

Two paths, chosen per deployment:
- `http`: POST to the cache chain (the cluster tier's `/v1/encode`), naming the chain with
  `X-Cache-Route` and sending `X-Cache-Key` = sha256(model, processor, URL or content hash,
  scope), so no tier hashes the body. If the chain itself fails (connection error, or a 502/503/504
  that is not the encoder's own typed error) and RPC is configured, the call falls back to
  direct Dynamo RPC; fallbacks are counted.
- `rpc`: Dynamo RPC straight to an encode worker (`<ns>.mm_encoder.encode`).
The result is the wire v1 body plus its header (`wire.peek`: the tensor is not inflated here).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass

import aiohttp

from ..core import wire
from ..core.dynamo import TOO_LARGE_HINT, call_encode, is_too_large
from ..core.errors import EncoderUnavailable, RemoteError, RequestTooLarge
from .chat import MediaRef

log = logging.getLogger("mm_encoder.frontend.encoder")


@dataclass
class Encoded:
    body: bytes  # wire v1, passed to the engine untouched
    header: wire.WireHeader
    source: str  # "http:<X-Cache-Status>" or "rpc"


def cache_key(model: str, processor: dict | None, url: str, scope: str) -> str:
    """The tiers' key for one item: what the encoder's answer depends on, nothing else."""
    ref = url if url[:5].lower() != "data:" else "sha256:" + hashlib.sha256(url.encode()).hexdigest()
    doc = json.dumps([model, processor or {}, ref, scope], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()


class EncoderClient:
    def __init__(self, model: str, *, http_url: str | None = None, route: str = "cluster,shared",
                 rpc_client=None, timeout_s: float = 600.0, scope: str = ""):
        if http_url is None and rpc_client is None:
            raise ValueError("EncoderClient needs an HTTP cache chain, a Dynamo RPC client, or both")
        self.model = model
        self.http_url = http_url.rstrip("/") + "/v1/encode" if http_url else None
        self.route = route
        self.rpc_client = rpc_client
        self.scope = scope
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5)
        self._session: aiohttp.ClientSession | None = None
        self.calls = 0
        self.fallbacks = 0

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def embed_all(self, media: list[MediaRef], scope: str | None = None) -> list[Encoded]:
        """All items concurrently; the first failure cancels the rest and is raised."""
        tasks = [asyncio.ensure_future(self.embed(m, scope if scope is not None else self.scope)) for m in media]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def embed(self, item: MediaRef, scope: str = "") -> Encoded:
        self.calls += 1
        request = {"model": self.model, "url": item.url, "modality": item.modality, "scope": scope}
        if self.http_url is not None:
            try:
                return await self._http(request)
            except EncoderUnavailable as e:
                if self.rpc_client is None:
                    raise
                self.fallbacks += 1
                log.warning("cache chain failed (%s); falling back to direct RPC", e.message)
        return await self._rpc(request)

    async def _http(self, request: dict) -> Encoded:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        headers = {
            "Content-Type": "application/json",
            "Accept": wire.CONTENT_TYPE,
            "X-Cache-Key": cache_key(self.model, None, request["url"], request["scope"]),
            "X-Cache-Route": self.route,
        }
        try:
            async with self._session.post(self.http_url, json=request, headers=headers) as r:
                body = await r.read()
                status = r.status
                cache_status = r.headers.get("X-Cache-Status", "")
                ctype = r.headers.get("Content-Type", "")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise EncoderUnavailable(f"cache chain {self.http_url} unreachable: {type(e).__name__}: {e}") from None
        if status == 200:
            return Encoded(body, wire.peek(body), f"http:{cache_status}")
        error = _json_error(body) if ctype.startswith("application/json") else None
        if error is None and status in (502, 503, 504):  # the chain failed, not the encoder
            raise EncoderUnavailable(f"cache chain answered {status}")
        if error is None:
            raise RemoteError(f"encoder answered {status}")
        raise RemoteError.from_dict({**error, "status": status}, f"encoder answered {status}")

    async def _rpc(self, request: dict) -> Encoded:
        client = self.rpc_client
        if not client.instance_ids():
            raise EncoderUnavailable("no encode worker is registered")
        try:
            reply = await call_encode(client, request)
        except RemoteError:
            raise
        except Exception as e:  # Dynamo transport errors: the worker went away mid-call
            if is_too_large(e):
                raise RequestTooLarge(f"the encode request is above the request plane's message limit; "
                                      f"{TOO_LARGE_HINT}") from None
            raise EncoderUnavailable(f"encode worker unreachable over RPC: {type(e).__name__}: {e}") from None
        return Encoded(reply.body, wire.peek(reply.body), "rpc")


def _json_error(body: bytes) -> dict | None:
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return err if isinstance(err, dict) else None
