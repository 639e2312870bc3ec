"""BENCHMARKS.md's section for bench/aiperf.py: AIPerf's figures beside our client's and the frontend's."""

from __future__ import annotations

from pathlib import Path

CASE_NAMES = {("epd", "miss"): "EPD miss", ("epd", "hit"): "EPD hit", ("agg", "miss"): "agg (baseline)",
              ("agg", "hit"): "agg, repeated image"}


def _v(d: dict | None, key: str, digits: int = 0) -> str:
    if not d or d.get(key) is None:
        return "-"
    return f"{d[key]:,.{digits}f}"


def _ratio(a: dict | None, b: dict | None, key: str) -> str:
    if not a or not b or not a.get(key) or not b.get(key):
        return "-"
    return f"{a[key] / b[key]:.2f}x"


def _p50(g: dict, graph: str, case: str, client: str, metric: str) -> dict | None:
    return (g.get(graph, {}).get("cases", {}).get(case, {}).get(client) or {}).get(metric)


def section(result: dict, plots: Path) -> str:
    cfg, graphs = result["config"], result["graphs"]
    lines = [
        "## AIPerf beside our own client (`python -m bench.aiperf`)",
        "",
        f"AIPerf ({result.get('aiperf_version') or '?'}, `aiperf profile`, the benchmark client Dynamo's operators "
        "use; its own virtualenv: `make aiperf-venv`) against each graph under `mm-encoder serve GRAPH --dtype fp32 "
        f"--preset {cfg['preset']}` (the generated tiny Kimi-K2.5, random weights), one graph after the other: "
        "EPD (graphs/epd.yaml: encode worker behind the cache tiers, engines that get embeddings) and the "
        "aggregated baseline (graphs/agg.yaml: engines that encode pixels themselves, no cache). Chat requests "
        f"with one {cfg['image']} each, {cfg['osl']} streamed tokens, {cfg['requests']} requests per case at "
        f"concurrency {cfg['concurrency']} (closed loop). **miss**: AIPerf's synthetic requests with "
        "`--image-source noise`, a new random image per request; **hit**: an AIPerf input file "
        "(`--custom-dataset-type single_turn`) naming one noise JPEG on every line, sent once before by a "
        "one-request AIPerf run (AIPerf re-encodes the file: the server must see its bytes). AIPerf's figures are its "
        "JSON export's (`profile_export_aiperf.json`). **ours**: the same number of requests of the same shape "
        "at the same concurrency from bench/graphs.py's client, right after AIPerf's (fresh noise images for "
        "miss; for hit the same image, sent once before). Encodes per request: EPD counts the encode worker's "
        "forwards, agg the media items its engines encoded. Latency: until the "
        "last chunk; TTFT: until the first token's chunk. All processes (the graph's and AIPerf's own workers) "
        "share the machine's cores: these are scheduling figures for comparing the clients and the graphs, "
        "not capacity.",
        "",
        "| case | client | ok/sent | latency p50 ms | latency p99 ms | TTFT p50 ms | TTFT p99 ms | req/s | "
        "encodes per request |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for graph, g in graphs.items():
        for case, c in g["cases"].items():
            name = CASE_NAMES.get((graph, case), f"{graph} {case}")
            for client in ("aiperf", "ours"):
                r = c[client]
                ok = f"{r.get('completed', '-')}/{r.get('requests', '-')}"
                e = r.get("encodes_per_request")
                lines.append(
                    f"| {name} | {'AIPerf' if client == 'aiperf' else 'ours'} | {ok} | "
                    f"{_v(r['request_latency_ms'], 'p50')} | {_v(r['request_latency_ms'], 'p99')} | "
                    f"{_v(r['ttft_ms'], 'p50')} | {_v(r['ttft_ms'], 'p99')} | "
                    f"{_v(r['request_throughput'], 'avg', 2)} | "
                    f"{'-' if e is None else f'{e:.2f}'} |")
    lines += [
        "",
        "AIPerf's requests on two clocks: AIPerf's, and the frontend's own record of each of them (/mm/stats "
        "`recent`: `first_token_ms`, from the request's admission (its body already read and parsed) to the engine's "
        "first item) and its request-duration histogram (`dynamo_frontend_request_duration_seconds`, sum over "
        "count across the run: a mean; its buckets are too coarse for a median). What AIPerf's TTFT adds: "
        "sending the ~0.6 MB body, the frontend's parsing, the first chunk's way back, and AIPerf's own scheduling.",
        "",
        "| case | AIPerf TTFT p50 ms | frontend first token p50 ms | AIPerf TTFT p99 | frontend p99 | "
        "AIPerf mean latency ms | frontend mean duration ms | frontend records / requests |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for graph, g in graphs.items():
        for case, c in g["cases"].items():
            a, f = c["aiperf"], c["frontend"]
            ft = f.get("first_token_ms")
            lines.append(f"| {CASE_NAMES.get((graph, case), f'{graph} {case}')} | {_v(a['ttft_ms'], 'p50')} | "
                         f"{_v(ft, 'p50')} | {_v(a['ttft_ms'], 'p99')} | {_v(ft, 'p99')} | "
                         f"{_v(a['request_latency_ms'], 'avg')} | {_v(f, 'request_mean_ms')} | "
                         f"{f.get('records', '-')} / {f.get('requests', '-')} |")
    lines += ["", "Ratios of medians (p50), each client's figures against its own:", "",
              "| ratio | AIPerf latency | ours latency | AIPerf TTFT | ours TTFT |", "|---|---:|---:|---:|---:|"]
    pairs = [("EPD miss / EPD hit (what a cache hit saves)", ("epd", "miss"), ("epd", "hit")),
             ("agg / EPD hit (the baseline against a hit)", ("agg", "miss"), ("epd", "hit")),
             ("agg / EPD miss (the baseline against a miss)", ("agg", "miss"), ("epd", "miss"))]
    for label, num, den in pairs:
        if num[0] not in graphs or den[0] not in graphs:
            continue
        cells = [_ratio(_p50(graphs, *num, cl, m), _p50(graphs, *den, cl, m), "p50")
                 for m in ("request_latency_ms", "ttft_ms") for cl in ("aiperf", "ours")]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    lines += ["", "AIPerf against ours, per case (p50 over p50):", "",
              "| case | latency AIPerf / ours | TTFT AIPerf / ours |", "|---|---:|---:|"]
    for graph, g in graphs.items():
        for case, c in g["cases"].items():
            lines.append(f"| {CASE_NAMES.get((graph, case), f'{graph} {case}')} | "
                         f"{_ratio(c['aiperf']['request_latency_ms'], c['ours']['request_latency_ms'], 'p50')} | "
                         f"{_ratio(c['aiperf']['ttft_ms'], c['ours']['ttft_ms'], 'p50')} |")
    example = next((c["command"] for g in graphs.values() for c in g["cases"].values() if c.get("command")), None)
    hit = next((c["command"] for g in graphs.values() for k, c in g["cases"].items() if k == "hit"), None)
    lines += ["", "The AIPerf commands the module ran (miss, then hit; $WORK: its temporary folder, the URL a free "
              "port of this run):", ""]
    for cmd in (example, hit):
        if cmd:
            lines += ["```", cmd, "```"]
    lines += [
        "",
        "What AIPerf did not do here, and how the module works around it:",
        "",
        "- `--tokenizer builtin` is not offline: it downloads tiktoken's `o200k_base` at run time (no network "
        "on these machines). The module passes the served checkpoint's own tokenizer by its absolute path "
        "(the run directory's `checkpoint/kimi-k2.5-tiny`).",
        "- With `HF_HUB_OFFLINE=1`, AIPerf 0.13.0 looks a tokenizer up in the hub's cache only, a local directory "
        "too (`HFValidationError: Repo id must be in the form ...`); the module unsets it for AIPerf (an absolute "
        "path makes no hub request).",
        "- Client-side token counts disagree with the server's (the random model's text re-tokenizes "
        "differently): `--use-server-token-count`, the server's `usage`.",
        "- An image file in an input file is re-encoded by AIPerf (PIL, its default JPEG quality) before it is "
        "sent: the server caches AIPerf's bytes, not the file's, so the file cannot be primed from outside; "
        "AIPerf's own warm-up request (`--warmup-request-count 1`) primes it.",
        "- AIPerf has no notion of a cache hit: that hits were hits and misses misses is checked with the "
        "encode worker's forwards (the encodes column).",
        "- `--no-server-metrics` and `--no-gpu-telemetry`: no GPU here, and the frontend's /metrics is read by "
        "the module itself, before and after each run.",
    ]
    return "\n".join(lines) + "\n"
