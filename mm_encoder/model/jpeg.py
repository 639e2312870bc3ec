"""JPEG structure, checked before libjpeg decodes (it would paper over what is missing).

A JPEG must hold at least the entropy data its header claims (1 bit per 8x8 block for Huffman
coding); a one-scan sequential JPEG is decoded without the marker that ends its scan, so data cut
short runs dry instead of being filled with grey; a progressive JPEG must code every coefficient.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..core.errors import MediaError

# SOFn marker -> entropy bits each 8x8 block needs at least: Huffman codes are >= 1 bit and every
# block codes at least its DC difference. Arithmetic coding (SOF9-11) has no such floor.
_SOF_MIN_BITS = {0xC0: 1, 0xC1: 1, 0xC2: 1, 0xC3: 1, 0xC9: 0, 0xCA: 0, 0xCB: 0}
_SCAN_END = re.compile(rb"\xff[^\x00\xff\xd0-\xd7]")  # a marker that is not stuffing, fill or RSTn
_SCAN_END_NO_RST = re.compile(rb"\xff[^\x00\xff]")  # without a restart interval RSTn ends a scan too


@dataclass
class _JpegLayout:
    sof: int
    blocks: int  # 8x8 blocks over all components (no MCU padding: a lower bound)
    scans: int
    entropy_bytes: int
    scan_end: int  # offset of the marker that ends the last scan
    unfinished: list[int]  # progressive: components whose 64 coefficients are not all coded to the last bit


def _jpeg_layout(data: bytes) -> _JpegLayout | None:
    """Walk the marker segments; None where the structure is not understood (Pillow judges)."""
    pos, sof, blocks, scans, entropy, dri, end = 2, None, 0, 0, 0, 0, 0
    done: dict[int, set[int]] = {}  # component id -> coefficients whose final (Al = 0) scan was seen
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker == 0xD9 or (scans and (0xD0 <= marker <= 0xD7 or marker == 0x01)):
            break
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        seg = data[pos + 4 : pos + 2 + length]
        if marker in _SOF_MIN_BITS and len(seg) >= 6 and sof is None:
            height, width, n = int.from_bytes(seg[1:3], "big"), int.from_bytes(seg[3:5], "big"), seg[5]
            comps = [(seg[7 + 3 * i] >> 4, seg[7 + 3 * i] & 15) for i in range(n) if 8 + 3 * i <= len(seg)]
            hmax = max((h for h, _ in comps), default=1) or 1
            vmax = max((v for _, v in comps), default=1) or 1
            blocks = sum(math.ceil(math.ceil(width * h / hmax) / 8) * math.ceil(math.ceil(height * v / vmax) / 8)
                         for h, v in comps)
            sof = marker
            done = {seg[6 + 3 * i]: set() for i in range(n) if 7 + 3 * i <= len(seg)}
        elif marker == 0xDD and len(seg) >= 2:
            dri = int.from_bytes(seg[:2], "big")
        elif marker == 0xDA:
            ns = seg[0] if seg else 0
            if len(seg) >= 4 + 2 * ns:  # components, then Ss, Se, Ah/Al
                ss, se, al = seg[1 + 2 * ns], seg[2 + 2 * ns], seg[3 + 2 * ns] & 15
                for i in range(ns):
                    if al == 0 and seg[1 + 2 * i] in done:
                        done[seg[1 + 2 * i]].update(range(ss, min(se, 63) + 1))
            start = pos + 2 + length
            m = (_SCAN_END if dri else _SCAN_END_NO_RST).search(data, start)
            if m is None:
                return None  # no end marker: Pillow's own truncation check applies
            scans, entropy, end, pos = scans + 1, entropy + m.start() - start, m.start(), m.start()
            continue
        pos += 2 + length
    if sof is None or not scans:
        return None
    return _JpegLayout(sof, blocks, scans, entropy, end, [c for c, k in done.items() if len(k) < 64])


def vet_jpeg(data: bytes) -> bytes | None:
    """Refuse a JPEG whose data cannot cover its declared size; for a one-scan sequential JPEG,
    the bytes to decode: its scan without the end marker, plus zero padding for libjpeg's bit
    reader, so a scan cut short runs dry (Pillow: "truncated") instead of being filled with grey."""
    layout = _jpeg_layout(data)
    if layout is None:
        return None
    need = layout.blocks * _SOF_MIN_BITS[layout.sof]
    if layout.entropy_bytes * 8 < need:
        raise MediaError("corrupt", f"JPEG header declares {layout.blocks} 8x8 blocks (at least {need} bits of "
                                    f"image data) but holds {layout.entropy_bytes} bytes: truncated or lying")
    if layout.sof in (0xC0, 0xC1) and layout.scans == 1:
        return data[: layout.scan_end] + bytes(16)
    if layout.sof in (0xC2, 0xCA) and layout.unfinished:
        # libjpeg decodes the scans it has and leaves the rest zero: a progressive file cut short
        # (an end marker appended) would pass as a blurred image
        raise MediaError("corrupt", f"progressive JPEG ends before its scans code every coefficient of "
                                    f"component(s) {layout.unfinished}: truncated")
    return None
