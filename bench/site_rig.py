"""An encoder site and model clusters' tiers on hosts of this machine, for the benchmarks that cross
sites (bench/wan.py, bench/clusters.py): host 1 runs the encoder site (`mm-encoder serve
graphs/encoder-site.yaml`), each further host one model cluster's cluster tier (`mm-encoder cache up
--tier cluster`, its next level the site's router), every hop TLS from one CA, as deployed; the
client, in the root namespace, asks a cluster tier as the frontend (HEAD) or an engine (a body
fetch) does, with an engine's certificate of that cluster. Hosts: harness/hosts.py (root needed)."""

from __future__ import annotations

import http.client
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from harness import hosts
from harness.processes import Process
from harness.serve_fixtures import ROOT, data_url
from harness.sites import serve_on
from mm_encoder.core import wire
from mm_encoder.core.requests import EncodeRequest
from mm_encoder.security.identity import server_host
from mm_encoder.security.issuing import Issuer
from mm_encoder.security.pki import Authority
from mm_encoder.security.tls import tls_client

ENCODER_MODEL = "Kimi-K2.5"  # the name a generated Kimi-K2.5 checkpoint's encoder answers to
TIER_PORT, SITE_PORT = 8081, 8090


@dataclass
class Site:
    work: Path
    ca: Path
    run_dir: Path

    def shards(self) -> list[str]:
        """The router's shards as its nginx.conf names them: the names its consistent-hash ring is built from."""
        conf = (self.run_dir / "nginx-router" / "nginx.conf").read_text()
        block = conf.split("upstream mm_shards", 1)[1].split("}", 1)[0]
        names = [line.split()[1] for line in block.splitlines() if line.strip().startswith("server ")]
        return list(dict.fromkeys(names))


def start_site(stack: ExitStack, h: hosts.Hosts, work: Path, preset: str = "tiny") -> Site:
    """Host 1: the encoder site on its address, the generated checkpoint of `preset`, one new CA."""
    ca, checkpoint = work / "ca", work / "ck" / f"kimi-k2.5-{preset}"
    Authority.create(ca, name="bench CA")
    made = Process([sys.executable, "-m", "mm_encoder.cli", "make-checkpoint", "--preset", preset, str(checkpoint)])
    assert made.wait(timeout=300) == 0, made.text
    site = stack.enter_context(serve_on(h, 1, ROOT / "graphs" / "encoder-site.yaml", work / "site", ca, checkpoint,
                                        SITE_PORT))
    site.wait_for("ready", 300)
    return Site(work, ca, work / "site")


class ClusterTier:
    """Host i's cluster tier, cluster `name` (a graph the site's `clusters` names), and its client."""

    def __init__(self, stack: ExitStack, h: hosts.Hosts, i: int, name: str, site: Site):
        work = site.work / name
        issuer = Issuer(work / "tls", site.ca, graph=name, hosts=(h.addr(i),))
        issuer.issue([("cluster", "cache-cluster"), ("engine", "engine")], site=False)
        cert, key, ca_file = issuer.files("cluster")
        self.proc = stack.enter_context(Process(h.popen_argv(i, [
            sys.executable, "-m", "mm_encoder.cache_tiers", "up", "--tier", "cluster",
            "--listen", f"{h.addr(i)}:{TIER_PORT}", "--next", f"{h.addr(1)}:{SITE_PORT}",
            "--run-dir", str(work / "tier"), "--cache-dir", str(work / "tier-cache"),
            "--tls-cert", cert, "--tls-key", key, "--tls-ca", ca_file, "--ops-listen", "127.0.0.1:9081",
            "--tls-server-name", server_host("mm-encoder.local", "encoder-site", "cache-router")]),
            name=f"cluster tier {name}"))
        engine_cert, engine_key, _ = issuer.files("engine")
        self.ctx = tls_client(ca_file, engine_cert, engine_key)
        self.ctx.check_hostname = False  # its certificate names its role and the host's address; the chain is checked
        self.host = h.addr(i)
        self.last_shard = ""
        self._healthy(60)
        self.conn = http.client.HTTPSConnection(self.host, TIER_PORT, context=self.ctx, timeout=300)

    def _healthy(self, timeout: float) -> None:
        """/_cache/health answered 200 (it listens once nginx has read its config)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            conn = http.client.HTTPSConnection(self.host, TIER_PORT, context=self.ctx, timeout=5)
            try:
                conn.request("GET", "/_cache/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            finally:
                conn.close()
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"the cluster tier did not get healthy: {self.proc.tail()}")

    def ask(self, image: bytes, route: str = "cluster,shared", *, body: bool = True,
            scope: str = "") -> tuple[float, int, str]:
        """An engine's body fetch (POST /v1/encode/fetch), or with `body=False` the frontend's HEAD, for
        `image` (in a tenant's `scope`, as its frontend asks): seconds to the last byte, the body's size,
        X-Cache-Status."""
        req = EncodeRequest(model=ENCODER_MODEL, url=data_url(image, "image/jpeg"), modality="image", scope=scope)
        headers = {"Content-Type": "application/json", "Accept": wire.CONTENT_TYPE, "X-Cache-Key": req.key(),
                   "X-Cache-Route": route}
        start = time.perf_counter()
        self.conn.request("POST" if body else "HEAD", "/v1/encode/fetch" if body else "/v1/encode", body=req.body(),
                          headers=headers)
        r = self.conn.getresponse()
        data = r.read()
        took = time.perf_counter() - start
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {data[:300]!r} {r.getheader('X-MM-Error', '')}")
        self.last_shard = r.getheader("X-Cache-Shard", "")  # the router's pick, when the answer came through it
        return took, len(data), r.getheader("X-Cache-Status", "")
