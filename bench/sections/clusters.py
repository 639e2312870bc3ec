"""BENCHMARKS.md's section for bench/clusters.py: its figures (the JSON it writes) as markdown."""

from __future__ import annotations

from pathlib import Path


def _ratio(level: dict) -> str:
    return "-" if level["hit_ratio"] is None else f"{level['hit_ratio']:.1%}"


def section(result: dict, plots: Path) -> str:
    p, m, t = result["predicted"], result["measured"], result["traffic"]
    pop = t["popularity"]
    lines = [
        "## Two model clusters, one encoder site: the capacity model against the fleet (`python -m bench.clusters`)",
        "",
        f"A two-cluster trace made by `mm-encoder capacity`'s own generator ({t['requests']} requests of one image, "
        f"Zipf s={pop['exponent']} over {pop['catalogue']} images, each request on one of 2 clusters at random, seed "
        f"{t['seed']}), predicted by its simulator and replayed in order on an encoder site (host 1) and the two "
        "clusters' tiers (hosts 2 and 3), TLS on every hop: each item the frontend's HEAD through its cluster's "
        f"tier, a distinct {result['image'][0]}x{result['image'][1]} JPEG per catalogue rank. The simulator is given "
        "the real keys and the router's shard names, so it places keys as nginx does.",
        "",
        "| level | predicted lookups | predicted hit ratio | measured lookups | measured hit ratio |",
        "|---|---:|---:|---:|---:|",
        f"| cluster tiers (both) | {p['cluster']['lookups']} | {_ratio(p['cluster'])} | {m['cluster']['lookups']} | "
        f"{_ratio(m['cluster'])} |",
        f"| shared tier (the site) | {p['shared']['lookups']} | {_ratio(p['shared'])} | {m['shared']['lookups']} | "
        f"{_ratio(m['shared'])} |",
        f"| encodes | {p['encodes']} | | {m['encodes']} | |",
        "",
        "| shard | predicted lookups | measured lookups |",
        "|---|---:|---:|",
    ]
    for shard, n in p["shard_lookups"].items():
        lines.append(f"| `{shard}` | {n} | {m['shard_lookups'].get(shard, 0)} |")
    per = m["per_cluster"]
    lines += ["", "Measured per cluster (the level that answered): " + "; ".join(
        f"{c}: " + ", ".join(f"{k} {v}" for k, v in sorted(levels.items())) for c, levels in per.items()) + ".",
        "", f"{p['unique']} distinct images among {p['items']} items; {m['encodes']} encodes measured: "
        + ("each image encoded once across both clusters." if m["encodes"] == p["unique"] else
           "some images were encoded more than once.")]
    return "\n".join(lines) + "\n"
