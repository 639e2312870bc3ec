"""BENCHMARKS.md's section for bench/hostile_memory.py: its figures (the JSON it writes) as markdown and plots."""

from __future__ import annotations

from pathlib import Path

from bench import stats

PATCH_BYTES = 3 * 14 * 14 * 4  # one prepared float32 patch


# Peak RSS before the limits (issue 13's measurements), for the table.
BEFORE_MB = {"bodies": 4200.0, "jpegs": 3400.0}


ATTACKS = {"bodies": "32 concurrent 60 MB msgpack bodies", "jpegs": "8 concurrent 2.5 KB JPEGs claiming 8000x8000",
           "video_longest": "the longest video allowed: 600 s of 448x448 at 2 fps (1,200 frames x 256 patches)",
           "video_patch_cap": "a video at `--max-video-patches 262144`: 64 frames x 4,096 patches"}


def _answers(statuses: dict) -> str:
    names = {"0": "connection closed", "200": "200", "413": "413", "422": "422", "503": "503"}
    items = sorted(statuses.items(), key=lambda kv: str(kv[0]))
    return ", ".join(f"{n} x {names.get(str(k), str(k))}" for k, n in items)


def section(result: dict, plots: Path) -> str:
    a = result["attacks"]
    idle = a["idle"]["peak_rss_mb"]
    lines = [
        "## Hostile load: worker memory (`python -m bench.hostile_memory`)",
        "",
        "Peak RSS of one encode worker (`tiny`, default limits), each attack in a fresh worker on loopback. Peak is "
        f"the kernel's VmHWM, read after the attack; median (min-max) over {result['repeats']} run(s) each. The idle "
        f"worker peaks at {stats.fmt(idle, 0)} MB.",
        "",
        "| attack | before (issue 13's measurements) | now, peak RSS MB | answers (last run) |",
        "|---|---:|---:|---|",
    ]
    for name, label in ATTACKS.items():
        if name not in a:
            continue
        before = f"{BEFORE_MB[name] / 1000:.1f} GB" if name in BEFORE_MB else "-"
        lines.append(f"| {label} | {before} | {stats.fmt(a[name]['peak_rss_mb'], 0)} | "
                     f"{_answers(a[name]['statuses'])} |")
    lines += [
        "",
        "- The bound for bodies: `--max-receiving-bytes` (256 MiB) of bodies in flight, about twice that at peak "
        "(the bytes read and their msgpack unpacking); bodies past it are refused 503 `overloaded` from their "
        "headers, before they are read.",
        "- Lying JPEGs are refused before decoding (422 `corrupt`): there are fewer bits of scan data than 1 per "
        "8x8 block. Decoding is also bounded across requests, at 4 x `--max-pixels` pixels at once.",
    ]
    if "video_patch_cap" in a and "video_longest" in a:
        per_patch = {name: (a[name]["peak_rss_mb"]["median"] - idle["median"]) * 2**20 / patches
                     for name, patches in (("video_patch_cap", 1 << 18), ("video_longest", 1200 * 256))}
        worst = max(per_patch.values())
        lines += [
            "- Videos are decoded chunk by chunk (frames are never all held); what grows with a video is its prepared "
            "patches, which its forward needs together, plus what decoding its frames leaves in the allocator. "
            f"Measured over idle: {per_patch['video_patch_cap']:,.0f} bytes per patch with 4,096-patch frames and "
            f"{per_patch['video_longest']:,.0f} with 256-patch frames (per-frame overhead; the prepared patches "
            f"alone are {PATCH_BYTES // 2:,} bytes in bf16, {PATCH_BYTES:,} in fp32).",
            "- The bound, across all requests: patches prepared and waiting for their forward are held against "
            "`--max-prepared-patches` (default `--max-video-patches`, 2^21: the largest video fits alone; others "
            "wait `--decode-wait-s`, then 503 `overloaded`), so the worker's peak stays under idle + "
            f"`--max-prepared-patches` x {worst:,.0f} bytes (the worst per-patch cost above) + the caches "
            f"(`--cache-bytes`): {(1 << 21) * worst / 2**30:.1f} GB + 1 GiB at the defaults. Without that budget "
            "`--max-pending` (64 requests) let 64 long videos wait prepared at once. A host that serves long videos "
            "with less memory lowers both (2^20 patches is 262,144 LLM tokens, about a 256K context). A 600 s video "
            "of 4,096-patch frames (4.9 M patches) is refused from its header, before decoding (413 `too_large`).",
        ]
    lines.append("")
    return "\n".join(lines)
