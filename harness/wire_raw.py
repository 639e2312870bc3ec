"""A v1 body's msgpack map without its zstd frame: the "msgpack raw" format bench/wire.py measures beside
the real ones, and what tests/test_wire.py holds the streamed encoder's map to. Written by the wire
module's own map writer (its checked fields, then the map split before the tensor bytes); the package
itself never sends a body uncompressed."""

from __future__ import annotations

from typing import Any

from mm_encoder import wire


def pack(**fields: Any) -> bytes:
    """The uncompressed map; takes `wire.encode`'s arguments but `level`."""
    head, data = wire._map_parts(wire._fields(**fields))
    return b"".join((head, data))
