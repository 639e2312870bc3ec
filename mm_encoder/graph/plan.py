"""A graph's one plan: per component, the module it runs, where each replica listens, whom it calls,
who may call it, its certificate and its environment, as typed facts; each replica's command line is
rendered from them last (`graph.argv`), the same way on every site, and nothing reads it back.

What differs between `mm-encoder serve` (`serve/`) and `render-k8s` (`k8s/`) is a `Site`: where
components listen, how they reach each other (loopback ports there, Service DNS names here), where
the checkpoint and the caches live, and Dynamo's environment. The topology (who talks to whom, in
which order) is written here only; every default comes from the component's own settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..cache_tiers.config import TierConfig, tier_options
from ..core.dtypes import TorchName, torch_name
from ..core.errors import GraphError
from ..core.topology import CACHE_TIERS, ORDER, Kind, callers
from ..runtime.dynamo import MAX_MESSAGE_SIZE
from ..security.identity import server_host
from . import argv
from .planned import Chain, ComponentPlan, Replica, Site
from .schema import Component, Graph

MODULES: dict[Kind, str] = {
    "encoder": "mm_encoder.encode_worker",
    "cache-shared": "mm_encoder.cache_tiers",
    "cache-router": "mm_encoder.cache_tiers",
    "cache-cluster": "mm_encoder.cache_tiers",
    "engine": "mm_encoder.engines",
    "frontend": "mm_encoder.frontend",
    "planner": "mm_encoder.planner",
}
VLLM_ENGINE = "mm_encoder.engines.vllm"  # an engine with `backend: vllm`
STOCK_FRONTEND = "dynamo.frontend"  # Dynamo's own frontend (`stock: true`), from the ai-dynamo package
DYNAMO_KINDS: tuple[Kind, ...] = ("encoder", "engine", "frontend", "planner")  # on Dynamo's runtime (not nginx)
BODY_KINDS: tuple[Kind, ...] = ("encoder", "engine")  # send or receive embedding bodies; the frontend only handles
READY_LINE = "engine ready"  # what an engine prints once registered (it serves no HTTP)
OPS_KINDS: tuple[Kind, ...] = ("encoder", *CACHE_TIERS)  # with TLS: status and health on a plaintext ops port
TLS_KINDS: tuple[Kind, ...] = tuple(k for k in ORDER if k != "planner")  # with TLS: their HTTP hop is HTTPS
HEALTH: dict[Kind, str | None] = {"encoder": "/ready", "cache-shared": "/_cache/health",
                                  "cache-router": "/_cache/health", "cache-cluster": "/_cache/health",
                                  "engine": None, "frontend": "/v1/models", "planner": "/healthz"}


def replica_name(name: str, i: int, n: int) -> str:
    return name if n == 1 else f"{name}-{i}"


def tier_upstreams(graph: Graph, kind: Kind) -> list[str]:
    """The components a tier of `kind` sends requests to: its `--next` level first (a router's shards),
    then the encoders of a cluster tier's direct route. A model cluster's tier: none of its own graph (its
    next level is the encoder site; an encoder there is the fallback over RPC, never behind the tier)."""
    if graph.site == "cluster" and kind == "cache-cluster":
        return []

    def names(k: Kind) -> list[str]:
        return [n for n, _ in graph.of_kind(k)]

    upstreams = {"cache-router": names("cache-shared"), "cache-shared": names("encoder"),
                 "cache-cluster": [*(names("cache-router") or names("encoder")), *names("encoder")]}.get(kind, [])
    return list(dict.fromkeys(upstreams))


def wire_dtype(graph: Graph) -> TorchName | None:
    """The rows' dtype from encoder to engine: `llm.wire_dtype`, else `llm.dtype` (the worker packs
    what its model runs in), in torch's spelling; None: the encoders' default."""
    dtype = graph.llm.wire_dtype or graph.llm.dtype
    return torch_name(dtype) if dtype else None


def plan(graph: Graph, site: Site) -> list[ComponentPlan]:
    """Every component of `graph`, in start order, each replica's command line rendered last."""
    planned = _Planner(graph, site).components()
    return [replace(cp, replicas=tuple(replace(r, argv=argv.render(graph, site, cp, r)) for r in cp.replicas))
            for cp in planned]


@dataclass
class _Planner:
    """The typed facts, kind by kind in start order; `reach` collects the addresses of what was
    planned so far, which is what the later kinds connect to."""

    g: Graph
    site: Site
    reach: dict[Kind, list[str]] = field(default_factory=dict)

    def components(self) -> list[ComponentPlan]:
        out = []
        for kind in ORDER:
            for name, c in self.g.of_kind(kind):
                out.append(self._component(name, c))
                self.reach.setdefault(kind, []).extend(self.site.reach(name, c.kind, c.replicas))
        return out

    def _component(self, name: str, c: Component) -> ComponentPlan:
        g, kind = self.g, c.kind
        tls = g.tls.enabled  # a certificate each: for its HTTPS hop (TLS_KINDS) and to Dynamo's planes
        scaled = kind == "encoder" and g.planner is not None  # names that stay as the count moves
        options = self._tier_options(name, c) if kind in CACHE_TIERS else {}
        replicas = []
        for i in range(c.replicas):
            rname = replica_name(name, i, 2 if scaled else c.replicas)
            r = Replica(rname, i, self.site.listen(name, kind, i) if HEALTH[kind] else None,
                        self.site.ops_listen(name, kind, i) if tls and kind in OPS_KINDS else None,
                        self.site.tls_files(rname) if tls else None)
            replicas.append(replace(r, tier=self._tier(name, kind, r, options)) if kind in CACHE_TIERS else r)
        module = STOCK_FRONTEND if c.stock else VLLM_ENGINE if c.backend == "vllm" else MODULES[kind]
        ours = kind == "frontend" and not g.stock_frontend and not g.inline_encoding
        return ComponentPlan(
            name, kind, c, module, tuple(replicas), {**self._env(kind), **c.env}, HEALTH[kind],
            reads_model=kind in ("encoder", "engine") or (kind == "frontend" and not c.stock),
            callers=callers(kind, {k.kind for k in g.components.values()}) if kind in OPS_KINDS else frozenset(),
            tls=g.tls.enabled, chain=self.chain() if kind in ("encoder", "engine", "frontend") else None,
            wire_dtype=wire_dtype(g) if ours or (kind == "encoder" and g.llm.wire_dtype) else None)

    def _env(self, kind: Kind) -> dict[str, str]:
        env = {"PYTHONUNBUFFERED": "1"}
        if kind in DYNAMO_KINDS:
            rt = self.g.runtime
            env |= {"DYN_REQUEST_PLANE": rt.request_plane, "DYN_EVENT_PLANE": rt.event_plane,
                    **self.site.dynamo_env(kind)}
            if rt.discovery != "default":  # the graph's choice over the site's
                env["DYN_DISCOVERY_BACKEND"] = rt.discovery
        if kind in BODY_KINDS:  # a body fetched over RPC (the chain's fallback) is the embeddings' size
            env["DYN_TCP_MAX_MESSAGE_SIZE"] = str(MAX_MESSAGE_SIZE)
        return env

    def _tier_options(self, name: str, c: Component) -> Mapping[str, Any]:
        """The graph's own `args` for a tier, as its settings read them, checked before anything starts."""
        try:
            return tier_options(c.args)
        except ValueError as e:
            raise GraphError(f"components.{name}.args: {e}") from None

    def _tier(self, name: str, kind: Kind, r: Replica, options: Mapping[str, Any]) -> TierConfig:
        """A tier replica's configuration: its address, directories and levels, its TLS, then the graph's options."""
        assert r.http is not None
        tier = kind.removeprefix("cache-")
        run_dir, cache_dir = self.site.tier_dirs(r.name)
        facts: dict[str, Any] = {"tier": tier, "listen": ":".join(map(str, r.http)), "run_dir": run_dir}
        if tier == "router":
            facts["shards"] = tuple(self.reach["cache-shared"])
        elif tier == "cluster" and self.g.site == "cluster":
            facts |= {"cache_dir": cache_dir, **self._to_encoder_site()}
        else:
            facts["cache_dir"] = cache_dir
            facts["next"] = tuple(self.reach["encoder"] if tier == "shared"
                                  else self.reach.get("cache-router") or self.reach["encoder"])
            if tier == "cluster":
                facts["direct"] = tuple(self.reach["encoder"])
            if tier == "shared" and len(self.g.of_kind("encoder")) > 1:  # an encoder site's models
                facts["next_model"] = tuple(f"{model}={address}" for name, c in self.g.of_kind("encoder")
                                            for model in c.serves for address in self.site.reach(name, c.kind,
                                                                                                 c.replicas))
        if tier == "cluster":  # named by its graph, as a TLS caller's certificate names it (the graph's args win)
            facts["cluster_name"] = self.g.name[:63]
        if r.tls is not None and r.ops is not None:
            facts |= {"tls_cert": r.tls.cert, "tls_key": r.tls.key, "tls_ca": r.tls.ca,
                      "tls_allow": tuple(sorted(callers(kind, {c.kind for c in self.g.components.values()}))),
                      "ops_listen": ":".join(map(str, r.ops))}
            td, upstreams = self.g.tls.trust_domain, tier_upstreams(self.g, kind)  # each checked by its role's name
            facts["tls_server_name"] = (server_host(td, self.g.name, self.g.components[upstreams[0]].kind)
                                        if upstreams else server_host(td, self.g.encoder_site.graph, "cache-router"))
            if tier == "cluster" and self.g.site == "single":
                facts["tls_direct_server_name"] = server_host(td, self.g.name, "encoder")
            if tier == "router" and self.g.site == "encoder":  # the door: the model clusters it names call it
                facts["tls_allow_graphs"] = self.g.clusters
        try:
            return TierConfig.model_validate({**facts, **options})
        except ValueError as e:
            raise GraphError(f"components.{name}: {e}") from None

    def _to_encoder_site(self) -> dict[str, Any]:
        """A model cluster's tier: its next level, and its direct route, is the encoder site's router,
        across the network: behind a circuit breaker (`TierConfig.site_breaker`)."""
        site = self.g.encoder_site
        if site.url is None:
            raise GraphError(f"graph {self.g.name} is a model cluster: name its encoder site "
                             "(encoder_site.url, or serve --encoder-site URL)")
        return {"next": (site.address,), "direct": (site.address,), "site_breaker": True}

    def chain(self) -> Chain | None:
        """The cache chain's first level and its route, as components reach it (None: no tiers).
        Asked of the site, not of what was planned so far: the encoder, planned first, names it too."""
        scheme = "https" if self.g.tls.enabled else "http"
        cluster, router = self.g.of_kind("cache-cluster"), self.g.of_kind("cache-router")
        if cluster:  # the outermost tier, and the route through the chain
            name, c = cluster[0]
            return Chain(f"{scheme}://{self.site.reach(name, c.kind, c.replicas)[0]}",
                         "cluster,shared" if router or self.g.site == "cluster" else "cluster")
        if router:
            name, c = router[0]
            return Chain(f"{scheme}://{self.site.reach(name, c.kind, c.replicas)[0]}", "shared")
        return None
