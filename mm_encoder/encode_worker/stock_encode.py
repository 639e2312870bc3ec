"""The worker as Dynamo's own Encode worker: what the stock `python -m dynamo.frontend` calls, once
per request with media, before it sends the request to an engine.

Registered for the served LLM with `worker_type=Encode` (model type Empty: the frontend must not
serve it as a chat model of its own), on `<namespace>.encoder.generate`. A request's
`multi_modal_data` (`{"image_url": [{"Url": ...}], "video_url": [...]}`) is fetched with our own
fetcher and its address policy, encoded through the same `EncodeService` (so its caches answer),
and answered with one terminal chunk whose `encoder_result` holds a handle per item
(`core.handle.encoder_result`): the engine fetches the bodies itself.

Dynamo 1.6.1 hides an Encode worker's failure from the client: it falls back to sending the
request downstream without an `encoder_result`. So a refusal travels inside a successful result,
`{"mm_encoder": 1, "error": {"code", "message", "status"}}`, and the engine raises it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..core.errors import BadRequest, MMEncoderError
from ..core.handle import ENCODER_RESULT_VERSION, MediaHandle, encoder_result
from ..core.requests import EncodeRequest
from ..runtime.aio import gather_or_cancel
from ..runtime.dynamo import endpoint_path, register_encode_worker, serve_endpoint
from .pipeline import EncodeService

if TYPE_CHECKING:
    from ..runtime.dynamo import Context, DistributedRuntime

log = logging.getLogger(__name__)

STOCK_COMPONENT, STOCK_ENDPOINT = "encoder", "generate"
MODALITY_KEYS = {"image_url": "image", "video_url": "video"}
MAX_ITEMS = 16  # media items per request; the frontend's own default limit


def media_items(request: Any) -> list[tuple[str, str]]:
    """(modality, url) per item, images then videos, each in prompt order; anything else is refused."""
    mm = request.get("multi_modal_data") if isinstance(request, dict) else None
    if not mm:
        return []
    if not isinstance(mm, dict) or sorted(set(mm) - set(MODALITY_KEYS)):
        raise BadRequest(f"multi_modal_data may hold only {sorted(MODALITY_KEYS)}, got {sorted(mm)[:8]}")
    items = []
    for key, modality in MODALITY_KEYS.items():
        for entry in mm.get(key) or []:
            url = entry.get("Url") if isinstance(entry, dict) else None
            if not isinstance(url, str) or not url or len(entry) != 1:
                kind = sorted(entry)[:3] if isinstance(entry, dict) else type(entry).__name__
                raise BadRequest(f"multi_modal_data.{key}: each item must be {{'Url': str}}, got {kind}")
            items.append((modality, url))
    if len(items) > MAX_ITEMS:
        raise BadRequest(f"{len(items)} media items in one request; at most {MAX_ITEMS}")
    return items


class StockEncoder:
    """Serves one EncodeService as Dynamo's Encode worker for one LLM directory."""

    def __init__(self, service: EncodeService, runtime: DistributedRuntime, namespace: str, model_dir: str,
                 name: str | None, chain: str | None, route: str):
        self.service = service
        self.runtime = runtime
        self.namespace = namespace
        self.model_dir = model_dir
        self.name = name
        self.chain, self.route = chain, route
        self.rpc = endpoint_path(namespace)
        self._task: asyncio.Future[Any] | None = None

    async def start(self) -> None:
        from ..core.handle import chain_url

        self.chain = chain_url(self.chain) if self.chain else None
        endpoint = self.runtime.endpoint(endpoint_path(self.namespace, STOCK_COMPONENT, STOCK_ENDPOINT))
        self._task = serve_endpoint(endpoint, self.generate, health_check=True)
        await register_encode_worker(endpoint, self.model_dir, self.name)
        log.info("registered as Dynamo's Encode worker for %s", self.name or self.model_dir)

    async def generate(self, request: Any, context: Context | None = None) -> AsyncIterator[dict[str, Any]]:
        if isinstance(request, dict) and request.get("health_check"):
            yield {"token_ids": [], "index": 0, "finish_reason": "stop", "encoder_result": {"ready": True}}
            return
        try:
            result = encoder_result(await self.handles(media_items(request)))
        except MMEncoderError as e:
            log.info("encode for the stock frontend refused: [%s] %s", e.code, e.message)
            result = {"mm_encoder": ENCODER_RESULT_VERSION, "error": e.to_dict(status=True)["error"]}
        yield {"token_ids": [], "index": 0, "finish_reason": "stop", "encoder_result": result}

    async def handles(self, items: list[tuple[str, str]]) -> dict[str, list[MediaHandle]]:
        spec = self.service.encoder.spec
        sources = [EncodeRequest(model=spec.name, url=url, modality=modality, revision=spec.revision,
                                 dtype=self.service.batcher.wire_dtype)
                   for modality, url in items]
        results = await gather_or_cancel(self.service.encode(s, "dynamo") for s in sources)
        out: dict[str, list[MediaHandle]] = {}
        for (modality, _), source, r in zip(items, sources, results, strict=True):
            out.setdefault(modality, []).append(
                MediaHandle.build(r.header, source, chain=self.chain, route=self.route, rpc=self.rpc))
        return out

    async def stop(self, timeout_s: float) -> None:
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout_s)
