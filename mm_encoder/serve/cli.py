"""`mm-encoder serve GRAPH`: run a whole graph on one machine (`python -m mm_encoder.serve`).

Every component on loopback, each replica on a free port (the frontend on the graph's port), logs and
state in the run directory; Ctrl-C or SIGTERM stops everything in reverse order and checks that no
process of the graph is left; SIGHUP renews a TLS graph's certificates. The options override the
graph file's own settings for this run.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from ..core.errors import GraphError
from ..graph.schema import Graph, load_graph
from ..graph.shipped import find_graph
from .runner import GraphRunner
from .site import LOOPBACK, is_loopback


@dataclass(frozen=True)
class ServeOptions:
    graph: str
    run_dir: Path | None = None
    restart: bool = False
    port: int | None = None
    status_interval: float = 60.0
    checkpoint: Path | None = None
    dtype: str | None = None
    preset: str | None = None
    tls: bool = False
    tls_dir: Path | None = None
    start_timeout_s: float = 180.0
    bind: str = LOOPBACK
    encoder_site: str | None = None
    plaintext_off_loopback: bool = False
    name: str | None = None
    tenant_header: str | None = None
    tenant_key: Path | None = None

    def apply(self, graph: Graph) -> Graph:
        """The graph as this run serves it: the options over the file's settings."""
        if self.name:
            graph = graph.model_copy(update={"name": self.name})
        if self.port:
            graph = graph.model_copy(update={"site_port" if graph.site == "encoder" else "frontend_port": self.port})
        if self.encoder_site:
            if graph.site != "cluster":
                raise GraphError(f"--encoder-site names a model cluster's encoder site; graph {graph.name} is not one "
                                 "(site: cluster)")
            graph = graph.model_copy(update={"encoder_site": graph.encoder_site.model_copy(
                update={"url": self.encoder_site})})
        if self.tls or self.tls_dir:
            tls = {"enabled": True, **({"ca_dir": str(self.tls_dir.resolve())} if self.tls_dir else {})}
            graph = graph.model_copy(update={"tls": graph.tls.model_copy(update=tls)})
        if self.tenant_header or self.tenant_key:
            tenants = {k: v for k, v in (("header", self.tenant_header),
                                         ("key_file", self.tenant_key and str(self.tenant_key.resolve()))) if v}
            graph = graph.model_copy(update={"tenants": graph.tenants.model_copy(update=tenants)})
        llm = {k: v for k, v in (("checkpoint", self.checkpoint and str(self.checkpoint.resolve())),
                                 ("dtype", self.dtype), ("preset", self.preset)) if v}
        if llm:
            graph = graph.model_copy(update={"llm": graph.llm.model_copy(update=llm)})
        try:  # validated again, as a whole: the options may have made it inconsistent
            graph = Graph.model_validate(graph.model_dump())
        except ValidationError as e:
            raise GraphError("; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())) from None
        if not is_loopback(self.bind) and not graph.tls.enabled and not self.plaintext_off_loopback:
            raise GraphError(f"--bind {self.bind} serves other hosts: with TLS (--tls, or --tls-dir with the "
                             "operator's CA), or say --plaintext-off-loopback to serve them in plaintext")
        return graph


def check_local(graph: Graph) -> None:
    """What one machine cannot run, refused before anything starts: an interpreter that is not there, an
    encoder site's door on several routers, or an encode planner without etcd (Dynamo's VirtualConnector
    keeps its decisions in etcd)."""
    for name, c in graph.components.items():  # an interpreter of the graph's own (vLLM's virtualenv)
        if c.python and not os.access(c.python, os.X_OK):
            raise GraphError(f"component {name}: python {c.python} is not an executable here"
                             + (" (make vllm-venv builds it)" if c.backend == "vllm" else ""))
    doors = [(n, c) for n, c in graph.of_kind("cache-router") if graph.site == "encoder" and c.replicas > 1]
    if doors:
        raise GraphError(f"component {doors[0][0]}: an encoder site's router is its door, one port on one machine: "
                         "one replica here (render-k8s spreads several behind its LoadBalancer)")
    if graph.planner is not None and not graph.runtime.needs_etcd:
        raise GraphError(f"graph {graph.name}: an encode planner on one machine uses Dynamo's VirtualConnector, "
                         "whose state lives in etcd: set `runtime: {discovery: etcd}` (serve then runs etcd)")


def serve(options: ServeOptions) -> int:
    """The graph loaded, checked and run until stopped: serve's exit status (2: refused before starting)."""
    try:
        source = find_graph(options.graph)
        graph = options.apply(load_graph(source))
        check_local(graph)
    except GraphError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    runner = GraphRunner(graph, options.run_dir or Path(f"/tmp/mm-encoder-{graph.name}"), restart=options.restart,
                         start_timeout_s=options.start_timeout_s, bind=options.bind)
    return runner.run(str(source), options.status_interval)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mm-encoder serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("graph", help="a shipped graph's name (mm-encoder graphs lists them), e.g. epd, or a graph file")
    p.add_argument("--name", help="the graph's name for this run (default: the file's `name`): a second model "
                   "cluster from one file; its certificates, run directory and status carry it")
    p.add_argument("--run-dir", type=Path, help="logs, state, Dynamo store (default: /tmp/mm-encoder-<graph>)")
    p.add_argument("--restart", action="store_true", help="restart a component that dies")
    p.add_argument("--port", type=int, help="the frontend's port, an encoder site's router's (default: the graph's "
                   "frontend_port, site_port)")
    p.add_argument("--status-interval", type=float, default=60.0, help="seconds between status lines (0: never)")
    p.add_argument("--checkpoint", type=Path, help="the model's checkpoint directory, for every component (default: "
                   "the graph's llm.checkpoint, else a generated tiny Kimi-K2.5)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), help="dtype of every component that runs a model "
                   "(default: the graph's llm.dtype)")
    p.add_argument("--preset", choices=("tiny", "small", "vllm-tiny"),
                   help="without a checkpoint: the generated Kimi-K2.5's size (default: the graph's llm.preset)")
    p.add_argument("--tls", action="store_true", help="TLS with client certificates on every hop, from a "
                   "throwaway CA in the run directory (the graph's `tls`; docs/security.md)")
    p.add_argument("--tls-dir", type=Path, help="with --tls: the operator's CA (its ca.pem and ca.key) instead")
    p.add_argument("--bind", default=LOOPBACK, metavar="ADDR", help="where the site's door listens for other "
                   "hosts (a frontend; an encoder site's router); everything else stays on loopback. Off loopback "
                   "only with TLS (default: 127.0.0.1)")
    p.add_argument("--plaintext-off-loopback", action="store_true", help="allow --bind off loopback without TLS: "
                   "anyone on that network can call the site and read its answers")
    p.add_argument("--encoder-site", metavar="URL", help="a model cluster (site: cluster): its encoder site's URL, "
                   "https://HOST:PORT with TLS (default: the graph's encoder_site.url)")
    p.add_argument("--tenant-header", metavar="NAME", help="serve tenants: the frontend takes each request's "
                   "tenant from this header, which the operator's gateway sets (a request without it: 400 "
                   "missing_tenant), and every cache entry is the tenant's own (docs/tenants.md; default: the "
                   "graph's tenants.header, unset: off)")
    p.add_argument("--tenant-key", type=Path, metavar="FILE", help="with tenants: the secret (at least 32 random "
                   "bytes, mode 600) the scopes are keyed by; the same file for every cluster whose tenants share "
                   "an encoder site's entries (default: the graph's tenants.key_file, else <run dir>/tenant.key)")
    p.add_argument("--start-timeout-s", type=float, default=180.0, help="how long each replica may take to become "
                   "healthy (loading a real checkpoint's shards takes longer than the tiny model's)")
    return p


def main(argv: list[str] | None = None) -> int:
    return serve(ServeOptions(**vars(parser().parse_args(argv))))


if __name__ == "__main__":
    sys.exit(main())
