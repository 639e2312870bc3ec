"""`mm-encoder status`: per component of a running graph: up/down, requests, cache hit ratio per
level, encodes and p50 latency. Reads `state.json` from the graph's run directory and asks each
component (frontend `/mm/stats`, encoder `/metrics`, cache tiers `/_cache/stats`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import urllib.request
from pathlib import Path
from typing import Any


def _get(url: str, timeout: float = 2.0) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()
    except OSError:
        return None


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def histogram_p50(samples: dict[str, float], metric: str, labels: str) -> float | None:
    """Median from cumulative Prometheus buckets (upper bound of the bucket holding it), seconds."""
    buckets = []
    for key, value in samples.items():
        if key.startswith(metric + "_bucket{") and labels in key:
            le = key.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), value))
    if not buckets:
        return None
    buckets.sort()
    total = buckets[-1][1]
    if total == 0:
        return None
    return next(le for le, count in buckets if count >= total / 2)


def collect(run_dir: Path) -> dict[str, Any]:
    state = json.loads((run_dir / "state.json").read_text())
    rows = []
    for c in state["components"]:
        row = {"name": c["name"], "kind": c["kind"], "up": _alive(c.get("pid"))}
        url = c.get("url")
        if row["up"] and url and c["kind"] == "encoder":
            text = _get(f"{url}/metrics")
            if text is not None:
                s = _samples(text.decode())
                row["requests"] = sum(v for k, v in s.items() if k.startswith("mm_encoder_requests_total{"))
                row["encodes"] = s.get("mm_encoder_forward_items_total", 0.0)
                for level in ("alias", "mm_hash"):
                    hits = s.get(f'mm_encoder_cache_hits_total{{level="{level}"}}', 0.0)
                    misses = s.get(f'mm_encoder_cache_misses_total{{level="{level}"}}', 0.0)
                    row[f"hit_{level}"] = hits / (hits + misses) if hits + misses else None
                p50 = histogram_p50(s, "mm_encoder_stage_seconds", 'stage="total"')
                row["p50_ms"] = p50 * 1e3 if p50 is not None else None
        elif row["up"] and url and c["kind"].startswith("cache-") and c["kind"] != "cache-router":
            raw = _get(f"{url}/_cache/stats")
            if raw:
                counts = json.loads(raw)
                row["requests"] = counts.get("requests", 0)
                looked = sum(v for k, v in counts.items() if k in ("HIT", "MISS", "EXPIRED", "STALE", "UPDATING"))
                row["hit_ratio"] = counts.get("HIT", 0) / looked if looked else None
        elif row["up"] and url and c["kind"] == "frontend":
            raw = _get(f"{url}/mm/stats")
            if raw:
                procs = json.loads(raw).get("processors", [])
                row["requests"] = sum(p["requests"] for p in procs)
                row["encoder_calls"] = sum(p["encoder_calls"] for p in procs)
                row["errors"] = sum(sum(p["errors"].values()) for p in procs)
                routed: dict[str, int] = {}
                for p in procs:
                    for k, v in p["routed"].items():
                        routed[k] = routed.get(k, 0) + v
                row["routed"] = routed
        rows.append(row)
    return {"graph": state["graph"], "base_url": state["base_url"], "components": rows}


def format_lines(status: dict[str, Any]) -> list[str]:
    lines = []
    for r in status["components"]:
        parts = [f"{r['name']:12s} {r['kind']:14s} {'up' if r['up'] else 'DOWN':4s}"]
        for key, label in (("requests", "requests"), ("encodes", "encodes"), ("encoder_calls", "encoder calls"),
                           ("errors", "errors")):
            if r.get(key) is not None:
                parts.append(f"{label}={r[key]:.0f}")
        for key, label in (("hit_ratio", "hit"), ("hit_alias", "alias hit"), ("hit_mm_hash", "mm_hash hit")):
            if key in r:
                parts.append(f"{label}={'-' if r[key] is None else format(r[key], '.0%')}")
        if r.get("p50_ms") is not None:
            parts.append(f"p50<={r['p50_ms']:.0f}ms")
        if r.get("routed"):
            parts.append("routed=" + ",".join(str(v) for v in r["routed"].values()))
        lines.append("  " + "  ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mm-encoder status", description=__doc__)
    p.add_argument("--run-dir", type=Path, default=None, help="the graph's run dir (default: /tmp/mm-encoder-epd)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    run_dir = args.run_dir or Path("/tmp/mm-encoder-epd")
    if not (run_dir / "state.json").is_file():
        print(f"error: no running graph in {run_dir} (start one with mm-encoder serve)", file=sys.stderr)
        return 2
    status = collect(run_dir)
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(f"graph {status['graph']}: {status['base_url']}")
        print("\n".join(format_lines(status)))
    return 0
