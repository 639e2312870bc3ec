"""Each replica's command line, rendered from its typed plan (`graph.plan`) as the last step, for
every site: the component's options from the plan's facts, its TLS options, then the graph's own
`args` as given (so they win). The one place that knows each component's flags."""

from __future__ import annotations

from collections.abc import Callable

from ..cache_tiers.config import tier_flags, tier_options
from ..core.dtypes import torch_name
from .planned import ComponentPlan, Replica, Site
from .schema import Graph

_Render = Callable[[Graph, Site, ComponentPlan, Replica], list[str]]


def render(g: Graph, site: Site, cp: ComponentPlan, r: Replica) -> tuple[str, ...]:
    """`python -m <cp.module>` arguments for replica `r`."""
    own = _RENDER[_form(cp)](g, site, cp, r)
    return (*own, *_tls(g, cp, r), *cp.component.args)


def _form(cp: ComponentPlan) -> str:
    """Which command line the component takes: its kind's, or vLLM's adapter's, or Dynamo's own frontend's."""
    if cp.component.stock:
        return "stock-frontend"
    if cp.component.backend == "vllm":
        return "vllm-engine"
    return "cache" if cp.kind.startswith("cache-") else cp.kind


def _http(r: Replica) -> list[str]:
    assert r.http is not None
    return ["--http-host", r.http[0], "--http-port", str(r.http[1])]


def _dtype(g: Graph) -> list[str]:
    return ["--dtype", g.llm.dtype] if g.llm.dtype else []


def _encoder(g: Graph, site: Site, cp: ComponentPlan, r: Replica) -> list[str]:
    argv = ["--model", site.checkpoint_of(cp.name, cp.component), *_dtype(g), "--dynamo", "--namespace", g.namespace,
            *_http(r)]
    if cp.wire_dtype:
        argv += ["--wire-dtype", cp.wire_dtype]
    if g.stock_frontend:  # Dynamo's Encode worker for the model; its handles name the chain
        argv += ["--stock-model-dir", site.checkpoint_dir, "--stock-name", g.llm.served_name]
        if cp.chain:
            argv += ["--handle-chain", cp.chain.url, "--handle-route", cp.chain.route]
    return argv


def _cache(g: Graph, site: Site, cp: ComponentPlan, r: Replica) -> list[str]:
    """The tier's configuration but what the graph's `args` set (they follow, as given)."""
    assert r.tier is not None
    return ["up", *tier_flags(r.tier, exclude=tier_options(cp.component.args).keys())]


def _engine(g: Graph, site: Site, cp: ComponentPlan, r: Replica) -> list[str]:
    argv = ["--checkpoint", site.checkpoint_dir, *_dtype(g), "--name", g.llm.served_name,
            "--namespace", g.namespace, "--block-size", str(g.block_size)]
    if g.inline_encoding:  # the aggregated baseline: the whole model, its own vision tower on pixels
        argv += ["--encode-inline"]
    elif cp.chain:  # the chain the engine trusts to fetch bodies from (handles name it)
        argv += ["--encoder-chain", cp.chain.url]
    return argv + (["--frontend", "stock"] if g.stock_frontend else [])


def _vllm_engine(g: Graph, site: Site, cp: ComponentPlan, r: Replica) -> list[str]:
    """The dtype in vLLM's spelling; the graph's `args` are vLLM's own flags."""
    dtype = ["--dtype", torch_name(g.llm.dtype)] if g.llm.dtype else []
    argv = ["--model", site.checkpoint_dir, "--name", g.llm.served_name, "--namespace", g.namespace,
            "--block-size", str(g.block_size), *dtype]
    return argv + (["--encoder-chain", cp.chain.url] if cp.chain else [])


def _frontend(g: Graph, site: Site, cp: ComponentPlan, r: Replica) -> list[str]:
    argv = ["--model-dir", site.checkpoint_dir, *_http(r), "--namespace", g.namespace,
            "--block-size", str(g.block_size)]
    if cp.chain:
        argv += ["--encoder-http", cp.chain.url, "--encoder-route", cp.chain.route]
    if cp.wire_dtype:
        argv += ["--wire-dtype", cp.wire_dtype]
    if g.tenants.header:
        argv += ["--tenant-header", g.tenants.header, "--tenant-key", site.tenant_key()]
    return argv + (["--inline-media"] if g.inline_encoding else [])


def _stock_frontend(g: Graph, site: Site, cp: ComponentPlan, r: Replica) -> list[str]:
    """Dynamo's own frontend: it discovers the model from the engines' and the encoder's cards."""
    return [*_http(r), "--namespace", g.namespace]


def _planner(g: Graph, site: Site, cp: ComponentPlan, r: Replica) -> list[str]:
    """The encode planner: the graph's encoder component, through the site's connector."""
    encoder = g.of_kind("encoder")[0][0]
    return ["--namespace", g.namespace, "--component", encoder, "--connector", site.connector,
            "--model-name", g.llm.served_name, *_http(r)]


def _tls(g: Graph, cp: ComponentPlan, r: Replica) -> list[str]:
    """With TLS: the replica's certificate; an encoder's callers and plaintext status port; the
    frontend's HTTPS. A tier's are part of its configuration; the planner's certificate is for Dynamo's
    planes only (its /status stays plaintext)."""
    if r.tls is None or cp.kind.startswith("cache-") or cp.kind == "planner":
        return []
    argv = ["--tls-cert", r.tls.cert, "--tls-key", r.tls.key, "--tls-ca", r.tls.ca]
    if cp.kind == "encoder":
        assert r.ops is not None
        argv += ["--tls-allow", ",".join(sorted(cp.callers)), "--ops-port", str(r.ops[1])]
    elif cp.kind == "frontend":
        argv += ["--https", *(["--https-client-auth"] if g.tls.client_auth else [])]
        if r.tls.plane_cert:  # read once by Dynamo's HTTP server: the certificate serve renews by a restart
            argv += ["--https-cert", r.tls.plane_cert, "--https-key", r.tls.plane_key]
    return argv


_RENDER: dict[str, _Render] = {"encoder": _encoder, "cache": _cache, "engine": _engine, "vllm-engine": _vllm_engine,
                               "frontend": _frontend, "stock-frontend": _stock_frontend, "planner": _planner}
