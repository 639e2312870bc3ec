"""What the tenant scope costs in hit ratio: one Zipf trace served to 1, 2, 4, 8 and 16 tenants.

    python -m bench.tenants [--quick] [--json out.json]

The two-cluster trace of `bench.clusters` (Zipf 0.9 over a catalogue, each request on one of two
clusters), each request now from one of T tenants (uniform, seeded). With `--tenant-header` every
cache level keys an item by (tenant scope, image) (`security.tenants`), so T tenants asking for one
catalogue hold up to T entries of each image. Predicted by the capacity model (`capacity.simulate`,
each (tenant, image) its own item, placed on the shard its real key hashes to) for every T, at the
tiers' default sizes (every miss compulsory) and with every cache scaled down until a cluster tier
holds a quarter of the one-tenant working set (misses from capacity too). Measured for T = 1 and T = 4 on the real fleet
(bench/site_rig.py: the encoder site on host 1, two cluster tiers, TLS), each HEAD in its tenant's
scope, as `bench.clusters` replays it.
"""

from __future__ import annotations

import argparse
import tempfile
import zlib
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from bench import stats
from bench.clusters import CLUSTERS, key, replay, traffic
from bench.site_rig import ClusterTier, start_site
from harness import hosts
from mm_encoder.capacity.simulate import prepare, simulate
from mm_encoder.capacity.traffic import Trace, Traffic, make_trace, size_classes
from mm_encoder.security.tenants import Tenants

TENANTS = (1, 2, 4, 8, 16)
MEASURED = (1, 4)
TENANT_KEY = bytes(range(32))


def tenants_of(trace: Trace, n: int, seed: int) -> list[int]:
    """Each item's tenant: uniform over n, one draw per item (one item per request here)."""
    return np.random.default_rng(seed + n).integers(0, n, size=len(trace.ranks)).tolist()


def scopes_of(tenant_ids: list[int], n: int) -> list[str]:
    """Each item's scope as its frontend computes it; no scope with one tenant (tenants off)."""
    t = Tenants("X-Tenant", TENANT_KEY)
    return [t.scope_of(f"tenant-{i}") if n > 1 else "" for i in tenant_ids]


def small_scale(t: Traffic, trace: Trace) -> float:
    """The factor on every cache size that leaves a cluster tier a quarter of the one-tenant working set."""
    return prepare(t, trace).working_set / 4 / t.cluster_tier_bytes


def predict(t: Traffic, trace: Trace, n: int, shards: list[str] | None) -> dict:
    """The model on the trace with each (tenant, image) its own item, at the default and small caches."""
    tenant_ids = tenants_of(trace, n, t.seed)
    catalogue = t.popularity.catalogue
    items = trace.ranks + np.array(tenant_ids, dtype=np.int64) * catalogue
    scoped = Trace(items, trace.classes, trace.clusters)
    scopes = scopes_of(tenant_ids, n)
    hashes = {int(i): zlib.crc32(key(int(r), s).encode()) for i, r, s in zip(items, trace.ranks, scopes, strict=True)}
    if shards:
        t = t.model_copy(update={"shard_names": tuple(shards), "shards": len(shards)})
    out = {}
    for label, scale in (("default", 1.0), ("small", small_scale(t, trace))):
        r = simulate(t, trace=scoped, key_hashes=hashes, scale=scale).as_dict()
        out[label] = {"cluster": r["tiers"]["cluster"]["hit_ratio"], "shared": r["tiers"]["shared"]["hit_ratio"],
                      "encodes": r["fleet"]["encodes"], "unique": r["trace"]["unique_items"]}
    return out


def run(args: argparse.Namespace) -> dict:
    t = traffic(args.quick)
    trace = make_trace(t, size_classes(t))
    result: dict = {"machine": stats.machine(), "traffic": t.model_dump(mode="json"),
                    "small_scale": small_scale(t, trace),
                    "predicted": {str(n): predict(t, trace, n, None) for n in TENANTS}, "measured": {}}
    why = hosts.available()
    if why is not None:
        result["not_measured"] = f"the fleet needs network namespaces: {why}"
        return result
    with tempfile.TemporaryDirectory(prefix="mm-bench-tenants-") as tmp:
        for n in MEASURED:  # a fresh fleet per tenant count: every cache starts cold
            with ExitStack() as stack:
                h = stack.enter_context(hosts.Hosts(3))
                site = start_site(stack, h, Path(tmp) / f"t{n}")
                tiers = [ClusterTier(stack, h, i + 2, name, site) for i, name in enumerate(CLUSTERS)]
                m = replay(trace, tiers, scopes_of(tenants_of(trace, n, t.seed), n))
                result["measured"][str(n)] = {"cluster": m["cluster"]["hit_ratio"], "shared": m["shared"]["hit_ratio"],
                                         "encodes": m["encodes"],
                                         "predicted": predict(t, trace, n, site.shards())["default"]}
    return result


def main() -> None:
    stats.cli(__doc__, "tenants", run)


if __name__ == "__main__":
    main()
