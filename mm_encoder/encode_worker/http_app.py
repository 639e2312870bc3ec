"""HTTP transport (aiohttp): what the nginx cache tiers and HTTP clients talk to.

    POST /v1/encode   JSON or msgpack request -> wire v1 body (or legacy JSON with Accept: application/json)
    GET|HEAD /v1/encode  the same request in the body: the cache tiers turn a client's HEAD into a GET
                      (they fetch and cache the body, the client gets the headers); X-MM-Meta has
                      the wire header as JSON, so a HEAD answers what a frontend needs to splice
    POST /v1/encode/fetch  the same, for an engine fetching a body by handle (tiers do not wait on a fill)
    GET  /health      liveness: the process answers
    GET  /ready       readiness: model loaded and not draining (503 otherwise)
    GET  /metrics     Prometheus text
    GET  /v1/models   served model names

With TLS (`security.tls`) the port serves HTTPS: the handshake refuses a client without a
certificate from the deployment's CA, and a caller whose role may not call the worker gets 403
`forbidden_peer` before its request is read. /health, /ready and /metrics are then also served
in plaintext on the ops port (`ops_app`), for probes and Prometheus, which hold no certificate.

Errors are `{"error": {"code", "message"}}` with the error's status, and the code and message again
in `X-MM-Error-Code` / `X-MM-Error` (a HEAD answer has no body); 503s carry Retry-After.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl

import msgpack
from aiohttp import web
from aiohttp.typedefs import Handler

from ..core import wire
from ..core.errors import BadRequest, Draining, MMEncoderError, UnsupportedEncoding, code_for_status
from ..core.requests import EncodeRequest, unique_keys
from ..runtime import tracing
from .pipeline import EncodeService

log = logging.getLogger(__name__)

SERVICE_KEY = web.AppKey("service", EncodeService)
CALLERS_KEY = web.AppKey("callers", frozenset[str])  # with TLS: the roles that may call this worker
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


def error_response(e: MMEncoderError, retry_after: int | None = None) -> web.Response:
    """The error's JSON body and status; 503s say when to retry. A `draining` answer also closes its
    connection: the caller's retry then opens a new one, which a tier's upstream or a Kubernetes
    Service sends to a replica that is not leaving (a kept-alive one would come back here)."""
    headers = {"X-MM-Error-Code": e.code, "X-MM-Error": _header_text(e.message)}
    if retry_after is not None and e.http_status == 503:
        headers["Retry-After"] = str(retry_after)
    response = web.Response(status=e.http_status, text=json.dumps(e.to_dict()), content_type="application/json",
                            headers=headers)
    if e.code == Draining.code:
        response.force_close()
    return response


def _header_text(text: str, limit: int = 512) -> str:
    """A message as one printable-ASCII header line."""
    out = "".join(c if " " <= c <= "~" else "?" for c in text)
    return out if len(out) <= limit else out[: limit - 3] + "..."


@web.middleware
async def _peers(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With TLS: the caller's certificate names this deployment and a role this worker admits, else 403
    before any work (`security.identity`)."""
    callers: frozenset[str] = request.app[CALLERS_KEY]
    request.app[SERVICE_KEY].settings.allowed(
        request.transport.get_extra_info("ssl_object") if request.transport else None, callers)
    return await handler(request)


@web.middleware
async def _admit_bodies(request: web.Request, handler: Handler) -> web.StreamResponse:
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):  # aiohttp would inflate it while reading
        raise UnsupportedEncoding(f"Content-Encoding {encoding!r} is not accepted for request bodies; send them "
                                  "uncompressed (media bytes are compressed already)")
    service = request.app[SERVICE_KEY]
    n = request.content_length if request.content_length is not None else service.settings.max_body_bytes
    if request.method in ("GET", "HEAD", "OPTIONS") and not request.can_read_body:
        n = 0
    with service.admission.receiving.hold(n):  # reserved from the announced size, before the body is read
        return await handler(request)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes a typed JSON error; nothing escapes as a bare 500 page."""
    retry = request.app[SERVICE_KEY].settings.retry_after_s
    try:
        return await handler(request)
    except MMEncoderError as e:
        return error_response(e, retry)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = e.reason if e.status != 413 else e.text or e.reason
        return error_response(MMEncoderError(message, code_for_status(e.status), e.status))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(MMEncoderError("internal error; see the worker's log", "internal", 500))


async def _parse(request: web.Request) -> EncodeRequest:
    ctype = request.content_type
    body = await request.read()
    if ctype == "application/json":
        req = EncodeRequest.parse(body, json=True)
        if req.data is not None:  # JSON has no bytes: base64 text would be decoded here, unbounded by the fetcher
            raise BadRequest("`data` is for msgpack bodies and Dynamo RPC; a JSON body sends `url` (a data: URL "
                             "for inline bytes)")
        return req
    if ctype in MSGPACK_TYPES:
        try:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=True, object_pairs_hook=unique_keys)
        except BadRequest:
            raise
        except Exception as e:  # msgpack raises several unrelated types for malformed input
            raise BadRequest(f"the msgpack body does not decode: {type(e).__name__}: {e}") from None
        return EncodeRequest.parse(obj)
    raise BadRequest(f"Content-Type must be application/json or application/msgpack, not {ctype!r}")


def _wants_json(request: web.Request) -> bool:
    accept = request.headers.get("Accept", "")
    return "application/json" in accept and wire.CONTENT_TYPE not in accept


async def post_encode(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    try:
        req = await _parse(request)
    except MMEncoderError as e:
        service.metrics.refused("http", e.code)
        raise
    result = await service.encode(req, "http", tracing.extract(request.headers))
    body, ctype = result.body, wire.CONTENT_TYPE
    if _wants_json(request):  # legacy json+base64, for comparison only
        body = await asyncio.get_running_loop().run_in_executor(None, wire.to_json, result.body)
        ctype = wire.JSON_CONTENT_TYPE
    headers = {
        "Content-Type": ctype,
        "X-MM-Hash": result.mm_hash,
        "X-MM-Meta": json.dumps(result.header.to_meta(), separators=(",", ":")),
        "X-MM-Cache": result.source,
        "Server-Timing": result.server_timing(),
        "ETag": f'"{result.mm_hash}.{"json" if ctype == wire.JSON_CONTENT_TYPE else "v1"}"',
        "Vary": "Accept",
    }
    return web.Response(body=body, headers=headers)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    if not service.ready:
        reason = "draining" if service.draining else "starting"
        return error_response(MMEncoderError(f"worker is {reason}", "not_ready", 503), service.settings.retry_after_s)
    return web.json_response({"status": "ready", "model": service.encoder.spec.name})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[SERVICE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def models(request: web.Request) -> web.Response:
    spec = request.app[SERVICE_KEY].encoder.spec
    entry = {
        "id": spec.name,
        "object": "model",
        "aliases": list(spec.aliases),
        "revision": spec.revision,
        "out_dim": spec.projector.out_dim,
        "owned_by": "mm-encoder",
    }
    return web.json_response({"object": "list", "data": [entry]})


def build_app(service: EncodeService, callers: frozenset[str] | None = None) -> web.Application:
    """The worker's app; with `callers` (TLS), only peers of those roles get past the first step."""
    s = service.settings
    first = [_peers] if callers is not None else []
    app = web.Application(middlewares=[_errors, *first, _admit_bodies], client_max_size=s.max_body_bytes)
    app[SERVICE_KEY] = service
    if callers is not None:
        app[CALLERS_KEY] = callers
    app.router.add_post("/v1/encode", post_encode)
    app.router.add_get("/v1/encode", post_encode)  # and HEAD (aiohttp adds it; the body is dropped)
    app.router.add_post("/v1/encode/fetch", post_encode)  # an engine's fetch by handle (the tiers' lock-free path)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    return app


def ops_app(service: EncodeService) -> web.Application:
    """Health, readiness and metrics alone: the plaintext port beside an HTTPS one."""
    app = web.Application(middlewares=[_errors])
    app[SERVICE_KEY] = service
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    return app


async def start_http(service: EncodeService, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None,
                     callers: frozenset[str] | None = None, ops: bool = False) -> tuple[web.AppRunner, int]:
    """Start serving (with `ssl_context`: HTTPS to `callers`; `ops`: the ops app instead); returns
    the runner (for cleanup) and the bound port (for port 0)."""
    # handler_cancellation: a client that hangs up cancels its handler, so queued work is dropped.
    # keepalive_timeout also closes a connection whose request headers never complete (slowloris).
    # auto_decompress off: a compressed body is refused by name (_admit_bodies), never inflated.
    runner = web.AppRunner(
        ops_app(service) if ops else build_app(service, callers), handler_cancellation=True, access_log=None,
        auto_decompress=False, shutdown_timeout=service.settings.drain_timeout_s,
        keepalive_timeout=service.settings.idle_timeout_s,
    )
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    return runner, runner.addresses[0][1]
