"""BENCHMARKS.md's section for bench/wan.py: its figures (the JSON it writes) as markdown."""

from __future__ import annotations

from pathlib import Path

from bench import stats

RATE = {"unshaped": "no shaping (veth + bridge)", "10gbit": "10 Gbit/s", "1gbit": "1 Gbit/s"}


def section(result: dict, plots: Path) -> str:
    ms, kinds, body = result["ms"], result["kinds"], result["body_mb"]
    lines = [
        "## A WAN link between a model cluster and its encoder site (`python -m bench.wan`)",
        "",
        "Two hosts as network namespaces on one bridge (harness/hosts.py): the encoder site "
        "(`graphs/encoder-site.yaml`, the generated `wide` checkpoint: Kimi-K2.5's 7168-wide rows, fp32) and a "
        "model cluster's cluster tier, TLS with client certificates on every hop from one CA; the client "
        "fetches bodies through the cluster tier as an engine does, one kept-alive connection. The site's link "
        "is shaped with `tc qdisc ... tbf` in both directions (bandwidth only: this kernel has no netem, so no "
        f"added delay), the rates alternating within each of {result['rounds']} round(s); median (min-max) of "
        "single requests, in ms. Bodies: " + ", ".join(f"{img} {mb:.1f} MB" for img, mb in body.items()) + ".",
        "",
        "| image | link | " + " | ".join(kinds.values()) + " |",
        "|---|---|" + "---:|" * len(kinds),
    ]
    for img in result["images"]:
        for rate in result["rates"]:
            cells = [stats.fmt(ms[rate][img][k], 1) for k in kinds]
            lines.append(f"| {img} | {RATE.get(rate, rate)} | " + " | ".join(cells) + " |")
    lines += ["", *reading(result)]
    return "\n".join(lines) + "\n"


def reading(result: dict) -> list[str]:
    """What the table says for where a tier goes, from the figures themselves."""
    ms, out = result["ms"], []
    for img in result["images"]:
        for rate in ("1gbit", "10gbit"):
            if rate not in ms:
                continue
            local, across = ms[rate][img]["cluster"]["median"], ms[rate][img]["shared"]["median"]
            out.append(f"- {img}, {RATE[rate]}: the cluster's own tier answers {across / local:.1f}x faster than the "
                       f"site's shared tier across the link ({local:.0f} vs {across:.0f} ms).")
    body = max(result["body_mb"].values())
    out += ["", f"Where a tier goes: a body is tens of MB (here up to {body:.0f} MB: fp32 rows 7168 wide; bf16 "
            "halves it), so at 1 Gbit/s the link alone costs about 8 ms per MB, more than a local hit's whole "
            "answer: every model cluster keeps its own cluster tier, so what it asked for before never crosses "
            "the link again. The site's shared tier is what saves an encode (seconds) when another cluster "
            "asked first; across a 10 Gbit/s link it costs a fraction more than a local hit. Bandwidth only: "
            "a WAN's round trips (not shaped here) add to every request that crosses, the hits' too."]
    return out
