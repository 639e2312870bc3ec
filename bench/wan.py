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
import http.client
import ssl
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from bench import stats
from harness import hosts
from harness.media_factory import image_bytes, natural_image
from harness.processes import Process
from harness.serve_fixtures import ROOT, data_url
from mm_encoder.core import wire
from mm_encoder.core.requests import EncodeRequest
from mm_encoder.security.identity import server_host
from mm_encoder.security.issuing import Issuer
from mm_encoder.security.pki import Authority
from mm_encoder.security.tls import tls_client

MODEL = "kimi-k2.5-wide"  # the checkpoint directory
ENCODER_MODEL = "Kimi-K2.5"  # the name its encoder answers to (its family's)
IMAGES = {"full-hd": (1920, 1080), "4k": (3840, 2160)}
RATES = ("unshaped", "10gbit", "1gbit")
TIER_PORT, SITE_PORT = 8081, 8090
KINDS = {"cluster": "cluster-tier hit", "shared": "shared-tier hit across the link",
         "miss": "miss (encoded at the site)"}


def jpeg(size: tuple[int, int], seed: int) -> bytes:
    return image_bytes(natural_image(*size, seed=seed), "JPEG")


class Fetcher:
    """An engine's fetch through the cluster tier: one kept-alive HTTPS connection, its certificate presented."""

    def __init__(self, host: str, ctx: ssl.SSLContext):
        self.conn = http.client.HTTPSConnection(host, TIER_PORT, context=ctx, timeout=300)

    def fetch(self, image: bytes, route: str) -> tuple[float, int, str]:
        """Seconds to the last byte, the body's size, where it came from (X-Cache-Status)."""
        req = EncodeRequest(model=ENCODER_MODEL, url=data_url(image, "image/jpeg"), modality="image")
        body = req.body()
        headers = {"Content-Type": "application/json", "Accept": wire.CONTENT_TYPE, "X-Cache-Key": req.key(),
                   "X-Cache-Route": route}
        start = time.perf_counter()
        self.conn.request("POST", "/v1/encode/fetch", body=body, headers=headers)
        r = self.conn.getresponse()
        data = r.read()
        took = time.perf_counter() - start
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {data[:300]!r}")
        return took, len(data), r.getheader("X-Cache-Status", "")


def start(stack: ExitStack, h: hosts.Hosts, work: Path) -> ssl.SSLContext:
    """The site on host 1, the cluster tier on host 2, one CA; the client's TLS context (an engine's)."""
    ca, checkpoint = work / "ca", work / "ck" / MODEL
    Authority.create(ca, name="bench.wan CA")
    made = Process([sys.executable, "-m", "mm_encoder.cli", "make-checkpoint", "--preset", "wide", str(checkpoint)])
    assert made.wait(timeout=300) == 0, made.text
    site = stack.enter_context(Process(h.popen_argv(1, [
        sys.executable, "-m", "mm_encoder.cli", "serve", str(ROOT / "graphs" / "encoder-site.yaml"), "--run-dir",
        str(work / "site"), "--tls-dir", str(ca), "--checkpoint", str(checkpoint), "--bind", h.addr(1),
        "--status-interval", "0"]), name="encoder site", cwd=ROOT))
    site.wait_for("ready", 300)
    issuer = Issuer(work / "cluster-tls", ca, graph="cluster-a", hosts=(h.addr(2),))
    issuer.issue([("cluster", "cache-cluster"), ("engine", "engine")], site=False)
    cert, key, ca_file = issuer.files("cluster")
    tier = stack.enter_context(Process(h.popen_argv(2, [
        sys.executable, "-m", "mm_encoder.cache_tiers", "up", "--tier", "cluster",
        "--listen", f"{h.addr(2)}:{TIER_PORT}", "--next", f"{h.addr(1)}:{SITE_PORT}",
        "--run-dir", str(work / "tier"), "--cache-dir", str(work / "tier-cache"),
        "--tls-cert", cert, "--tls-key", key, "--tls-ca", ca_file, "--ops-listen", "127.0.0.1:9081",
        "--tls-server-name", server_host("mm-encoder.local", "encoder-site", "cache-router")]), name="cluster tier"))
    engine_cert, engine_key, _ = issuer.files("engine")
    ctx = tls_client(ca_file, engine_cert, engine_key)
    ctx.check_hostname = False  # the tier's certificate names its role and the host's address; the chain is checked
    healthy(h.addr(2), ctx, tier, 60)
    return ctx


def healthy(host: str, ctx: ssl.SSLContext, proc: Process, timeout: float) -> None:
    """The tier's /_cache/health answered 200 (it listens once nginx has read its config)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conn = http.client.HTTPSConnection(host, TIER_PORT, context=ctx, timeout=5)
        try:
            conn.request("GET", "/_cache/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"the cluster tier did not get healthy: {proc.tail()}")


def shape(h: hosts.Hosts, rate: str) -> None:
    if rate == "unshaped":
        h.unshape(1)
    else:  # a burst of ~10 ms at the rate: tbf needs at least rate/HZ
        h.shape(1, rate, burst="12mb" if rate == "10gbit" else "2mb")


def measure(h: hosts.Hosts, ctx: ssl.SSLContext, rounds: int) -> tuple[dict, dict]:
    """Per round, per rate (alternating), per image: one request of each kind; the raw seconds and sizes."""
    client = Fetcher(h.addr(2), ctx)
    hit_images = {name: jpeg(size, seed=1) for name, size in IMAGES.items()}
    for image in hit_images.values():  # fill the cluster tier and the site's shard
        for route in ("cluster,shared", "cluster,shared", "shared"):
            client.fetch(image, route)
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
                    took, n, where = client.fetch(image, "shared" if kind == "shared" else "cluster,shared")
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
        ctx = start(stack, h, Path(tmp))
        raw, sizes = measure(h, ctx, rounds)
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
