"""A WAN link between a model cluster and its encoder site (not a test): where a tier pays off.

    python -m bench.wan [--quick] [--rounds 5] [--json out.json]

Two hosts (harness/hosts.py: network namespaces on a bridge, root needed): host 1 is the encoder
site (`mm-encoder serve graphs/encoder-site.yaml`, the generated `wide` checkpoint, whose rows are
Kimi-K2.5's 7168 wide), host 2 a model cluster's cluster tier (`mm-encoder cache up --tier cluster`,
its next level the site's router), both with TLS and client certificates from one CA, as deployed.
The client runs in the root namespace and asks the cluster tier for a body, as an engine fetches
one (`POST /v1/encode/fetch`, one kept-alive connection). The site's link is shaped with the
kernel's token-bucket filter (`tc qdisc ... tbf`, both directions; this kernel has no netem, so
bandwidth, not delay) at each rate in turn, the rates alternating within every round. Per rate and
image (full HD 1920x1080 and 4K 3840x2160 JPEGs):
- a cluster-tier hit (the body is in the cluster's own tier: nothing crosses the link);
- a shared-tier hit across the link (`X-Cache-Route: shared`: the cluster tier passes the request
  on without caching; the site's shard answers, the body crosses the link);
- a miss (a new image each time: the site encodes it, the body crosses the link).
Figures are the median (min-max) of the rounds' single requests.
"""

from __future__ import annotations

import argparse
import tempfile
from contextlib import ExitStack
from pathlib import Path

from bench import stats
from bench.site_rig import ClusterTier, start_site
from harness import hosts
from harness.media_factory import image_bytes, natural_image

IMAGES = {"full-hd": (1920, 1080), "4k": (3840, 2160)}
RATES = ("unshaped", "10gbit", "1gbit")
KINDS = {"cluster": "cluster-tier hit", "shared": "shared-tier hit across the link",
         "miss": "miss (encoded at the site)"}


def jpeg(size: tuple[int, int], seed: int) -> bytes:
    return image_bytes(natural_image(*size, seed=seed), "JPEG")


def shape(h: hosts.Hosts, rate: str) -> None:
    if rate == "unshaped":
        h.unshape(1)
    else:  # a burst of ~10 ms at the rate: tbf needs at least rate/HZ
        h.shape(1, rate, burst="12mb" if rate == "10gbit" else "2mb")


def measure(h: hosts.Hosts, client: ClusterTier, rounds: int) -> tuple[dict, dict]:
    """Per round, per rate (alternating), per image: one request of each kind; the raw seconds and sizes."""
    hit_images = {name: jpeg(size, seed=1) for name, size in IMAGES.items()}
    for image in hit_images.values():  # fill the cluster tier and the site's shard
        for route in ("cluster,shared", "cluster,shared", "shared"):
            client.ask(image, route)
    raw: dict = {rate: {img: {k: [] for k in KINDS} for img in IMAGES} for rate in RATES}
    sizes: dict = {}
    seed = 1000
    for _ in range(rounds):
        for rate in RATES:
            shape(h, rate)
            for img, size in IMAGES.items():
                for kind in KINDS:
                    seed += 1
                    image = hit_images[img] if kind != "miss" else jpeg(size, seed)
                    took, n, where = client.ask(image, "shared" if kind == "shared" else "cluster,shared")
                    expect = {"cluster": "cluster=HIT", "shared": "shared=HIT", "miss": "shared=MISS"}[kind]
                    assert expect in where, (kind, where)
                    raw[rate][img][kind].append(took)
                    sizes[img] = n
    h.unshape(1)
    return raw, sizes


def run(args: argparse.Namespace) -> dict:
    why = hosts.available()
    if why is not None:
        raise SystemExit(f"bench.wan needs network namespaces: {why}")
    rounds = 2 if args.quick else args.rounds
    with tempfile.TemporaryDirectory(prefix="mm-bench-wan-") as tmp, ExitStack() as stack:
        h = stack.enter_context(hosts.Hosts(2))
        site = start_site(stack, h, Path(tmp), preset="wide")
        raw, sizes = measure(h, ClusterTier(stack, h, 2, "cluster-a", site), rounds)
    figures = {rate: {img: {k: stats.summary(v * 1e3 for v in raw[rate][img][k]) for k in KINDS} for img in IMAGES}
               for rate in RATES}
    return {"machine": stats.machine(), "rounds": rounds, "rates": list(RATES), "images": IMAGES,
            "body_mb": {img: n / 1e6 for img, n in sizes.items()}, "kinds": KINDS, "ms": figures}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    stats.emit(run(args), args.json, "wan")


if __name__ == "__main__":
    main()
