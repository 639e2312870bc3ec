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

This module and its rules (`wire_schema`) are the only code that knows the layout; everything
else calls encode/decode/peek. torch and numpy are imported where tensors are made, so a process
that only peeks at headers (the frontend) never loads them.
"""

from __future__ import annotations

import base64
import binascii
import json
import operator
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import zstandard

from .errors import WireError
from .spec import tokens_for_grid
from .wire_schema import (  # noqa: F401 (KNOWN_VERSIONS, MODALITIES: part of this module's API)
    DTYPE_SIZES,
    KEYS,
    KNOWN_VERSIONS,
    MODALITIES,
    WIRE_VERSION,
    WireDtype,
    check_envelope,
    check_fields,
    check_header,
    kind,
)

if TYPE_CHECKING:
    import torch

# The body is zstd-compressed as part of the format, not as a transfer encoding: no Content-Encoding
# header, so caches and proxies store and serve it as is and never re-compress or unpack it.
CONTENT_TYPE = "application/vnd.mm-encoder.embeddings.v1+msgpack"
JSON_CONTENT_TYPE = "application/json"  # legacy JSON + base64 form, for old clients and comparison only

DEFAULT_LEVEL = 1  # bench/wire.py: with byte planes, level 1 is both smaller and faster than 3
DEFAULT_MAX_SIZE = 1 << 31  # decompressed bytes a decoder accepts by default

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_META_KEYS = tuple(k for k in KEYS if k not in ("version", "byte_planes", "embeds"))
_HOST_LITTLE = sys.byteorder == "little"


@dataclass(frozen=True)
class WireHeader:
    """Everything but the tensor: what a frontend needs to splice (length, grids, timestamps)."""

    mm_hash: str
    model: str
    modality: str
    dtype: str
    shape: tuple[int, int]  # (length, hidden)
    grid_thws: tuple[tuple[int, int, int], ...]
    length: int
    timestamps: tuple[str, ...] | None

    @property
    def tokens_per_grid(self) -> list[int]:
        return [tokens_for_grid(g) for g in self.grid_thws]

    def to_meta(self) -> dict[str, Any]:
        """The header as JSON values: the worker's `X-MM-Meta` header and a handle's fields."""
        return {"mm_hash": self.mm_hash, "model": self.model, "modality": self.modality, "dtype": self.dtype,
                "shape": list(self.shape), "grid_thws": [list(g) for g in self.grid_thws], "length": self.length,
                "timestamps": None if self.timestamps is None else list(self.timestamps)}

    @classmethod
    def from_meta(cls, meta: Any) -> WireHeader:
        """`to_meta`'s dict back, checked by the same rules as a body's header (WireError if not)."""
        if not isinstance(meta, dict) or sorted(meta) != sorted(_META_KEYS):
            raise WireError(f"header metadata must be a map of exactly {list(_META_KEYS)}, got {kind(meta)}")
        check_header({**meta, "byte_planes": False})
        return cls(**_header(meta))


@dataclass(frozen=True, eq=False, kw_only=True)
class WireMessage(WireHeader):
    """A decoded body: the header and the tensor."""

    embeds: torch.Tensor  # [length, hidden], CPU, `dtype`, writable (owns its buffer)
    byte_planes: bool  # how the body laid the bytes out (decoded embeds are always plain tensors)
    version: int = WIRE_VERSION

    # Identity, not the header's field equality: two messages with one header may differ in embeds,
    # and a tensor has no boolean ==.
    __eq__ = object.__eq__
    __hash__ = object.__hash__


@dataclass(frozen=True)
class Packed:
    """A body with its header beside it, as the encoder made them: what a cache keeps, so an
    answer's header (X-MM-Meta, a handle) never means reading back the body just packed."""

    body: bytes
    header: WireHeader


# ---------------------------------------------------------------------------------------- encode


def encode(**fields: Any) -> bytes:
    """A v1 body (`pack`'s, without its header)."""
    return pack(**fields).body


def pack(
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
) -> Packed:
    """A v1 body and its header: msgpack map -> one zstd frame. Deterministic for the same inputs
    and libzstd.

    `embeds` [length, hidden] in any float dtype is cast to `dtype`. Inputs a decoder would refuse
    raise ValueError (the caller's bug, not a peer's), so every body this returns decodes.
    """
    if type(level) is not int:
        raise ValueError(f"zstd level must be an int, got {level!r}")
    obj = _fields(mm_hash=mm_hash, model=model, modality=modality, embeds=embeds, grid_thws=grid_thws,
                  timestamps=timestamps, dtype=dtype, byte_planes=byte_planes)
    head, data = _map_parts(obj)
    cctx = zstandard.ZstdCompressor(
        level=level, write_checksum=True, write_content_size=True, write_dict_id=False, threads=0
    )
    # Streamed in two pieces so the tensor bytes are never copied into a msgpack buffer first;
    # `size` puts the content size in the frame header.
    cobj = cctx.compressobj(size=len(head) + data.nbytes)
    return Packed(b"".join((cobj.compress(head), cobj.compress(data), cobj.flush())), WireHeader(**_header(obj)))


def encode_json(**fields: Any) -> bytes:
    """Legacy body: `encode`'s map (same keywords but `level`; plain byte order unless
    byte_planes=True) as JSON, embeds base64 (standard alphabet, padded), no zstd."""
    obj = _fields(**{"byte_planes": False, **fields})
    obj["embeds"] = base64.b64encode(obj["embeds"]).decode("ascii")
    return json.dumps(obj, separators=(",", ":")).encode("ascii")


def to_json(body: bytes, *, max_size: int = DEFAULT_MAX_SIZE) -> bytes:
    """A v1 body -> the legacy JSON body (plain byte order), for a client that accepts only JSON."""
    m = decode(body, max_size=max_size)
    return encode_json(mm_hash=m.mm_hash, model=m.model, modality=m.modality, embeds=m.embeds,
                       grid_thws=m.grid_thws, timestamps=m.timestamps, dtype=m.dtype)


def _map_parts(fields: dict[str, Any]) -> tuple[bytes, memoryview]:
    """`_fields`' map, embeds last, split before the tensor bytes: (everything before them, them).

    Byte-identical to msgpack.packb of the map (smallest encodings; `bin` for the tensor).
    """
    obj = dict(fields)
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
    import torch  # here, not at the top: a frontend that only peeks at headers never loads torch

    if dtype not in DTYPE_SIZES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_SIZES)}")
    if not isinstance(embeds, torch.Tensor) or embeds.ndim != 2 or not embeds.is_floating_point():
        raise ValueError("embeds must be a 2-D floating point tensor [length, hidden]")
    if isinstance(timestamps, str):
        raise ValueError("timestamps must be a sequence of strings, not one string")
    try:
        grids = [[operator.index(x) for x in g] for g in grid_thws]
    except TypeError as e:
        raise ValueError(f"grid_thws must be (t, h, w) integer triples: {e}") from None
    t = embeds.detach().to(device="cpu", dtype=getattr(torch, dtype)).contiguous()
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
        check_fields(obj)
    except WireError as e:
        raise ValueError(f"cannot encode: {e.message}") from None
    return obj


def _to_wire(t: torch.Tensor, byte_planes: bool) -> memoryview:
    """Contiguous CPU tensor -> little-endian bytes, as byte planes (most significant first) or plain."""
    import numpy as np
    import torch

    k = t.element_size()
    u8 = t.view(torch.uint8).reshape(-1, k).numpy()  # [n, k] in host byte order; shares t's memory
    le = u8 if _HOST_LITTLE else u8[:, ::-1]  # [n, k], least significant byte first
    out = le[:, ::-1].T if byte_planes else le  # planes: [k, n], most significant plane first
    return np.ascontiguousarray(out).reshape(-1).data  # no copy for plain on a little-endian host


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
    check_envelope(obj, "JSON object")
    if type(obj["embeds"]) is not str:
        raise WireError(f"'embeds' must be a base64 string in the JSON form, got {kind(obj['embeds'])}")
    try:
        obj["embeds"] = base64.b64decode(obj["embeds"], validate=True)
    except (binascii.Error, ValueError) as e:
        raise WireError(f"'embeds' is not valid base64: {e}") from None
    return _message(obj)


_NO_KEY = object()


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
        key: Any = _NO_KEY  # a key whose value is not complete yet survives to the next chunk
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
                    if key is _NO_KEY:
                        key = unpacker.unpack()
                    if key == "embeds":  # the tensor: stop before it
                        fields["embeds"] = None
                        break
                    fields[key] = unpacker.unpack()  # OutOfData here: the unpacker rewinds to this value
                    key = _NO_KEY
            except msgpack.OutOfData:
                continue
    except (zstandard.ZstdError, ValueError, TypeError) as e:
        raise WireError(f"cannot read the body's header: {type(e).__name__}: {e}") from None
    fields.pop("embeds", None)
    if not isinstance(fields.get("version"), int) or fields["version"] not in KNOWN_VERSIONS:
        raise WireError(f"unknown or missing wire version {kind(fields.get('version'))}")
    missing = [k for k in KEYS if k != "embeds" and k not in fields]
    if missing:
        raise WireError(f"header incomplete or not v1: missing {missing} in the first {read} bytes")
    check_header(fields)
    return WireHeader(**_header(fields))


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
    check_envelope(obj, "msgpack map")
    return _message(obj)


def _header(m: dict[str, Any]) -> dict[str, Any]:
    """A validated map's header fields as WireHeader's keywords (tuples, not lists)."""
    return {
        "mm_hash": m["mm_hash"],
        "model": m["model"],
        "modality": m["modality"],
        "dtype": m["dtype"],
        "shape": tuple(m["shape"]),
        "grid_thws": tuple((t, h, w) for t, h, w in m["grid_thws"]),
        "length": m["length"],
        "timestamps": None if m["timestamps"] is None else tuple(m["timestamps"]),
    }


def _message(m: dict[str, Any]) -> WireMessage:
    check_fields(m)
    embeds = _from_wire(m["embeds"], m["dtype"], m["byte_planes"]).view(*m["shape"])
    return WireMessage(**_header(m), embeds=embeds, byte_planes=m["byte_planes"], version=m["version"])


def _from_wire(data: bytes, dtype: str, byte_planes: bool) -> torch.Tensor:
    """Little-endian bytes (planes or plain) -> a flat writable tensor; one copy of the bytes."""
    import numpy as np
    import torch

    k = DTYPE_SIZES[dtype]
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
    return torch.frombuffer(buf, dtype=getattr(torch, dtype))
