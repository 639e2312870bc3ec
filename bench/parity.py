"""Parity per registered model (not a test; tests/test_parity.py gates the same on small towers):
the fast path against the independent eager fp32 reference (harness/reference.py) on the same
random weights, in fp32 and in bf16.

    python -m bench.parity [--quick] [--layers N] [--json PATH]

For every model of the registry (`mm-encoder models`): per-token cosine (mean, min), relative L2
and max |error| of the fast model's output against the reference's, on a few images through the
model's own preprocessing. The bf16 model is the fp32 weights cast (as the package builds one);
the reference always runs in fp32 on the fp32 weights. Full-width towers run with `--layers`
layers (default: all 27; --quick: 2). Gate: bf16 mean cosine >= 0.9994 for every model; a model
under it makes this script exit 1 (after writing its JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import stats
from harness.media_factory import image_bytes, natural_image
from harness.models import random_model, ref_cfg
from harness.reference import reference_forward
from mm_encoder import Encoder, list_models
from mm_encoder.core.spec import ModelSpec
from mm_encoder.model.checkpoint import build_empty

GATE = 0.9994  # bf16 fast vs fp32 reference, mean per-token cosine
# (width, height): 448x448 is a 32x32 grid (the 64x64 position table resized), 210x140 a small
# non-square one; the narrow towers also get 896x896, the table's own 64x64 grid (used as is).
IMAGES = [(448, 448), (210, 140)]
SMALL_EXTRA = [(896, 896)]
WIDE_HIDDEN = 1024  # towers at least this wide run with `--layers` layers


def _errors(fast: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    cos = torch.cat([F.cosine_similarity(f.double(), r.double(), dim=-1) for f, r in zip(fast, ref, strict=True)])
    f = torch.cat([x.double() for x in fast])
    r = torch.cat([x.double() for x in ref])
    return {"cos_mean": float(cos.mean()), "cos_min": float(cos.min()),
            "rel_l2": float((f - r).norm() / r.norm()), "max_abs": float((f - r).abs().max())}


@torch.inference_mode()
def check(spec: ModelSpec, layers: int | None) -> dict:
    full_layers = spec.tower.num_layers
    wide = spec.tower.hidden_size >= WIDE_HIDDEN
    if wide and layers is not None:
        spec = spec.model_copy(update={"tower": spec.tower.model_copy(update={"num_layers": layers})})
    sizes = IMAGES if wide else IMAGES + SMALL_EXTRA
    items = [image_bytes(natural_image(w, h, seed=w + h), "JPEG", quality=90) for w, h in sizes]
    t0 = time.perf_counter()
    m32 = random_model(spec, seed=3)
    m16 = build_empty(spec)
    m16.load_state_dict({k: v.to(torch.bfloat16) for k, v in m32.state_dict().items()}, strict=True, assign=True)
    cpu = torch.device("cpu")
    e32 = Encoder(spec, m32, device=cpu, dtype=torch.float32, batch_max_patches=1 << 20)
    e16 = Encoder(spec, m16.eval(), device=cpu, dtype=torch.bfloat16, batch_max_patches=1 << 20)
    prepared = [e32.preprocess_item(x) for x in items]
    grids = [p.grid for p in prepared]
    ref = reference_forward(m32.state_dict(), ref_cfg(spec), torch.cat([p.pixel_values for p in prepared]), grids)
    fast32 = [r.embeds for r in e32.encode(items)]
    fast16 = [r.embeds for r in e16.encode(items)]
    out = {"model": spec.name, "projector": spec.projector.type, "out_dim": spec.projector.out_dim,
           "hidden": spec.tower.hidden_size, "layers": spec.tower.num_layers, "layers_full": full_layers,
           "images": [f"{w}x{h}" for w, h in sizes], "grids": [list(g) for g in grids],
           "tokens": sum(p.num_tokens for p in prepared),
           "fp32": _errors(fast32, ref), "bf16": _errors(fast16, ref), "seconds": time.perf_counter() - t0}
    out["gate_pass"] = out["bf16"]["cos_mean"] >= GATE
    return out


def run(quick: bool, layers: int | None) -> dict:
    torch.manual_seed(0)
    layers = layers if layers is not None else (2 if quick else None)
    rows = []
    for spec in list_models():
        row = check(spec, layers)
        rows.append(row)
        print(f"{row['model']:18s} layers {row['layers']:2d}/{row['layers_full']:2d}  fp32 cos mean "
              f"{row['fp32']['cos_mean']:.7f} min {row['fp32']['cos_min']:.7f}  bf16 cos mean "
              f"{row['bf16']['cos_mean']:.6f} min {row['bf16']['cos_min']:.6f}  "
              f"{'PASS' if row['gate_pass'] else 'FAIL'}  {row['seconds']:.0f} s", flush=True)
    return {"mode": "quick" if quick else "full", "machine": stats.machine(), "gate": GATE, "models": rows,
            "gate_pass": all(r["gate_pass"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="full-width towers with 2 layers")
    p.add_argument("--layers", type=int, help="layers of the full-width towers (default: all; --quick: 2)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    result = run(args.quick, args.layers)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if not result["gate_pass"]:
        sys.exit(f"parity gate failed: bf16 mean cosine under {GATE} for "
                 + ", ".join(r["model"] for r in result["models"] if not r["gate_pass"]))


if __name__ == "__main__":
    main()
