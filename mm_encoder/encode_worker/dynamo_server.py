"""Dynamo RPC transport: `<namespace>.mm_encoder.encode` on the Dynamo runtime.

Request: the same fields as the HTTP request (`core.requests.EncodeRequest`), as a dict; `data`
may be raw bytes (Dynamo's msgpack codec carries them as bytes). Response: one message, an
`EncodeReply` (`body` is byte-for-byte what `POST /v1/encode` returns; with `"header_only": true`
in the request, `header` instead of the body) or
`{"error": {"code", "message", "status"}}`. The client side is `client.call_encode`.

`<namespace>.mm_encoder.load` answers the worker's load signals as one map (`ServiceMetrics.load`):
what the encode planner reads from every instance discovery lists (`mm_encoder.planner`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..core.errors import MMEncoderError
from ..core.requests import EncodeRequest
from ..runtime import tracing
from ..runtime.dynamo import ENCODER_COMPONENT, LOAD_ENDPOINT, endpoint_path, serve_endpoint
from .pipeline import EncodeResult, EncodeService

if TYPE_CHECKING:
    from ..runtime.dynamo import Context, DistributedRuntime

log = logging.getLogger(__name__)


class DynamoServer:
    """Serves one EncodeService on a Dynamo endpoint; `stop()` drains, then deregisters."""

    def __init__(self, service: EncodeService, runtime: DistributedRuntime, namespace: str):
        self.service = service
        self.runtime = runtime
        self.namespace = namespace
        self.path = endpoint_path(namespace)
        self._task: asyncio.Future[Any] | None = None
        self._load_task: asyncio.Future[Any] | None = None

    async def start(self) -> None:
        endpoint = self.runtime.endpoint(self.path)
        endpoint.metrics.register_prometheus_expfmt_callback(lambda: self.service.metrics.render().decode())
        # serve_endpoint returns a future that resolves when the endpoint stops serving.
        self._task = serve_endpoint(endpoint, self.encode, health_check=True)
        load = self.runtime.endpoint(endpoint_path(self.namespace, ENCODER_COMPONENT, LOAD_ENDPOINT))
        self._load_task = serve_endpoint(load, self.load)
        log.info("serving Dynamo endpoint %s (and its load signals)", self.path)

    async def load(self, request: Any, context: Context | None) -> AsyncIterator[dict[str, Any]]:
        yield self.service.metrics.load(draining=self.service.draining)

    async def encode(self, request: Any, context: Context | None) -> AsyncIterator[dict[str, Any]]:
        if isinstance(request, dict) and request.get("health_check"):
            yield {"ready": self.service.ready}
            return
        header_only = False
        if isinstance(request, dict) and "header_only" in request:  # the envelope's, not the request's
            request = dict(request)
            header_only = request.pop("header_only") is True
        try:
            result = await self._unless_stopped(EncodeRequest.parse(request), context)
        except MMEncoderError as e:
            yield e.to_dict(status=True)
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unhandled error in Dynamo encode")
            yield MMEncoderError("internal error; see the worker's log", "internal", 500).to_dict(status=True)
            return
        yield result.reply(header_only).to_dict()

    async def _unless_stopped(self, req: EncodeRequest, context: Context | None) -> EncodeResult:
        """Run the request, cancelling it if the caller stops the stream (queued work is dropped)."""
        # the caller's trace, as Dynamo's request context carries it
        work = asyncio.ensure_future(self.service.encode(req, "dynamo", tracing.from_dynamo(context)))
        stopped = context.async_killed_or_stopped() if context is not None else None
        if stopped is None:
            return await work
        either: set[asyncio.Future[Any]] = {work, stopped}
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
            if not stopped.done():
                stopped.cancel()
        if work.cancelled():
            raise asyncio.CancelledError
        return work.result()

    async def stop(self, timeout_s: float) -> None:
        """Dynamo waits for in-flight streams, then deregisters the instance."""
        self.runtime.shutdown()
        for task in (self._task, self._load_task):
            if task is not None:
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(task, timeout_s)
