"""BENCHMARKS.md's section for bench/frontend.py: its figures (the JSON it writes) as markdown and plots."""

from __future__ import annotations

from pathlib import Path

from bench import stats


def _n(v) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _over(x, y) -> str:
    return f"1/{y / x:,.0f}" if x and y and y / x >= 100 else f"1/{y / x:.1f}" if x and y else ""


def _rat(x, y) -> str:
    return f"{x / y:.2f}" if x and y else ""


def section(result: dict, plots: Path) -> str:
    h, b = result["handle"], result["body"]
    hc, bc = h["ttft_cold_ms"], b["ttft_cold_ms"]
    lines = [*_table(result), *_notes(_rat(hc and hc["median"], bc and bc["median"]))]
    failed = [m for m in (h, b) if m.get("failed_example")]
    for m in failed:
        lines.append(f"- A failed stream in `{m['transport']}` mode ended with: `{m['failed_example'][:200]}`")
    return "\n".join(lines) + "\n"


def _table(result: dict) -> list[str]:
    """The two transports side by side: request-plane bytes, TTFT, the frontend's RSS under load."""
    h, b = result["handle"], result["body"]
    cfg = result.get("config", {"streams": 50, "tokens": 200, "repeats": "?"})
    n, over, rat = _n, _over, _rat
    hb, bb = h["request_plane_bytes_per_4k_request"], b["request_plane_bytes_per_4k_request"]
    hr, br, hc, bc = h["ttft_repeated_ms"], b["ttft_repeated_ms"], h["ttft_cold_ms"], b["ttft_cold_ms"]
    hl, bl = h["ttft_under_load_median_s"], b["ttft_under_load_median_s"]
    return [
        "## Embeddings by handle vs through the frontend (`python -m bench.frontend`)",
        "",
        "Both stacks were up at once on loopback on one generated `wide` Kimi-K2.5 checkpoint (tiny MoonViT, "
        "7168-wide projector, a one-layer 7168-wide DeepseekV3), each with its own encode worker, nginx cluster "
        "tier, engine (the checkpoint's language model through transformers) and frontend. They differ only in "
        "`--media-transport`:",
        "- `handle`: the frontend asks for headers only, and the engine fetches the body through the tier "
        "(`/v1/encode/fetch`).",
        "- `body`: the frontend POSTs, receives the body and sends it to the engine, as before handles.",
        "",
        "A 3840x2160 image is 4,214 tokens x 7168 bf16 (~36.5 MB on the wire). Single requests alternate between "
        "the stacks (handle, body, handle, ...), so the machine's noise falls on both. The load test "
        f"({cfg['streams']} concurrent streams of {cfg['tokens']} tokens, `ignore_eos`, all about one 4K image) runs "
        "on one stack at a time; the frontend's RSS is sampled every 100 ms. Single-request figures are median "
        f"(min-max) of {cfg['repeats']}.",
        "",
        "| | handle | body | handle / body |",
        "|---|---:|---:|---:|",
        f"| request-plane bytes per 4K request, http(s) image URL | {n(hb['http_url'])} | {n(bb['http_url'])} | "
        f"{over(hb['http_url'], bb['http_url'])} |",
        f"| the same, image as a data: URL (1.1 MB JPEG) | {n(hb['data_url'])} | {n(bb['data_url'])} | "
        f"{over(hb['data_url'], bb['data_url'])} |",
        f"| TTFT, repeated 4K image (ms) | {stats.fmt(hr, 0)} | {stats.fmt(br, 0)} | "
        f"{rat(hr and hr['median'], br and br['median'])} |",
        f"| TTFT, cold 4K image, a new one each time (ms) | {stats.fmt(hc, 0)} | {stats.fmt(bc, 0)} | "
        f"{rat(hc and hc['median'], bc and bc['median'])} |",
        f"| frontend RSS before the burst (MB) | {n(h['rss_baseline_mb'])} | {n(b['rss_baseline_mb'])} | |",
        f"| frontend RSS peak over {cfg['streams']} streams (MB) | {n(h['rss_peak_mb'])} | {n(b['rss_peak_mb'])} | "
        f"{rat(h['rss_peak_mb'], b['rss_peak_mb'])} |",
        f"| streams completed (of {cfg['streams']}) | {h['streams_completed']} | {b['streams_completed']} | |",
        f"| TTFT under that load, median (s) | {stats.fmt(hl)} | {stats.fmt(bl)} | {rat(hl, bl)} |",
        f"| embedding bytes received by the frontend | {n(h['encoder_body_bytes'])} | {n(b['encoder_body_bytes'])} "
        "| |",
        "",
    ]


def _notes(cold_ratio: str) -> list[str]:
    return [
        "- Bytes are the engine's own `dynamo_component_request_bytes_total`. A handle request is token ids (4,214 "
        "placeholders) plus a ~0.5 KB handle. A data: URL rides inside the handle's source, so an engine can "
        "re-encode the image if every cache has evicted it. That makes such a request as large as the image the "
        "client sent, not the embeddings.",
        "- The `handle` frontend ran with Dynamo's default `DYN_TCP_MAX_MESSAGE_SIZE`. The `body` frontend needs it "
        "raised (256 MiB here).",
        "- Cold images: each path moves the 36.5 MB body twice after the encode (worker to tier, then tier to "
        "engine; or tier to frontend, then frontend to engine), so neither should be much faster; this run: "
        f"handle / body = {cold_ratio or '-'}. The engine's fetch skips nginx's "
        "cache lock (which polls every 500 ms) and asks the next level (docs/cache-tiers.md).",
        "- The load test's TTFT is one engine taking the prefills of 4,214 tokens in turn; `--max-inflight-media 8` "
        "(the default) lets 8 at a time past encoding in both modes.",
        "- The RSS peak in `body` mode is those 8 requests' bodies in flight (8 x 36.5 MB, plus the aiohttp and "
        "msgpack copies). In `handle` mode what is above baseline is the streams' request state and the "
        "detokenizers; no embeddings.",
    ]

