"""What every mm-encoder process needs of Dynamo's runtime: its names, its defaults and the client
calls. The worker's server side is `service.dynamo_server`; this module imports no torch.

Discovery and planes come from Dynamo's own environment (DYN_DISCOVERY_BACKEND, DYN_REQUEST_PLANE,
DYN_EVENT_PLANE); where they are unset, the defaults here run one machine without etcd or NATS.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from .errors import RemoteError
from .requests import EncodeReply

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


def make_runtime(loop: asyncio.AbstractEventLoop):
    """Dynamo's DistributedRuntime as the environment configures it (defaults: `PLANES`)."""
    from dynamo.runtime import DistributedRuntime  # optional dependency: the `dynamo` extra

    plane = {k: os.environ.get(k, v) for k, v in PLANES.items()}
    return DistributedRuntime(loop, plane["DYN_DISCOVERY_BACKEND"], plane["DYN_REQUEST_PLANE"],
                              event_plane=plane["DYN_EVENT_PLANE"])


def is_too_large(e: BaseException) -> bool:
    """Dynamo's TCP request plane refusing a message above DYN_TCP_MAX_MESSAGE_SIZE."""
    return "payload is too large" in str(e)


async def call_encode(client, request: dict[str, Any]) -> EncodeReply:
    """One encode request through a Dynamo client (round robin over the encode workers); the
    worker's reply, or RemoteError with the worker's own code and status."""
    reply = None
    async for msg in await client.round_robin(request):
        reply = msg.data() if hasattr(msg, "data") else msg
    if reply is None:
        raise RemoteError("the encode worker closed the stream without a response", "no_response", 502)
    return EncodeReply.from_dict(reply)
