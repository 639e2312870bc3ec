"""Every error mm-encoder raises on purpose, in one hierarchy, each with a stable code and the
HTTP status its transport answers. Callers map errors to responses by reading `code` and
`http_status`, never by guessing from types or messages.

    MMEncoderError                       code, http_status, message
    ├── BadRequest            400        the request itself is malformed
    │   └── ContextOverflow   400        the prompt (media expanded) does not fit the model
    ├── MediaError            413/422    the media bytes (codes: MediaError.codes)
    ├── FetchError            400-504    a media URL refused or not fetched (codes: FetchError.codes)
    ├── UnknownModelError     404
    ├── RevisionMismatch, DtypeMismatch   409   the caller expects another checkpoint or row dtype
    ├── RequestTooLarge       413        above a transport's message limit
    ├── Unavailable           503        retry later or elsewhere: Overloaded, Draining,
    │                                    EncoderUnavailable (EncoderSiteUnreachable), EngineUnavailable
    ├── RemoteError           any        an error another component returned, code and status kept
    ├── WireError             502        a peer's wire-v1 body is broken
    ├── HandleError           502        an embedding handle that does not resolve to its own body
    ├── BadEngineReply        502        an engine's reply item is not `core.engine_reply`'s
    └── configuration (operator's mistakes, 4xx/500): CheckpointError (NotACheckpoint), ModelDirError, GraphError,
        CacheTierError
"""

from __future__ import annotations

from typing import Any, ClassVar


class MMEncoderError(Exception):
    """Base class: `code` is stable and machine-readable, the message says what to change."""

    code = "error"
    http_status = 400

    def __init__(self, message: str, code: str | None = None, http_status: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        if http_status is not None:
            self.http_status = http_status

    @property
    def message(self) -> str:
        return str(self.args[0])

    def __str__(self) -> str:
        return f"[{self.code}] {self.args[0]}"

    def to_dict(self, *, status: bool = False) -> dict[str, Any]:
        """The `{"error": ...}` body: code and message (and the status, for Dynamo replies)."""
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if status:
            err["status"] = self.http_status
        return {"error": err}


class _Coded(MMEncoderError):
    """A family whose code picks the status; an unknown code is the caller's bug."""

    codes: ClassVar[dict[str, int]] = {}

    def __init__(self, code: str, message: str):
        if code not in self.codes:
            raise ValueError(f"unknown {type(self).__name__} code {code!r}")
        super().__init__(message, code, self.codes[code])


# --- the client's request -------------------------------------------------------------------


class BadRequest(MMEncoderError):
    code = "bad_request"
    http_status = 400


class ContextOverflow(BadRequest):
    code = "context_length_exceeded"


class MissingTenant(BadRequest):
    """A frontend that serves tenants (`--tenant-header`) got a request without the tenant's header."""

    code = "missing_tenant"


class BadTenant(BadRequest):
    """The tenant header's value is not a tenant's name (empty, too long, not printable ASCII)."""

    code = "bad_tenant"


class UnknownModelError(MMEncoderError, KeyError):
    code = "unknown_model"
    http_status = 404

    def __init__(self, name: str, served: list[str]):
        super().__init__(f"unknown model {name!r}; served names: {', '.join(served)}")
        self.served = served


class RevisionMismatch(MMEncoderError):
    """The caller expects another revision of the model than this worker serves (another checkpoint)."""

    code = "revision_mismatch"
    http_status = 409


class DtypeMismatch(MMEncoderError):
    """The caller expects rows of another dtype than this worker packs (`--wire-dtype`, by default the
    dtype its model runs in): answering anyway would hand an fp32 engine bf16 rows, or the reverse."""

    code = "dtype_mismatch"
    http_status = 409


class ForbiddenPeer(MMEncoderError):
    """A peer with a valid certificate whose identity may not call this hop (`security.identity.admit`)."""

    code = "forbidden_peer"
    http_status = 403


class PkiError(MMEncoderError, ValueError):
    """A certificate, key, identity or directory the operator must fix; the message says what."""

    code = "bad_pki"
    http_status = 500


class RequestTooLarge(MMEncoderError):
    code = "request_too_large"
    http_status = 413


class UnsupportedEncoding(MMEncoderError):
    """A compressed request body: its decoded size is unknown until it has been decoded (a 200 KB
    gzip body can hold 200 MB), so it would bypass the bytes admitted before reading."""

    code = "unsupported_encoding"
    http_status = 415


class MediaError(_Coded):
    """Bad media from the user. Never cached, never fatal to the process."""

    code = "corrupt"
    http_status = 422
    codes: ClassVar[dict[str, int]] = {
        "empty": 422,  # zero bytes, or an image with a zero-size dimension
        "unsupported_format": 422,  # not an image/video format we decode
        "corrupt": 422,  # truncated or undecodable data
        "too_large": 413,  # more bytes, seconds or frames than the limits allow
        "too_many_pixels": 422,  # header says more pixels than max_pixels (refused before decoding)
        "bad_aspect_ratio": 422,  # long side / short side above max_aspect_ratio
        "no_frames": 422,  # a video without decodable frames
        "bad_input": 422,  # an item of a type (or modality) the encoder does not take
    }


class FetchError(_Coded):
    """A URL we refuse or could not fetch; the message says what to change."""

    code = "fetch_failed"
    http_status = 502
    codes: ClassVar[dict[str, int]] = {
        "bad_url": 400,  # unparsable URL, userinfo, empty host, bad port, malformed data: URL
        "forbidden_scheme": 400,  # not http/https/data/file (or a redirect to anything but http/https)
        "forbidden_address": 403,  # the host is or resolves to an internal address that is not allow-listed
        "forbidden_path": 403,  # file:// outside allow_file_dirs (or file:// disabled), or not a regular file
        "dns_failure": 422,  # the host does not resolve
        "too_many_redirects": 422,
        "too_large": 413,  # Content-Length or streamed/decoded bytes over max_bytes
        "fetch_timeout": 504,  # whole fetch (or connect) over its deadline
        "upstream_status": 422,  # the origin answered >= 400 (or a 3xx without Location)
        "fetch_failed": 502,  # connection refused/reset, TLS error, broken HTTP, unreadable allowed file
    }


# --- retry later or elsewhere (503, with Retry-After over HTTP) -----------------------------


class Unavailable(MMEncoderError):
    code = "unavailable"
    http_status = 503


class Overloaded(Unavailable):
    """The bounded queue is full: retry later (or elsewhere) instead of growing memory."""

    code = "overloaded"


class Draining(Unavailable):
    code = "draining"


class EncoderUnavailable(Unavailable):
    code = "encoder_unavailable"


class EncoderSiteUnreachable(EncoderUnavailable):
    """A model cluster's tier cannot reach its encoder site (its circuit breaker is open, or the connect
    or read timed out): cached items are still served, a miss is this 503 at once, with Retry-After."""

    code = "encoder_site_unreachable"


class EngineUnavailable(Unavailable):
    code = "engine_unavailable"


# --- other components' answers --------------------------------------------------------------


class RemoteError(MMEncoderError):
    """An error another component returned (the encode worker over HTTP or RPC): its code and
    status are kept so the client sees the worker's own answer."""

    def __init__(self, message: str, code: str = "encoder_error", http_status: int = 502):
        super().__init__(message, code, http_status if 400 <= http_status < 600 else 502)

    @classmethod
    def from_dict(cls, err: Any, fallback: str) -> RemoteError:
        """From a peer's `{"code", "message", "status"}`; anything else is reported as `fallback`."""
        if not isinstance(err, dict):
            return cls(fallback)
        status = err.get("status", 502)
        return cls(str(err.get("message", fallback)), str(err.get("code", "encoder_error")),
                   status if isinstance(status, int) else 502)


class WireError(MMEncoderError):
    """A body a peer sent us is broken (not a client mistake: the upstream answered garbage)."""

    code = "bad_wire_body"
    http_status = 502

    def __init__(self, message: str):
        super().__init__(message)


class HandleError(MMEncoderError):
    """An embedding handle that is malformed, names a chain this engine does not trust, or whose
    fetched body is not the one it announced (mm_hash or grids differ): never spliced."""

    code = "bad_handle"
    http_status = 502


class BadEngineReply(MMEncoderError):
    """An engine answered an item that is not a `core.engine_reply` item (a bug or a mismatched
    release): the request fails as the engine's fault, never half-read."""

    code = "bad_engine_reply"
    http_status = 502


# --- the operator's configuration -----------------------------------------------------------


class CheckpointError(MMEncoderError):
    """A checkpoint that does not match the model: lists every missing/unexpected/mis-shaped tensor."""

    code = "bad_checkpoint"
    http_status = 500


class NotACheckpoint(CheckpointError, ValueError):
    """A checkpoint directory without a readable config.json (`families.read_config`); a ValueError
    too, as the vLLM adapter refuses its arguments before vLLM starts."""


class ModelDirError(MMEncoderError):
    """The served LLM's directory lacks what the frontend needs (tokenizer, chat template)."""

    code = "bad_model_dir"
    http_status = 500


class GraphError(MMEncoderError):
    code = "bad_graph"
    http_status = 400


class CacheTierError(MMEncoderError):
    code = "cache_tier"
    http_status = 500


# What a transport answers for statuses it raises itself (an unknown route, a body over the cap).
_STATUS_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def code_for_status(status: int) -> str:
    return _STATUS_CODES.get(status, "bad_request" if status < 500 else "internal")
