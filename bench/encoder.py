"""Encoder benchmark (not a test): preprocess/forward time and tokens per image size and model.

    python bench/encoder.py [--repeats 3] [--json out.json] [--quick]

Reports medians over --repeats runs, all configurations measured in one process, and the
fast/reference forward-time ratio on the same weights and inputs (tests/reference.py).
Full-width tower: MoonViT at 1152 wide with 0 and 2 layers (per-layer cost = (t2 - t0) / 2;
27 layers on 2 CPU cores take minutes per full-HD image), and all 27 layers on 448x448.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import random_model, ref_cfg  # noqa: E402
from media_factory import image_bytes, natural_image  # noqa: E402
from reference import reference_forward  # noqa: E402

from mm_encoder import Encoder, get_spec  # noqa: E402

SIZES = {"448x448": (448, 448), "full-HD": (1920, 1080), "4K": (3840, 2160)}


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def make_encoder(name: str, layers: int | None = None) -> Encoder:
    spec = get_spec(name)
    if layers is not None:
        spec = spec.model_copy(update={"tower": spec.tower.model_copy(update={"num_layers": layers})})
    return Encoder(spec, random_model(spec), device=torch.device("cpu"), dtype=torch.float32)


@torch.inference_mode()
def measure(enc: Encoder, data: bytes, repeats: int, with_reference: bool = False) -> dict:
    pixels, grid = enc.preprocess(data)
    enc.model(pixels, [grid])  # warm-up
    row = {
        "tokens": grid[1] * grid[2] // 4,
        "grid": list(grid),
        "preprocess_ms": median_ms(lambda: enc.preprocess(data), repeats),
        "forward_ms": median_ms(lambda: enc.model(pixels, [grid]), repeats),
    }
    if with_reference:
        sd = enc.model.state_dict()
        cfg = ref_cfg(enc.spec)
        row["reference_ms"] = median_ms(lambda: reference_forward(sd, cfg, pixels, [grid]), repeats)
        row["ref_over_fast"] = row["reference_ms"] / row["forward_ms"]
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="448x448 and full-HD only, 1 repeat on full width")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.manual_seed(0)
    images = {k: image_bytes(natural_image(w, h, seed=1), "JPEG", quality=90) for k, (w, h) in SIZES.items()}
    if args.quick:
        images.pop("4K")
    rows = []

    def run(model: str, enc: Encoder, size: str, repeats: int, ref: bool = False) -> dict:
        row = {"model": model, "size": size, **measure(enc, images[size], repeats, ref)}
        rows.append(row)
        extra = f"  ref/fast {row['ref_over_fast']:.2f}x" if ref else ""
        print(f"{model:24s} {size:8s} tokens={row['tokens']:5d} preprocess={row['preprocess_ms']:8.1f} ms "
              f"forward={row['forward_ms']:9.1f} ms{extra}", flush=True)
        return row

    tiny = make_encoder("tiny")
    for size in images:
        run("tiny", tiny, size, args.repeats, ref=size != "4K")
    wide_repeats = 1 if args.quick else args.repeats
    wide0, wide2 = make_encoder("kimi-k2.5-vision", 0), make_encoder("kimi-k2.5-vision", 2)
    per_layer = {}
    for size in images:
        r0 = run("moonvit-1152 0 layers", wide0, size, wide_repeats)
        r2 = run("moonvit-1152 2 layers", wide2, size, wide_repeats, ref=size == "448x448")
        per_layer[size] = (r2["forward_ms"] - r0["forward_ms"]) / 2
        print(f"{'':24s} {size:8s} per-layer cost {per_layer[size]:9.1f} ms", flush=True)
    del wide0, wide2
    full = make_encoder("kimi-k2.5-vision")
    run("moonvit-1152 27 layers", full, "448x448", wide_repeats)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "per_layer_ms": per_layer,
                                         "threads": torch.get_num_threads()}, indent=2))


if __name__ == "__main__":
    main()
