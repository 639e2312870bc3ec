"""BENCHMARKS.md's section for bench/cache.py: its figures (the JSON it writes) as markdown and plots."""

from __future__ import annotations

from pathlib import Path

from bench import stats
from bench.cache import COALESCE_N, REFERENCE

SHORT = {"cluster": "cluster tier", "shared": "router + shard", "shared_via_cluster": "cluster -> router + shard",
         "shared_lua_key": "shard, key hashed in Lua", "alias": "worker URL alias LRU",
         "mm_hash": "worker mm_hash LRU", "encode": "full encode"}


def section(result: dict, plots: Path) -> str:
    lines = [*_levels(result), *_coalescing(result)]
    png = _plot(result, plots)
    if png:
        lines += ["", f"![hit latency per level]({png})"]
    return "\n".join(lines) + "\n"


def _levels(result: dict) -> list[str]:
    """Each level's hits: req/s and latency, against a cluster-tier hit and the reference stack."""
    lv = result["levels"]
    ref = result.get("reference", REFERENCE)
    tier = lv["cluster"]["rps_c8"]
    lines = [
        "## The cache hierarchy (`python -m bench.cache`)",
        "",
        f"One encode worker (`tiny-wide`: tiny tower, 7168-wide projector; a 616x644 JPEG gives a "
        f"{result['body_mb']:.2f} MB body, the size of a 4K image's K2.5 embeddings on the reference stack) "
        "behind the levels of graphs/epd.yaml on loopback: cluster tier -> router -> shared shard -> worker. "
        "After a warm-up, wrk sends the same POST (a 52 KB msgpack body with the JPEG, or a JSON body with its "
        "URL; the frontend's `X-Cache-Key` to the tiers), so every request is a hit at the level asked. "
        "req/s at 8 connections, latency at 1 connection. The full encode row sends a new JPEG per request "
        "straight to the worker (aiohttp, 1 and 8 clients). "
        f"Levels alternate in {result['rounds']} round(s) of {result['seconds']} s per run in one process; "
        "median (min-max) over rounds. wrk, nginx and the worker share the machine's cores.",
        "",
        "| level | req/s at c=8 | vs cluster tier | p50 ms at c=1 | p99 ms at c=1 | p50 ms at c=8 | non-2xx |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in lv.values():
        lines.append(f"| {r['label']} | {stats.fmt(r['rps_c8'], 0)} | {stats.ratio(r['rps_c8'], tier):.2f}x | "
                     f"{stats.fmt(r['p50_c1_ms'], 2)} | {stats.fmt(r['p99_c1_ms'], 2)} | "
                     f"{stats.fmt(r['p50_c8_ms'], 1)} | {r['non2xx']} |")
    c = lv["cluster"]
    met = c["rps_c8"]["median"] >= ref["rps"] and c["p50_c1_ms"]["median"] <= ref["p50_ms"]
    lines += [
        f"| reference stack, tier hit | {ref['rps']:.0f} | | {ref['p50_ms']:.1f} | | | |",
        "",
        f"- Tier hit against the reference stack (>= {ref['rps']:.0f} req/s, p50 <= {ref['p50_ms']} ms): "
        f"{'met' if met else 'NOT met'}, {c['rps_c8']['median']:.0f} req/s and p50 {c['p50_c1_ms']['median']:.2f} ms.",
        "- What limits a hit: copying the body through loopback TCP on cores that wrk also uses "
        f"({c['rps_c8']['median']:.0f} x {result['body_mb']:.2f} MB = "
        f"{c['rps_c8']['median'] * result['body_mb'] / 1e3:.1f} GB/s of payload); nginx serves from tmpfs with "
        "`sendfile off; output_buffers 2 1m`. At c=8 the latency is mostly queueing.",
        f"- The router hop costs {1 - stats.ratio(lv['shared']['rps_c8'], tier):.0%} of a tier hit's req/s: every "
        "byte is received and re-sent once more (relayed in 1 MB chunks: `proxy_buffering off; "
        "proxy_buffer_size 1m`). Asked through the cluster tier (`X-Cache-Route: shared`: the cluster tier passes "
        "it on uncached) a shared hit pays one hop more.",
        f"- The worker's own caches run at {stats.ratio(lv['mm_hash']['rps_c8'], tier):.2f}x (mm_hash) and "
        f"{stats.ratio(lv['alias']['rps_c8'], tier):.2f}x (URL alias) the req/s of a cluster-tier hit here: the "
        "hit path is a hash (or a URL lookup), a dict lookup and one write of the cached body. The tiers are "
        "there to share entries across workers and to survive worker restarts, not because the worker is slow "
        "at hits.",
        "",
    ]
    return lines


def _coalescing(result: dict) -> list[str]:
    co = result["coalescing"]
    lines = [
        f"Coalescing: {COALESCE_N} identical concurrent requests for a new image, forwards counted from the "
        "worker's `dynamo_component_encode_forward_items_total`:",
        "",
        "| path | forwards (must be 1) | answered 200 | p50 ms | max ms |",
        "|---|---:|---:|---:|---:|",
    ]
    names = {"worker": "straight to the worker (its single-flight)",
             "cluster": "through cluster tier -> router -> shard -> worker (nginx cache lock)"}
    for where, r in co.items():
        lines.append(f"| {names[where]} | {stats.fmt(r['forwards'], 0)} | {stats.fmt(r['ok'], 0)} of {r['n']} | "
                     f"{stats.fmt(r['p50_ms'], 0)} | {stats.fmt(r['max_ms'], 0)} |")
    ok = all(r["forwards"]["max"] == 1 for r in co.values())
    lines += [
        "",
        f"- {'Every' if ok else 'NOT every'} burst ran one forward. Through the tiers the 15 waiters sit on "
        "nginx's cache lock, which polls every 500 ms: hence the waiters' latency.",
    ]
    return lines


def _plot(result: dict, plots: Path) -> str | None:
    plt = stats.pyplot()
    if plt is None:
        return None
    lv = result["levels"]
    names = list(lv)
    med = [lv[n]["p50_c1_ms"]["median"] for n in names]
    err = [[m - lv[n]["p50_c1_ms"]["min"] for n, m in zip(names, med, strict=True)],
           [lv[n]["p50_c1_ms"]["max"] - m for n, m in zip(names, med, strict=True)]]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(range(len(names)), med, xerr=err, color=["#4c72b0"] * (len(names) - 1) + ["#c44e52"])
    ax.axvline(result.get("reference", REFERENCE)["p50_ms"], color="grey", ls="--", label="reference tier hit")
    ax.set_yticks(range(len(names)), [SHORT.get(n, n) for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("p50 latency at 1 connection, ms (log)")
    ax.set_title(f"p50 of a hit per level ({result['body_mb']:.2f} MB body) and of a full encode", fontsize=10)
    ax.legend(fontsize=8)
    return stats.save_png(fig, plots, "cache-levels.png")
