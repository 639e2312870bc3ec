"""BENCHMARKS.md's section for bench/frontends.py: its figures (the JSON it writes) as markdown and plots."""

from __future__ import annotations

from pathlib import Path

from bench import stats
from bench.frontends import CONCURRENCY, SETUPS


def _f(v: dict | float | None, digits: int = 2, spread: bool = True) -> str:
    return stats.fmt(v, digits, spread)


def _r(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b and b > 0 else None


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} µs"


def _eos(ours: dict, stock: dict) -> str:
    """What the start-up check found about `ignore_eos` (top level, under nvext, absent)."""
    def got(r: dict) -> str:
        return f"{r['completion_tokens']} tokens" if r["status"] == 200 else f"HTTP {r['status']}"

    text = (f"top-level `ignore_eos`: {got(ours['top_level'])} in `ours`, {got(stock['top_level'])} in `stock`; "
            f"`nvext.ignore_eos`: {got(ours['nvext'])} in `ours`, {got(stock['nvext'])} in `stock`")
    if ours["nvext"]["status"] != 200:
        text += (" (Dynamo's HTTP layer refuses the field before any chat processor runs, so our "
                 "`SamplingParams.from_openai` never sees `nvext.ignore_eos`)")
    return text + (f"; without it: {got(ours['without'])} in `ours`, {got(stock['without'])} in `stock` "
                   "(random weights rarely pick eos).")


def _chunks(setup: dict) -> str:
    c = setup.get("chunks_per_response")
    return "-" if c is None else f"{c['median']:.1f}"


def _findings(result: dict) -> list[str]:
    """What this run's figures say, computed from them."""
    cells, out = result["cells"], []
    for other in ("stock", "stock-kv"):
        r = [c["ratios"][other]["frontend_cpu"] for c in cells.values() if c["ratios"][other]["frontend_cpu"]]
        t = [c["ratios"][other]["rps"] for c in cells.values() if c["ratios"][other]["rps"]]
        if r and t:
            out.append(f"- Finding: ours / {other}, frontend CPU per request: {min(r):.2f}-{max(r):.2f} over the "
                       f"{len(r)} cells; req/s: {min(t):.2f}-{max(t):.2f}.")
    x = [c["setups"]["ours"]["cpu_ms_per_request"] for c in cells.values()]
    x = [e["median"] / f["median"] for e, f in ((y["engines"], y["frontend"]) for y in x) if e and f]
    if x:
        out.append(f"- The engines' CPU per request is {min(x):.0f}-{max(x):.0f}x the frontend's (ours): on this "
                   "machine the engines bound throughput, so req/s differences are mostly routing and noise.")
    no_text = result.get("first_chunk_without_text", {})
    empty, n = no_text.get("ours"), result["config"]["ttft_n"]
    total = n * result["config"]["rounds"]
    ttft, first = result["ttft_ms"], result.get("first_chunk_ms", {})
    if empty and ttft.get("ours") and first.get("ours"):
        out.append(f"- Finding: TTFT. In {empty} of {total} single requests ours' first chunk carried no text (the "
                   "role with empty text: here the first token is part of a UTF-8 character), so the first text "
                   "came with the engine's next item (the engines send their first two items unheld, "
                   "engines/stream.py); to the first chunk of "
                   f"any kind ours took {first['ours']['median']:.1f} ms, stock "
                   f"{first['stock']['median']:.1f} ms (stock's first chunk, the role alone, had no text in "
                   f"{no_text.get('stock', '-')} of {total}; its tokens come one per item, so its first text follows "
                   "at once).")
    img = cells.get("image-16", {}).get("setups")
    if img and all(img[x]["cpu_ms_per_request"]["rest"] for x in SETUPS):
        rest = {x: img[x]["cpu_ms_per_request"]["rest"]["median"] for x in SETUPS}
        out.append(f"- Finding: image cache hits cost the rest of the graph (encode worker, tiers) "
                   f"{rest['ours']:.1f} ms per request with ours vs {rest['stock']:.1f} (stock) and "
                   f"{rest['stock-kv']:.1f} (stock-kv): the stock frontend calls the encode worker for every "
                   "request with media (graphs/epd-stock.yaml); ours looks the image up through the cache tiers.")
    return out


def section(result: dict, plots: Path) -> str:
    lines = [*_cpu_table(result), *_latency_table(result), *_method(result), *_findings(result),
             *_failures(result)]
    return "\n".join(lines) + "\n"


def _cpu_table(result: dict) -> list[str]:
    """The frontends' CPU per request and req/s per cell, TTFT and CPU per token."""
    cfg, cells = result["config"], result["cells"]
    head = "## Our frontend vs Dynamo's stock frontend (`python -m bench.frontends`)"
    lines = [
        head,
        "",
        "Three whole graphs under `mm-encoder serve GRAPH --checkpoint DIR --dtype fp32`, all up at once on "
        f"loopback, on one generated tiny Kimi-K2.5 checkpoint (`{result['model']}`), each with the same encode "
        "worker, cache tiers (cluster, router, 2 shards) and 2 transformers engines; only the frontend differs. "
        "`ours`: graphs/epd.yaml, our chat processor inside Dynamo's HTTP frontend (`python -m mm_encoder.frontend`, "
        "which routes by KV overlap). `stock`: graphs/epd-stock.yaml, Dynamo's `python -m dynamo.frontend` in its "
        "default router mode (round-robin). `stock-kv`: the same with `--router-mode kv`. Frontend CPU is the "
        "frontend process group's CPU time over the measured window divided by the requests completed in it "
        f"(median (min-max) over {cfg['rounds']} round(s)); ratios are median over median.",
        "",
        "| cell | frontend CPU ms/req: ours | stock | stock-kv | ours / stock | ours / stock-kv | req/s: ours | "
        "stock | stock-kv | ours / stock | ours / stock-kv |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells.values():
        s, r = c["setups"], c["ratios"]
        cpu = [_f(s[n]["cpu_ms_per_request"]["frontend"]) for n in SETUPS]
        rps = [_f(s[n]["rps"], 1) for n in SETUPS]
        lines.append(f"| {c['label']} | {' | '.join(cpu)} | {_r(r['stock']['frontend_cpu'])} | "
                     f"{_r(r['stock-kv']['frontend_cpu'])} | {' | '.join(rps)} | {_r(r['stock']['rps'])} | "
                     f"{_r(r['stock-kv']['rps'])} |")
    for key, what in (("ttft_ms", "first chunk with content"), ("first_chunk_ms", "first chunk of any kind"),
                      ("last_chunk_ms", "last chunk (the whole answer)"),
                      ("text_chunk_gap_ms", "gap between chunks with content (inter-token latency as delivered)")):
        if key not in result:
            continue
        ttft = result[key]
        tm = {n: ttft[n]["median"] if ttft[n] else None for n in SETUPS}
        lines.append(f"| c=1, streamed, 16 tokens: {what} (ms, median (min-max) of "
                     f"{cfg['ttft_n'] * cfg['rounds']} requests) | " + " | ".join(_f(ttft[n], 1) for n in SETUPS)
                     + f" | {_r(_div(tm['ours'], tm['stock']))} | {_r(_div(tm['ours'], tm['stock-kv']))} | | | | | |")
    tok = result["cpu_us_per_token"]
    for mode, label in (("non_streamed", "non-streamed"), ("streamed", "streamed")):
        v = {n: tok[n][mode]["frontend"] for n in SETUPS}
        lines.append(f"| frontend CPU per generated token, {label} (µs; (128 - 1 tokens) / 127) | "
                     + " | ".join(_f(v[n], 1) for n in SETUPS)
                     + f" | {_r(_div(v['ours'], v['stock']))} | {_r(_div(v['ours'], v['stock-kv']))} | | | | | |")
    return lines


def _latency_table(result: dict) -> list[str]:
    """Latency, the engines' CPU and what came back, per cell and setup."""
    cells = result["cells"]
    lines = [
        "",
        "Latency (wrk, whole response), the engines' CPU and what came back, per setup as ours / stock / stock-kv "
        "(medians over the rounds):",
        "",
        "| cell | concurrency | p50 ms | p99 ms | engines CPU ms/req | rest CPU ms/req | SSE chunks per response | "
        "frontend thread switches per request | requests | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def trio(c: dict, key, digits: int = 1) -> str:
        vals = []
        for n in SETUPS:
            v = c["setups"][n].get(key) if isinstance(key, str) else c["setups"][n][key[0]][key[1]]
            vals.append("-" if v is None else f"{v['median']:,.{digits}f}")
        return " / ".join(vals)

    for c in cells.values():
        chunks = trio(c, "chunks_per_response") if c["stream"] else "-"
        lines.append(f"| {c['label']} | {c['concurrency']} | {trio(c, 'p50_ms')} | {trio(c, 'p99_ms')} | "
                     f"{trio(c, ('cpu_ms_per_request', 'engines'), 2)} | {trio(c, ('cpu_ms_per_request', 'rest'), 2)} "
                     f"| {chunks} | {trio(c, 'frontend_switches_per_request', 0)} | "
                     f"{' / '.join(str(c['setups'][n]['requests']) for n in SETUPS)} | "
                     f"{' / '.join(str(c['setups'][n]['errors']) for n in SETUPS)} |")
    return lines


def _method(result: dict) -> list[str]:
    """How it was measured, and what each setup ran."""
    cfg, cells, setups = result["config"], result["cells"], result["setups"]
    m = result.get("machine", {})
    tok = result["cpu_us_per_token"]
    eng = {n: tok[n]["non_streamed"]["engines"] for n in SETUPS}
    ie = setups["ours"]["ignore_eos"]
    ie_stock = setups["stock"]["ignore_eos"]
    intervals = {setups[n]["engines_stream_interval"] for n in SETUPS}
    stream16 = cells["text-16-stream"]["setups"]
    idle = {n: setups[n]["idle_cpu_ms_per_s"]["frontend"] for n in SETUPS}
    return [
        "",
        f"- Method: closed loops with `wrk` (1 thread, a Lua script building each body): per cell a "
        f"{cfg['warmup_s']} s warm-up run, then a measured run of {cfg['lead_s']} + {cfg['duration_s']} + "
        f"{cfg['tail_s']} s; CPU and completed requests (the frontend's `dynamo_frontend_requests_total`, status "
        f"success) are taken over the middle {cfg['duration_s']} s ({cfg['duration_s'] * cfg.get('long', 1)} s in the "
        "128-token cells, which complete ~10x fewer requests), where the loop is at its concurrency at both "
        "edges, so requests in flight at the start and at the end roughly balance. Latency and errors are wrk's over "
        f"the whole measured run. {cfg['rounds']} round(s); one setup measured at a time while the other two graphs "
        "idle, the setups alternating cell by cell (the order rotated each round).",
        f"- Concurrency {CONCURRENCY}: two requests in flight per engine, so both engines stay busy (one request's "
        "prefill overlaps another's decode) while queues stay short. p50 is then mostly service time, and the "
        "frontend's CPU per request is not diluted by idle time. More would only add queueing on this machine: "
        "every process shares its cores.",
        "- Text prompts are distinct (a counter in the first words, so no two share a KV block); the image prompt "
        "is the same bundled 1280x720 sample.jpg every time (a data: URL; a cache hit after the warm-up); the "
        "identical-prompt row sends one text prompt at concurrency 8, where a KV router may pile requests onto "
        "one engine and round-robin spreads them.",
        f"- Every request sets `ignore_eos` at the top level and `stream_options.include_usage`; a response counts "
        "as an error unless it is a 200 whose `usage.completion_tokens` is max_tokens, so every setup generated "
        f"the same tokens. Checked at start, 128 tokens asked: {_eos(ie, ie_stock)}",
        f"- The engines' `--stream-interval-ms`: {', '.join(sorted(intervals))} (from their ready lines; "
        "\"1 token per item\" when they print none). The engines merge tokens into one item for our frontend's "
        "requests only (`engines/engine.py` `generate`; the stock frontend's requests go through "
        "`generate_dynamo`, a token per item); for a non-streamed request without stop strings our frontend asks "
        "for the first token alone and the rest at the finish (`EngineRequest.stream` false: two items per "
        "answer). SSE chunks per streamed 16-token response (the role and usage "
        f"chunks included): {_chunks(stream16['ours'])} ours, {_chunks(stream16['stock'])} stock, "
        f"{_chunks(stream16['stock-kv'])} stock-kv. Fewer than one per token in stock: a token that ends "
        "mid-character waits for the next one.",
        "- CPU: utime+stime (+ reaped children) from /proc/PID/stat, summed over each component's process group "
        "(every replica runs in its own session). Engines: both engines; rest: encode worker, nginx tiers, NATS. "
        "Frontend CPU per generated token: (CPU at 128 tokens - at 1) / 127; engines, non-streamed: "
        + ", ".join(f"{n} {_us(eng[n])}" for n in SETUPS) + ".",
        "- Frontend threads at start: " + "; ".join(
            f"{n} " + ", ".join(f"{k} {v}" for k, v in sorted(setups[n].get("frontend_threads", {}).items()))
            for n in SETUPS) + ". Ours runs Dynamo's runtime with 1 worker thread (`--runtime-threads`, default "
        "1): its processor runs on the one Python thread, and every further Rust worker only adds thread "
        "switches per request; the stock frontend keeps Dynamo's default. Thread switches per request: the "
        "frontend process's voluntary + involuntary context switches (/proc/PID/task/*/status) over the window.",
        "- Idle frontend CPU (all three graphs idle, before the cells): "
        + ", ".join(f"{n} {idle[n]:.1f} ms/s" for n in SETUPS) + ".",
        f"- Machine: {m.get('cores')} cores, {m.get('cpu')}; load average at start {result.get('loadavg', '-')}; "
        "other processes on the machine only add noise, and fall on all three setups alike.",
    ]


def _failures(result: dict) -> list[str]:
    cells, lines = result["cells"], []
    errs = {f"{c['label']} ({n})": c["setups"][n] for c in cells.values() for n in SETUPS if c["setups"][n]["errors"]}
    if errs:
        lines.append("- **Errors**: " + "; ".join(f"{k}: {v['errors']} (first: `{(v['first_error'] or '')[:120]}`)"
                                                 for k, v in errs.items()))
    failed = {n: k for n, k in result.get("ttft_failed", {}).items() if k}
    if failed:
        lines.append("- **TTFT requests that failed**: " + ", ".join(f"{n} {k}" for n, k in failed.items()))
    return lines
