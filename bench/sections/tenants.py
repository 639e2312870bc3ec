"""BENCHMARKS.md's section for bench/tenants.py: its figures (the JSON it writes) as markdown."""

from __future__ import annotations

from pathlib import Path


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def section(result: dict, plots: Path) -> str:
    t, predicted, measured = result["traffic"], result["predicted"], result["measured"]
    pop = t["popularity"]
    one = predicted["1"]
    lines = [
        "## What the tenant scope costs in hit ratio (`python -m bench.tenants`)",
        "",
        f"`bench.clusters`' trace ({t['requests']} requests of one image, Zipf s={pop['exponent']} over "
        f"{pop['catalogue']} images, each request on one of 2 clusters, seed {t['seed']}), each request now from "
        "one of T tenants (uniform). With `--tenant-header` each cache level keys an item by (tenant, image), so a "
        "popular image is encoded and stored once per tenant that asks for it. Predicted by the capacity model "
        "(each (tenant, image) its own item) at the tiers' default sizes, where every miss is compulsory, and "
        f"with every cache scaled by {result['small_scale']:.3f} (a cluster tier then holds a quarter of the "
        "one-tenant working set); measured on the real fleet (encoder site and two cluster tiers on their own "
        "hosts, TLS) at the default sizes.",
        "",
        "| tenants | distinct items | cluster tiers' hit ratio | shared tier's | encodes (x one tenant's) | "
        "small caches: cluster | shared | encodes |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, p in predicted.items():
        d, s = p["default"], p["small"]
        lines.append(f"| {n} | {d['unique']} | {_pct(d['cluster'])} | {_pct(d['shared'])} | {d['encodes']} "
                     f"({d['encodes'] / one['default']['encodes']:.2f}x) | {_pct(s['cluster'])} | "
                     f"{_pct(s['shared'])} | {s['encodes']} |")
    if measured:
        lines += ["", "Measured on the fleet beside the model's prediction for the same tenants and shards:", "",
                  "| tenants | cluster tiers' hit ratio (measured / predicted) | shared tier's | encodes |",
                  "|---:|---:|---:|---:|"]
        for n, m in measured.items():
            p = m["predicted"]
            lines.append(f"| {n} | {_pct(m['cluster'])} / {_pct(p['cluster'])} | {_pct(m['shared'])} / "
                         f"{_pct(p['shared'])} | {m['encodes']} / {p['encodes']} |")
    else:
        lines += ["", f"Not measured on the fleet: {result.get('not_measured', 'no run')}."]
    many = predicted[str(max(int(n) for n in predicted))]["default"]
    lines += ["", f"The cost is the sharing lost: with one tenant {_pct(one['default']['cluster'])} of lookups hit "
              f"a cluster tier; with {max(int(n) for n in predicted)} tenants {_pct(many['cluster'])}, and the fleet "
              f"encodes {many['encodes'] / one['default']['encodes']:.2f}x as often. Tenants that ask for disjoint "
              "images lose nothing; the scope costs most where tenants share a popular catalogue, which is exactly "
              "what it hides from each other."]
    return "\n".join(lines) + "\n"
