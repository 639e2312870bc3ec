"""The site faults soak (`make soak`; not collected by pytest): an encoder site and a model cluster on
two hosts (network namespaces, TLS, `harness/sites.py`), the cluster with the shipped defaults (its
tier's breaker: connect 2 s, read 60 s, --site-retry-s 5) under `serve --restart`, and a bounded load
of 3 clients (text-only chats, chats with an image the cluster tier holds, chats with a new image)
through each fault. Needs root (network namespaces).

    python -m bench.site_faults [--load-s 75] [--phases cut,host,tier,fallback] [--json PATH]

1. cut: the site's link down for --load-s, then up; how long until a new image is a 200 again.
2. host: every process of the site's host killed (a host lost), the site's serve started again after
   --down-s; recovery after it is ready.
3. tier: the cluster tier killed with a warm cache and the link cut (so only the tier can answer), serve
   --restart brings it back on the same cache directory: what a cached item is after the restart.
4. fallback: the cluster again with an encoder of its own (graphs/model-cluster.yaml's commented
   `fallback`), the link cut: new images answered by it.
Every request must be a 200 or a typed 503 (the frontend counts `encoder_site_unreachable`) within the
bounds below; the last lines check that no namespace is left.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from harness import hosts
from harness.sites import Load, Sites, cluster_graph, image, recovery, summary, violations
from harness.topology import require_nginx

CONNECT_S, READ_S, RETRY_S, KEEPALIVE_S, MARGIN_S = 2, 60, 5, 10, 3
BOUNDS = {"bound_s": CONNECT_S + MARGIN_S, "first_bound_s": READ_S + MARGIN_S, "first_s": KEEPALIVE_S}
CACHED = [1, 2, 3, 4]


def warm(sites: Sites) -> None:
    for seed in CACHED:
        outcome = sites.chat(image(seed))
        assert outcome.ok, outcome


def _loaded(sites: Sites, seed0: int, seconds: float, during: list, bounds: dict = BOUNDS) -> dict:
    """The load for `seconds` while `during` (callables, in order, in this thread) runs; its outcome."""
    load = Load(sites, CACHED, seed0, timeout=READ_S + 60)
    before = sites.errors()
    runner = threading.Thread(target=load.run, args=(seconds, 400))
    runner.start()
    try:
        for step in during:
            step()
    finally:
        runner.join()
    after = sites.errors()
    refused = sum(r.outcome.status == 503 for r in load.records)
    typed = after.get("encoder_site_unreachable", 0) - before.get("encoder_site_unreachable", 0)
    return {"requests": len(load.records), "by_kind": summary(load.records), "refused": refused,
            "typed": typed, "violations": violations(load.records, **bounds)}


def cut(sites: Sites, load_s: float) -> dict:
    out = _loaded(sites, 10_000, load_s, [lambda: sites.hosts.cut(1)])
    sites.hosts.restore(1)
    out["recovered_s"] = recovery(sites, 19_000, 60)
    return out


def host(sites: Sites, load_s: float, down_s: float) -> dict:
    started: dict[str, float] = {}

    def lose() -> None:
        sites.hosts.kill_host(1)
        time.sleep(down_s)
        t0 = time.monotonic()
        sites.start_site()
        started["site_start_s"] = time.monotonic() - t0
        started["ready_at"] = time.monotonic()

    out = _loaded(sites, 20_000, load_s, [lose])
    out["site_start_s"] = started.get("site_start_s")
    out["recovered_s"] = recovery(sites, 29_000, 60)  # after the load, itself past the site's ready line
    return out


def tier(sites: Sites) -> dict:
    """The cluster tier killed warm, with the site cut off: only the tier can answer a cached item."""
    assert sites.cluster is not None
    comp = sites.cluster.component("cluster")
    sites.hosts.cut(1)
    try:
        before = [sites.chat(image(seed)).status for seed in CACHED]
        t0 = time.monotonic()
        os.killpg(comp["pid"], signal.SIGKILL)
        first, seen = None, []
        while time.monotonic() - t0 < 90:
            outcome = sites.chat(image(CACHED[0]), timeout=30)
            seen.append(outcome.status)
            if outcome.ok:
                first = time.monotonic() - t0
                break
            time.sleep(0.25)
        after = [sites.chat(image(seed)).status for seed in CACHED]
    finally:
        sites.hosts.restore(1)
    return {"cached_before": before, "first_200_after_kill_s": first, "statuses_while_down": seen,
            "cached_after": after, "restarted_pid": sites.cluster.component("cluster")["pid"]}


def fallback(sites: Sites, root: Path, load_s: float) -> dict:
    assert sites.cluster is not None
    sites.cluster.stop(check=False)
    sites.start_cluster(graph=cluster_graph(root / "fallback.yaml", fallback=True), restart=True)
    warm(sites)
    # a chat asks the tier twice (the frontend's HEAD, the engine's fetch), each up to a probe's connect
    out = _loaded(sites, 30_000, load_s, [lambda: sites.hosts.cut(1)], {**BOUNDS, "bound_s": 2 * CONNECT_S + MARGIN_S})
    sites.hosts.restore(1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load-s", type=float, default=75.0, help="each fault's load (above the 60 s read timeout)")
    p.add_argument("--down-s", type=float, default=10.0, help="how long the site's host stays lost")
    p.add_argument("--phases", default="cut,host,tier,fallback")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    why = hosts.available()
    if why:  # as the tests do: skipped, with the reason
        print(f"site faults skipped: they need network namespaces: {why}")
        return
    require_nginx()
    from mm_encoder.engines.tiny_checkpoint import write_checkpoint

    results: dict[str, object] = {"bounds": BOUNDS}
    with tempfile.TemporaryDirectory(prefix="mm-site-faults-") as tmp, hosts.Hosts(2) as h:
        root = Path(tmp)
        sites = Sites(h, root, write_checkpoint(root / "ckpt" / "kimi-k2.5-tiny", "tiny"),
                      cluster_graph(root / "cluster.yaml"))
        try:
            sites.start_site()
            sites.start_cluster(restart=True)
            warm(sites)
            results["baseline"] = summary(Load(sites, CACHED, 1_000).run(10, 30))  # before any fault
            for phase in a.phases.split(","):
                t0 = time.monotonic()
                results[phase] = (cut(sites, a.load_s) if phase == "cut" else host(sites, a.load_s / 2, a.down_s)
                                  if phase == "host" else tier(sites) if phase == "tier" else
                                  fallback(sites, root, a.load_s / 2))
                print(phase, round(time.monotonic() - t0, 1), "s:", json.dumps(results[phase]), flush=True)
        finally:
            sites.stop()
    left = [ns for ns in hosts.Hosts._netns() if ns.startswith(f"mm{h.tag}")]
    results["namespaces_left"] = left
    print("namespaces left:", left)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    bad = [f"{k}: {v['violations']}" for k, v in results.items() if isinstance(v, dict) and v.get("violations")]
    if bad or left:
        raise SystemExit("site faults: " + "; ".join(bad) if bad else f"namespaces left: {left}")


if __name__ == "__main__":
    main()
