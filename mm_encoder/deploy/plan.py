"""A graph's one plan: per component, the module it runs, each replica's arguments, its environment
and how to tell it is ready. `mm-encoder serve` (local.py) starts the plan as processes on one
machine and `mm-encoder render-k8s` (k8s.py) renders it as pods; the topology (who talks to
whom, in which order) is written here only, and every default comes from the component's own
settings (the worker's, the frontend's, `TierConfig`'s, `runtime.dynamo`'s).

What differs between the two is a `Site`: where components listen, how they reach each other
(loopback ports here, Service DNS names there), where the model's checkpoint and the caches live,
and the Dynamo environment (file discovery here, the operator's Kubernetes discovery there).
Every component that runs or describes the model reads the same checkpoint directory.
"""

from __future__ import annotations

import subprocess
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import GraphError
from ..runtime.dynamo import MAX_MESSAGE_SIZE
from .graph import Component, Graph, Kind

# Start order: each kind only talks to kinds before it.
ORDER: tuple[Kind, ...] = ("encoder", "cache-shared", "cache-router", "cache-cluster", "engine", "frontend",
                          "planner")
MODULES: dict[Kind, str] = {
    "encoder": "mm_encoder.worker",
    "cache-shared": "mm_encoder.deploy.cache_tiers",
    "cache-router": "mm_encoder.deploy.cache_tiers",
    "cache-cluster": "mm_encoder.deploy.cache_tiers",
    "engine": "mm_encoder.engines",
    "frontend": "mm_encoder.frontend",
    "planner": "mm_encoder.planner",
}
VLLM_ENGINE = "mm_encoder.engines.vllm"  # an engine with `backend: vllm`
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # llm.dtype as torch spells it: vLLM's --dtype, the wire's
STOCK_FRONTEND = "dynamo.frontend"  # Dynamo's own frontend (`stock: true`), from the ai-dynamo package
DYNAMO_KINDS: tuple[Kind, ...] = ("encoder", "engine", "frontend", "planner")  # on Dynamo's runtime (not nginx)
BODY_KINDS: tuple[Kind, ...] = ("encoder", "engine")  # send or receive embedding bodies; the frontend only handles
READY_LINE = "engine ready"  # what an engine prints once registered (it serves no HTTP)
CACHE_TIERS: tuple[Kind, ...] = ("cache-shared", "cache-router", "cache-cluster")
OPS_KINDS: tuple[Kind, ...] = ("encoder", *CACHE_TIERS)  # with TLS: status and health on a plaintext ops port
TLS_KINDS: tuple[Kind, ...] = tuple(k for k in ORDER if k != "planner")  # with TLS: a certificate each


@dataclass(frozen=True)
class Replica:
    name: str  # the component's name, plus -N for replicas beyond one (on one machine)
    argv: tuple[str, ...]  # after `python -m <module>`
    port: int | None  # where it serves HTTP (None: an engine)
    ops_port: int | None = None  # with TLS: its health, status and metrics in plaintext (encoders, tiers)


@dataclass(frozen=True)
class ComponentPlan:
    name: str
    kind: Kind
    component: Component  # the graph's entry: replicas, image, resources
    module: str
    replicas: tuple[Replica, ...]
    env: dict[str, str]  # the Dynamo environment, then the graph's `env` (which wins)
    health_path: str | None  # GET on the replica's port that answers 200 once ready
    uses: frozenset[str]  # "model": it reads the checkpoint directory
    tls: bool = False  # the graph's TLS: its HTTP hops are HTTPS with client certificates


class Site(ABC):
    """Where a plan runs."""

    checkpoint_dir: str  # the model's checkpoint directory as components see it
    connector: str = "virtual"  # how an encode planner's decisions are carried out (planner/settings.py)

    @abstractmethod
    def listen(self, name: str, kind: Kind, replica: int) -> tuple[str, int]:
        """Host and port replica `replica` of component `name` serves HTTP on."""

    @abstractmethod
    def reach(self, name: str, kind: Kind, replicas: int) -> list[str]:
        """The host:port addresses other components use for component `name`."""

    @abstractmethod
    def tier_dirs(self, replica: str) -> tuple[str, str]:
        """The run directory and cache directory of the tier replica named `replica`."""

    @abstractmethod
    def dynamo_env(self, kind: Kind) -> dict[str, str]:
        """Dynamo's environment for a component of `kind`, beyond the planes every site shares."""

    def tls_files(self, replica: str) -> tuple[str, str, str]:
        """With TLS: replica `replica`'s certificate and key and the deployment's CA, as it sees them."""
        raise GraphError("`tls` is not supported on this site yet")

    def ops_listen(self, name: str, kind: Kind, replica: int) -> tuple[str, int]:
        """With TLS: where replica `replica` of an encoder or tier serves its status in plaintext."""
        raise GraphError("`tls` is not supported on this site yet")

    def server_name(self, name: str, kind: Kind) -> str | None:
        """With TLS: the name component `name`'s certificate carries for those that call it, which a tier
        checks its next level's certificate for (None: the tier's default, the site's certificates' host)."""
        return None


def tier_upstreams(graph: Graph, kind: Kind) -> list[str]:
    """The components a tier of `kind` sends requests to: its `--next` level first (a router's shards),
    then the encoders of a cluster tier's direct route."""
    def names(k: Kind) -> list[str]:
        return [n for n, _ in graph.of_kind(k)]

    upstreams = {"cache-router": names("cache-shared"), "cache-shared": names("encoder"),
                 "cache-cluster": [*(names("cache-router") or names("encoder")), *names("encoder")]}.get(kind, [])
    return list(dict.fromkeys(upstreams))


def replica_name(name: str, i: int, n: int) -> str:
    return name if n == 1 else f"{name}-{i}"


def plan(graph: Graph, site: Site) -> list[ComponentPlan]:
    """Every component of `graph`, in start order."""
    return _Planner(graph, site).components()


class _Planner:
    """One method per kind: a replica's arguments. `reach` collects, kind by kind in start order,
    the addresses of what was planned so far, which is what the later kinds connect to."""

    def __init__(self, graph: Graph, site: Site):
        self.g, self.site = graph, site
        self.reach: dict[Kind, list[str]] = {}
        self.dtype = ["--dtype", graph.llm.dtype] if graph.llm.dtype else []
        self.wire_dtype = self._wire_dtype()
        self.tls = graph.tls.enabled
        self.scheme = "https" if self.tls else "http"

    def _wire_dtype(self) -> str | None:
        """The rows' dtype from encoder to engine: an encoder's explicit `--wire-dtype`, else the
        graph's `llm.dtype` (the worker packs what its model runs in). The frontend names it in every
        encode request, so the tiers key it and an encoder packing another refuses (409)."""
        given = {v for _, c in self.g.of_kind("encoder") if (v := _flag_value(c.args, "--wire-dtype")) is not None}
        if len(given) > 1:
            raise GraphError(f"the encoders' --wire-dtype differ ({', '.join(sorted(given))}): one graph, one dtype")
        return given.pop() if given else TORCH_DTYPES[self.g.llm.dtype] if self.g.llm.dtype else None

    def components(self) -> list[ComponentPlan]:
        out = []
        for kind in ORDER:
            for name, c in self.g.of_kind(kind):
                out.append(self._component(name, c))
                self.reach.setdefault(kind, []).extend(self.site.reach(name, kind, c.replicas))
        return out

    def _component(self, name: str, c: Component) -> ComponentPlan:
        stock = self.g.stock_frontend
        model = ("model",)
        argv, health, uses = {
            "encoder": (self.encoder, "/ready", model),
            "cache-shared": (self.shared, "/_cache/health", ()),
            "cache-router": (self.router, "/_cache/health", ()),
            "cache-cluster": (self.cluster, "/_cache/health", ()),
            "engine": (self.engine, None, model),
            "frontend": (self.frontend, "/v1/models", () if stock else model),
            "planner": (self.planner, "/healthz", ()),
        }[c.kind]
        scaled = c.kind == "encoder" and self.g.planner is not None  # names that stay as the count moves
        ops = self.tls and c.kind in OPS_KINDS
        replicas = tuple(
            Replica(rname := replica_name(name, i, 2 if scaled else c.replicas),
                    (*argv(name, i), *self._tls(rname, c.kind, name, i), *c.args),
                    self.site.listen(name, c.kind, i)[1] if health else None,
                    self.site.ops_listen(name, c.kind, i)[1] if ops else None)
            for i in range(c.replicas)
        )
        env = {"PYTHONUNBUFFERED": "1"}
        if c.kind in DYNAMO_KINDS:
            rt = self.g.runtime
            env |= {"DYN_REQUEST_PLANE": rt.request_plane, "DYN_EVENT_PLANE": rt.event_plane,
                    **self.site.dynamo_env(c.kind)}
            if rt.discovery != "default":  # the graph's choice over the site's
                env["DYN_DISCOVERY_BACKEND"] = rt.discovery
        if c.kind in BODY_KINDS:  # a body fetched over RPC (the chain's fallback) is the embeddings' size
            env["DYN_TCP_MAX_MESSAGE_SIZE"] = str(MAX_MESSAGE_SIZE)
        module = STOCK_FRONTEND if c.stock else VLLM_ENGINE if c.backend == "vllm" else MODULES[c.kind]
        return ComponentPlan(name, c.kind, c, module, replicas, {**env, **c.env}, health, frozenset(uses), self.tls)

    def _tls(self, replica: str, kind: Kind, name: str, i: int) -> list[str]:
        """With TLS: a replica's certificate, the roles that may call it and its plaintext status address."""
        if not self.tls or kind not in TLS_KINDS:
            return []
        cert, key, ca = self.site.tls_files(replica)
        argv = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca]
        if kind == "encoder":  # the shared tiers, the engines, and the cluster tier's direct route
            callers = {"cache-shared", "engine", *(["cache-cluster"] if self.g.of_kind("cache-cluster") else [])}
            ops_port = self.site.ops_listen(name, kind, i)[1]
            argv += ["--tls-allow", ",".join(sorted(callers)), "--ops-port", str(ops_port)]
        elif kind in CACHE_TIERS:  # and the name its next level's certificate carries, where the site has one
            argv += ["--ops-listen", ":".join(map(str, self.site.ops_listen(name, kind, i)))]
            upstream = tier_upstreams(self.g, kind)[0]
            if (server := self.site.server_name(upstream, self.g.components[upstream].kind)) is not None:
                argv += ["--tls-server-name", server]
        elif kind == "frontend":
            argv += ["--https", *(["--https-client-auth"] if self.g.tls.client_auth else [])]
        return argv

    def _http(self, name: str, kind: Kind, i: int) -> list[str]:
        host, port = self.site.listen(name, kind, i)
        return ["--http-host", host, "--http-port", str(port)]

    def _tier(self, name: str, kind: Kind, i: int, tier: str) -> list[str]:
        host, port = self.site.listen(name, kind, i)
        run_dir, cache_dir = self.site.tier_dirs(replica_name(name, i, self.g.components[name].replicas))
        argv = ["up", "--tier", tier, "--listen", f"{host}:{port}", "--run-dir", run_dir]
        return argv if tier == "router" else [*argv, "--cache-dir", cache_dir]

    def encoder(self, name: str, i: int) -> list[str]:
        argv = ["--model", self.site.checkpoint_dir, *self.dtype, "--dynamo", "--namespace", self.g.namespace,
                *self._http(name, "encoder", i)]
        if self.g.stock_frontend:  # Dynamo's Encode worker for the model; its handles name the chain
            argv += ["--stock-model-dir", self.site.checkpoint_dir, "--stock-name", self.g.llm.served_name]
            if chain := self.chain():
                argv += ["--handle-chain", chain[0], "--handle-route", chain[1]]
        return argv

    def shared(self, name: str, i: int) -> list[str]:
        return [*self._tier(name, "cache-shared", i, "shared"), *_pairs("--next", self.reach["encoder"])]

    def router(self, name: str, i: int) -> list[str]:
        return [*self._tier(name, "cache-router", i, "router"), *_pairs("--shard", self.reach["cache-shared"])]

    def cluster(self, name: str, i: int) -> list[str]:
        upstream = self.reach.get("cache-router") or self.reach["encoder"]
        return [*self._tier(name, "cache-cluster", i, "cluster"), *_pairs("--next", upstream),
                *_pairs("--direct", self.reach["encoder"])]

    def engine(self, name: str, i: int) -> list[str]:
        g = self.g
        if g.components[name].backend == "vllm":  # the dtype in vLLM's spelling; the graph's `args` are vLLM's flags
            dtype = ["--dtype", TORCH_DTYPES[g.llm.dtype]] if g.llm.dtype else []
            argv = ["--model", self.site.checkpoint_dir, "--name", g.llm.served_name, "--namespace", g.namespace,
                    "--block-size", str(g.block_size), *dtype]
            chain = self.chain()
            return argv + (["--encoder-chain", chain[0]] if chain else [])
        argv = ["--checkpoint", self.site.checkpoint_dir, *self.dtype, "--name", g.llm.served_name,
                "--namespace", g.namespace, "--block-size", str(g.block_size)]
        if g.inline_encoding:  # the aggregated baseline: the whole model, its own vision tower on pixels
            argv += ["--encode-inline"]
        elif chain := self.chain():  # the chain the engine trusts to fetch bodies from (handles name it)
            argv += ["--encoder-chain", chain[0]]
        return argv + (["--frontend", "stock"] if g.stock_frontend else [])

    def chain(self) -> tuple[str, str] | None:
        """The cache chain's first level and its route, as components reach it (None: no tiers).
        Asked of the site, not of what was planned so far: the encoder, planned first, names it too."""
        cluster, router = self.g.of_kind("cache-cluster"), self.g.of_kind("cache-router")
        if cluster:  # the outermost tier, and the route through the chain
            name, c = cluster[0]
            return f"{self.scheme}://{self.site.reach(name, c.kind, c.replicas)[0]}", \
                "cluster,shared" if router else "cluster"
        if router:
            name, c = router[0]
            return f"{self.scheme}://{self.site.reach(name, c.kind, c.replicas)[0]}", "shared"
        return None

    def frontend(self, name: str, i: int) -> list[str]:
        g = self.g
        if g.stock_frontend:  # Dynamo's own: it discovers the model from the engines' and encoder's cards
            return [*self._http(name, "frontend", i), "--namespace", g.namespace]
        argv = ["--model-dir", self.site.checkpoint_dir, *self._http(name, "frontend", i), "--namespace", g.namespace,
                "--block-size", str(g.block_size)]
        if chain := self.chain():
            url, route = chain
            argv += ["--encoder-http", url, "--encoder-route", route]
        if self.wire_dtype and not g.inline_encoding:
            argv += ["--wire-dtype", self.wire_dtype]
        return argv + (["--inline-media"] if g.inline_encoding else [])


    def planner(self, name: str, i: int) -> list[str]:
        """The encode planner: the graph's encoder component, through the site's connector."""
        g = self.g
        host, port = self.site.listen(name, "planner", i)
        encoder = g.of_kind("encoder")[0][0]
        return ["--namespace", g.namespace, "--component", encoder, "--connector", self.site.connector,
                "--model-name", g.llm.served_name, "--http-host", host, "--http-port", str(port)]


def _flag_value(args: tuple[str, ...] | list[str], flag: str) -> str | None:
    """The value a component's own `args` give `flag` (`--flag V` or `--flag=V`), the last one winning."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _pairs(flag: str, values: list[str]) -> list[str]:
    return [x for v in values for x in (flag, v)]


@dataclass(frozen=True)
class GeneratedCheckpoint:
    """The small random Kimi-K2.5 a graph without `llm.checkpoint` serves: written by
    `engines.tiny_checkpoint` with these arguments, the same on every site (so every component
    reads the same model). It loads torch, so it runs as its own process."""

    preset: str

    MODULE = "mm_encoder.engines.tiny_checkpoint"

    @classmethod
    def of(cls, graph: Graph) -> GeneratedCheckpoint | None:
        return None if graph.llm.checkpoint else cls(graph.llm.preset)

    def argv(self, target: str) -> list[str]:
        """`python -m <MODULE>` arguments that write it into `target`."""
        return [target, "--preset", self.preset]

    def write(self, target: str | Path, python: str = sys.executable) -> None:
        done = subprocess.run([python, "-m", self.MODULE, *self.argv(str(target))], capture_output=True, text=True)
        if done.returncode != 0:
            raise GraphError(f"writing the generated {self.preset} checkpoint into {target} failed:\n"
                             f"{done.stderr[-2000:]}")
