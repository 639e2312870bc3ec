"""`data:` URLs (RFC 2397): inline media, decoded against the byte cap before any allocation."""

from __future__ import annotations

import base64
import binascii
import re
from urllib.parse import unquote_to_bytes

from ..core.errors import FetchError
from .policy import Fetched, shorten, too_large

_MIME = re.compile(r"[a-z0-9!#$&^_.+-]+/[a-z0-9!#$&^_.+-]+")
_MIME_PARAM = re.compile(r"[A-Za-z0-9!#$&^_.+-]+=(?:[A-Za-z0-9!#$&^_.+%-]+|\"[^\"]*\")")
_BAD_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")


def parse_data_url(url: str, cap: int) -> Fetched:
    """RFC 2397: data:[<mediatype>][;base64],<data>. Malformed ones are refused, not guessed at."""
    shown = shorten(url)
    meta, sep, payload = url[5:].partition(",")
    if not sep:
        raise FetchError("bad_url", f"data: URL {shown!r} has no ','; use data:[<type>][;base64],<data>")
    params = meta.split(";")
    is_b64 = len(params) > 1 and params[-1].strip().lower() == "base64"
    if is_b64:
        params.pop()
    mime = params[0].strip().lower()
    if mime and not _MIME.fullmatch(mime):
        raise FetchError("bad_url", f"data: URL {shown!r} has a malformed media type {params[0]!r}")
    for p in params[1:]:
        if not _MIME_PARAM.fullmatch(p.strip()):
            raise FetchError("bad_url", f"data: URL {shown!r} has a malformed parameter {p!r}; use name=value")
    if _BAD_PERCENT.search(payload):
        raise FetchError("bad_url", f"data: URL {shown!r} has a malformed %-escape; use %XX with two hex digits")
    if len(payload) > 3 * cap + 3:  # even all-%XX or base64 decodes to more than the cap
        raise FetchError("too_large", too_large(shown, "the decoded data: URL", cap))
    if is_b64:
        if (len(payload) - payload.count("%") * 2) * 3 // 4 > cap + 3:
            raise FetchError("too_large", too_large(shown, "the decoded data: URL", cap))
        raw = unquote_to_bytes(payload).replace(b" ", b"")
        if len(raw) % 4 == 1:
            raise FetchError("bad_url", f"data: URL {shown!r} is not valid base64 (bad length)")
        raw += b"=" * (-len(raw) % 4) if not raw.endswith(b"=") else b""
        try:
            data = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise FetchError("bad_url", f"data: URL {shown!r} is not valid base64") from None
    else:
        data = unquote_to_bytes(payload)
    if len(data) > cap:
        raise FetchError("too_large", too_large(shown, f"{len(data)} decoded bytes", cap))
    extra = [p.strip() for p in params[1:]]
    ctype = ";".join([mime or "text/plain", *extra]) if mime or extra else "text/plain;charset=US-ASCII"
    return Fetched(data, url, ctype, 0)
