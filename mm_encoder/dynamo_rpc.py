"""Dynamo RPC transport: `<namespace>.mm_encoder.encode` on the Dynamo runtime.

Request: the same fields as the HTTP request (`mm_encoder.protocol.EncodeRequest`), as a dict;
`data` may be raw bytes (Dynamo's msgpack codec carries them as bytes). Response: one message,
`{"body": <wire v1 bytes>, "mm_hash", "source", "timings_ms"}` or `{"error": {"code", "message",
"status"}}`. `body` is byte-for-byte what `POST /v1/encode` returns for the same request.

Discovery and planes come from Dynamo's own environment (DYN_DISCOVERY_BACKEND, DYN_REQUEST_PLANE,
DYN_EVENT_PLANE; defaults here: file, tcp, zmq, i.e. one machine without etcd or NATS).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from .errors import MMEncoderError
from .protocol import EncodeRequest
from .service import EncodeService

log = logging.getLogger("mm_encoder.dynamo")

COMPONENT = "mm_encoder"
ENDPOINT = "encode"
HEALTH_PAYLOAD = {"health_check": True}


def endpoint_path(namespace: str) -> str:
    return f"{namespace}.{COMPONENT}.{ENDPOINT}"


def make_runtime(loop: asyncio.AbstractEventLoop):
    from dynamo.runtime import DistributedRuntime  # optional dependency: the `dynamo` extra

    return DistributedRuntime(
        loop,
        os.environ.get("DYN_DISCOVERY_BACKEND", "file"),
        os.environ.get("DYN_REQUEST_PLANE", "tcp"),
        event_plane=os.environ.get("DYN_EVENT_PLANE", "zmq"),
    )


def error_message(e: MMEncoderError) -> dict[str, Any]:
    return {"error": {"code": e.code, "message": e.message, "status": e.http_status}}


class DynamoServer:
    """Serves one EncodeService on a Dynamo endpoint; `stop()` drains, then deregisters."""

    def __init__(self, service: EncodeService, runtime, namespace: str):
        self.service = service
        self.runtime = runtime
        self.path = endpoint_path(namespace)
        self._task: asyncio.Future | None = None

    async def start(self) -> None:
        endpoint = self.runtime.endpoint(self.path)
        endpoint.metrics.register_prometheus_expfmt_callback(lambda: self.service.metrics.render().decode())
        # serve_endpoint returns a future that resolves when the endpoint stops serving.
        self._task = asyncio.ensure_future(
            endpoint.serve_endpoint(self.handle, graceful_shutdown=True, health_check_payload=HEALTH_PAYLOAD)
        )
        log.info("serving Dynamo endpoint %s", self.path)

    async def handle(self, request: Any, context) -> AsyncIterator[dict[str, Any]]:
        if isinstance(request, dict) and request.get("health_check"):
            yield {"ready": self.service.ready}
            return
        try:
            req = EncodeRequest.parse(request)
            result = await self._encode_unless_stopped(req, context)
        except MMEncoderError as e:
            yield error_message(e)
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unhandled error in Dynamo encode")
            yield {"error": {"code": "internal", "message": "internal error; see the worker's log", "status": 500}}
            return
        yield {"body": result.body, "mm_hash": result.mm_hash, "source": result.source,
               "timings_ms": result.timings_ms}

    async def _encode_unless_stopped(self, req: EncodeRequest, context):
        """Run the encode, cancelling it if the caller stops the stream (queued work is dropped)."""
        work = asyncio.ensure_future(self.service.encode(req, "dynamo"))
        stopped = context.async_killed_or_stopped() if context is not None else None
        if stopped is None:
            return await work
        try:
            await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
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
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout_s)


def is_too_large(e: BaseException) -> bool:
    """Dynamo's TCP request plane refusing a message above DYN_TCP_MAX_MESSAGE_SIZE."""
    return "payload is too large" in str(e)


TOO_LARGE_HINT = "raise DYN_TCP_MAX_MESSAGE_SIZE (bytes) on both sides of the call"


class RemoteEncodeError(MMEncoderError):
    """An error the encode worker returned over Dynamo RPC (its code and status kept)."""


async def call_encode(client, request: dict[str, Any]) -> dict[str, Any]:
    """Send one encode request through a Dynamo client; the worker's response dict, or raises
    RemoteEncodeError with the worker's code and status."""
    reply = None
    async for msg in await client.round_robin(request):
        reply = msg.data() if hasattr(msg, "data") else msg
    if reply is None:
        raise RemoteEncodeError("the encode worker closed the stream without a response", "no_response", 502)
    if "error" in reply:
        err = reply["error"]
        raise RemoteEncodeError(err["message"], err["code"], err.get("status", 502))
    return reply
