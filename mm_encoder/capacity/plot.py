"""The capacity model's plot, a plain SVG written here (no plotting library): the same trace at
several cache sizes (every tier scaled by one factor, log axis), two panels: the hit ratio per
tier, and the encoders needed (or the encodes per second, without a worker capacity)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from xml.sax.saxutils import escape

from .simulate import Result

W, H = 900, 380
PANEL_W, PANEL_H = 340, 260
LEFT, TOP = 80, 60
GAP = 110
COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:g}" if abs(v) < 1e4 else f"{v:,.0f}"


def _panel(x0: int, title: str, xs: Sequence[float], series: dict[str, list[float | None]], y_max: float | None,
           percent: bool) -> list[str]:
    out = [f'<text x="{x0 + PANEL_W / 2}" y="{TOP - 20}" text-anchor="middle" font-weight="bold">'
           f'{escape(title)}</text>',
           f'<rect x="{x0}" y="{TOP}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#888"/>']
    values = [v for vs in series.values() for v in vs if v is not None]
    hi = y_max if y_max is not None else max(values or [1.0]) * 1.1 or 1.0
    lx = [math.log2(x) for x in xs]
    x_lo, x_hi = min(lx), max(lx) if max(lx) > min(lx) else min(lx) + 1

    def px(x: float) -> float:
        return x0 + (math.log2(x) - x_lo) / (x_hi - x_lo) * PANEL_W

    def py(y: float) -> float:
        return TOP + PANEL_H - y / hi * PANEL_H

    for t in _ticks(0, hi):
        label = f"{t:.0%}" if percent else _fmt(t)
        out.append(f'<line x1="{x0}" x2="{x0 + PANEL_W}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{x0 - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{label}</text>')
    for x in xs:
        out.append(f'<text x="{px(x):.1f}" y="{TOP + PANEL_H + 18}" text-anchor="middle">{x:g}x</text>')
    out.append(f'<text x="{x0 + PANEL_W / 2}" y="{TOP + PANEL_H + 40}" text-anchor="middle">'
               'cache sizes (every tier, x the given size)</text>')
    for i, (name, vs) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        pts = [(px(x), py(v)) for x, v in zip(xs, vs, strict=True) if v is not None]
        if pts:
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="'
                       + " ".join(f"{a:.1f},{b:.1f}" for a, b in pts) + '"/>')
            out += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{colour}"/>' for a, b in pts]
        if len(series) > 1:
            ly = TOP + 16 + 16 * i
            out.append(f'<rect x="{x0 + 10}" y="{ly - 9}" width="10" height="10" fill="{colour}"/>')
            out.append(f'<text x="{x0 + 26}" y="{ly}">{escape(name)}</text>')
    return out


def render(results: Sequence[Result], scales: Sequence[float]) -> str:
    """The SVG text for a sweep (`simulate.sweep`) over `scales`."""
    hit = {"cluster tier": [r.cluster.hit_ratio for r in results],
           "shared tier": [r.shared.hit_ratio for r in results],
           "encoder cache": [r.encoder.hit_ratio for r in results]}
    t = results[0].traffic
    if t.capacity_pps is not None:
        right_title = f"encoders needed (at {t.target_utilization:.0%} of {t.capacity_pps:,.0f} patches/s)"
        right: dict[str, list[float | None]] = {"encoders": [float(r.encoders_needed or 0) for r in results]}
    else:
        right_title = "encodes per second reaching the fleet"
        right = {"encodes/s": [r.encodes_per_second for r in results]}
    head = (f"{t.requests:,} requests at {t.requests_per_second:g}/s, Zipf s={t.popularity.exponent:g} over "
            f"{t.popularity.catalogue:,} images, {t.clusters} cluster tier(s), {len(t.ring_names())} shards")
    body = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
            'font-size="12">', f'<rect width="{W}" height="{H}" fill="white"/>',
            f'<text x="{W / 2}" y="18" text-anchor="middle">{escape(head)}</text>',
            *_panel(LEFT, "hit ratio per tier", scales, hit, 1.0, True),
            *_panel(LEFT + PANEL_W + GAP, right_title, scales, right, None, False), "</svg>"]
    return "\n".join(body) + "\n"


def write(path: Path, results: Sequence[Result], scales: Sequence[float]) -> None:
    path.write_text(render(results, scales))
