"""Two model clusters, one encoder site: `mm-encoder capacity`'s prediction beside the measurement.

    python -m bench.clusters [--quick] [--json out.json]

A synthetic two-cluster trace from the capacity model itself (`capacity.traffic.make_trace`: Zipf
popularity over a catalogue, each request on one of two clusters at random) is predicted by its
simulator (`capacity.simulate`) and replayed, item by item in its order, on the real deployment:
the encoder site on host 1 and cluster-a's and cluster-b's cluster tiers on hosts 2 and 3
(bench/site_rig.py; TLS on every hop). Each item is the frontend's one question (HEAD through its
cluster's tier) for a distinct JPEG per catalogue rank. The simulator is given the real keys (the
sha256 of each request's body, which the router hashes) and the router's real shard names, so it
places each key on the shard nginx does. Measured: each answer's `X-Cache-Status` (which level
answered) and `X-Cache-Shard`; per tier, the hit ratio and lookups beside the prediction.
"""

from __future__ import annotations

import argparse
import tempfile
import zlib
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

from bench import stats
from bench.site_rig import ENCODER_MODEL, ClusterTier, start_site
from harness import hosts
from harness.media_factory import image_bytes, natural_image
from harness.serve_fixtures import data_url
from mm_encoder.capacity.simulate import simulate
from mm_encoder.capacity.traffic import Trace, Traffic, make_trace, size_classes
from mm_encoder.core.requests import EncodeRequest

SIZE = (320, 240)  # small images: the tiny tower encodes each miss in well under a second here
CLUSTERS = ("cluster-a", "cluster-b")


def traffic(quick: bool) -> Traffic:
    return Traffic(requests=150 if quick else 600, clusters=2, popularity={"exponent": 0.9,
                                                                          "catalogue": 100 if quick else 400},
                   image_mix=f"{SIZE[0]}x{SIZE[1]}:1", seed=7)


def image(rank: int) -> bytes:
    return image_bytes(natural_image(*SIZE, seed=int(rank)), "JPEG")


def key(rank: int, scope: str = "") -> str:
    return EncodeRequest(model=ENCODER_MODEL, url=data_url(image(rank), "image/jpeg"), modality="image",
                         scope=scope).key()


def predict(t: Traffic, trace: Trace, shards: list[str]) -> dict:
    """The simulator on the same trace, with the real keys and the router's shard names."""
    t = t.model_copy(update={"shard_names": tuple(shards), "shards": len(shards)})
    hashes = {int(r): zlib.crc32(key(r).encode()) for r in set(trace.ranks.tolist())}
    r = simulate(t, trace=trace, key_hashes=hashes).as_dict()
    return {"cluster": r["tiers"]["cluster"], "shared": r["tiers"]["shared"], "encodes": r["fleet"]["encodes"],
            "shard_lookups": dict(zip(shards, r["shards"]["lookups"], strict=True)),
            "unique": r["trace"]["unique_items"], "items": r["trace"]["items"]}


def replay(trace: Trace, tiers: list[ClusterTier], scopes: list[str] | None = None) -> dict:
    """Every item, in order, through its cluster's tier (in its tenant's scope: `scopes`, one per item);
    what answered it."""
    levels: Counter[str] = Counter()
    shards: Counter[str] = Counter()
    per_cluster: dict[str, Counter[str]] = {c: Counter() for c in CLUSTERS}
    scopes = scopes or [""] * len(trace.ranks)
    for rank, cluster, scope in zip(trace.ranks.tolist(), trace.clusters.tolist(), scopes, strict=True):
        _, _, where = tiers[cluster].ask(image(rank), body=False, scope=scope)
        level = "cluster" if where.startswith("cluster=HIT") else "shared" if "shared=HIT" in where else "encode"
        levels[level] += 1
        per_cluster[CLUSTERS[cluster]][level] += 1
        if level != "cluster" and tiers[cluster].last_shard:
            shards[tiers[cluster].last_shard] += 1
    lookups = sum(levels.values())
    shared_lookups = lookups - levels["cluster"]
    return {"cluster": {"lookups": lookups, "hits": levels["cluster"], "hit_ratio": levels["cluster"] / lookups},
            "shared": {"lookups": shared_lookups, "hits": levels["shared"],
                       "hit_ratio": levels["shared"] / shared_lookups if shared_lookups else None},
            "encodes": levels["encode"], "shard_lookups": dict(shards),
            "per_cluster": {c: dict(v) for c, v in per_cluster.items()}}


def run(args: argparse.Namespace) -> dict:
    why = hosts.available()
    if why is not None:
        raise SystemExit(f"bench.clusters needs network namespaces: {why}")
    t = traffic(args.quick)
    trace = make_trace(t, size_classes(t))
    with tempfile.TemporaryDirectory(prefix="mm-bench-clusters-") as tmp, ExitStack() as stack:
        h = stack.enter_context(hosts.Hosts(3))
        site = start_site(stack, h, Path(tmp))
        tiers = [ClusterTier(stack, h, i + 2, name, site) for i, name in enumerate(CLUSTERS)]
        measured = replay(trace, tiers)
        predicted = predict(t, trace, site.shards())
    return {"machine": stats.machine(), "traffic": t.model_dump(mode="json"), "image": list(SIZE),
            "predicted": predicted, "measured": measured}


def main() -> None:
    stats.cli(__doc__, "clusters", run)


if __name__ == "__main__":
    main()
