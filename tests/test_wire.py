"""Wire format v1 (mm_encoder/wire.py, docs/wire-format.md): round trips, determinism, byte planes,
the legacy JSON form, and a table of broken bodies that must all be refused with WireError."""

from __future__ import annotations

import base64
import json
import warnings
from typing import Any

import msgpack
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import wire_raw
from mm_encoder import wire
from mm_encoder.core.errors import MMEncoderError, WireError

IMAGE = {"modality": "image", "grid_thws": [(1, 4, 8)], "timestamps": None}  # 8 tokens
VIDEO = {"modality": "video", "grid_thws": [(4, 4, 8), (2, 2, 4)], "timestamps": ["00:00:00.000", "00:00:02.500"]}
TOKENS = {"image": 8, "video": 10}
BITS = {"bfloat16": torch.int16, "float16": torch.int16, "float32": torch.int32}


def embeds(n: int, hidden: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g, dtype=torch.float64) * 3
    x[0, :4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])  # special values survive bit-exact
    return x


def encode(item: dict, byte_planes: bool = True, dtype: str = "bfloat16", **kw: Any) -> bytes:
    x = kw.pop("embeds", None)
    x = embeds(TOKENS[item["modality"]]) if x is None else x
    return wire.encode(mm_hash="abc123", model="kimi-k2.5-vision", embeds=x, dtype=dtype, byte_planes=byte_planes,
                       **item, **kw)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[str(a.dtype)[6:]]),
                                                                     b.view(BITS[str(b.dtype)[6:]]))


def zstd(raw: bytes, **kw: Any) -> bytes:
    params = {"write_checksum": True, "write_content_size": True, **kw}
    return zstandard.ZstdCompressor(level=3, **params).compress(raw)


def raw_map(body: bytes) -> dict:
    return msgpack.unpackb(zstandard.ZstdDecompressor().decompress(body), raw=False)


# ----------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("byte_planes", [True, False])
@pytest.mark.parametrize("item", [IMAGE, VIDEO], ids=["image", "video"])
def test_round_trip_bit_exact(dtype: str, byte_planes: bool, item: dict) -> None:
    x = embeds(TOKENS[item["modality"]])
    body = encode(item, byte_planes, dtype, embeds=x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.frombuffer warns on a read-only buffer
        m = wire.decode(body)
    assert same_bits(m.embeds, x.to(getattr(torch, dtype)))
    assert (m.version, m.mm_hash, m.model, m.modality, m.dtype) == (1, "abc123", "kimi-k2.5-vision",
                                                                   item["modality"], dtype)
    assert m.shape == (TOKENS[item["modality"]], 12) and m.length == m.shape[0]
    assert m.grid_thws == tuple(item["grid_thws"]) and m.byte_planes is byte_planes
    assert m.timestamps == (None if item["timestamps"] is None else tuple(item["timestamps"]))
    assert m.embeds.device.type == "cpu" and m.embeds.is_contiguous()
    m.embeds.add_(1)  # writable


def test_deterministic_and_input_layout_independent() -> None:
    x = embeds(8)
    a, b = encode(IMAGE, embeds=x), encode(IMAGE, embeds=x)
    assert a == b
    # a non-contiguous float32 view of the same values gives the same body
    assert encode(IMAGE, embeds=x.float().t().contiguous().t()) == a
    assert same_bits(wire.decode(encode(IMAGE, level=9, embeds=x)).embeds, wire.decode(a).embeds)


def test_body_framing() -> None:
    body = encode(VIDEO)
    params = zstandard.get_frame_parameters(body)
    assert body[:4] == b"\x28\xb5\x2f\xfd" and params.has_checksum and params.dict_id == 0
    raw = zstandard.ZstdDecompressor().decompress(body)
    assert params.content_size == len(raw)
    assert list(msgpack.unpackb(raw, raw=False)) == list(wire.KEYS)  # fixed key order


@pytest.mark.parametrize("tokens", [1, 16, 4096])  # embeds as msgpack bin 8, bin 16, bin 32
def test_map_is_canonical_msgpack(tokens: int) -> None:
    """The streamed map is byte-identical to msgpack's own encoding of the same map."""
    x = torch.randn(tokens, 4)
    body = wire.encode(mm_hash="h", model="m", modality="image", embeds=x, grid_thws=[(1, 2, 2 * tokens)])
    raw = zstandard.ZstdDecompressor().decompress(body)
    assert msgpack.packb(msgpack.unpackb(raw)) == raw
    assert wire_raw.pack(mm_hash="h", model="m", modality="image", embeds=x, grid_thws=[(1, 2, 2 * tokens)]) == raw


# bf16: 1.0 = 0x3F80, -2.0 = 0xC000, 0.5 = 0x3F00 (little-endian: 80 3F, 00 C0, 00 3F)
LAYOUTS = [
    ("bfloat16", False, "803f 00c0 003f"),
    ("bfloat16", True, "3fc03f 800000"),
    ("float16", False, "003c 00c0 0038"),  # 1.0 = 0x3C00, -2.0 = 0xC000, 0.5 = 0x3800
    ("float16", True, "3cc038 000000"),
    ("float32", False, "0000803f 000000c0 0000003f"),
    ("float32", True, "3fc03f 800000 000000 000000"),
]


@pytest.mark.parametrize(("dtype", "byte_planes", "expected"), LAYOUTS)
def test_byte_layout_little_endian_and_planes(dtype: str, byte_planes: bool, expected: str) -> None:
    x = torch.tensor([[1.0, -2.0, 0.5]])
    body = encode({"modality": "image", "grid_thws": [(1, 2, 2)], "timestamps": None}, byte_planes, dtype, embeds=x)
    assert raw_map(body)["embeds"] == bytes.fromhex(expected.replace(" ", ""))
    assert same_bits(wire.decode(body).embeds, x.to(getattr(torch, dtype)))


def test_planes_reverse_and_big_endian_host_swaps(monkeypatch: pytest.MonkeyPatch) -> None:
    x = embeds(8)
    plain, planes = raw_map(encode(IMAGE, False, embeds=x))["embeds"], raw_map(encode(IMAGE, embeds=x))["embeds"]
    n = len(plain) // 2
    assert planes == plain[1::2] + plain[0::2]  # high bytes plane, then low bytes plane
    # On a big-endian host the native bytes are swapped before they hit the wire, and back after.
    monkeypatch.setattr(wire, "_HOST_LITTLE", False)
    for byte_planes in (False, True):
        body = encode(IMAGE, byte_planes, embeds=x)
        swapped = bytes(b for i in range(n) for b in (plain[2 * i + 1], plain[2 * i]))
        assert raw_map(body)["embeds"] == (planes[n:] + planes[:n] if byte_planes else swapped)
        assert same_bits(wire.decode(body).embeds, x.bfloat16())


def test_json_round_trip_and_to_json() -> None:
    x = embeds(10)
    body = encode(VIDEO, embeds=x)
    legacy = wire.to_json(body)
    obj = json.loads(legacy)
    assert list(obj) == list(wire.KEYS) and obj["byte_planes"] is False
    assert base64.b64decode(obj["embeds"]) == raw_map(encode(VIDEO, False, embeds=x))["embeds"]
    m = wire.decode_json(legacy)
    assert same_bits(m.embeds, x.bfloat16()) and m.timestamps == tuple(VIDEO["timestamps"])
    for dtype in wire.DTYPE_SIZES:
        for byte_planes in (False, True):
            j = wire.encode_json(mm_hash="h", model="m", embeds=x, dtype=dtype, byte_planes=byte_planes, **VIDEO)
            assert same_bits(wire.decode_json(j).embeds, x.to(getattr(torch, dtype)))
    with pytest.raises(WireError, match="zstd"):
        wire.decode(legacy)
    with pytest.raises(WireError, match="JSON"):
        wire.decode_json(body)


@pytest.mark.parametrize(
    "change",
    [
        {"embeds": torch.zeros(8, 4, 2)},
        {"embeds": torch.zeros(8, 4, dtype=torch.int32)},
        {"embeds": torch.zeros(7, 4)},
        {"dtype": "int8"},
        {"timestamps": ["00:00:00.000"]},
        {"grid_thws": [(1, 4)]},
        {"grid_thws": [(1.0, 4, 8)]},
        {"modality": "audio"},
        {"mm_hash": ""},
        {"level": 3.0},
    ],
)
def test_encode_refuses_bad_input(change: dict) -> None:
    kw = {"mm_hash": "h", "model": "m", "embeds": torch.zeros(8, 4), **IMAGE, **change}
    with pytest.raises(ValueError):
        wire.encode(**kw)


# --------------------------------------------------------------------------------- broken bodies


def good_map(item: dict = VIDEO, byte_planes: bool = True) -> dict:
    return raw_map(encode(item, byte_planes))


def mutated(**change: Any) -> dict:
    m = good_map(IMAGE if change.pop("_image", False) else VIDEO)
    for k, v in change.items():
        if v is DROP:
            del m[k]
        else:
            m[k] = v(m) if callable(v) else v
    return m


DROP = object()
EMB = good_map()["embeds"]
TAMPERED = {
    "version 2": (mutated(version=2), "knows version 1"),
    "version 0": (mutated(version=0), "unknown wire version"),
    "version str": (mutated(version="1"), "version"),
    "version bool": (mutated(version=True), "version"),
    "no version": (mutated(version=DROP), "version"),
    "missing key": (mutated(length=DROP), "missing \\['length'\\]"),
    "extra key": (mutated(extra=1), "unexpected \\['extra'\\]"),
    "mm_hash int": (mutated(mm_hash=5), "mm_hash"),
    "mm_hash empty": (mutated(mm_hash=""), "mm_hash"),
    "model nil": (mutated(model=None), "model"),
    "modality audio": (mutated(modality="audio"), "modality"),
    "modality list": (mutated(modality=["video"]), "modality"),
    "dtype int8": (mutated(dtype="int8"), "dtype"),
    "dtype list": (mutated(dtype=["bfloat16"]), "dtype"),
    "dtype changes itemsize": (mutated(dtype="float32"), "embeds"),
    "shape 1-D": (mutated(shape=[10 * 12]), "shape"),
    "shape 3-D": (mutated(shape=[10, 12, 1]), "shape"),
    "shape float": (mutated(shape=[10.0, 12]), "shape"),
    "shape zero": (mutated(shape=[0, 12], length=0, grid_thws=[[1, 1, 1]], timestamps=["00:00:00.000"]), "shape"),
    "shape[0] != length": (mutated(shape=[5, 24]), "length"),
    "hidden wrong": (mutated(shape=[10, 6]), "embeds"),
    "length wrong": (mutated(length=11), "length"),
    "length bool": (mutated(length=True), "length"),
    "embeds short": (mutated(embeds=EMB[:-1]), "embeds"),
    "embeds long": (mutated(embeds=EMB + b"\0"), "embeds"),
    "embeds empty": (mutated(embeds=b""), "embeds"),
    "embeds str": (mutated(embeds="x" * len(EMB)), "embeds"),
    "embeds list": (mutated(embeds=list(EMB[:8])), "embeds"),
    "grid empty": (mutated(grid_thws=[]), "grid_thws"),
    "grid pair": (mutated(grid_thws=[[4, 4], [2, 2, 4]]), "grid_thws"),
    "grid zero": (mutated(grid_thws=[[0, 4, 8], [2, 2, 4]]), "grid_thws"),
    "grid negative": (mutated(grid_thws=[[1, -4, -8], [2, 2, 4]]), "grid_thws"),
    "grid bool": (mutated(grid_thws=[[True, 4, 8], [2, 2, 4]]), "grid_thws"),
    "grid not list": (mutated(grid_thws={"t": 1}), "grid_thws"),
    "grid/length mismatch": (mutated(grid_thws=[[4, 4, 8], [2, 4, 4]]), "give 12 tokens"),
    "byte_planes int": (mutated(byte_planes=1), "byte_planes"),
    "timestamps nil for video": (mutated(timestamps=None), "timestamps"),
    "timestamps count": (mutated(timestamps=["00:00:00.000"]), "timestamps"),
    "timestamps format": (mutated(timestamps=["0:00:00.000", "00:00:02.500"]), "timestamps"),
    "timestamps int": (mutated(timestamps=[0, 2500]), "timestamps"),
    "timestamps for image": (mutated(_image=True, timestamps=["00:00:00.000"]), "timestamps"),
    "list not map": ([1, 2, 3], "not a msgpack map|must be a msgpack map"),
    "int not map": (7, "must be a msgpack map"),
}


def msgpack_body(obj: Any) -> bytes:
    return zstd(msgpack.packb(obj, use_bin_type=True))


def json_body(obj: Any) -> bytes:
    if isinstance(obj, dict) and isinstance(obj.get("embeds"), bytes):
        obj = {**obj, "embeds": base64.b64encode(obj["embeds"]).decode()}
    return json.dumps(obj).encode()


@pytest.mark.parametrize(("obj", "match"), TAMPERED.values(), ids=TAMPERED.keys())
def test_tampered_fields_refused(obj: Any, match: str) -> None:
    with pytest.raises(WireError, match=match):
        wire.decode(msgpack_body(obj))
    with pytest.raises(WireError):  # the same rules for the legacy JSON form
        wire.decode_json(json_body(obj))


def test_untampered_table_baseline_decodes() -> None:
    wire.decode(msgpack_body(good_map()))
    wire.decode_json(json_body(good_map()))


def duplicate_key_body() -> bytes:
    m = good_map()
    p = msgpack.Packer(use_bin_type=True)
    raw = p.pack_map_header(len(m) + 1) + b"".join(p.pack(k) + p.pack(v) for k, v in m.items())
    return zstd(raw + p.pack("modality") + p.pack("image"))


def forged_header(content_size: int) -> bytes:
    # magic, descriptor (8-byte content size, single segment, checksum), size, then one empty raw last block
    return b"\x28\xb5\x2f\xfd" + bytes([0xE4]) + content_size.to_bytes(8, "little") + b"\x01\x00\x00"


GOOD = encode(VIDEO)
BROKEN = {
    "empty": (b"", "not a zstd frame"),
    "json": (json_body(good_map()), "not a zstd frame"),
    "magic only": (GOOD[:4], "frame header"),
    "str": ("abc", "must be bytes"),
    "trailing garbage": (GOOD + b"\0", "unused data|corrupt"),
    "two frames": (GOOD + GOOD, "unused data|corrupt"),
    "trailing msgpack byte": (zstd(msgpack.packb(good_map()) + b"\xc0"), "trailing bytes"),
    "not msgpack": (zstd(b"\xc1\xc1"), "not a msgpack body"),
    "msgpack truncated": (zstd(msgpack.packb(good_map())[:-7]), "not a msgpack body"),
    "invalid utf-8": (zstd(b"\x81\xa2\xff\xfe\x01"), "not a msgpack body"),
    "int keys": (zstd(msgpack.packb({1: 2})), "not a msgpack body"),
    "deep nesting": (zstd(b"\x91" * 100_000 + b"\xc0"), "not a msgpack body"),
    "duplicate key": (duplicate_key_body(), "duplicate"),
    "no content size": (zstd(msgpack.packb(good_map()), write_content_size=False), "content size"),
    "no checksum": (zstd(msgpack.packb(good_map()), write_checksum=False), "checksum"),
    "forged 1 TiB content size": (forged_header(1 << 40), "above the limit"),
    "forged size, tiny frame": (forged_header(1000), "corrupt"),
    "zero content size": (zstd(b""), "empty"),
}


@pytest.mark.parametrize(("body", "match"), BROKEN.values(), ids=BROKEN.keys())
def test_broken_bodies_refused(body: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match):
        wire.decode(body)


def test_zstd_bomb_refused_before_decompressing() -> None:
    bomb = zstd(b"\0" * (8 << 20))  # 8 MiB of zeros in a few hundred bytes
    assert len(bomb) < 2000
    with pytest.raises(WireError, match="above the limit of 1048576"):
        wire.decode(bomb, max_size=1 << 20)
    with pytest.raises(WireError, match="above the limit"):
        wire.decode(GOOD, max_size=100)
    with pytest.raises(WireError, match="above the limit"):
        wire.decode_json(json_body(good_map()), max_size=100)


def assert_refused_or_identical(body: bytes) -> bool:
    """True if refused; a change zstd ignores (its unused header bit) may decode to the same message."""
    try:
        m = wire.decode(body)
    except WireError:
        return True
    ref = wire.decode(GOOD)
    assert same_bits(m.embeds, ref.embeds)
    assert (m.mm_hash, m.grid_thws, m.timestamps, m.byte_planes) == (ref.mm_hash, ref.grid_thws, ref.timestamps,
                                                                     ref.byte_planes)
    return False


def test_truncated_at_every_offset() -> None:
    for n in range(len(GOOD)):
        with pytest.raises(WireError):
            wire.decode(GOOD[:n])


def test_every_bit_flip_refused() -> None:
    accepted = []
    for i in range(len(GOOD)):
        for bit in range(8):
            body = bytearray(GOOD)
            body[i] ^= 1 << bit
            if not assert_refused_or_identical(bytes(body)):
                accepted.append((i, bit))
    assert len(accepted) <= 8, accepted  # the checksum catches every change to the content


@pytest.mark.parametrize(
    "body",
    [b'{"version":1', b"[" * 100_000, b'{"version":1,"version":1}', b"\xff\xfe\xfd", b"NaN",
     json_body({**good_map(), "embeds": "!!!!"}), json_body({**good_map(), "embeds": "QQ"}), b"{}"],
)
def test_broken_json_refused(body: bytes) -> None:
    with pytest.raises(WireError):
        wire.decode_json(body)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300), st.booleans())
def test_random_bytes_only_wire_error(data: bytes, with_magic: bool) -> None:
    body = (b"\x28\xb5\x2f\xfd" + data) if with_magic else data
    with pytest.raises(WireError):
        wire.decode(body)
    with pytest.raises(WireError):
        wire.decode_json(data)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_random_splices_only_wire_error(data: st.DataObject) -> None:
    """Random overwrites of a good body's bytes: refused with WireError, or (rarely) a no-op for zstd."""
    body = bytearray(GOOD)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] = data.draw(st.integers(0, 255))
    if bytes(body) != GOOD:
        assert_refused_or_identical(bytes(body))


def test_wire_error_is_a_502_with_a_stable_code() -> None:
    with pytest.raises(WireError) as e:
        wire.decode(b"nope")
    assert isinstance(e.value, MMEncoderError)
    assert (e.value.code, e.value.http_status) == ("bad_wire_body", 502)
    assert str(e.value).startswith("[bad_wire_body] ")
