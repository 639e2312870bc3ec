"""BENCHMARKS.md's section for bench/encoder.py: its figures (the JSON it writes) as markdown and plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench import stats
from bench.encoder import _WIRE, CHEAP_MS, CHEAP_REPEATS, REFERENCE_STACK, STAGES

STAGE_LABELS = {"fetch": "fetch", "hash": "mm_hash", "decode": "decode", "preprocess": "resize + patchify",
                "forward": "forward", "pack": "pack", "respond": "respond"}


def _f(s, digits: int = 1) -> str:
    return stats.fmt(s, digits)


NOISY = " †"


NOISY_NOTE = ("† a figure this ratio compares has max over twice its min: the machine was busy during those "
              "repeats; rerun when it is quiet before reading much into it.")


def _noisy(*figures: dict) -> str:
    return NOISY if any(f["max"] > 2 * f["min"] for f in figures) else ""


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}x"


def _med(s: dict) -> str:
    med = s["median"]
    return stats.fmt(med, 2 if med < 10 else 1 if med < 1000 else 0)


def _auto(s: dict) -> str:
    """ms with digits that suit the size."""
    med = s["median"]
    return stats.fmt(s, 2 if med < 10 else 1 if med < 1000 else 0)


def _row_name(r: dict) -> str:
    if r["label"] == "tiny":
        return "tiny"
    if r.get("extrapolated"):
        return f"MoonViT-1152, {r['layers']} layers (extrapolated)"
    return f"MoonViT-1152, {r['layers']} layers"


def section(result: dict, plots: Path) -> str:
    mode = result.get("mode", "full")
    today = result.get("default_dtype", "bfloat16")
    lines = [*_breakdown(result, plots, today), *_before_after(result, plots, today), *_dtypes(result)]
    if mode != "full":
        lines += ["", f"_This section is from a `--{mode}` run: fewer sizes and repeats than `make bench`._"]
    return "\n".join(lines) + "\n"


def _breakdown(result: dict, plots: Path, today: str) -> list[str]:
    """Where the time goes per image, stage by stage."""
    w = result.get("wire", _WIRE)
    packs = w["wire_dtype"] or f"the model's dtype, {today}"
    lines = [
        "## Encoder (`python -m bench.encoder`)",
        "",
        f"Random weights (std 0.02), JPEG inputs (q90) from harness/media_factory.py, one image at a time; "
        f"{result['repeats']} repeat(s) ({result['wide_repeats']} for the full-width tower; at least "
        f"{CHEAP_REPEATS}, after two warm-up passes, where a pass takes under {CHEAP_MS} ms), alternating "
        f"between the rows compared. Today's path runs in the CPU default dtype ({today}: "
        "mm_encoder/model/loading.py `default_dtype`).",
        "",
        "### Where the time goes per image",
        "",
        "Stages of the worker's path, in ms: fetch = the package's `Fetcher` over http on loopback (a threaded "
        "http.server, keep-alive: a lower bound, a remote origin adds its round trips); mm_hash = `identify`; "
        "decode = JPEG -> RGB; resize + patchify = `preprocess` (torch bicubic, pad, patchify, normalise); forward "
        f"= tower + projector; pack = wire v1 as the worker packs ({packs}, byte planes "
        f"{'on' if w['wire_byte_planes'] else 'off'}, zstd {w['zstd_level']}); respond = the HTTP head + body "
        "written to a loopback TCP socket until the reading peer has the last byte. The full-width tower "
        "(MoonViT 1152 wide + patchmerger -> 7168) is measured with 0 and 2 layers; 27 layers = "
        "t(0) + 27 x (t(2) - t(0)) / 2, repeat by repeat (27 real layers take minutes per full-HD image "
        "on this CPU); where a row says 27 layers without \"extrapolated\", all 27 ran.",
        "",
        "| model | image | tokens | " + " | ".join(STAGE_LABELS[s] for s in STAGES)
        + " | total | forward share | body MB |",
        "|---|---|---:|" + "---:|" * (len(STAGES) + 3),
    ]
    for r in result["breakdown"]:
        st = r["stages"]
        share = st["forward"]["median"] / st["total"]["median"]
        lines.append(f"| {_row_name(r)} | {r['size']} | {r['tokens']:,} | "
                     + " | ".join(_auto(st[s]) for s in STAGES)
                     + f" | {_auto(st['total'])} | {share:.1%} | {r['body_bytes'] / 1e6:.2f} |")
    per_layer = [r for r in result["breakdown"] if r.get("extrapolated")]
    if per_layer:
        lines += ["", "Per-layer cost of the full-width tower, (t(2) - t(0)) / 2: " + ", ".join(
            f"{r['size']} ({r['tokens'] * 4:,} patches) {_auto(r['per_layer_ms'])} ms" for r in per_layer) + "."]
    shares = [(r, r["stages"]["forward"]["median"] / r["stages"]["total"]["median"]) for r in result["breakdown"]]
    lines += ["", "- On the CPU the forward dominates: " + "; ".join(
        f"{_row_name(r)} {r['size']} {s:.1%}" for r, s in shares if r["label"] == "tiny" or r["layers"] > 2)
        + " of the image's time. Everything but the forward is the same work whatever the tower's depth."]
    png = _plot_breakdown(result, plots)
    if png:
        lines += ["", f"![where the time goes per image]({png})"]
    return lines


def _before_after(result: dict, plots: Path, today: str) -> list[str]:
    """Before vs after, same weights: the reference path against today's, fp32 and bf16."""
    ref = result.get("reference_stack", REFERENCE_STACK)
    lines = [
        "",
        "### Before vs after, same weights",
        "",
        "Before: PIL decode, Pillow BICUBIC resize on the CPU, pad/patchify, the eager fp32 reference forward "
        "(harness/reference.py `reference_forward`: conv patch embed, complex RoPE, explicit softmax attention, "
        "a Python loop per item), a json+base64 body, all on one thread. After: today's path (torch resize in "
        f"preprocess.py, the fast model, msgpack + raw + zstd as the worker packs), in fp32 and in {today}. "
        "Both include mm_hash, decode, resize, forward and pack of one image (no fetch, no respond). ms.",
        "",
        "| model | image | tokens | before | after fp32 | before / after fp32 | after bf16 | before / after bf16 "
        "| forward before / after fp32 | body MB before / after |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["before_after"]:
        b, a32, a16 = r["before"], r["after_fp32"], r["after_bf16"]
        bb = r["body_bytes"]
        lines.append(f"| {r['label']} | {r['size']} | {r['tokens']:,} | {_auto(b['total'])} | {_auto(a32['total'])} | "
                     f"**{r['speedup_fp32']:.2f}x**{_noisy(b['total'], a32['total'])} | {_auto(a16['total'])} | "
                     f"**{r['speedup_bf16']:.2f}x**{_noisy(b['total'], a16['total'])} | "
                     f"{stats.ratio(b['forward'], a32['forward']):.2f}x{_noisy(b['forward'], a32['forward'])} | "
                     f"{bb['before'] / 1e6:.2f} / {bb['after_fp32'] / 1e6:.2f} |")
    lines += [f"| reference stack (GPU) | 4K | | {ref['before_ms']} | {ref['after_ms']} | "
              f"{ref['before_ms'] / ref['after_ms']:.1f}x | | | | |", ""]
    if any(NOISY in line for line in lines):
        lines += [NOISY_NOTE, ""]
    for r in result["before_after"]:
        b, a = r["before"], r["after_fp32"]
        parts = ", ".join(f"{STAGE_LABELS[s]} {_med(b[s])} -> {_med(a[s])}" for s in STAGES if s in b)
        lines.append(f"- {r['label']} {r['size']}, medians before -> after fp32: {parts} ms.")
    png = _plot_before_after(result, plots)
    if png:
        lines += ["", f"![before vs after]({png})"]
    return lines


def _dtypes(result: dict) -> list[str]:
    """bf16 vs fp32 on the CPU, and the forward against the machine's matmul rate."""
    mm = result["matmul"]
    lines = [
        "",
        "### bf16 vs fp32 on the CPU, and how close the forward is to the machine's limit",
        "",
        "The same weights in fp32 and cast to bf16 (as the package builds a bf16 model), the same image, forward "
        "only, alternating. Cosine: per token, bf16 output vs fp32 output. FLOP/s: the forward's FLOPs "
        "counted analytically (2 per multiply-add: patch embed, per layer qkv, QK^T and AV over the item's "
        "tokens, wo, MLP; the projector) over its time, against `torch.matmul` of two "
        f"{mm['n']}x{mm['n']} matrices in the same run: fp32 {_f(mm['float32'], 0)} GFLOP/s, "
        f"bf16 {_f(mm['bfloat16'], 0)} GFLOP/s ({stats.ratio(mm['bfloat16'], mm['float32']):.2f}x).",
        "",
        "| model | image | patches | GFLOP | fp32 ms | bf16 ms | bf16 speed-up | cos mean | cos min "
        "| fp32 GFLOP/s (of matmul) | bf16 GFLOP/s (of matmul) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["dtype"]:
        lines.append(f"| {r['label']} | {r['size']} | {r['patches']:,} | {r['gflop']:,.1f} | {_auto(r['fp32_ms'])} | "
                     f"{_auto(r['bf16_ms'])} | **{r['speedup']:.2f}x**{_noisy(r['fp32_ms'], r['bf16_ms'])} | "
                     f"{r['cos_mean']:.6f} | {r['cos_min']:.6f} | "
                     f"{_f(r['fp32_gflops'], 0)} ({r['fp32_of_matmul']:.0%}) | "
                     f"{_f(r['bf16_gflops'], 0)} ({r['bf16_of_matmul']:.0%}) |")
    lines.append("")
    if any(_noisy(r["fp32_ms"], r["bf16_ms"]) for r in result["dtype"]):
        lines += [NOISY_NOTE, ""]
    for label in dict.fromkeys(r["label"] for r in result["dtype"]):
        rows = [r for r in result["dtype"] if r["label"] == label]
        lines.append(f"- {label}: " + "; ".join(
            f"{r['size']} bf16 {r['speedup']:.2f}x{_noisy(r['fp32_ms'], r['bf16_ms'])} the speed of fp32 at per-token "
            f"cosine {r['cos_mean']:.6f} (min {r['cos_min']:.6f}); the forward runs at {r['fp32_of_matmul']:.0%} of "
            f"fp32 matmul's FLOP/s in fp32 and {r['bf16_of_matmul']:.0%} of bf16 matmul's in bf16" for r in rows) + ".")
    clean = [r for r in result["dtype"] if not _noisy(r["fp32_ms"], r["bf16_ms"])]
    wide = [r["speedup"] for r in clean if r["label"] != "tiny"]
    tiny = [r["speedup"] for r in clean if r["label"] == "tiny"]
    if wide and min(wide) > 1.3:
        lines.append(f"- bf16 pays on the 1152-wide tower ({_span(wide)}): its qkv, MLP and "
                     "projector are large matmuls, which native bf16 (AVX-512 BF16 / AMX) runs several times faster "
                     "than fp32 (the matmul figures above).")
    if tiny and max(tiny) < 1.3:
        lines.append(f"- On tiny (32 wide) bf16 gains little or loses ({_span(tiny)}): its forward "
                     "is attention at head dim 16 and per-op work, not large matmuls. The CPU default (bf16) pays on "
                     "the real towers, not on tiny.")
    return lines


def _plot_breakdown(result: dict, plots: Path) -> str | None:
    plt = stats.pyplot()
    if plt is None:
        return None
    rows = [r for r in result["breakdown"] if r["label"] == "tiny" or r["layers"] > 2]
    if not rows:
        return None
    names = [f"{_row_name(r)}\n{r['size']}" for r in rows]
    colors = ["#8c8c8c", "#b07aa1", "#59a14f", "#edc948", "#4e79a7", "#f28e2b", "#e15759"]
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.7 * len(rows)))
    left = [0.0] * len(rows)
    for stage, color in zip(STAGES, colors, strict=True):
        share = [r["stages"][stage]["median"] / r["stages"]["total"]["median"] * 100 for r in rows]
        ax.barh(range(len(rows)), share, left=left, color=color, label=STAGE_LABELS[stage])
        left = [a + b for a, b in zip(left, share, strict=True)]
    for i, r in enumerate(rows):
        ax.text(101, i, f"{r['stages']['total']['median']:,.0f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 115)
    ax.set_xlabel("share of the image's time, % (median total at the right)")
    ax.set_title("Where the time goes per image (CPU)")
    ax.legend(fontsize=7, ncol=7, loc="upper center", bbox_to_anchor=(0.5, -0.3 if len(rows) < 4 else -0.18))
    return stats.save_png(fig, plots, "encoder-breakdown.png")


def _plot_before_after(result: dict, plots: Path) -> str | None:
    plt = stats.pyplot()
    if plt is None or not result["before_after"]:
        return None
    rows = result["before_after"]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for k, (key, label, color) in enumerate((("before", "before", "#e15759"), ("after_fp32", "after fp32", "#4e79a7"),
                                             ("after_bf16", "after bf16", "#59a14f"))):
        med = [r[key]["total"]["median"] for r in rows]
        err = [[m - r[key]["total"]["min"] for m, r in zip(med, rows, strict=True)],
               [r[key]["total"]["max"] - m for m, r in zip(med, rows, strict=True)]]
        ax.bar(x + (k - 1) * 0.27, med, 0.27, yerr=err, color=color, label=label)
    ax.set_xticks(x, [f"{r['label']}\n{r['size']}" for r in rows], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms per image (log)")
    ax.set_title("Encoder end to end, before vs after (same weights, CPU)")
    ax.legend(fontsize=8)
    return stats.save_png(fig, plots, "encoder-before-after.png")
