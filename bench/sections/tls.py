"""BENCHMARKS.md's section for bench/tls.py: its figures (the JSON it writes) as markdown."""

from __future__ import annotations

from pathlib import Path

from bench import stats

WHAT = {"fetch": "an engine's body fetch (`POST /v1/encode/fetch`, the 4.7 MB body)",
        "head": "the frontend's header question (`HEAD /v1/encode`)"}


def section(result: dict, plots: Path) -> str:
    h, c = result["hits"], result["chat"]
    lines = [
        "## TLS against plaintext (`python -m bench.tls`)",
        "",
        "Two stacks at once, an encode worker (`tiny-wide`) behind a cluster tier, one in plaintext and one with "
        "TLS and client certificates on both hops; a cluster-tier hit asked with keep-alive connections (and TLS "
        f"session reuse) by an aiohttp client on uvloop, the stacks alternating, {result['rounds']} round(s) of "
        f"{result['seconds']:g} s each. The tier's CPU is nginx's own (all its processes, /proc schedstat) per "
        "request: what bounds a tier whose clients are other machines. Here the client shares the two cores, "
        "and decrypting costs it as much as encrypting costs the tier.",
        "",
        "| hit | plaintext req/s (8 conn.) | TLS req/s | ratio | plaintext p50 ms (1 conn.) | TLS p50 ms | "
        "tier CPU per hit, plaintext / TLS ms | the tier's capacity, TLS / plaintext |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w, label in WHAT.items():
        p, t = h["plaintext"][w], h["tls"][w]
        lines.append(f"| {label} | {stats.fmt(p['rps_c8'], 0)} | {stats.fmt(t['rps_c8'], 0)} | {h['ratio'][w]:.2f} | "
                     f"{stats.fmt(p['p50_c1_ms'], 2)} | {stats.fmt(t['p50_c1_ms'], 2)} | "
                     f"{stats.fmt(p['tier_cpu_ms'], 3, False)} / {stats.fmt(t['tier_cpu_ms'], 3, False)} | "
                     f"**{h['capacity_ratio'][w]:.2f}** |")
    target = result["target"]
    met = [w for w in WHAT if h["capacity_ratio"][w] >= target]
    lines += [
        "",
        f"- Target: cluster-tier hits at >= {target}x of plaintext. "
        + (f"Met for {', '.join(met)}; " if met else "Not met here; ")
        + "what TLS costs is the body's encryption (AES-128-GCM first in the tiers' ciphersuites) and, for nginx, "
        "one write per 16 KB TLS record where plaintext writes a megabyte at a time; Debian's kernel here has no "
        "kTLS, which would move the encryption into sendfile.",
        "",
        f"A full image chat, `mm-encoder serve graphs/epd.yaml` and the same with `--tls` at once, {result['chats']} "
        "chats each, alternating: median (min-max) ms.",
        "",
        "| chat | plaintext | TLS | ratio |",
        "|---|---:|---:|---:|",
        f"| a new image (an encode through every hop) | {stats.fmt(c['plaintext']['cold_ms'])} | "
        f"{stats.fmt(c['tls']['cold_ms'])} | {c['ratio']['cold_ms']:.2f} |",
        f"| the same image again (the tiers' hit) | {stats.fmt(c['plaintext']['hit_ms'])} | "
        f"{stats.fmt(c['tls']['hit_ms'])} | {c['ratio']['hit_ms']:.2f} |",
    ]
    return "\n".join(lines) + "\n"
