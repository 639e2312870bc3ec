"""results.md for bench/gpu.py: the run's results.json as markdown."""

from __future__ import annotations

from bench import stats
from bench.gpu_tools import (
    PARITY_GATE,
)


def render_md(r: dict) -> str:
    m, c = r["machine"], r["config"]
    lines = [f"# GPU benchmark ({r['mode']}), {r['started']}", ""]
    if r["mode"] != "gpu":
        lines += ["**cpu-logic mode: a tiny tower and small images on the CPU, to exercise the code. "
                  "Not a measurement.**", ""]
    gpu = (f"{m['gpu']} ({m['gpu_memory_gib']} GiB, capability {m['capability']}, {m['sms']} SMs)" if "gpu" in m
           else "no GPU")
    lines += [
        f"Machine: {gpu}, CPU {m.get('cpu')} x{m.get('cores')}; torch {m.get('torch')} "
        f"(CUDA {m.get('torch_cuda')}), Python {m.get('python')}. Run took {r['elapsed_s']} s.",
        f"Model: {c.get('model')} ({c.get('layers')} layers x {c.get('hidden')}, head_dim {c.get('head_dim')}, "
        f"-> {c.get('out_dim')}), {c.get('params', 0) / 1e6:.1f} M params, {c.get('weights')}, seed {c.get('seed')}. "
        "Figures are medians (min-max) over the repeats each stage's time budget allowed.", ""]
    for part in (_parity, _forward, _syncs, _attention, _copy, _before_after, _engine, _checks, _errors):
        lines += part(r)
    lines += ["Stage times (s): " + ", ".join(f"{k} {v}" for k, v in r["stage_s"].items()) + ".", ""]
    return "\n".join(lines)


def _parity(r: dict) -> list[str]:
    if not r["parity"]:
        return []
    lines: list[str] = []
    lines += ["## Parity: bf16 fast vs fp32 reference (harness/reference.py), same weights and pixels", "",
              "| image | tokens | cos mean | cos min | rel L2 | max abs | reference bf16: cos mean / min | "
              f"gate (mean >= {PARITY_GATE}) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for p in r["parity"].values():
        rb = p["reference_bf16"]
        lines.append(f"| {p['image']} | {p['tokens']} | {p['cos_mean']:.6f} | {p['cos_min']:.6f} | "
                     f"{p['rel_l2']:.2e} | {p['max_abs']:.3g} | {rb['cos_mean']:.6f} / {rb['cos_min']:.6f} | "
                     f"{'met' if p['met'] else 'MISSED'} |")
    lines.append("")
    return lines


def _forward(r: dict) -> list[str]:
    if not r["forward"]:
        return []
    f = stats.fmt
    lines: list[str] = []
    timer = next(iter(r["forward"].values()))["timer"]
    lines += [f"## Forward time, ms ({timer})", "",
              "| image | patches | fast bf16 | reference bf16 | reference fp32 | ref bf16 / fast "
              "| ref fp32 / fast |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for x in r["forward"].values():
        lines.append(f"| {x['image']} | {x['patches']} | {f(x['fast_bf16_ms'])} | {f(x['reference_bf16_ms'])} | "
                     f"{f(x['reference_fp32_ms'])} | {x['bf16_reference_over_fast']:.1f}x | "
                     f"{x['fp32_reference_over_fast']:.1f}x |")
    lines.append("")
    return lines


def _syncs(r: dict) -> list[str]:
    if not r["syncs"]:
        return []
    lines: list[str] = []
    s = r["syncs"]
    ff, ef = s["fast_forward"], s["encoder_forward"]
    prof = s["profiler"]
    lines += ["## Device syncs in the fast forward (target 0)", "", f"Method: {s['method']}.", "",
              f"- fast forward ({s['image']}): **{ff['syncs']}** synchronising calls"
              + (": " + ", ".join(f"`{k}` x{v}" for k, v in ff["sites"].items()) if ff["sites"] else ""),
              f"- Encoder.forward (with its copy and final wait): {ef['syncs']}"
              + (": " + ", ".join(f"`{k}` x{v}" for k, v in ef["sites"].items()) if ef["sites"] else ""),
              "- profiler cross-check: " + (f"error {prof['error']}" if "error" in prof else
                                            f"{prof['sync_calls_total']} synchronising runtime calls "
                                            f"{prof['sync_calls']}, {prof['dtoh_copies']} device-to-host copies, "
                                            f"memcpys {prof['memcpy']}"), ""]
    return lines


def _attention(r: dict) -> list[str]:
    if not r["attention"]:
        return []
    f = stats.fmt
    lines: list[str] = []
    a = r["attention"]
    lines += ["## Attention: varlen vs per-item SDPA", "",
              f"{a['items']} items packed in one batch ({a['tokens']} tokens, longest {a['max_seqlen']}). "
              f"varlen path taken: **{'yes' if a['varlen_taken'] else 'NO'}** ({a['varlen_calls']} varlen calls "
              f"for {a['expected_varlen_calls']} layers, {a['sdpa_calls']} SDPA calls; varlen available: "
              f"{a['varlen_available']}" + (f"; it failed: {a['varlen_error']}" if a["varlen_error"] else "")
              + ").", "",
              "| what | default path (ms) | per-item SDPA (ms) | SDPA / default |", "|---|---:|---:|---:|",
              f"| attention op, one layer | {f(a['op_default_ms'], 3)} | {f(a['op_per_item_sdpa_ms'], 3)} | "
              f"{a['op_sdpa_over_default']:.2f}x |",
              f"| whole forward | {f(a['forward_default_ms'])} | {f(a['forward_per_item_sdpa_ms'])} | "
              f"{a['forward_sdpa_over_default']:.2f}x |", "",
              f"Outputs agree: min cosine {a['default_vs_sdpa']['cos_min']:.6f}, max abs "
              f"{a['default_vs_sdpa']['max_abs']:.3g}.", ""]
    return lines


def _copy(r: dict) -> list[str]:
    if not r["copy"]:
        return []
    f = stats.fmt
    lines: list[str] = []
    x = r["copy"]
    lines += ["## Output copy: pinned buffer + side stream vs plain .cpu()", "",
              f"4K output {x['shape']} {x['dtype']} ({x['bytes'] / 1e6:.1f} MB), pinned: {x['pinned']}.", "",
              "| what | ms | GB/s |", "|---|---:|---:|",
              f"| plain `.cpu()` | {f(x['plain_cpu_ms'], 2)} | {x['plain_gb_s']:.1f} |",
              "| EncodeSteps._to_host (pinned, non_blocking, side stream, event wait) "
              f"| {f(x['pinned_side_stream_ms'], 2)} | {x['pinned_gb_s']:.1f} |",
              "| two 4K items: forward + `.cpu()` each, one after the other "
              f"| {f(x['two_items_sequential_ms'])} | |",
              f"| two 4K items: Encoder.forward ({x['batches_per_forward']} batches, the copy overlaps the next "
              f"forward) | {f(x['two_items_encoder_forward_ms'])} | |", ""]
    return lines


def _before_after(r: dict) -> list[str]:
    if not r["before_after"]:
        return []
    f = stats.fmt
    where = "GPU" if r["mode"] == "gpu" else "CPU"
    lines: list[str] = []
    ba = r["before_after"]
    keys = ba["stages"]
    ref = ba["reference_stack"]
    lines += [f"## Before vs after, one {ba['image']} ({ba['tokens']} tokens), ms", "",
              "Stages are wall time on one thread, with the device synchronised between them; total = their "
              "sum.", "",
              f"- before: {ba['before_what']}.", f"- before fp32: {ba['before_fp32_what']}.",
              f"- after: {ba['after_what']}.", "",
              "| row | " + " | ".join(keys) + " | total | before / after | body MB |",
              "|---|" + "---:|" * (len(keys) + 3)]
    for name in ("before", "before_fp32", "after"):
        row = ba[name]
        speed = f"{row['total']['median'] / ba['after']['total']['median']:.2f}x" if name != "after" else ""
        lines.append(f"| {name} ({where}) | " + " | ".join(f(row[k], spread=False) for k in keys)
                     + f" | {f(row['total'])} | {speed} | {row['body_bytes'] / 1e6:.1f} |")
    lines += ["| reference stack (GPU) | " + " | ".join("" for _ in keys)
              + f" | {ref['before_ms']} -> {ref['after_ms']} | {ref['speedup']:.1f}x | |", ""]
    return lines


def _engine(r: dict) -> list[str]:
    if not r.get("engine", {}).get("presets"):
        return []
    f = stats.fmt
    where = "GPU" if r["mode"] == "gpu" else "CPU"
    lines: list[str] = []
    e = r["engine"]
    lines += [f"## Engine: the language model on the {where} (generated Kimi-K2.5, random weights)", "",
              f"`LanguageModel.load` of each preset's checkpoint, the engine's own calls (prefill, then one step "
              f"per token with the KV cache); prefill ms and decode tokens/s over {e['decode_tokens']} greedy "
              f"steps, {e['timer']}; transformers {e['transformers']}.", "",
              "| preset | dtype | prompt tokens | prefill ms | decode tok/s |", "|---|---|---:|---:|---:|"]
    for preset, p in e["presets"].items():
        for row in p["rows"]:
            lines.append(f"| {preset} | {row['dtype']} | {row['prompt_tokens']:,} | {f(row['prefill_ms'])} | "
                         f"{f(row['decode_tok_s'])} |")
    lines.append("")
    for preset, p in e["presets"].items():
        g = p.get("greedy")
        if g is None:
            continue
        lines.append(f"- {preset} ({p.get('params', 0) / 1e6:.1f} M parameters), greedy tokens for one "
                     f"{g['prompt_tokens']}-token prompt, {where} fp32 vs CPU fp32: "
                     + (f"**equal** over {g['tokens']} tokens (smallest CPU top-2 margin "
                        f"{g['min_cpu_margin']:.3g})." if g["equal"] else
                        f"**differ from step {g['first_divergence']}** of {g['tokens']} (CPU top-2 margin "
                        f"there {g['cpu_margin']:.3g}; CPU {g['cpu_tokens']}, device {g['device_tokens']})."))
    lines.append("")
    return lines


def _checks(r: dict) -> list[str]:
    if not r["checks"]:
        return []
    lines: list[str] = []
    lines += ["## Checks", "", "| check | result | value | target |", "|---|---|---|---|"]
    for k, v in r["checks"].items():
        val = v["value"]
        val = f"{val:.6g}" if isinstance(val, float) else val
        res = ("ok" if v["ok"] else "NOT MET") + (" (cpu-logic)" if "note" in v else "")
        lines.append(f"| {k} | {res} | {val} | {v['target']} |")
    lines.append("")
    return lines


def _errors(r: dict) -> list[str]:
    if not r["errors"]:
        return []
    lines: list[str] = []
    lines += ["## Errors", ""] + [f"- {k}: {v}" for k, v in r["errors"].items()] + [""]
    return lines
