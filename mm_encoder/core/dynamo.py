"""What every mm-encoder process needs of Dynamo's runtime: its names, its defaults and the client
calls. The worker's server side is `service.dynamo_server`; this module imports no torch.

Discovery and planes come from Dynamo's own environment (DYN_DISCOVERY_BACKEND, DYN_REQUEST_PLANE,
DYN_EVENT_PLANE); where they are unset, the defaults here run one machine without etcd or NATS.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from .errors import MMEncoderError

if TYPE_CHECKING:
    from dynamo.runtime import DistributedRuntime

NAMESPACE = "mm"  # Dynamo namespace of every component, unless a graph or option says otherwise
BLOCK_SIZE = 16  # KV block size the engines use and the router hashes by
ENCODER_COMPONENT, ENCODE_ENDPOINT = "mm_encoder", "encode"
ENGINE_COMPONENT, GENERATE_ENDPOINT = "engine", "generate"
HEALTH_PAYLOAD = {"health_check": True}
# One machine without etcd or NATS: file discovery, TCP requests, ZMQ events.
PLANES = {"DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq"}
# DYN_TCP_MAX_MESSAGE_SIZE where graphs set it: a 4K image's embeddings make a ~40 MB engine request.
MAX_MESSAGE_SIZE = 256 << 20
TOO_LARGE_HINT = "raise DYN_TCP_MAX_MESSAGE_SIZE (bytes) on both sides of the call"


def endpoint_path(namespace: str, component: str = ENCODER_COMPONENT, endpoint: str = ENCODE_ENDPOINT) -> str:
    return f"{namespace}.{component}.{endpoint}"


def make_runtime(loop: asyncio.AbstractEventLoop) -> DistributedRuntime:
    """Dynamo's DistributedRuntime as the environment configures it (defaults: `PLANES`)."""
    from dynamo.runtime import DistributedRuntime  # optional dependency: the `dynamo` extra

    plane = {k: os.environ.get(k, v) for k, v in PLANES.items()}
    return DistributedRuntime(loop, plane["DYN_DISCOVERY_BACKEND"], plane["DYN_REQUEST_PLANE"],
                              event_plane=plane["DYN_EVENT_PLANE"])


def is_too_large(e: BaseException) -> bool:
    """Dynamo's TCP request plane refusing a message above DYN_TCP_MAX_MESSAGE_SIZE."""
    return "payload is too large" in str(e)


def client_error(e: MMEncoderError) -> Exception:
    """The exception a handler inside Dynamo's HTTP frontend raises so the client sees `e`'s status.
    Dynamo 1.6.1 shows a message only for `InvalidArgument` (400); for an `HttpError` it keeps the
    status and replaces the message with the status's name. The code leads the message: `[code] ...`."""
    from dynamo.llm.exceptions import CannotConnect, HttpError, InvalidArgument

    # For 503, HttpError reads "Internal server error"; CannotConnect reads "Service temporarily
    # unavailable". Neither shows our message, and no handler can set headers: no Retry-After here.
    text = f"[{e.code}] {e.message}"
    if e.http_status == 400:
        return InvalidArgument(text)
    return CannotConnect(text) if e.http_status == 503 else HttpError(e.http_status, text)


def internal_error(e: BaseException) -> Exception:
    """What a handler inside Dynamo's HTTP frontend raises for a bug: a 500 that names the
    exception's type and nothing the request sent."""
    from dynamo.llm.exceptions import HttpError

    return HttpError(500, f"internal error: {type(e).__name__}")


def worker_error(e: MMEncoderError) -> Exception:
    """The exception a worker behind Dynamo's stock frontend raises for `e`: the frontend shows the
    message of `InvalidArgument` (as a 400: a 404/413/422 keeps its code in the text) and answers
    503 to `CannotConnect`; anything else is a 500 whose message it hides."""
    from dynamo.llm.exceptions import CannotConnect, InvalidArgument, Unknown

    text = f"[{e.code}] {e.message}"
    if 400 <= e.http_status < 500:
        return InvalidArgument(text)
    return CannotConnect(text) if e.http_status == 503 else Unknown(text)
