"""`mm-encoder status [--watch]`: per component of a running graph: up/down, requests, cache hit ratio
per level (and a tier's requests and hits per calling cluster), encodes, p50 and p95 latency, the
frontend's slowest recent request. Reads `state.json` from the graph's run directory and asks each
component (frontend `/mm/stats`, encoder `/metrics`, cache tiers `/_cache/stats`, the encode planner
`/status`: encoders wanted and running, its last decision and why), and with TLS how long each
component's certificates have left."""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from ..core.quantiles import from_buckets, nearest_rank
from ..security.tls import tls_client


def _get(url: str, context: ssl.SSLContext | None = None, timeout: float = 2.0) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as r:
            body: bytes = r.read()
            return body
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


def samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition (prometheus_client's parser)."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(found: list[Sample], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(s.value for s in found if s.name == name and labels.items() <= s.labels.items())


def histogram_quantile(found: list[Sample], metric: str, q: float, **labels: str) -> float | None:
    """The q-quantile from cumulative Prometheus buckets, as the upper bound of the bucket holding it
    (what a histogram can say without interpolating), seconds; None without observations."""
    buckets = sorted((float(s.labels["le"]), s.value) for s in found
                     if s.name == f"{metric}_bucket" and labels.items() <= s.labels.items())
    return from_buckets(buckets, q, interpolate=False)


def collect(run_dir: Path) -> dict[str, Any]:
    state = json.loads((run_dir / "state.json").read_text())
    rows = []
    # with TLS: encoders and tiers in plaintext on their ops ports; the frontend's HTTPS with the CA and
    # the launcher's certificate
    tls = state.get("tls")
    context = tls_client(tls["ca"], tls.get("cert"), tls.get("key")) if tls else None
    for c in state["components"]:
        row = {"name": c["name"], "kind": c["kind"], "up": _alive(c.get("pid")), **_expiry(c)}
        url = c.get("ops_url") or c.get("url")
        if row["up"] and url and c["kind"] == "encoder":
            text = _get(f"{url}/metrics")
            if text is not None:
                found = samples(text.decode())
                row["requests"] = total(found, "dynamo_component_encode_requests_total")
                row["encodes"] = total(found, "dynamo_component_encode_forward_items_total")
                for level in ("alias", "mm_hash"):
                    hits = total(found, "dynamo_component_embedding_cache_hits_total", level=level)
                    misses = total(found, "dynamo_component_embedding_cache_misses_total", level=level)
                    row[f"hit_{level}"] = hits / (hits + misses) if hits + misses else None
                for q, key in ((0.5, "p50_ms"), (0.95, "p95_ms")):
                    v = histogram_quantile(found, "dynamo_component_encode_stage_duration_seconds", q, stage="total")
                    row[key] = v * 1e3 if v is not None else None
        elif row["up"] and url and c["kind"].startswith("cache-"):
            raw = _get(f"{url}/_cache/stats")
            if raw:
                row.update(tier_counts(json.loads(raw), c["kind"]))
        elif row["up"] and url and c["kind"] == "planner":
            raw = _get(f"{url}/status")
            if raw:
                planner = json.loads(raw)
                row.update(wanted=planner["wanted"], running=planner["running"], decision=planner["last_decision"],
                           signals=planner["signals"])
        elif row["up"] and url and c["kind"] == "frontend":
            raw = _get(f"{url}/mm/stats", context)
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
                row.update(_recent(procs))
        rows.append(row)
    out = {"graph": state["graph"], "base_url": state["base_url"], "components": rows}
    if "scaling" in state:  # what `serve` carried out of the planner's decisions
        out["scaling"] = state["scaling"]
    return out


LOOKUPS = ("HIT", "MISS", "EXPIRED", "STALE", "UPDATING")  # the results that looked in the cache


def _hit_ratio(counts: dict[str, Any]) -> float | None:
    looked = sum(counts.get(k, 0) for k in LOOKUPS)
    return counts.get("HIT", 0) / looked if looked else None


def tier_counts(stats: dict[str, Any], kind: str) -> dict[str, Any]:
    """A tier's row from its /_cache/stats: requests and hit ratio (a cache tier's), and the same per
    calling cluster (`clusters`: the encoder site's operator sees which model cluster asks what)."""
    clusters = stats.get("clusters", {})
    router = kind == "cache-router"
    row: dict[str, Any] = {"requests": sum(c["requests"] for c in clusters.values()) if router
                           else stats.get("requests", 0)}
    if not router:
        row["hit_ratio"] = _hit_ratio(stats)
    row["clusters"] = {name: {"requests": c["requests"], **({} if router else {"hits": c.get("HIT", 0),
                                                                                "hit_ratio": _hit_ratio(c)})}
                       for name, c in sorted(clusters.items())}
    return row


def _expiry(component: dict[str, Any]) -> dict[str, float]:
    """Seconds until the component's certificates end (its own, and Dynamo's planes' where it has one)."""
    now = time.time()
    return {key.replace("not_after", "expires_in_s"): datetime.fromisoformat(component[key]).timestamp() - now
            for key in ("cert_not_after", "plane_cert_not_after") if component.get(key)}


def _recent(procs: list[dict[str, Any]]) -> dict[str, Any]:
    """The frontend's recent requests (its /mm/stats, up to 256 per processor): the p50 and p95 of
    the time before the engine (encode + route, ms), and the slowest of them by request id (and its
    trace id, where the frontend traces)."""
    recent = [r for p in procs for r in p.get("recent", [])]
    spent = [(sum(v for k, v in r.get("timings", {}).items() if k in ("encode_ms", "route_ms")), r) for r in recent]
    if not spent:
        return {}
    slowest_ms, slowest = max(spent, key=lambda x: x[0])
    return {"p50_ms": nearest_rank([ms for ms, _ in spent], 0.5), "p95_ms": nearest_rank([ms for ms, _ in spent], 0.95),
            "slowest": {"request_id": slowest.get("request_id"), "trace_id": slowest.get("trace_id"), "ms": slowest_ms,
                        "timings": slowest.get("timings", {})}}


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
            bound = "<=" if r["kind"] == "encoder" else "="  # an encoder's are its histogram's bucket bounds
            parts.append(f"p50{bound}{r['p50_ms']:.0f}ms p95{bound}{r['p95_ms']:.0f}ms")
        if r.get("slowest"):
            slow = r["slowest"]
            parts.append(f"slowest={slow['request_id']} ({slow['ms']:.0f}ms"
                         + (f", trace {slow['trace_id']})" if slow.get("trace_id") else ")"))
        if r.get("routed"):
            parts.append("routed=" + ",".join(str(v) for v in r["routed"].values()))
        for key, label in (("cert_expires_in_s", "cert"), ("plane_cert_expires_in_s", "dynamo cert")):
            if key in r:
                parts.append(f"{label} {'EXPIRED' if r[key] <= 0 else 'ends in ' + _duration(r[key])}")
        if r.get("kind") == "planner" and r.get("wanted") is not None:
            parts.append(f"encoders wanted={r['wanted']} running={r['running']}")
            if d := r.get("decision"):
                parts.append(f"last: {d['action']} {d['from']}->{d['replicas']} ({d['reason']})")
        lines.append("  " + "  ".join(parts))
        for name, c in r.get("clusters", {}).items():  # a tier's calling clusters, one line each
            hits = "" if "hits" not in c else f"  hits={c['hits']:.0f}" + (
                "" if c["hit_ratio"] is None else f" ({c['hit_ratio']:.0%})")
            lines.append(f"      from {name}: requests={c['requests']:.0f}{hits}")
    return lines


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mm-encoder status", description=__doc__)
    p.add_argument("--run-dir", type=Path, default=None, help="the graph's run dir (default: /tmp/mm-encoder-epd)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                   help="again every SECONDS (default 2) until Ctrl-C")
    p.add_argument("--count", type=int, default=None, help="with --watch: stop after this many")
    args = p.parse_args(argv)
    if args.watch is not None and args.watch <= 0:
        p.error("--watch: SECONDS must be above 0")
    if args.count is not None and args.count < 1:
        p.error("--count: at least 1")
    run_dir = args.run_dir or Path("/tmp/mm-encoder-epd")
    if not (run_dir / "state.json").is_file():
        print(f"error: no running graph in {run_dir} (start one with mm-encoder serve)", file=sys.stderr)
        return 2
    shown = 0
    try:
        while True:
            status = collect(run_dir)
            if args.json:
                print(json.dumps(status, indent=None if args.watch else 2), flush=True)
            else:
                stamp = f" at {time.strftime('%H:%M:%S')}" if args.watch else ""
                print(f"graph {status['graph']}: {status['base_url']}{stamp}")
                print("\n".join(format_lines(status)), flush=True)
            shown += 1
            if args.watch is None or (args.count is not None and shown >= args.count):
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
