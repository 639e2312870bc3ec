"""`mm-encoder capacity`: the cache hierarchy and the encode fleet a traffic needs (docs/capacity.md).

    mm-encoder capacity --rps 2000 --zipf 0.9 --catalogue 50000000 --clusters 8 --shards 16 \\
        --shard-size 64g --cluster-tier-size 16g --capacity-pps 30000 --plot capacity.svg
    mm-encoder capacity --traffic traffic.yaml --capacity-from http://encoder:8090 --json

A traffic file holds `Traffic`'s fields (the options below override it). Exit 2 on a bad value,
naming the field.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .simulate import Result, prepare, simulate, sweep
from .traffic import Traffic

METRIC = "dynamo_component_encode_capacity_patches_per_second"
# option -> Traffic field (a dotted path for a nested one)
OPTIONS: dict[str, tuple[str, str]] = {
    "--rps": ("requests_per_second", "requests per second"),
    "--media-per-request": ("media_per_request", "media items per request (a mean)"),
    "--image-mix": ("image_mix", "WxH:weight,... (default 1280x720:0.5,1920x1080:0.3,3840x2160:0.2)"),
    "--zipf": ("popularity.exponent", "the Zipf exponent s of the catalogue's popularity (0: uniform)"),
    "--catalogue": ("popularity.catalogue", "distinct images"),
    "--requests": ("requests", "requests in the synthetic trace (default 1,000,000)"),
    "--clusters": ("clusters", "LLM clusters: one cluster tier each"),
    "--cluster-tier-size": ("cluster_tier_bytes", "each cluster tier's --max-size (1g)"),
    "--shards": ("shards", "shared-tier shards"),
    "--shard-size": ("shard_bytes", "each shard's --max-size (2g)"),
    "--shard-name": ("shard_name", "the shards' names as the router writes them, {i} = 0, 1, ..."),
    "--encoder-cache": ("encoder_cache_bytes", "each encode worker's --cache-bytes (1g)"),
    "--encoders": ("encoders", "encode workers (default: as many as needed)"),
    "--capacity-pps": ("capacity_pps", "one worker's patches per second"),
    "--utilization": ("target_utilization", "target utilization of the workers (0.7)"),
    "--model": ("model", "registry model: patch size, resize rule, projector width (kimi-k2.5-vision)"),
    "--dtype": ("dtype", "the rows' dtype (bf16)"),
    "--compression": ("compression", "body bytes per raw byte (1.0; docs/wire-format.md measured 0.88)"),
    "--seed": ("seed", "the trace's seed"),
}
FIELD_OPTION = {f: o for o, (f, _) in OPTIONS.items()}
DEFAULT_SCALES = (0.25, 0.5, 1.0, 2.0, 4.0)


class UsageError(Exception):
    pass


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mm-encoder capacity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traffic", type=Path, help="a YAML file of the traffic's fields")
    for option, (_, help_) in OPTIONS.items():
        p.add_argument(option, help=help_)
    p.add_argument("--capacity-from", metavar="URL",
                   help=f"read one worker's capacity from its /metrics ({METRIC})")
    p.add_argument("--json", action="store_true", help="the whole result as JSON")
    p.add_argument("--plot", type=Path, metavar="FILE.svg", help="hit ratios and encoders vs cache sizes")
    p.add_argument("--scales", default=",".join(f"{s:g}" for s in DEFAULT_SCALES),
                   help="the plot's cache-size factors (default 0.25,0.5,1,2,4)")
    return p


def _set(doc: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        doc = doc.setdefault(part, {})
        if not isinstance(doc, dict):
            raise UsageError(f"{part}: expected a mapping")
    doc[last] = value


def capacity_from(url: str, timeout: float = 10) -> float:
    """One worker's measured patches per second, from its /metrics."""
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read(1 << 22).decode(errors="replace")
    except (OSError, ValueError) as e:
        raise UsageError(f"capacity_from: cannot read {url}: {e}") from None
    for line in text.splitlines():
        if line.startswith(METRIC + " ") or line.startswith(METRIC + "{"):
            value = float(line.rsplit(" ", 1)[1])
            if not math.isfinite(value) or value <= 0:
                raise UsageError(f"capacity_from: {url} reports {METRIC} = {value} (not measured yet)")
            return value
    raise UsageError(f"capacity_from: {url} has no {METRIC}")


def traffic_from(args: argparse.Namespace) -> Traffic:
    doc: dict[str, Any] = {}
    if args.traffic is not None:
        try:
            loaded = yaml.safe_load(args.traffic.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise UsageError(f"traffic: cannot read {args.traffic}: {e}") from None
        if not isinstance(loaded, dict):
            raise UsageError(f"traffic: {args.traffic} is not a mapping of the traffic's fields")
        doc = loaded
    for option, (dotted, _) in OPTIONS.items():
        value = getattr(args, option[2:].replace("-", "_"))
        if value is not None:
            _set(doc, dotted, value)
    if args.capacity_from:
        doc["capacity_pps"] = capacity_from(args.capacity_from)
    return Traffic.model_validate(doc)


def describe(error: ValidationError) -> list[str]:
    """One line per problem: the field (and its option), what is wrong."""
    lines = []
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"]) or "traffic"
        option = FIELD_OPTION.get(where) or FIELD_OPTION.get(str(e["loc"][0]) if e["loc"] else "")
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{where}{f' ({option})' if option else ''}: {msg}")
    return lines


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def table(r: Result) -> str:
    t = r.traffic
    lines = [f"{t.requests:,} requests ({r.items:,} images, {r.unique:,} unique) at {t.requests_per_second:g}/s: "
             f"{t.duration_s / 3600:.2f} h of traffic, simulated in {r.seconds:.1f} s",
             "image mix: " + ", ".join(f"{c.width}x{c.height} {c.share:.0%} ({c.patches:,} patches, "
                                       f"{_bytes(c.body_bytes)})" for c in r.classes),
             f"working set (every unique image once): {_bytes(r.working_set_bytes)}", "",
             f"{'level':14s} {'caches':>7s} {'size each':>10s} {'lookups':>12s} {'hits':>12s} {'hit ratio':>9s} "
             f"{'peak (busiest)':>14s}"]
    for name, level in (("cluster tier", r.cluster), ("shared tier", r.shared), ("encoder cache", r.encoder)):
        lines.append(f"{name:14s} {level.caches:7d} {_bytes(level.bytes_each):>10s} {level.lookups:12,d} "
                     f"{level.hits:12,d} {_pct(level.hit_ratio):>9s} {_bytes(level.peak_bytes):>14s}")
    n = len(r.shard_lookups)
    lines += ["", f"shards: the busiest takes {r.busiest_shard_share:.1%} of shard lookups (even: {1 / n:.1%}); "
              "ring shares " + " ".join(f"{s:.1%}" for s in r.ring_shares[:16]) + (" ..." if n > 16 else ""),
              f"fleet: {r.encodes:,} encodes, {r.encodes_per_unique:.3f} per unique image; "
              f"{r.encodes_per_second:,.2f} encodes/s, {r.patches_per_second:,.0f} patches/s"]
    if t.capacity_pps is not None:
        lines.append(f"encoders needed: {r.encoders_needed} (at {t.target_utilization:.0%} of "
                     f"{t.capacity_pps:,.0f} patches/s each; caches simulated with {r.encoders})")
    else:
        lines.append("encoders needed: give --capacity-pps or --capacity-from URL (a worker's /metrics)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        scales = [float(s) for s in args.scales.split(",") if s.strip()]
        if not scales or len(scales) > 16 or not all(1 / 1024 <= s <= 1024 for s in scales):
            raise ValueError
    except ValueError:
        print("error: scales (--scales): 1 to 16 factors in 1/1024..1024, like 0.25,0.5,1,2,4", file=sys.stderr)
        return 2
    try:
        traffic = traffic_from(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValidationError as e:
        print("error: bad traffic:\n" + "\n".join(f"  {line}" for line in describe(e)), file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    prepared = prepare(traffic)
    result = simulate(traffic, prepared=prepared)
    result.seconds = time.perf_counter() - t0  # the trace and its keys included
    doc = result.as_dict()
    if args.plot is not None:
        from . import plot

        results = sweep(traffic, sorted(scales), result, prepared)
        plot.write(args.plot, results, sorted(scales))
        doc["sweep"] = [{"scale": s, "hit_ratios": {"cluster": x.cluster.hit_ratio, "shared": x.shared.hit_ratio,
                                                   "encoder_cache": x.encoder.hit_ratio},
                         "encodes_per_second": x.encodes_per_second, "encoders_needed": x.encoders_needed}
                        for s, x in zip(sorted(scales), results, strict=True)]
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(table(result))
        if args.plot is not None:
            print(f"plot: {args.plot}")
    return 0
