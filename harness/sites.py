"""An encoder site and a model cluster on two hosts (`harness.hosts`), each under its own `mm-encoder
serve`, with TLS from one CA: what the site-fault tests and the soak's site variant start. Host 1 is
the site, host 2 the cluster; the test client calls the cluster's frontend from the root namespace,
so a fault on host 1's link is one between the two sites only.

`Sites.chat` is one request that never raises: its status, seconds and the code the frontend counted
(`Outcome`), so a load under a fault can count what every request got.
"""

from __future__ import annotations

import itertools
import json
import os
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

from .hosts import Hosts
from .media_factory import image_bytes, natural_image
from .serve_fixtures import MODEL, ROOT, Served, data_url

SITE_PORT, FRONTEND_PORT = 8090, 8000
READY = "ready:"


@dataclass(frozen=True)
class Outcome:
    status: int | str  # the HTTP status, or the exception's name when no answer came
    seconds: float
    body: str

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass(frozen=True)
class Record:
    kind: str  # "text", "cached" (an image the cluster tier holds) or "new" (one nobody has seen)
    started: float  # seconds after the load's start
    outcome: Outcome


def image(seed: int) -> list[dict]:
    """A chat's content: a question and a small image of its own (`seed`)."""
    return [{"type": "text", "text": "What is in this image?"},
            {"type": "image_url", "image_url": {"url": data_url(image_bytes(natural_image(64, 48, seed=seed)))}}]


def cluster_graph(path: Path, tier_args: tuple[str, ...] = (), engines: int = 1, fallback: bool = False) -> Path:
    """graphs/model-cluster.yaml with its tier's `args` extended, `engines` replicas (2 cores: one) and
    with `fallback` an encoder of its own (asked over RPC while the site is unreachable)."""
    g = yaml.safe_load((ROOT / "graphs" / "model-cluster.yaml").read_text())
    g["components"]["cluster"]["args"] = [*g["components"]["cluster"].get("args", []), *tier_args]
    g["components"]["engine"]["replicas"] = engines
    if fallback:
        g["components"]["fallback"] = {"kind": "encoder"}
    path.write_text(yaml.safe_dump(g))
    return path


def serve_on(hosts: Hosts, i: int, graph: Path, run_dir: Path, ca_dir: Path, checkpoint: Path, port: int,
             *extra: str) -> Served:
    """`mm-encoder serve GRAPH` in host i's network, its door on the host's address (`--port`: a frontend's,
    an encoder site's router's), TLS from the operator's CA in `ca_dir`: how the tests and benchmarks that
    cross sites start one. `extra`: serve's other options (`--encoder-site`, `--name`, `--restart`)."""
    command = hosts.popen_argv(i, [sys.executable, "-m", "mm_encoder.cli"])
    return Served(str(graph), run_dir, port, "--tls-dir", str(ca_dir), "--checkpoint", str(checkpoint),
                  "--bind", hosts.addr(i), *extra, command=command, env=dict(os.environ), cwd=ROOT)


class Sites:
    """The two serves; `start_site`/`start_cluster` wait for their ready lines."""

    def __init__(self, hosts: Hosts, root: Path, checkpoint: Path, graph: Path):
        from mm_encoder.security.pki import Authority

        self.hosts, self.root, self.checkpoint, self.graph = hosts, root, checkpoint, graph
        self.ca_dir = root / "ca"
        Authority.create(self.ca_dir, name="site faults test CA")
        self.ca_file = str(self.ca_dir / "ca.pem")
        self.site: Served | None = None
        self.cluster: Served | None = None
        self.starts = 0

    def _serve(self, host: int, graph: Path, port: int, *extra: str) -> Served:
        """`extra`: serve's own options besides the site's (`--restart`, `--encoder-site`)."""
        self.starts += 1
        return serve_on(self.hosts, host, graph, self.root / f"run-{host}-{self.starts}", self.ca_dir, self.checkpoint,
                        port, *extra)

    def start_site(self, timeout: float = 240) -> Served:
        self.site = self._serve(1, ROOT / "graphs" / "encoder-site.yaml", SITE_PORT)
        self.site.wait_for(READY, timeout)
        return self.site

    def start_cluster(self, timeout: float = 240, graph: Path | None = None, restart: bool = False) -> Served:
        """The model cluster (`graph`, else the one given at first), with `restart` under serve --restart."""
        url = f"https://{self.hosts.addr(1)}:{SITE_PORT}"
        self.cluster = self._serve(2, graph or self.graph, FRONTEND_PORT, "--encoder-site", url,
                                   *(["--restart"] if restart else []))
        self.cluster.wait_for(READY, timeout)
        return self.cluster

    @property
    def base(self) -> str:
        return f"https://{self.hosts.addr(2)}:{FRONTEND_PORT}"

    def _context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca_file)

    def chat(self, content: str | list[dict], timeout: float = 120, **fields: object) -> Outcome:
        body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": content}], **fields}
        req = urllib.request.Request(f"{self.base}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self._context()) as r:
                return Outcome(r.status, time.monotonic() - t0, r.read().decode())
        except urllib.error.HTTPError as e:
            return Outcome(e.code, time.monotonic() - t0, e.read().decode(errors="replace"))
        except OSError as e:  # no answer at all: counted as lost by the caller
            return Outcome(type(e).__name__, time.monotonic() - t0, str(e))

    def errors(self) -> dict[str, int]:
        """The frontend's refusals by code (GET /mm/stats): the type a 503 had."""
        with urllib.request.urlopen(f"{self.base}/mm/stats", timeout=30, context=self._context()) as r:
            stats = json.loads(r.read())["processors"][0]
        return dict(stats.get("errors") or {})

    def stop(self) -> None:
        """Each serve stopped (SIGTERM; one whose host was killed is gone already), not checked: the hosts'
        `close` kills whatever is left in their namespaces."""
        for served in (self.cluster, self.site):
            if served is not None and served.proc.poll() is None:
                served.stop(check=False)


class Load:
    """A closed loop of `clients`, bounded in count and time, each request in turn a text-only chat, a
    chat with an image the cluster tier holds (`cached` seeds) and one with a new image; every
    answer recorded. `seed0` keeps one load's new images apart from another's."""

    KINDS = ("text", "cached", "new")

    def __init__(self, sites: Sites, cached: list[int], seed0: int, timeout: float = 120):
        self.sites, self.cached, self.timeout = sites, cached, timeout
        self._seeds = itertools.count(seed0)
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self.records: list[Record] = []

    def _one(self, t0: float) -> None:
        with self._lock:
            i, seed = next(self._turn), next(self._seeds)
        kind = self.KINDS[i % 3]
        content = ("Say something." if kind == "text" else
                   image(self.cached[i % len(self.cached)] if kind == "cached" else seed))
        started = time.monotonic() - t0
        outcome = self.sites.chat(content, timeout=self.timeout)
        with self._lock:
            self.records.append(Record(kind, started, outcome))

    def run(self, seconds: float, max_requests: int, clients: int = 3, pause_s: float = 0.25) -> list[Record]:
        """Until `seconds` have passed or `max_requests` were sent, each client pausing `pause_s` between
        its requests (fast 503s would otherwise spend the count in the fault's first seconds); what each got."""
        t0 = time.monotonic()
        sent = itertools.count()

        def client() -> None:
            while time.monotonic() - t0 < seconds and next(sent) < max_requests:
                self._one(t0)
                time.sleep(pause_s)

        with ThreadPoolExecutor(clients) as pool:
            for f in [pool.submit(client) for _ in range(clients)]:
                f.result()
        return self.records


def recovery(sites: Sites, seed0: int, limit_s: float) -> float | None:
    """Seconds until a chat with a new image is a 200 again (one every half second), None past `limit_s`."""
    t0 = time.monotonic()
    for seed in itertools.count(seed0):
        if sites.chat(image(seed), timeout=limit_s).ok:
            return time.monotonic() - t0
        if time.monotonic() - t0 > limit_s:
            return None
        time.sleep(0.5)
    return None  # not reached


def violations(records: list[Record], *, bound_s: float, first_bound_s: float, first_s: float) -> list[str]:
    """Every request that broke the promise under a fault: a text-only or cached chat that was not a 200
    within `bound_s`; a new image that got neither a 200 nor a 503, or got it later than `bound_s`
    (`first_bound_s` for the requests sent in the first `first_s` seconds, which may wait out a
    kept-alive connection's read timeout)."""
    out = []
    for r in records:
        bound = first_bound_s if r.started < first_s else bound_s
        allowed = (200,) if r.kind != "new" else (200, 503)
        if r.outcome.status not in allowed or r.outcome.seconds > bound:
            out.append(f"{r.kind} at {r.started:.1f} s: {r.outcome.status} in {r.outcome.seconds:.2f} s "
                       f"(bound {bound} s): {r.outcome.body[:200]}")
    return out


def summary(records: list[Record], slow_s: float = 5.0) -> dict[str, dict[str, object]]:
    """Per kind: the statuses counted, the median and slowest answer, and how many took over `slow_s`."""
    out: dict[str, dict[str, object]] = {}
    for kind in Load.KINDS:
        seconds = sorted(r.outcome.seconds for r in records if r.kind == kind)
        out[kind] = {"statuses": dict(Counter(str(r.outcome.status) for r in records if r.kind == kind)),
                     "p50_s": round(seconds[len(seconds) // 2], 3) if seconds else None,
                     "max_s": round(seconds[-1], 2) if seconds else None,
                     f"over_{slow_s:g}s": sum(x > slow_s for x in seconds)}
    return out


def tier_answer(sites: Sites, body: str) -> tuple[int, dict[str, str]]:
    """The cluster tier's own answer to one POST /v1/encode (from inside the cluster's host, with the
    frontend's certificate: the tier admits its own graph's frontend): status and headers."""
    assert sites.cluster is not None
    tier = sites.cluster.component("cluster")
    tls = sites.cluster.run_dir / "tls"
    done = subprocess.run(sites.hosts.popen_argv(2, ["curl", "-sS", "-o", "/dev/null", "-D", "-", "--max-time", "90",
                               "--cacert", sites.ca_file, "--cert", str(tls / "frontend.pem"), "--key",
                               str(tls / "frontend.key"), "-H", "Content-Type: application/json",
                               "--data-binary", "@-", f"{tier['url']}/v1/encode"]),
                          input=body, capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    if not lines:
        raise AssertionError(f"curl to the cluster tier: {done.stderr}")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.title(): v.strip() for k, v in headers.items()}
