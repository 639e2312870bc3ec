"""Wire format benchmark (not a test): body size and encode/decode speed for one image's embeddings.

    python bench/wire.py [--repeats 5] [--quick] [--json out.json]

The payload is a 4K image's embeddings for Kimi-K2.5: 4,096 tokens x 7168, bf16 (--quick: 1,024
tokens, fewer repeats and levels). Values come from the real projector (the spec's PatchMerger,
seeded random weights exactly as `init_random` fills them) applied to layer-normed gaussian
tower-like features [tokens, 4, 1152], so their exponent spread is that of a real projector output.

All formats are measured side by side in one process, medians over --repeats. MB = 10^6 bytes;
encode/decode MB/s are MB of raw embeddings (tokens x hidden x 2) per second, one thread.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import zstandard

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mm_encoder import wire  # noqa: E402
from mm_encoder.core.registry import get_spec  # noqa: E402
from mm_encoder.model.checkpoint import build_empty, init_random  # noqa: E402

MODEL = "kimi-k2.5-vision"


@torch.inference_mode()
def realistic_embeds(tokens: int, seed: int = 0) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """bf16 [tokens, out_dim] from the spec's projector on random weights, and a grid giving `tokens`."""
    spec = get_spec(MODEL)
    # The full model on meta costs nothing; only the projector (54M params) gets real weights.
    projector = build_empty(spec).mm_projector
    init_random(projector, seed=seed, device=torch.device("cpu"), dtype=torch.float32)  # type: ignore[arg-type]
    d = spec.tower.hidden_size
    g = torch.Generator().manual_seed(seed + 1)
    feats = F.layer_norm(torch.randn(tokens, 4, d, generator=g), (d,))  # MoonViT ends in a LayerNorm
    out = torch.cat([projector(chunk) for chunk in feats.split(1024)])
    side = 2 * int(tokens**0.5)  # h = w patches, h*w/4 tokens
    assert side * side // 4 == tokens, "tokens must be a square"
    return out.to(torch.bfloat16), [(1, side, side)]


def median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def formats(levels: list[int]) -> dict[str, tuple[Callable[..., bytes], Callable[[bytes], wire.WireMessage]]]:
    out: dict[str, tuple[Callable[..., bytes], Callable[[bytes], wire.WireMessage]]] = {
        "json+base64": (lambda **kw: wire.encode_json(**kw, byte_planes=False), wire.decode_json),
        "msgpack raw (no zstd)": (lambda **kw: wire._pack(**kw, byte_planes=False), wire._unpack),
    }
    for split in (False, True):
        for level in levels:
            name = f"raw+{'split+' if split else ''}zstd L{level}"
            out[name] = (lambda s=split, lv=level, **kw: wire.encode(**kw, byte_planes=s, level=lv), wire.decode)
    return out


def plane_sizes(x: torch.Tensor, level: int = 3) -> list[float]:
    """Compressed/raw ratio of each byte plane alone, most significant first."""
    u8 = x.contiguous().view(torch.uint8).reshape(-1, x.element_size())
    cctx = zstandard.ZstdCompressor(level=level)
    ratios = []
    for j in reversed(range(u8.shape[1])):  # little-endian: the last byte is the most significant
        plane = u8[:, j].contiguous().numpy().tobytes()
        ratios.append(len(cctx.compress(plane)) / len(plane))
    return ratios


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="1,024 tokens, 2 repeats, zstd levels 1 and 3")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    tokens, repeats, levels = (1024, 2, [1, 3]) if args.quick else (4096, args.repeats, [1, 3, 9])
    torch.manual_seed(0)

    t0 = time.perf_counter()
    x, grids = realistic_embeds(tokens)
    raw_mb = x.numel() * x.element_size() / 1e6
    print(f"{MODEL}: {tokens} tokens x {x.shape[1]} bf16 = {raw_mb:.2f} MB raw "
          f"(projector forward {time.perf_counter() - t0:.1f} s); std {x.float().std():.4f}; "
          f"zstandard {zstandard.__version__} (libzstd {'.'.join(map(str, zstandard.ZSTD_VERSION))}), "
          f"{platform.processor() or platform.machine()}, medians of {repeats}", flush=True)
    item = {"mm_hash": "0" * 64, "model": MODEL, "modality": "image", "embeds": x, "grid_thws": grids}

    rows = []
    for name, (enc, dec) in formats(levels).items():
        body = enc(**item)
        m = dec(body)
        assert torch.equal(m.embeds.view(torch.int16), x.view(torch.int16)), f"{name}: not bit-exact"
        assert enc(**item) == body, f"{name}: not deterministic"
        rows.append({
            "format": name,
            "size_mb": len(body) / 1e6,
            "encode_s": median_s(lambda e=enc: e(**item), repeats),
            "decode_s": median_s(lambda d=dec, b=body: d(b), repeats),
        })
        r = rows[-1]
        print(f"  {name:24s} {r['size_mb']:7.2f} MB  enc {raw_mb / r['encode_s']:7.0f} MB/s  "
              f"dec {raw_mb / r['decode_s']:7.0f} MB/s", flush=True)

    base = rows[0]["size_mb"]
    print(f"\n{tokens} tokens x {x.shape[1]} bf16 ({raw_mb:.2f} MB raw)\n")
    print("| format | body MB | vs json+base64 | encode MB/s | decode MB/s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        r["ratio"] = r["size_mb"] / base
        print(f"| {r['format']} | {r['size_mb']:.2f} | {r['ratio']:.3f}x | {raw_mb / r['encode_s']:.0f} | "
              f"{raw_mb / r['decode_s']:.0f} |")

    planes = plane_sizes(x)
    print(f"\nzstd L3 on each byte plane alone (compressed/raw): high (sign+exponent) {planes[0]:.3f}, "
          f"low (mantissa) {planes[1]:.3f}")

    by = {r["format"]: r for r in rows}
    plain, split = by["raw+zstd L3"], by["raw+split+zstd L3"]
    print(f"target raw+zstd L3 <= 0.60x of json+base64: {plain['ratio']:.3f}x -> "
          f"{'met' if plain['ratio'] <= 0.60 else 'MISSED'}; split L3: {split['ratio']:.3f}x")
    for lv in levels:
        p_, s_ = by[f"raw+zstd L{lv}"], by[f"raw+split+zstd L{lv}"]
        print(f"byte planes at L{lv}: {1 - s_['size_mb'] / p_['size_mb']:+.1%} smaller than plain, "
              f"encode {p_['encode_s'] / s_['encode_s']:.2f}x and decode {p_['decode_s'] / s_['decode_s']:.2f}x "
              f"the speed of plain")
    # The smallest zstd body; among bodies within 2% of it, the fastest to encode.
    zstd_rows = [r for r in rows if "zstd L" in r["format"]]
    smallest = min(r["size_mb"] for r in zstd_rows)
    pick = min((r for r in zstd_rows if r["size_mb"] <= smallest * 1.02), key=lambda r: r["encode_s"])
    level = int(pick["format"].rsplit("L", 1)[1])
    print(f"recommended default: byte_planes={'split' in pick['format']}, level={level} ({pick['format']}: "
          f"the fastest encode among bodies within 2% of the smallest)")
    if args.json:
        args.json.write_text(json.dumps({"tokens": tokens, "hidden": x.shape[1], "raw_mb": raw_mb, "rows": rows,
                                         "plane_ratios": planes, "repeats": repeats}, indent=2))


if __name__ == "__main__":
    main()
