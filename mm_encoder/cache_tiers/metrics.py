"""The tiers' Prometheus metrics, per calling cluster: the families nginx serves on `GET /metrics`
(counted in Lua, `configs/nginx/tier_metrics.lua`, from each request's log phase). The names, types,
help and labels live here only: the tier's run directory gets them as a Lua table
(`lua_families`), and docs/observability.md's table is checked against them (harness/metric_exports.py).

The calling cluster (label `cluster`) is the model cluster a request came from: a cluster tier's
`--cluster-name` (it sends it on as `X-MM-Cluster`), with TLS the graph of a calling cluster tier's
certificate, else the `X-MM-Cluster` header as received (`unknown` when absent, `invalid` when not
1-63 of [a-z0-9-]). Past MAX_LABELS distinct values a tier counts the rest as `other`: a caller
cannot grow the tier's memory by sending new names."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LABELS = 64  # distinct `cluster` (and `shard`) values per tier; the rest are `other`
PREFIX = "dynamo_component_cache_tier_"


@dataclass(frozen=True)
class TierFamily:
    key: str  # its counters' key in the tier's lua_shared_dict
    name: str  # as queried (a counter's with `_total`)
    help: str
    labels: tuple[str, ...]  # besides `tier`
    tiers: tuple[str, ...] = ("cluster", "shared", "router")  # the tiers that count it

    type: str = "counter"


FAMILIES = (
    TierFamily("requests", PREFIX + "requests_total",
               "Encode requests (/v1/encode and /v1/encode/fetch) the tier answered, by calling cluster.",
               ("cluster",)),
    TierFamily("results", PREFIX + "results_total",
               "Cache lookups by nginx's result (HIT, MISS, EXPIRED, BYPASS, STALE, UPDATING, REVALIDATED), "
               "by calling cluster.", ("cluster", "result"), ("cluster", "shared")),
    TierFamily("bytes", PREFIX + "response_bytes_total",
               "Bytes sent to callers, headers included, by calling cluster.", ("cluster",)),
    TierFamily("errors", PREFIX + "upstream_errors_total",
               "Answers of 500 or above from the next level, or from nginx when it could not reach it "
               "(502, 504), by calling cluster and status.", ("cluster", "status")),
    TierFamily("shard", PREFIX + "shard_requests_total",
               "The router's requests by the shard that answered (the last one tried).", ("shard",), ("router",)),
)


def _lua_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def lua_families() -> str:
    """FAMILIES as a Lua module (`tier_metrics_families.lua` in the run directory)."""
    rows = []
    for f in FAMILIES:
        labels = ", ".join(_lua_string(label) for label in f.labels)
        tiers = ", ".join(f"[{_lua_string(t)}] = true" for t in f.tiers)
        rows.append(f"  {{key = {_lua_string(f.key)}, name = {_lua_string(f.name)}, type = {_lua_string(f.type)}, "
                    f"help = {_lua_string(f.help)}, labels = {{{labels}}}, tiers = {{{tiers}}}}},")
    return "-- Written by mm_encoder/cache_tiers/metrics.py: the families /metrics serves.\nreturn {\n" + \
        "\n".join(rows) + f"\n  max_labels = {MAX_LABELS},\n}}\n"
