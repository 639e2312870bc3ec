"""The wire-v1 map's rules: its keys, their types, and how they must agree (docs/wire-format.md).

Both directions use them: `wire.encode` checks what it is about to write (a failure is our own
bug) and `wire.decode`/`wire.peek` check what a peer sent (a failure is a `WireError`).
"""

from __future__ import annotations

import re
from typing import Any

from .dtypes import SIZES, TorchName
from .errors import WireError
from .spec import tokens_for_grid

WIRE_VERSION = 1
KNOWN_VERSIONS = (1,)
DTYPE_SIZES = SIZES  # names are torch's (core.dtypes)
WireDtype = TorchName
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

_TIMESTAMP = re.compile(r"[0-9]{2,}:[0-5][0-9]:[0-5][0-9]\.[0-9]{3}")  # hh:mm:ss.fff


def kind(v: Any) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 60 else r[:57] + '...'}"


def is_int(v: Any) -> bool:
    return type(v) is int  # not bool, not float


def check_envelope(obj: Any, what: str) -> None:
    """Map, known version, exactly the v1 keys: checked first so a newer body gets a clear error."""
    if not isinstance(obj, dict):
        raise WireError(f"body must be a {what}, got {type(obj).__name__}")
    version = obj.get("version")
    if not is_int(version):
        raise WireError(f"'version' missing or not an integer: {kind(version)}")
    if version not in KNOWN_VERSIONS:
        known = ", ".join(map(str, KNOWN_VERSIONS))
        raise WireError(f"unknown wire version {version}; this decoder knows version {known}")
    missing = [k for k in KEYS if k not in obj]
    extra = sorted(repr(k) for k in obj if k not in KEYS)
    if missing or extra:
        raise WireError(f"keys differ from v1: missing {missing}, unexpected [{', '.join(extra)}]")


def check_fields(m: dict[str, Any]) -> None:
    check_header(m)
    check_embeds(m)


def check_header(m: dict[str, Any]) -> None:
    for key in ("mm_hash", "model"):
        if type(m[key]) is not str or not m[key]:
            raise WireError(f"'{key}' must be a non-empty string, got {kind(m[key])}")
    if type(m["modality"]) is not str or m["modality"] not in MODALITIES:
        raise WireError(f"unknown modality {kind(m['modality'])}; known: {', '.join(MODALITIES)}")
    if type(m["dtype"]) is not str or m["dtype"] not in DTYPE_SIZES:
        raise WireError(f"unknown dtype {kind(m['dtype'])}; known: {', '.join(DTYPE_SIZES)}")
    shape = m["shape"]
    if not (type(shape) is list and len(shape) == 2 and all(is_int(x) and x > 0 for x in shape)):
        raise WireError(f"'shape' must be [length, hidden], two positive integers, got {kind(shape)}")
    if not is_int(m["length"]) or m["length"] != shape[0]:
        raise WireError(f"'length' {kind(m['length'])} must be an integer equal to shape[0] = {shape[0]}")
    grids = m["grid_thws"]
    if type(grids) is not list or not grids:
        raise WireError(f"'grid_thws' must be a non-empty list of [t, h, w], got {kind(grids)}")
    for g in grids:
        if not (type(g) is list and len(g) == 3 and all(is_int(x) and x > 0 for x in g)):
            raise WireError(f"each of 'grid_thws' must be [t, h, w], three positive integers, got {kind(g)}")
    tokens = sum(tokens_for_grid(g) for g in grids)
    if tokens != m["length"]:
        raise WireError(f"grid_thws {kind(grids)} give {tokens} tokens (h*w/4 each), but length is {m['length']}")
    if type(m["byte_planes"]) is not bool:
        raise WireError(f"'byte_planes' must be a boolean, got {kind(m['byte_planes'])}")
    ts = m["timestamps"]
    if m["modality"] == "image":
        if ts is not None:
            raise WireError(f"'timestamps' must be nil for an image, got {kind(ts)}")
    elif type(ts) is not list or len(ts) != len(grids):
        raise WireError(f"'timestamps' must list one per video chunk ({len(grids)}), got {kind(ts)}")
    elif not all(type(s) is str and _TIMESTAMP.fullmatch(s) for s in ts):
        raise WireError(f"'timestamps' must be hh:mm:ss.fff strings, got {kind(ts)}")


def check_embeds(m: dict[str, Any]) -> None:
    shape = m["shape"]
    embeds = m["embeds"]
    if not isinstance(embeds, (bytes, bytearray, memoryview)):
        raise WireError(f"'embeds' must be bytes, got {type(embeds).__name__}")
    itemsize = DTYPE_SIZES[m["dtype"]]
    expected = shape[0] * shape[1] * itemsize
    if memoryview(embeds).nbytes != expected:
        raise WireError(
            f"'embeds' has {memoryview(embeds).nbytes} bytes; shape {shape} of {m['dtype']} needs {expected}"
        )
