"""The encoder fleet's Grafana dashboard, built with grafana-foundation-sdk (the `dev` extra):

    python tools/dashboard.py            # writes mm_encoder/dashboards/encoder-fleet.json
    python tools/dashboard.py --check    # exit 1 when the committed JSON is not what this builds

The JSON ships in the wheel; `mm-encoder render-k8s` wraps it in a ConfigMap for Grafana's sidecar
(dashboards/grafana.py). Every query names metrics the package exports (tests/test_dashboard.py);
what each metric means: docs/observability.md "Metrics".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import Dashboard as DashboardBuilder
from grafana_foundation_sdk.builders.dashboard import DatasourceVariable, QueryVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

OUT = Path(__file__).resolve().parents[1] / "mm_encoder" / "dashboards" / "encoder-fleet.json"
UID = "mm-encoder-fleet"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
W = 'dynamo_namespace=~"$namespace",dynamo_component="mm_encoder"'  # the encode workers of the chosen namespaces
RI = "[$__rate_interval]"
E = "dynamo_component_encode"
C = "dynamo_component_embedding_cache"
REFUSED = W + ',outcome!~"ok|cancelled|overloaded|draining"'  # the refusals rejected_total does not count
T = "dynamo_component_cache_tier"
TC = 'cluster=~"$cluster"'  # the nginx tiers' requests from the chosen calling clusters (they carry no namespace)
LOOKED = TC + ',result=~"HIT|MISS|EXPIRED|STALE|UPDATING"'  # the results that looked in the cache
HIT = TC + ',result="HIT"'


def rate(metric: str, selector: str = W) -> str:
    return f"rate({metric}{{{selector}}}{RI})"


def quantile(q: float, histogram: str, by: str = "") -> str:
    keep = ", ".join(["le", *([by] if by else [])])
    return f"histogram_quantile({q}, sum by ({keep}) ({rate(histogram + '_bucket')}))"


def query(expr: str, legend: str) -> Dataquery:
    return Dataquery().expr(expr).legend_format(legend).datasource(DS)


def panel(ident: int, title: str, description: str, unit: str, *queries: Dataquery, width: int = 8,
          max_val: float | None = None) -> Timeseries:
    p = (Timeseries().id(ident).title(title).description(description).unit(unit).datasource(DS)
         .height(8).span(width).min(0).fill_opacity(10))
    if max_val is not None:
        p = p.max(max_val)
    for ref, q in zip("ABCDEFGH"[: len(queries)], queries, strict=True):
        p = p.with_target(q.ref_id(ref))
    return p


def pick_any(name: str, label: str, values: str) -> QueryVariable:
    """A variable over a label's values (`values`: label_values(...)), several at once, All by default."""
    return (QueryVariable(name).label(label).datasource(DS).query(values)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*")
            .current(VariableOption(selected=True, text="All", value="$__all")))


def row(ident: int, title: str) -> Row:
    return Row(title).id(ident)


def tier_hit_ratio(by: str) -> str:
    return f"sum by ({by}) ({rate(T + '_results_total', HIT)}) / sum by ({by}) ({rate(T + '_results_total', LOOKED)})"


def with_tier_panels(d: DashboardBuilder) -> DashboardBuilder:
    """The nginx tiers, per tier and per calling cluster (docs/observability.md "The calling cluster")."""
    return (
        d.with_row(row(105, "Cache tiers"))
        .with_panel(panel(
            13, "Tier hit ratio per tier", "Hits over lookups at each nginx tier (cluster, shared), all calling "
            "clusters chosen: a request the cluster tier answers never reaches the shared tier.", "percentunit",
            query(tier_hit_ratio("tier"), "{{tier}}"), max_val=1))
        .with_panel(panel(
            14, "Tier hit ratio per cluster", "Hits over lookups at each tier, per calling cluster: on the encoder "
            "site's shared tier, how much of each model cluster's misses another cluster had already paid for.",
            "percentunit", query(tier_hit_ratio("tier, cluster"), "{{cluster}} at {{tier}}"), max_val=1))
        .with_panel(panel(
            15, "Tier requests per cluster", "Encode requests per second each tier answered, per calling cluster "
            "(the router's are the encoder site's requests from each model cluster).", "reqps",
            query(f"sum by (tier, cluster) ({rate(T + '_requests_total', TC)})", "{{cluster}} at {{tier}}")))
        .with_panel(panel(
            16, "Tier upstream errors", "Answers of 500 or above per second from a tier's next level, or from nginx "
            "when it could not reach it (502, 504), by tier and status: one failure counts at each tier it passes.",
            "reqps", query(f"sum by (tier, status) ({rate(T + '_upstream_errors_total', TC)})",
                           "{{status}} at {{tier}}"), width=12))
        .with_panel(panel(
            17, "Tier bytes sent", "Bytes per second each tier sent its callers (headers included).", "Bps",
            query(f"sum by (tier) ({rate(T + '_response_bytes_total', TC)})", "{{tier}}"), width=12))
    )


def build() -> DashboardBuilder:
    hit = f"sum by (level) ({rate(C + '_hits_total')})"
    miss = f"sum by (level) ({rate(C + '_misses_total')})"
    forwards = f"sum({E}_forward_items_total{{{W}}})"
    refills = f'sum({C}_refills_total{{{W},level="mm_hash"}})'
    d = (
        DashboardBuilder("mm-encoder: encoder fleet")
        .uid(UID)
        .description("The disaggregated encode workers (mm_encoder) of the chosen Dynamo namespaces: requests "
                     "and latency per stage, the cache levels, the device, refusals and bytes moved; and the nginx "
                     "cache tiers per calling cluster.")
        .tags(["mm-encoder", "dynamo", "multimodal"])
        .refresh("30s")
        .time("now-1h", "now")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(pick_any("namespace", "Dynamo namespace",
                                f'label_values({E}_queue_depth{{dynamo_component="mm_encoder"}}, dynamo_namespace)'))
        .with_variable(pick_any("cluster", "Calling cluster (tiers)", f"label_values({T}_requests_total, cluster)"))
        .with_row(row(101, "Requests"))
        .with_panel(panel(
            1, "Encode requests by outcome", "Requests per second the encode workers finished, by outcome: ok, "
            "cancelled, or the error code they were refused with (both transports, HTTP and Dynamo RPC).", "reqps",
            query(f"sum by (outcome) ({rate(E + '_requests_total')})", "{{outcome}}")))
        .with_panel(panel(
            2, "Latency per stage (p95)", "The 95th percentile of each pipeline stage per request (fetch, decode, "
            "preprocess, queue, forward, pack) and of the whole request (total), from the stage histogram: "
            "interpolated within its buckets.", "s",
            query(quantile(0.95, E + "_stage_duration_seconds", "stage"), "{{stage}}")))
        .with_panel(panel(
            3, "Latency per stage (p50)", "The median of each pipeline stage per request, from the same histogram.",
            "s", query(quantile(0.5, E + "_stage_duration_seconds", "stage"), "{{stage}}")))
        .with_row(row(102, "Caches"))
        .with_panel(panel(
            4, "Hit ratio per cache level", "Hits over lookups at each of a worker's two LRU levels: alias (URL to "
            "mm_hash: a hit skips the download) and mm_hash (the encoded body: a hit skips decode and forward). "
            "The nginx tiers in front answer their hits before a worker sees the request.", "percentunit",
            query(f"{hit} / ({hit} + {miss})", "{{level}}"), max_val=1))
        .with_panel(panel(
            5, "Encodes per unique image", "Forward passes per distinct image, since the workers started: items "
            "encoded over the same less refills (a body put back for an mm_hash its worker's cache had dropped: "
            "a re-encode). 1.0 is every image encoded once. Counted per worker (the router's ring keeps an image "
            "on one worker); a worker remembers the last 65,536 mm_hashes it dropped, so a re-encode after more "
            "drops than that counts as a new image.", "none",
            query(f"{forwards} / ({forwards} - {refills})", "encodes per unique image")))
        .with_panel(panel(
            6, "Answered by level", "Successful requests per second by the level that answered: alias, mm_hash "
            "(the worker's caches), coalesced (joined identical work in flight), forward (encoded).", "reqps",
            query(f"sum by (level) ({rate(E + '_served_from_total')})", "{{level}}")))
        .with_row(row(103, "Device"))
        .with_panel(panel(
            7, "Queue wait", "Per item, from the device queue to its forward: p50 and p95 over all workers, from "
            "the queue-wait histogram (what the encode planner holds under its SLA).", "s",
            query(quantile(0.5, E + "_queue_wait_seconds"), "p50"),
            query(quantile(0.95, E + "_queue_wait_seconds"), "p95")))
        .with_panel(panel(
            8, "Forward busy fraction per worker", "Device seconds in forward passes per second, per worker: the "
            "share of time its device is busy (1.0: saturated).", "percentunit",
            query(f"sum by (instance) ({rate(E + '_forward_seconds_total')})", "{{instance}}"), max_val=1))
        .with_panel(panel(
            9, "Demand and capacity", "Patches admitted past the caches per second (demand), patches encoded per "
            "second, and the workers' measured capacity (patches per second of forward time, summed): the "
            "signals the encode planner sizes the fleet by.", "none",
            query(f"sum({rate(E + '_patches_admitted_total')})", "admitted"),
            query(f"sum({rate(E + '_patches_encoded_total')})", "encoded"),
            query(f"sum({E}_capacity_patches_per_second{{{W}}})", "capacity")))
        .with_row(row(104, "Refusals and bytes"))
        .with_panel(panel(
            10, "Refusals by reason", "Requests refused per second: the 503s by reason (overloaded: the queue is "
            "full; draining: the worker is stopping), and every other refusal by its error code.", "reqps",
            query(f"sum by (reason) ({rate(E + '_rejected_total')})", "503 {{reason}}"),
            query(f"sum by (outcome) ({rate(E + '_requests_total', REFUSED)})", "{{outcome}}")))
        .with_panel(panel(
            11, "Bytes moved", "Media bytes the workers downloaded, embedding bytes they answered with, and "
            "embedding bytes the frontends received (0 when engines fetch bodies by handle; frontends are not "
            "labelled by namespace).", "Bps",
            query(f"sum({rate(E + '_fetch_bytes_total')})", "fetched media"),
            query(f"sum({rate(E + '_response_bytes_total')})", "encoder responses"),
            query("sum(rate(dynamo_frontend_multimodal_encoder_body_bytes_total" + RI + "))", "frontends received")))
        .with_panel(panel(
            12, "Encoders wanted and running", "The encode planner's last decision (wanted) and the encoders in "
            "discovery (running), when the graph has a planner.", "none",
            query('sum by (state) (dynamo_planner_encode_replicas{dynamo_namespace=~"$namespace"})', "{{state}}")))
    )
    return with_tier_panels(d)


def render() -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build().build()) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the committed JSON instead of writing it")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is not what tools/dashboard.py builds: run it", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
