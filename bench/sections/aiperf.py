"""BENCHMARKS.md's section for bench/aiperf.py: AIPerf's figures beside our client's and the frontend's."""

from __future__ import annotations

import statistics
from pathlib import Path

CASE_NAMES = {("epd", "miss"): "EPD miss", ("epd", "hit"): "EPD hit", ("agg", "miss"): "agg (baseline)",
              ("agg", "hit"): "agg, repeated image"}


def _v(d: dict | None, key: str, digits: int = 0) -> str:
    if not d or d.get(key) is None:
        return "-"
    return f"{d[key]:,.{digits}f}"


def _machine(result: dict) -> str:
    m = result.get("machine") or {}
    return f"{m.get('cores', '?')}-core CPU machine ({m.get('cpu') or 'CPU unknown'}, device {m.get('device', 'cpu')})"


def _load(result: dict) -> str:
    """The 1-minute load average as each case ended: the graph and the clients alone keep it near the
    cores' count; well above it, other work shared the machine."""
    loads = [c["loadavg_1m"] for g in result["graphs"].values() for c in g["cases"].values() if "loadavg_1m" in c]
    if not loads:
        return ""
    return (f" The machine's 1-minute load average as each case ended: {_span(loads, 1, '')} "
            f"({result.get('machine', {}).get('cores', '?')} cores).")


def _client(name: str) -> str:
    return "AIPerf" if name == "aiperf" else "ours"


def _cpu(r: dict, client: str, requests: bool) -> str:
    """CPU seconds (wall seconds): AIPerf's over its profiling phase or its whole run; ours the same both ways."""
    if client == "aiperf" and requests:
        cpu, wall = r.get("profiling_cpu_s"), (r.get("benchmark_duration_s") or {}).get("avg")
    else:
        cpu, wall = r.get("client_cpu_s"), r.get("client_wall_s")
    if cpu is None:
        return "-"
    return f"{cpu:.2f} ({wall:.1f})" if wall is not None else f"{cpu:.2f}"


def _ratio(a: dict | None, b: dict | None, key: str) -> str:
    if not a or not b or not a.get(key) or not b.get(key):
        return "-"
    return f"{a[key] / b[key]:.2f}x"


def _p50(g: dict, graph: str, case: str, client: str, metric: str) -> dict | None:
    return (g.get(graph, {}).get("cases", {}).get(case, {}).get(client) or {}).get(metric)


def _span(values: list[float], digits: int = 2, unit: str = "x") -> str:
    lo, hi = (f"{v:.{digits}f}" for v in (min(values), max(values)))
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def _findings(result: dict) -> list[str]:
    """What the tables say, in words: the clients against each other, and the graphs with either client."""
    cases = [c for g in result["graphs"].values() for c in g["cases"].values()]
    out: list[str] = []

    def ratios(a: str, b: str, metric: str) -> list[float]:
        return [x[a][metric]["p50"] / x[b][metric]["p50"] for x in cases
                if (x.get(a) or {}).get(metric) and (x.get(b) or {}).get(metric) and x[b][metric]["p50"]]

    ttft = ratios("aiperf", "ours", "ttft_ms")
    front = ratios("frontend", "frontend_ours", "first_token_ms")
    prof = [(c["aiperf"]["profiling_cpu_s"], c["aiperf"]["benchmark_duration_s"]["avg"]) for c in cases
            if c["aiperf"].get("profiling_cpu_s") is not None and c["aiperf"].get("benchmark_duration_s")]
    if ttft and front:
        server_side = statistics.median(front) - 1 >= 0.5 * (statistics.median(ttft) - 1)
        text = (f"- AIPerf's TTFT p50 is {_span(ttft)} ours for the same kind of request, and the frontend's own "
                f"first-token time for AIPerf's requests is {_span(front)} that for ours: "
                + ("most of the gap is the server running slower while AIPerf runs beside it on the same cores, "
                   "not AIPerf's clock." if server_side else
                   "most of the gap is on AIPerf's side of the socket (its sending and its clock), not the server's."))
        if prof:
            text += (" AIPerf's processes used " + _span([c / w for c, w in prof], 2, "") + " CPU seconds per second "
                     "while its requests ran (of the machine's " + str(result["machine"].get("cores", "?")) +
                     " cores); our client a few hundredths.")
        out.append(text)
    g = result["graphs"]
    if "epd" in g and {"miss", "hit"} <= set(g["epd"]["cases"]):
        for metric, name in (("request_latency_ms", "latency"), ("ttft_ms", "TTFT")):
            pairs = [(_p50(g, "epd", "miss", cl, metric), _p50(g, "epd", "hit", cl, metric))
                     for cl in ("aiperf", "ours")]
            r = [m["p50"] / h["p50"] for m, h in pairs if m and h and h["p50"]]
            if len(r) == 2:
                out.append(f"- EPD, a cache hit against a miss: {name} p50 {r[0]:.2f}x lower by AIPerf, "
                           f"{r[1]:.2f}x by ours: both clients show the hit.")
    return out


def section(result: dict, plots: Path) -> str:
    lines = ["## AIPerf beside our own client (`python -m bench.aiperf`)", "", _intro(result), "",
             *_clients_table(result["graphs"]), "", *_clocks_table(result["graphs"]), *_ratio_tables(result["graphs"]),
             "", *_findings(result), *_commands(result), "", *_notes(result)]
    return "\n".join(lines) + "\n"


def _intro(result: dict) -> str:
    cfg = result["config"]
    return (
        f"AIPerf ({result.get('aiperf_version') or '?'}, `aiperf profile`, the benchmark client Dynamo's operators "
        "use; its own virtualenv: `make aiperf-venv`) against each graph under `mm-encoder serve GRAPH --dtype fp32 "
        f"--preset {cfg['preset']}` (the generated tiny Kimi-K2.5, random weights), one graph after the other: "
        "EPD (graphs/epd.yaml: encode worker behind the cache tiers, engines that get embeddings) and the "
        "aggregated baseline (graphs/agg.yaml: engines that encode pixels themselves, no cache). Chat requests "
        f"with one {cfg['image']} each, {cfg['osl']} streamed tokens, {cfg['requests']} requests per case at "
        f"concurrency {cfg['concurrency']} (closed loop), after a warm-up (a text request, then "
        f"{2 * cfg['concurrency']} image requests {cfg['concurrency']} at a time, so that neither client pays for the "
        "first batches). **miss**: AIPerf's synthetic requests with "
        "`--image-source noise`, a new random image per request; **hit**: an AIPerf input file "
        "(`--custom-dataset-type single_turn`) naming one noise JPEG on every line, sent once before by a "
        "one-request AIPerf run (AIPerf re-encodes the file: the server must see its bytes). AIPerf's figures are its "
        "JSON export's (`profile_export_aiperf.json`). **ours**: the same number of requests of the same shape "
        "at the same concurrency from bench/graphs.py's client, right after AIPerf's (fresh noise images for "
        "miss; for hit the same image, sent once before). Encodes per request: EPD counts the encode worker's "
        "forwards, agg the media items its engines encoded. Client CPU: the CPU seconds the client's processes "
        "used, with the wall time: while its requests ran (AIPerf's process tree between the lines it prints as "
        "its profiling phase starts and completes; ours: the benchmark's process), and in all (AIPerf's start, "
        "dataset generation and exit included). Latency: until the "
        "last chunk; TTFT: until the first token's chunk. All processes (the graph's and AIPerf's own workers) "
        "share the machine's cores: these are scheduling figures for comparing the clients and the graphs, "
        "not capacity.")


def _clients_table(graphs: dict) -> list[str]:
    """Each case, each client: AIPerf's export and our client's figures, encodes, the client's CPU."""
    lines = [
        "| case | client | ok/sent | latency p50 ms | latency p99 ms | TTFT p50 ms | TTFT p99 ms | req/s | "
        "encodes per request | client CPU s while its requests ran (their wall s) | client CPU s in all (wall s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for graph, g in graphs.items():
        for case, c in g["cases"].items():
            name = CASE_NAMES.get((graph, case), f"{graph} {case}")
            for client in ("aiperf", "ours"):
                r = c[client]
                ok = f"{r.get('completed', '-')}/{r.get('requests', '-')}"
                e = r.get("encodes_per_request")
                lines.append(
                    f"| {name} | {_client(client)} | {ok} | "
                    f"{_v(r['request_latency_ms'], 'p50')} | {_v(r['request_latency_ms'], 'p99')} | "
                    f"{_v(r['ttft_ms'], 'p50')} | {_v(r['ttft_ms'], 'p99')} | "
                    f"{_v(r['request_throughput'], 'avg', 2)} | "
                    f"{'-' if e is None else f'{e:.2f}'} | {_cpu(r, client, True)} | {_cpu(r, client, False)} |")
    return lines


def _clocks_table(graphs: dict) -> list[str]:
    """Each client's requests as the client saw them and as the frontend recorded them."""
    lines = [
        "Each client's requests on two clocks: the client's, and the frontend's own record of each request "
        "(/mm/stats `recent`: `first_token_ms`, from the request's admission, its body already read and "
        "parsed, to the engine's first item) and its request-duration histogram "
        "(`dynamo_frontend_request_duration_seconds`, sum over count across the run: a mean; its buckets are "
        "too coarse for a median). Client TTFT minus the frontend's: sending the ~0.6 MB body, the frontend "
        "reading and parsing it, the first chunk's way back, the client's own scheduling. The frontend's "
        "figure under one client against the other's: how much the client's own CPU use slowed the server.",
        "",
        "| case | client | client TTFT p50 ms | frontend first token p50 ms | difference ms | client TTFT p99 | "
        "frontend p99 | client mean latency ms | frontend mean duration ms | frontend records / requests |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for graph, g in graphs.items():
        for case, c in g["cases"].items():
            for client, front in (("aiperf", "frontend"), ("ours", "frontend_ours")):
                a, f = c[client], c.get(front) or {}
                ft = f.get("first_token_ms")
                diff = "-" if not ft or not a["ttft_ms"] else f"{a['ttft_ms']['p50'] - ft['p50']:,.0f}"
                lines.append(
                    f"| {CASE_NAMES.get((graph, case), f'{graph} {case}')} | {_client(client)} | "
                    f"{_v(a['ttft_ms'], 'p50')} | {_v(ft, 'p50')} | {diff} | {_v(a['ttft_ms'], 'p99')} | "
                    f"{_v(ft, 'p99')} | {_v(a['request_latency_ms'], 'avg')} | {_v(f, 'request_mean_ms')} | "
                    f"{f.get('records', '-')} / {f.get('requests', '-')} |")
    return lines


def _ratio_tables(graphs: dict) -> list[str]:
    lines: list[str] = []
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
    lines += ["", "AIPerf against ours, per case (p50 over p50; the frontend's: its first-token time for AIPerf's "
              "requests over that for ours):", "",
              "| case | latency AIPerf / ours | TTFT AIPerf / ours | frontend first token, AIPerf's / ours |",
              "|---|---:|---:|---:|"]
    for graph, g in graphs.items():
        for case, c in g["cases"].items():
            fa, fo = (c.get(k) or {} for k in ("frontend", "frontend_ours"))
            lines.append(f"| {CASE_NAMES.get((graph, case), f'{graph} {case}')} | "
                         f"{_ratio(c['aiperf']['request_latency_ms'], c['ours']['request_latency_ms'], 'p50')} | "
                         f"{_ratio(c['aiperf']['ttft_ms'], c['ours']['ttft_ms'], 'p50')} | "
                         f"{_ratio(fa.get('first_token_ms'), fo.get('first_token_ms'), 'p50')} |")
    return lines


def _commands(result: dict) -> list[str]:
    graphs, flag = result["graphs"], " --quick" if result["config"].get("quick") else ""
    lines = ["", f"Made by `python -m bench.aiperf{flag}` (`make bench-aiperf{' ARGS=--quick' if flag else ''}`; "
             f"this document's figures through `python -m bench.report --only aiperf{flag}`)."]
    example = next((c["command"] for g in graphs.values() for c in g["cases"].values() if c.get("command")), None)
    hit = next((c["command"] for g in graphs.values() for k, c in g["cases"].items() if k == "hit"), None)
    lines += ["", "The AIPerf commands the module ran (miss, then hit; $WORK: its temporary folder, the URL a free "
              "port of this run):", ""]
    for cmd in (example, hit):
        if cmd:
            lines += ["```", cmd, "```"]
    return lines


def _notes(result: dict) -> list[str]:
    return [
        f"Caveats: a {_machine(result)} and a tiny checkpoint with random weights, every process of the graph and "
        "of the client on the same cores; a handful of requests per case (a p99 is close to the slowest one); in "
        "each case AIPerf runs first and our client right after, on a server that has just served AIPerf's "
        "requests; AIPerf's TTFT is its first token's chunk, ours the first chunk with data (the same chunk "
        "from this frontend). Figures move from run to run by tens of percent: compare within one run."
        + _load(result),
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
        "sent: the server caches AIPerf's bytes, not the file's, so another client cannot prime the cache with "
        "the file; a one-request AIPerf run with the same input file does, before the measured run (AIPerf's "
        "`--warmup-request-count` would do it too, but its warm-up is in no figure the frontend reports apart: "
        "the frontend's records would mix it in).",
        "- AIPerf has no notion of a cache hit: that hits were hits and misses misses is checked with the "
        "encode worker's forwards (the encodes column).",
        "- `--no-server-metrics` and `--no-gpu-telemetry`: no GPU here, and the frontend's /metrics is read by "
        "the module itself, before and after each run.",
    ]
