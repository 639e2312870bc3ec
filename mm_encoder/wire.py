"""Wire format v1: one media item's embeddings as an HTTP body. Spec: docs/wire-format.md.

Why this layout:
- A msgpack map with the tensor as raw little-endian bytes (msgpack `bin`), never base64: base64
  adds a third to the size and a pass over every byte on both sides; `bin` is one memcpy.
- The whole body is one zstd frame with its content size and checksum in the header: the decoder
  allocates exactly what the header says (refused above `max_size`, so no zstd bombs) and detects
  corruption. Fixed level, single-threaded, fixed key order: the same inputs give the same bytes,
  which HTTP caches rely on.
- Byte planes: values of one tensor share few exponents, so the sign/exponent byte of each value is
  repetitive while the low mantissa byte is noise. Interleaved, zstd sees noise every other byte;
  stored as planes (all most significant bytes, then the next, ...), the exponent plane compresses
  well. A 4K image's Kimi-K2.5 embeddings (4096 x 7168 bf16, 58.7 MB): JSON+base64 78.3 MB,
  raw+zstd 45.8 MB, byte planes+zstd level 1 40.2 MB (bench/wire.py; table in the spec).

This module is the only code that knows the layout; everything else calls encode/decode.
"""

from __future__ import annotations

import base64
import binascii
import json
import operator
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import zstandard

from .errors import MMEncoderError

WIRE_VERSION = 1
KNOWN_VERSIONS = (1,)
# The body is zstd-compressed as part of the format, not as a transfer encoding: no Content-Encoding
# header, so caches and proxies store and serve it as is and never re-compress or unpack it.
CONTENT_TYPE = "application/vnd.mm-encoder.embeddings.v1+msgpack"
JSON_CONTENT_TYPE = "application/json"  # legacy JSON + base64 form, for old clients and comparison only

DEFAULT_LEVEL = 1  # bench/wire.py: with byte planes, level 1 is both smaller and faster than 3
DEFAULT_MAX_SIZE = 1 << 31  # decompressed bytes a decoder accepts by default
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MODALITIES = ("image", "video")
# The map's keys in the order encoders write them (decoders accept any order).
KEYS = (
    "version",
    "mm_hash",
    "model",
    "modality",
    "dtype",
    "shape",
    "grid_thws",
    "length",
    "byte_planes",
    "timestamps",
    "embeds",
)

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_TIMESTAMP = re.compile(r"[0-9]{2,}:[0-5][0-9]:[0-5][0-9]\.[0-9]{3}")  # hh:mm:ss.fff
_HOST_LITTLE = sys.byteorder == "little"


class WireError(MMEncoderError):
    """A body a peer sent us is broken (not a client mistake: the upstream answered garbage)."""

    code = "bad_wire_body"
    http_status = 502

    def __init__(self, message: str):
        super().__init__(message)


@dataclass(frozen=True, eq=False)  # eq=False: a tensor field has no boolean ==
class WireMessage:
    mm_hash: str
    model: str
    modality: str
    dtype: str
    shape: tuple[int, int]  # (length, hidden)
    grid_thws: tuple[tuple[int, int, int], ...]
    length: int
    embeds: torch.Tensor  # [length, hidden], CPU, `dtype`, writable (owns its buffer)
    timestamps: tuple[str, ...] | None
    byte_planes: bool  # how the body laid the bytes out (decoded embeds are always plain tensors)
    version: int = WIRE_VERSION


# ---------------------------------------------------------------------------------------- encode


def encode(
    *,
    mm_hash: str,
    model: str,
    modality: str,
    embeds: torch.Tensor,
    grid_thws: Iterable[Iterable[int]],
    timestamps: Iterable[str] | None = None,
    dtype: str = "bfloat16",
    byte_planes: bool = True,
    level: int = DEFAULT_LEVEL,
) -> bytes:
    """A v1 body: msgpack map -> one zstd frame. Deterministic for the same inputs and libzstd.

    `embeds` [length, hidden] in any float dtype is cast to `dtype`. Inputs a decoder would refuse
    raise ValueError (the caller's bug, not a peer's), so every body this returns decodes.
    """
    if type(level) is not int:
        raise ValueError(f"zstd level must be an int, got {level!r}")
    head, data = _map_parts(
        mm_hash=mm_hash,
        model=model,
        modality=modality,
        embeds=embeds,
        grid_thws=grid_thws,
        timestamps=timestamps,
        dtype=dtype,
        byte_planes=byte_planes,
    )
    cctx = zstandard.ZstdCompressor(
        level=level, write_checksum=True, write_content_size=True, write_dict_id=False, threads=0
    )
    # Streamed in two pieces so the tensor bytes are never copied into a msgpack buffer first;
    # `size` puts the content size in the frame header.
    cobj = cctx.compressobj(size=len(head) + data.nbytes)
    return b"".join((cobj.compress(head), cobj.compress(data), cobj.flush()))


def encode_json(
    *,
    mm_hash: str,
    model: str,
    modality: str,
    embeds: torch.Tensor,
    grid_thws: Iterable[Iterable[int]],
    timestamps: Iterable[str] | None = None,
    dtype: str = "bfloat16",
    byte_planes: bool = False,
) -> bytes:
    """Legacy body: the same map as JSON, embeds base64 (standard alphabet, padded), no zstd."""
    obj = _fields(
        mm_hash=mm_hash,
        model=model,
        modality=modality,
        embeds=embeds,
        grid_thws=grid_thws,
        timestamps=timestamps,
        dtype=dtype,
        byte_planes=byte_planes,
    )
    obj["embeds"] = base64.b64encode(obj["embeds"]).decode("ascii")
    return json.dumps(obj, separators=(",", ":")).encode("ascii")


def to_json(body: bytes, *, max_size: int = DEFAULT_MAX_SIZE) -> bytes:
    """A v1 body -> the legacy JSON body (plain byte order), for a client that accepts only JSON."""
    m = decode(body, max_size=max_size)
    return encode_json(
        mm_hash=m.mm_hash,
        model=m.model,
        modality=m.modality,
        embeds=m.embeds,
        grid_thws=m.grid_thws,
        timestamps=m.timestamps,
        dtype=m.dtype,
    )


def _pack(**fields: Any) -> bytes:
    """The uncompressed msgpack map (what the zstd frame holds); takes encode's arguments but `level`."""
    head, data = _map_parts(**fields)
    return b"".join((head, data))


def _map_parts(**fields: Any) -> tuple[bytes, memoryview]:
    """The msgpack map, embeds last, split before the tensor bytes: (everything before them, them).

    Byte-identical to msgpack.packb of the map (smallest encodings; `bin` for the tensor).
    """
    obj = _fields(**fields)
    data = obj.pop("embeds")
    packer = msgpack.Packer(use_bin_type=True)
    head = [packer.pack_map_header(len(obj) + 1)]
    head += [packer.pack(k) + packer.pack(v) for k, v in obj.items()]
    n = data.nbytes
    if n >= 1 << 32:
        raise ValueError(f"embeds are {n} bytes; msgpack bin holds at most 4 GiB")
    # bin 8 / bin 16 / bin 32: marker byte, then the length big-endian (msgpack spec)
    marker, width = (b"\xc4", 1) if n < 1 << 8 else (b"\xc5", 2) if n < 1 << 16 else (b"\xc6", 4)
    head += [packer.pack("embeds"), marker + n.to_bytes(width, "big")]
    return b"".join(head), data


def _fields(
    *,
    mm_hash: str,
    model: str,
    modality: str,
    embeds: torch.Tensor,
    grid_thws: Iterable[Iterable[int]],
    timestamps: Iterable[str] | None = None,
    dtype: str = "bfloat16",
    byte_planes: bool = True,
) -> dict[str, Any]:
    """The map in wire order, validated exactly as a decoder would (ValueError: our own bug)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    if not isinstance(embeds, torch.Tensor) or embeds.ndim != 2 or not embeds.is_floating_point():
        raise ValueError("embeds must be a 2-D floating point tensor [length, hidden]")
    if isinstance(timestamps, str):
        raise ValueError("timestamps must be a sequence of strings, not one string")
    try:
        grids = [[operator.index(x) for x in g] for g in grid_thws]
    except TypeError as e:
        raise ValueError(f"grid_thws must be (t, h, w) integer triples: {e}") from None
    t = embeds.detach().to(device="cpu", dtype=DTYPES[dtype]).contiguous()
    obj = {
        "version": WIRE_VERSION,
        "mm_hash": mm_hash,
        "model": model,
        "modality": modality,
        "dtype": dtype,
        "shape": list(t.shape),
        "grid_thws": grids,
        "length": t.shape[0],
        "byte_planes": byte_planes,
        "timestamps": None if timestamps is None else list(timestamps),
        "embeds": _to_wire(t, byte_planes),
    }
    try:
        _check_fields(obj)
    except WireError as e:
        raise ValueError(f"cannot encode: {e.message}") from None
    return obj


def _to_wire(t: torch.Tensor, byte_planes: bool) -> memoryview:
    """Contiguous CPU tensor -> little-endian bytes, as byte planes (most significant first) or plain."""
    k = t.element_size()
    u8 = t.view(torch.uint8).reshape(-1, k).numpy()  # [n, k] in host byte order; shares t's memory
    le = u8 if _HOST_LITTLE else u8[:, ::-1]  # [n, k], least significant byte first
    out = le[:, ::-1].T if byte_planes else le  # planes: [k, n], most significant plane first
    return memoryview(np.ascontiguousarray(out).reshape(-1))  # no copy for plain on a little-endian host


# ---------------------------------------------------------------------------------------- decode


def decode(body: bytes, *, max_size: int = DEFAULT_MAX_SIZE) -> WireMessage:
    """A v1 body -> WireMessage. Refuses anything off-spec with WireError, allocating <= max_size."""
    return _unpack(_decompress(body, max_size))


def decode_json(body: bytes, *, max_size: int = DEFAULT_MAX_SIZE) -> WireMessage:
    """A legacy JSON body -> WireMessage, with the same validation as `decode`."""
    _check_bytes(body)
    if len(body) > max_size:
        raise WireError(f"JSON body is {len(body)} bytes, above the limit of {max_size}")
    try:
        obj = json.loads(bytes(body), object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, duplicate keys
        raise WireError(f"not a JSON body: {e}") from None
    _check_envelope(obj, "JSON object")
    if type(obj["embeds"]) is not str:
        raise WireError(f"'embeds' must be a base64 string in the JSON form, got {_kind(obj['embeds'])}")
    try:
        obj["embeds"] = base64.b64decode(obj["embeds"], validate=True)
    except (binascii.Error, ValueError) as e:
        raise WireError(f"'embeds' is not valid base64: {e}") from None
    return _message(obj)


@dataclass(frozen=True)
class WireHeader:
    """Everything but the tensor: what a frontend needs to splice (length, grids, timestamps)."""

    mm_hash: str
    model: str
    modality: str
    dtype: str
    shape: tuple[int, int]
    grid_thws: tuple[tuple[int, int, int], ...]
    length: int
    timestamps: tuple[str, ...] | None


def peek(body: bytes, *, max_header: int = 1 << 20) -> WireHeader:
    """The header fields of a v1 body without inflating the embeddings: encoders write `embeds`
    last, so only the first KBs of the frame are decompressed. The header is validated like
    `decode` does; the tensor bytes are left to whoever decodes them."""
    _check_bytes(body)
    if bytes(body[:4]) != _ZSTD_MAGIC:
        raise WireError("not a zstd frame (a v1 body is one zstd frame; is this the legacy JSON form?)")
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True)
    fields: dict[str, Any] = {}
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(bytes(body), read_across_frames=False)
        n_keys: int | None = None
        read = 0
        while read < max_header and "embeds" not in fields:
            chunk = reader.read(4096)
            if not chunk:
                break
            read += len(chunk)
            unpacker.feed(chunk)
            try:
                if n_keys is None:
                    n_keys = unpacker.read_map_header()
                while len(fields) < n_keys:
                    key = unpacker.unpack()
                    if key == "embeds":  # the tensor: stop before it
                        fields["embeds"] = None
                        break
                    fields[key] = unpacker.unpack()
            except msgpack.OutOfData:
                continue
    except (zstandard.ZstdError, ValueError, TypeError) as e:
        raise WireError(f"cannot read the body's header: {type(e).__name__}: {e}") from None
    fields.pop("embeds", None)
    if not isinstance(fields.get("version"), int) or fields["version"] not in KNOWN_VERSIONS:
        raise WireError(f"unknown or missing wire version {_kind(fields.get('version'))}")
    missing = [k for k in KEYS if k != "embeds" and k not in fields]
    if missing:
        raise WireError(f"header incomplete or not v1: missing {missing} in the first {read} bytes")
    _check_header(fields)
    return WireHeader(fields["mm_hash"], fields["model"], fields["modality"], fields["dtype"],
                      tuple(fields["shape"]), tuple(tuple(g) for g in fields["grid_thws"]), fields["length"],
                      None if fields["timestamps"] is None else tuple(fields["timestamps"]))


def _check_bytes(body: Any) -> None:
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise WireError(f"body must be bytes, got {type(body).__name__}")


def _decompress(body: bytes, max_size: int) -> bytes:
    _check_bytes(body)
    data = bytes(body) if isinstance(body, memoryview) and not body.c_contiguous else body
    if bytes(data[:4]) != _ZSTD_MAGIC:
        raise WireError("not a zstd frame (a v1 body is one zstd frame; is this the legacy JSON form?)")
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise WireError(f"truncated or corrupt zstd frame header: {e}") from None
    size = params.content_size
    if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
        raise WireError("zstd frame header has no content size (v1 requires it)")
    if size > max_size:
        raise WireError(f"zstd frame claims {size} bytes decompressed, above the limit of {max_size}")
    if size == 0:
        raise WireError("zstd frame is empty")
    if params.dict_id != 0:
        raise WireError("zstd frame needs a dictionary (v1 uses none)")
    if not params.has_checksum:
        raise WireError("zstd frame has no content checksum (v1 requires it)")
    try:
        # The output buffer is exactly the header's content size; a frame that decodes to more or
        # fewer bytes, fails its checksum or has bytes after it is refused by libzstd.
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise WireError(f"corrupt or truncated zstd frame: {e}") from None


class _DuplicateKeyError(ValueError):
    pass


def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _DuplicateKeyError("duplicate keys in a map")
    return out


def _unpack(raw: bytes) -> WireMessage:
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True, object_pairs_hook=_unique_keys)
    except msgpack.ExtraData:
        raise WireError("trailing bytes after the msgpack map") from None
    except Exception as e:  # the parser's errors are ValueError/TypeError subclasses; none is ours to leak
        raise WireError(f"not a msgpack body: {type(e).__name__}: {e}") from None
    _check_envelope(obj, "msgpack map")
    return _message(obj)


# ------------------------------------------------------------------------------------ validation


def _kind(v: Any) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 60 else r[:57] + '...'}"


def _is_int(v: Any) -> bool:
    return type(v) is int  # not bool, not float


def _check_envelope(obj: Any, what: str) -> None:
    """Map, known version, exactly the v1 keys: checked first so a newer body gets a clear error."""
    if not isinstance(obj, dict):
        raise WireError(f"body must be a {what}, got {type(obj).__name__}")
    version = obj.get("version")
    if not _is_int(version):
        raise WireError(f"'version' missing or not an integer: {_kind(version)}")
    if version not in KNOWN_VERSIONS:
        known = ", ".join(map(str, KNOWN_VERSIONS))
        raise WireError(f"unknown wire version {version}; this decoder knows version {known}")
    missing = [k for k in KEYS if k not in obj]
    extra = sorted(repr(k) for k in obj if k not in KEYS)
    if missing or extra:
        raise WireError(f"keys differ from v1: missing {missing}, unexpected [{', '.join(extra)}]")


def _check_fields(m: dict[str, Any]) -> None:
    _check_header(m)
    _check_embeds(m)


def _check_header(m: dict[str, Any]) -> None:
    for key in ("mm_hash", "model"):
        if type(m[key]) is not str or not m[key]:
            raise WireError(f"'{key}' must be a non-empty string, got {_kind(m[key])}")
    if type(m["modality"]) is not str or m["modality"] not in MODALITIES:
        raise WireError(f"unknown modality {_kind(m['modality'])}; known: {', '.join(MODALITIES)}")
    if type(m["dtype"]) is not str or m["dtype"] not in DTYPES:
        raise WireError(f"unknown dtype {_kind(m['dtype'])}; known: {', '.join(DTYPES)}")
    shape = m["shape"]
    if not (type(shape) is list and len(shape) == 2 and all(_is_int(x) and x > 0 for x in shape)):
        raise WireError(f"'shape' must be [length, hidden], two positive integers, got {_kind(shape)}")
    if not _is_int(m["length"]) or m["length"] != shape[0]:
        raise WireError(f"'length' {_kind(m['length'])} must be an integer equal to shape[0] = {shape[0]}")
    grids = m["grid_thws"]
    if type(grids) is not list or not grids:
        raise WireError(f"'grid_thws' must be a non-empty list of [t, h, w], got {_kind(grids)}")
    for g in grids:
        if not (type(g) is list and len(g) == 3 and all(_is_int(x) and x > 0 for x in g)):
            raise WireError(f"each of 'grid_thws' must be [t, h, w], three positive integers, got {_kind(g)}")
    # MoonViT's 2x2 patch merger: a grid of h x w patches gives h*w/4 tokens, whatever t
    # (frames of a video chunk are pooled over time before merging).
    tokens = sum(h * w // 4 for _, h, w in grids)
    if tokens != m["length"]:
        raise WireError(f"grid_thws {_kind(grids)} give {tokens} tokens (h*w/4 each), but length is {m['length']}")
    if type(m["byte_planes"]) is not bool:
        raise WireError(f"'byte_planes' must be a boolean, got {_kind(m['byte_planes'])}")
    ts = m["timestamps"]
    if m["modality"] == "image":
        if ts is not None:
            raise WireError(f"'timestamps' must be nil for an image, got {_kind(ts)}")
    elif type(ts) is not list or len(ts) != len(grids):
        raise WireError(f"'timestamps' must list one per video chunk ({len(grids)}), got {_kind(ts)}")
    elif not all(type(s) is str and _TIMESTAMP.fullmatch(s) for s in ts):
        raise WireError(f"'timestamps' must be hh:mm:ss.fff strings, got {_kind(ts)}")


def _check_embeds(m: dict[str, Any]) -> None:
    shape = m["shape"]
    embeds = m["embeds"]
    if not isinstance(embeds, (bytes, bytearray, memoryview)):
        raise WireError(f"'embeds' must be bytes, got {type(embeds).__name__}")
    itemsize = DTYPES[m["dtype"]].itemsize
    expected = shape[0] * shape[1] * itemsize
    if memoryview(embeds).nbytes != expected:
        raise WireError(
            f"'embeds' has {memoryview(embeds).nbytes} bytes; shape {shape} of {m['dtype']} needs {expected}"
        )


def _message(m: dict[str, Any]) -> WireMessage:
    _check_fields(m)
    length, hidden = m["shape"]
    return WireMessage(
        mm_hash=m["mm_hash"],
        model=m["model"],
        modality=m["modality"],
        dtype=m["dtype"],
        shape=(length, hidden),
        grid_thws=tuple((t, h, w) for t, h, w in m["grid_thws"]),
        length=length,
        embeds=_from_wire(m["embeds"], DTYPES[m["dtype"]], m["byte_planes"]).view(length, hidden),
        timestamps=None if m["timestamps"] is None else tuple(m["timestamps"]),
        byte_planes=m["byte_planes"],
        version=m["version"],
    )


def _from_wire(data: bytes, dtype: torch.dtype, byte_planes: bool) -> torch.Tensor:
    """Little-endian bytes (planes or plain) -> a flat writable tensor; one copy of the bytes."""
    k = dtype.itemsize
    u8 = np.frombuffer(data, dtype=np.uint8)
    if byte_planes:
        planes = u8.reshape(k, -1)  # [k, n], most significant plane first
        buf: Any = np.empty((planes.shape[1], k), dtype=np.uint8)  # [n, k] in host byte order
        for j in range(k):  # one strided copy per plane: ~4x faster than numpy's transposing copy
            buf[:, j] = planes[k - 1 - j] if _HOST_LITTLE else planes[j]
    elif _HOST_LITTLE:
        buf = bytearray(data)
    else:
        buf = np.ascontiguousarray(u8.reshape(-1, k)[:, ::-1])
    return torch.frombuffer(buf, dtype=dtype)
