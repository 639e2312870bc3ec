"""BENCHMARKS.md's section for bench/engine.py: its figures (the JSON it writes) as markdown and plots."""

from __future__ import annotations

from pathlib import Path

from bench import stats
from bench.engine import DTYPES


def _label(row: dict) -> str:
    return "image" if row["prompt"] == "image" else "text"


def section(result: dict, plots: Path) -> str:
    cfg = result["config"]
    lines = [
        "## The engine: prefill, decode and prefix reuse (`python -m bench.engine`)",
        "",
        "The engine in this process, without Dynamo: the generated Kimi-K2.5 checkpoints with random weights "
        f"({', '.join(f'`{p}`' for p in result['presets'])}; sizes below), their language model "
        "(transformers' DeepseekV3: MLA attention, MoE) loaded by `LanguageModel.load` on the CPU in fp32 and "
        "bf16 and run by the package's `Engine` as the engine worker runs it (prefix store, greedy sampler, "
        "engine thread). Text prompts: the chat template around filler text, cut to the token count; the image "
        "prompt: a question and one 1280x720 JPEG whose rows (from the checkpoint's own vision tower, encoded "
        "beforehand) are written over its placeholders. Prefill ms = TTFT at the engine (an empty prefix store, "
        f"prefill and the first greedy token); decode tokens/s = the {cfg['decode_tokens']} tokens after the "
        "first. Again = the same prompt right after: the prefix store supplies its full "
        f"{cfg['block_size']}-token blocks (never the last token), the rest is prefilled. fp32 and bf16 and all "
        "prompts alternate repeat by repeat; median (min-max) over up to "
        f"{cfg['repeats']} repeats (fewer where the time budget ran out: the `n` column).",
        "",
        "| preset | dtype | prompt | tokens | n | prefill ms (TTFT) | decode tok/s | reused tokens | "
        "prefill again ms | cold / again |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for preset, pr in result["presets"].items():
        order = {p: i for i, p in enumerate(str(x) for x in cfg["prompts"])}
        rows = sorted(pr["rows"], key=lambda r: (order.get(r["prompt"], 99), list(DTYPES).index(r["dtype"])))
        for r in rows:
            ms = r["prefill_ms"]
            lines.append(
                f"| {preset} | {r['dtype']} | {_label(r)} | {r['prompt_tokens']:,} | {ms['n']} | "
                f"{stats.fmt(ms, 0 if ms['median'] >= 100 else 1)} | {stats.fmt(r['decode_tok_s'])} | "
                f"{r['reused_tokens']:,} | {stats.fmt(r['again_ms'], 0 if r['again_ms']['median'] >= 100 else 1)} | "
                f"{r['cold_over_again']:.1f}x |")
    lines.append("")
    for pr in result["presets"].values():
        by = {(r["prompt"], r["dtype"]): r for r in pr["rows"]}
        m = pr["model"]
        facts = (f"- `{pr['checkpoint']}`: language model {m['language_model_params'] / 1e6:.1f} M parameters "
                 f"({m['layers']} layers x {m['hidden']}, {m['experts']} experts, {m['experts_per_token']} per "
                 f"token, attention `{m['attention']}`); written in {pr['write_s']:.1f} s, loaded in "
                 f"{pr['load_s']['fp32']:.1f} s (fp32) / {pr['load_s']['bf16']:.1f} s (bf16).")
        ratios = [f"{p} tokens {stats.ratio(by[(p, 'fp32')]['prefill_ms'], by[(p, 'bf16')]['prefill_ms']):.2f}x"
                  for p in (str(x) for x in cfg["prompts"]) if (p, "fp32") in by and (p, "bf16") in by and p != "image"]
        if ratios:
            facts += " fp32 / bf16 prefill: " + ", ".join(ratios) + "."
        if pr.get("image"):
            im = pr["image"]
            facts += (f" The image: {im['rows']:,} rows (its encode, not counted here: "
                      f"{im['encode_ms_fp32_cpu']:,.0f} ms fp32 on the CPU).")
        lines.append(facts)
    lines.append(f"- On the CPU ({result['config']['threads']} torch threads); the spread (min-max) says how much "
                 "to trust a median on a shared machine. The same language model on a GPU: `bash bench/gpu.sh` "
                 "(its engine section).")
    png = _plot(result, plots)
    if png:
        lines += ["", f"![engine prefill and decode]({png})"]
    return "\n".join(lines) + "\n"


def _plot(result: dict, plots: Path) -> str | None:
    plt = stats.pyplot()
    if plt is None:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    colors = {"tiny": "#4c72b0", "small": "#c44e52"}
    for preset, pr in result["presets"].items():
        for dtype, style in (("fp32", "-o"), ("bf16", "--^")):
            rows = sorted((r for r in pr["rows"] if r["dtype"] == dtype and r["prompt"] != "image"),
                          key=lambda r: r["prompt_tokens"])
            if not rows:
                continue
            xs = [r["prompt_tokens"] for r in rows]
            label = f"{preset} {dtype}"
            a1.plot(xs, [r["prefill_ms"]["median"] for r in rows], style, color=colors.get(preset), label=label)
            a2.plot(xs, [r["decode_tok_s"]["median"] for r in rows], style, color=colors.get(preset), label=label)
    for ax, ylabel, title in ((a1, "prefill ms (TTFT), log", "Prefill (cold)"),
                              (a2, "decode tokens/s, log", f"Decode ({result['config']['decode_tokens']} tokens)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return stats.save_png(fig, plots, "engine-prefill-decode.png")
