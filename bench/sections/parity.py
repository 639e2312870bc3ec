"""BENCHMARKS.md's section for bench/parity.py: its figures (the JSON it writes) as markdown and plots."""

from __future__ import annotations

from pathlib import Path


def section(result: dict, plots: Path) -> str:
    rows = result["models"]
    cut = sorted({r["layers"] for r in rows if r["layers"] != r["layers_full"]})
    depth = (f"Full-width towers run with {', '.join(map(str, cut))} of their layers (the whole tower is too slow "
             "for this run's budget); " if cut else "Every tower runs with all its layers; ")
    lines = [
        "## Parity per model (`python -m bench.parity`)",
        "",
        "Every registered model (`mm-encoder models`) against the independent eager fp32 reference "
        "(harness/reference.py) on the same random weights (std 0.02), on JPEG images through the model's own "
        "preprocessing; the bf16 model is the fp32 weights cast. Per-token cosine over every output token of "
        f"the images, relative L2 and max |error| of the whole output. {depth}the narrow `tiny` tower also gets "
        f"an 896x896 image (its 64x64 grid uses the position table as is). Gate: bf16 mean cosine >= {result['gate']}.",
        "",
        "| model | projector -> width | layers run | images (tokens) | fp32 cos mean | fp32 cos min | fp32 rel L2 "
        "| bf16 cos mean | bf16 cos min | bf16 rel L2 | gate |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        a, b = r["fp32"], r["bf16"]
        lines.append(f"| {r['model']} | {r['projector']} -> {r['out_dim']:,} | {r['layers']} of {r['layers_full']} | "
                     f"{', '.join(r['images'])} ({r['tokens']:,}) | {a['cos_mean']:.7f} | {a['cos_min']:.7f} | "
                     f"{a['rel_l2']:.1e} | {b['cos_mean']:.6f} | {b['cos_min']:.6f} | {b['rel_l2']:.1e} | "
                     f"{'pass' if r['gate_pass'] else '**FAIL**'} |")
    worst = min(rows, key=lambda r: r["bf16"]["cos_mean"])
    lines += ["", f"- {'Every model passes' if result['gate_pass'] else 'NOT every model passes'} the bf16 gate; "
              f"the lowest bf16 mean cosine is {worst['bf16']['cos_mean']:.6f} ({worst['model']}, "
              f"{worst['layers']} layers). fp32 matches the reference to rounding on every model."]
    if result.get("mode") != "full":
        lines += ["", f"_This section is from a `--{result.get('mode')}` run (fewer layers than `make bench`)._"]
    return "\n".join(lines) + "\n"
