"""BENCHMARKS.md's section for bench/graphs.py: its figures (the JSON it writes) as markdown and plots."""

from __future__ import annotations

from pathlib import Path

from bench import stats
from bench.graphs import encodes_per_unique, model_name


def _ms(v: dict | None) -> str:
    return "-" if v is None else stats.fmt(v, 1 if v["median"] < 100 else 0)


def section(result: dict, plots: Path) -> str:
    cfg = result["config"]
    head = "## EPD vs the aggregated baseline (`python -m bench.graphs`)"
    if "presets" not in result:  # a graphs.json from before the graphs served a real model
        return (f"{head}\n\n_The stored figures are from before the graphs served a Kimi-K2.5 checkpoint; rerun "
                "`python -m bench.report --only graphs`._\n")
    runs = result["presets"]
    lines = [
        head,
        "",
        "Each graph alone under `mm-encoder serve GRAPH --dtype fp32`, serving a generated Kimi-K2.5 checkpoint "
        "with random weights (preset `tiny`: vision 64 wide x 2 layers, text model 256 wide x 2 layers with MoE; "
        "`small`: vision 384 x 4, text 768 x 6 with 8 experts), written by serve into its run directory and "
        "served as `kimi-k2.5-<preset>`. EPD: the encode worker runs the checkpoint's vision tower, behind the "
        "cluster tier, the router and 2 shards; 2 engines run its language model (transformers' DeepseekV3) on the "
        "spliced rows; a frontend. agg: 1 engine that runs the whole transformers model, its own vision tower on "
        "the pixels, in the loop that generates tokens; a frontend. Chat requests with a 1280x720 JPEG (1,196 "
        "image tokens) or text only, 8 streamed tokens each; TTFT is the time to the first chunk. The mixed "
        "workload is open loop: Poisson arrivals at each offered rate for "
        f"{cfg['duration_s']:.0f} s (seed {cfg['seed']}), half text-only, half with an image drawn from a pool of "
        f"{cfg['pool']} with a Zipf distribution (s={cfg['zipf_s']}), a fresh pool per rate; the same schedule for "
        "both graphs and both presets. Encodes per unique image: EPD counts the encode worker's forwards "
        "(`dynamo_component_encode_forward_items_total`); agg counts the media items its engine encoded "
        "(it has no cache and encodes every media item it is sent: the frontend's `media_items`). Each preset's "
        "two graphs in one run, one after the other; all processes share the machine's cores. Single-request "
        "rows: median (min-max) over requests, one at a time.",
        "",
        "| preset | graph | startup s | cold image ms | repeated image ms | text TTFT idle ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for preset, pr in runs.items():
        for name, r in pr["graphs"].items():
            lines.append(f"| {preset} | {name} | {r['startup_s']:.0f} | {stats.fmt(r['cold_ms'], 0)} | "
                         f"{stats.fmt(r['repeat_ms'], 0)} | {stats.fmt(r['text_idle_ttft_ms'], 1)} |")
    lines += [
        "",
        "| preset | offered req/s | graph | text TTFT p50 ms | text p99 | image TTFT p50 ms | image p99 | "
        "text ok/sent | image ok/sent | unique images | encodes per unique image |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for preset, pr in runs.items():
        for i, rate in enumerate(cfg["rates"]):
            for name, r in pr["graphs"].items():
                lv = r["levels"][i]
                t, im = lv["text"], lv["image"]
                e = encodes_per_unique(name, lv)
                lines.append(f"| {preset} | {rate:g} | {name} | {_ms(t['ttft_p50_ms'])} | {_ms(t['ttft_p99_ms'])} | "
                             f"{_ms(im['ttft_p50_ms'])} | {_ms(im['ttft_p99_ms'])} | {t['ok']}/{t['sent']} | "
                             f"{im['ok']}/{im['sent']} | {lv['unique_images']} | {'-' if e is None else f'{e:.2f}'} |")
    lines += [""]
    for preset, pr in runs.items():
        lines += _findings(preset, pr["graphs"], cfg["rates"])
    png = _plot(result, plots)
    if png:
        lines += ["", f"![text TTFT under image load]({png})"]
    return "\n".join(lines) + "\n"


def _findings(preset: str, g: dict, rates: list[float]) -> list[str]:
    if "epd" not in g or "agg" not in g:
        return []
    out = []
    top = len(rates) - 1
    e, a = g["epd"]["levels"][top]["text"], g["agg"]["levels"][top]["text"]
    ee = [x for x in (encodes_per_unique("epd", lv) for lv in g["epd"]["levels"]) if x is not None]
    ae = [x for x in (encodes_per_unique("agg", lv) for lv in g["agg"]["levels"]) if x is not None]
    if e["ttft_p50_ms"] and a["ttft_p50_ms"]:
        out.append(
            f"- {preset}: text latency while images are encoded, at {rates[top]:g} req/s: text TTFT p50 "
            f"{_ms(e['ttft_p50_ms'])} ms in EPD vs {_ms(a['ttft_p50_ms'])} ms in agg "
            f"({stats.ratio(a['ttft_p50_ms'], e['ttft_p50_ms']):.1f}x), p99 {_ms(e['ttft_p99_ms'])} vs "
            f"{_ms(a['ttft_p99_ms'])} ms. In the aggregated engine every image encode runs in the loop that "
            "generates tokens, so a text request waits behind it.")
    if ee and ae:
        out.append(
            f"- {preset}: encodes per unique image: EPD {min(ee):.2f}-{max(ee):.2f} (roughly once: repeats are "
            f"cluster-tier hits and identical concurrent misses coalesce), agg {min(ae):.2f}-{max(ae):.2f} (every "
            "repeat is encoded again).")
    ec, ac = g["epd"]["cold_ms"], g["agg"]["cold_ms"]
    er, ar = g["epd"]["repeat_ms"], g["agg"]["repeat_ms"]
    out.append(f"- {preset}: a single cold image: EPD {stats.fmt(ec, 0)} ms, agg {stats.fmt(ac, 0)} ms; repeated: "
               f"EPD {stats.fmt(er, 0)} ms (a cluster-tier hit, then prefill), agg {stats.fmt(ar, 0)} ms (encoded "
               "again).")
    if ec["median"] > ac["median"]:
        out.append(f"- {preset}: the cold image is faster in agg on this machine: EPD adds hops (frontend -> tier -> "
                   "router -> shard -> worker and back, plus the RPC to the engine) and every process shares the "
                   "same cores with the encoder. On the intended hardware the encoder runs on its own GPU(s).")
    return out


def _plot(result: dict, plots: Path) -> str | None:
    plt = stats.pyplot()
    if plt is None:
        return None
    rates = result["config"]["rates"]
    runs = result["presets"]
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4), squeeze=False)
    for ax, (preset, pr) in zip(axes[0], runs.items(), strict=True):
        for name, color in (("epd", "#4c72b0"), ("agg", "#c44e52")):
            if name not in pr["graphs"]:
                continue
            lv = pr["graphs"][name]["levels"]
            for key, style in (("ttft_p50_ms", "-o"), ("ttft_p99_ms", "--^")):
                ys = [x["text"][key] for x in lv]
                ax.plot(rates, [float("nan") if y is None else y["median"] for y in ys], style, color=color,
                        label=f"{name} text TTFT {key.split('_')[1]}")
        ax.set_yscale("log")
        ax.set_xlabel("offered load, req/s (half with an image)")
        ax.set_ylabel("text TTFT, ms (log)")
        ax.set_title(f"Text TTFT under image load: EPD vs agg ({model_name(preset)})")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return stats.save_png(fig, plots, "graphs-text-ttft.png")
