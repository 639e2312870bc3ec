"""Graph files (`graphs/*.yaml`): which components run, how many, with which args and env.

A graph is plain data validated by pydantic; errors name their path in the file
(`components.encoder.replicas: ...`). `graph.plan` turns it into what each component runs, which
`mm-encoder serve` (`serve/`) starts on one machine and `mm-encoder render-k8s` (`k8s/`) renders
as Kubernetes resources; both take a graph file or a shipped graph's name (`graph.shipped`).

    name: epd
    namespace: mm
    llm: {checkpoint: null, dtype: fp32}   # null: a generated tiny Kimi-K2.5 checkpoint
    frontend_port: 8000
    components:
      encoder:  {kind: encoder, replicas: 1}
      shared:   {kind: cache-shared, replicas: 2}
      router:   {kind: cache-router}
      cluster:  {kind: cache-cluster}
      engine:   {kind: engine, replicas: 2}
      frontend: {kind: frontend}
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .. import __version__
from ..cache_tiers.config import MODEL_NAME
from ..core.dtypes import ShortName
from ..core.errors import GraphError
from ..core.topology import CACHE_TIERS, Kind
from ..planner.settings import check_args
from ..runtime.dynamo import BLOCK_SIZE, NAMESPACE
from ..security.tenants import HEADER_NAME

# Options the plan sets from the graph as a whole, refused in a component's own `args`.
_PLANNED_FLAGS = {"--wire-dtype": "the rows' dtype from encoder to engine is llm.wire_dtype",
                  "--tls-allow": "who may call a component is the graph's topology (core/topology.py)"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Component(_Strict):
    kind: Kind
    replicas: int = Field(1, ge=1, le=64)
    args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    image: str | None = None  # Kubernetes only: overrides the graph's image
    resources: dict[str, dict[str, str]] = Field(default_factory=dict)  # Kubernetes only
    # frontend only: run Dynamo's own `python -m dynamo.frontend` (media through our Encode worker)
    stock: bool = False
    # engine only: the transformers engine (engines/process.py) or vLLM (engines/vllm.py; `args` are vLLM's)
    backend: Literal["transformers", "vllm"] = "transformers"
    # `serve` only: the interpreter this component runs under (vLLM lives in its own virtualenv:
    # `make vllm-venv`); a relative path is taken from the working directory. Kubernetes: the image's.
    python: str | None = None
    # encoder only: this component's own checkpoint (default: llm.checkpoint), and the model names it
    # answers to, by which an encoder site's shared tier routes each request (several encoder components)
    checkpoint: str | None = None
    serves: tuple[str, ...] = Field((), max_length=16)


class LLM(_Strict):
    """The model every component serves, from one checkpoint directory: the encode workers read its
    vision shards, the engines its language-model shards, the frontend its tokenizer and chat
    template. Without `checkpoint`, a small random Kimi-K2.5 is generated (`preset`)."""

    checkpoint: str | None = None
    name: str | None = None  # the served model name (default: the checkpoint directory's name)
    preset: Literal["tiny", "small", "vllm-tiny"] = "tiny"  # the generated checkpoint's size, without `checkpoint`
    dtype: Literal["fp32", "bf16"] | None = None  # every component that runs a model (None: each one's default)
    # The rows' dtype from encoder to engine (None: the one `dtype` names, else the encoders' model's): the
    # encoders pack it, the frontend names it in every encode request, so the tiers key it and an encoder
    # packing another refuses (409).
    wire_dtype: ShortName | None = None

    @property
    def served_name(self) -> str:
        """`name`, else the checkpoint directory's name (a relative path such as `.` or `..` taken from the
        working directory, as the path itself is), else `kimi-k2.5-<preset>` for the generated one."""
        if self.name:
            return self.name
        if self.checkpoint:
            return Path(os.path.abspath(self.checkpoint)).name
        return f"kimi-k2.5-{self.preset}"


class Tls(_Strict):
    """TLS with client certificates on the graph's own HTTP hops (docs/security.md): every component
    gets a certificate from one CA naming its role, serves HTTPS to the roles that may call it and
    calls the next hop over HTTPS. `serve`: a throwaway CA in the run directory, or the operator's
    (`ca_dir`: its ca.pem and ca.key). The frontend's OpenAI port serves HTTPS with a certificate
    from the same CA; `client_auth` asks its clients for one too."""

    enabled: bool = False
    ca_dir: str | None = None
    client_auth: bool = False
    # every certificate's URI, spiffe://<trust_domain>/<graph>/<role>/<name>: what each hop admits
    trust_domain: str = Field("mm-encoder.local", pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
    # lifetimes (serve's CA and certificates): the CA's, and each component's, renewed at two thirds of it
    ca_lifetime_days: int = Field(3650, ge=1, le=36500)
    cert_lifetime_s: float = Field(86400.0, ge=2.0, le=366 * 86400.0)
    # Dynamo's planes read a certificate once: theirs live longer, renewed by a rolling restart
    dynamo_cert_lifetime_s: float = Field(7 * 86400.0, ge=30.0, le=366 * 86400.0)
    # render-k8s: the cert-manager Issuer (`name`, or `ClusterIssuer/name`) that issues each component's
    # Secret through a Certificate; without it the Secrets are the operator's to create (docs/kubernetes.md)
    issuer: str | None = Field(None, pattern=r"^((Issuer|ClusterIssuer)/)?[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")

    @model_validator(mode="after")
    def _check(self) -> Tls:
        if self.issuer and not self.enabled:
            raise ValueError("tls.issuer issues the certificates of a graph with tls.enabled: true")
        return self


class Tenants(_Strict):
    """Serve tenants (docs/tenants.md): each request names its tenant in the `header` the operator's
    gateway sets, and every cache entry below the frontend is that tenant's own. `key_file`: the
    secret the scopes are keyed by, the same for every cluster whose tenants share the encoder site's
    entries (`serve --tenant-key FILE`; unset: a key of this run's own, `<run dir>/tenant.key`; the
    Kubernetes render mounts it from the Secret `<graph>-tenant-key`)."""

    header: str | None = Field(None, pattern=HEADER_NAME)
    key_file: str | None = None


class EncoderSite(_Strict):
    """A model cluster's encoder site (`site: cluster`): where its cluster tier sends misses, and the
    site graph's name, which the site's certificates carry (`spiffe://<trust domain>/<graph>/...`): the
    cluster tier checks the site's router for it. `url`: `serve --encoder-site URL` sets it per run."""

    url: str | None = Field(None, pattern=r"^https?://[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}/?$")
    graph: str = Field("encoder-site", pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")

    @property
    def address(self) -> str:
        """host:port, as a tier's `--next` takes it."""
        assert self.url is not None
        return self.url.split("://", 1)[1].rstrip("/")


class Runtime(_Strict):
    """Dynamo's own distributed runtime for the graph. `default`: each site's own (`serve`: file
    discovery, TCP requests, ZMQ events, no servers to run; Kubernetes: the operator's discovery).
    `etcd` discovery (leases drop a dead instance) and `nats` planes are the multi-machine setup;
    `serve` uses ETCD_ENDPOINTS / NATS_SERVER when set, else runs etcd and nats-server itself."""

    discovery: Literal["default", "file", "etcd", "kubernetes"] = "default"
    request_plane: Literal["tcp", "nats"] = "tcp"
    event_plane: Literal["zmq", "nats"] = "zmq"

    @property
    def needs_etcd(self) -> bool:
        return self.discovery == "etcd"

    @property
    def needs_nats(self) -> bool:
        return "nats" in (self.request_plane, self.event_plane)


class Graph(_Strict):
    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
    namespace: str = Field(NAMESPACE, pattern=r"^[a-z0-9][a-z0-9_-]*$")
    description: str = ""
    image: str = f"mm-encoder:{__version__}"
    # Kubernetes only: the image of a `backend: vllm` engine (vLLM in an image of its own, docker/Dockerfile.vllm)
    vllm_image: str = f"mm-encoder-vllm:{__version__}-cpu"
    frontend_port: int = Field(8000, ge=1, le=65535)
    llm: LLM = Field(default_factory=LLM)
    block_size: int = Field(BLOCK_SIZE, ge=1)
    runtime: Runtime = Field(default_factory=Runtime)
    tls: Tls = Field(default_factory=Tls)
    # `single`: every component here (the default). `encoder`: an encoder site (encoders, router, shared
    # shards; optionally a planner) that model clusters call across the network on `site_port`. `cluster`: a
    # model cluster (frontend, cluster tier, engines) whose misses go to `encoder_site` (docs/sites.md).
    site: Literal["single", "encoder", "cluster"] = "single"
    site_port: int = Field(8090, ge=1, le=65535)  # an encoder site: where its router serves the clusters
    encoder_site: EncoderSite = Field(default_factory=EncoderSite)  # a model cluster: its encoder site
    # an encoder site with TLS: the model clusters (their graphs' names) whose cluster tiers may call it
    clusters: tuple[str, ...] = ()
    tenants: Tenants = Field(default_factory=Tenants)  # off unless `header` names the tenant header
    components: dict[str, Component]

    @model_validator(mode="after")
    def _check(self) -> Graph:
        kinds = [c.kind for c in self.components.values()]
        for name in self.components:
            if not name.replace("-", "").isalnum() or name != name.lower():
                raise ValueError(f"component name {name!r}: lowercase letters, digits and '-' only")
        self._check_site(kinds)
        if self.site != "encoder" and kinds.count("frontend") != 1:
            raise ValueError("a graph has exactly one frontend")
        if any(c.stock and c.kind != "frontend" for c in self.components.values()):
            raise ValueError("`stock: true` names Dynamo's own frontend: only a frontend component takes it")
        if any(c.backend != "transformers" and c.kind != "engine" for c in self.components.values()):
            raise ValueError("`backend` names an engine's implementation: only an engine component takes it")
        vllm = any(c.backend == "vllm" for _, c in self.of_kind("engine"))
        if vllm and (self.stock_frontend or self.inline_encoding):
            raise ValueError("the vLLM engine takes this project's frontend's requests with media by handle: "
                             "no stock frontend, and an encoder component")
        if self.stock_frontend and self.inline_encoding:
            raise ValueError("Dynamo's stock frontend sends media to an Encode worker: add an encoder component")
        if "engine" not in kinds and self.site != "encoder":
            raise ValueError("a graph needs an engine")
        for kind in CACHE_TIERS:
            if kinds.count(kind) > 1:
                raise ValueError(f"at most one {kind} component (use replicas)")
        if ("cache-router" in kinds) != ("cache-shared" in kinds):
            raise ValueError("cache-router and cache-shared go together (the router shards over the shared tier)")
        if any(k in CACHE_TIERS for k in kinds) and "encoder" not in kinds and self.site != "cluster":
            raise ValueError("cache tiers front encode workers: add an encoder component")
        if self.tls.enabled and self.runtime.event_plane == "zmq":
            raise ValueError("tls: Dynamo's ZMQ event plane has no TLS; set runtime.event_plane: nats")
        if self.tenants.header and (self.site == "encoder" or self.stock_frontend or self.inline_encoding):
            raise ValueError("tenants.header is read by this project's frontend, which scopes the encoders' caches: "
                             "not on an encoder site, with Dynamo's stock frontend or the aggregated baseline")
        if self.tls.enabled and self.stock_frontend:
            raise ValueError("tls: Dynamo's stock frontend takes none of this project's TLS options (--tls-ca, "
                             "--https); use this project's frontend")
        for name, c in self.components.items():
            for flag, why in _PLANNED_FLAGS.items():
                if any(a == flag or a.startswith(flag + "=") for a in c.args):
                    raise ValueError(f"components.{name}.args: {flag} is the graph's to set: {why}")
        self._check_models()
        self._check_planner()
        return self

    def _check_models(self) -> None:
        """Several encoder components are an encoder site's models: each names the models it serves, none
        twice, so its shared tier can route a request to the encoders of the model it names."""
        for name, c in self.components.items():
            if (c.checkpoint or c.serves) and c.kind != "encoder":
                raise ValueError(f"components.{name}: `checkpoint` and `serves` are an encoder component's")
            bad = [m for m in c.serves if not MODEL_NAME.fullmatch(m)]
            if bad:
                raise ValueError(f"components.{name}.serves: {bad} (a model name of [A-Za-z0-9._/-])")
        encoders = self.of_kind("encoder")
        if len(encoders) < 2:
            return
        if self.site != "encoder":
            raise ValueError("several encoder components (one per model) make an encoder site: set site: encoder")
        seen: dict[str, str] = {}
        for name, c in encoders:
            if not c.serves:
                raise ValueError(f"components.{name}.serves: an encoder site with several encoder components "
                                 "routes by model: name the models each one serves")
            for model in c.serves:
                if model.lower() in seen:
                    raise ValueError(f"components.{name}.serves: {model} is served by {seen[model.lower()]} too")
                seen[model.lower()] = name

    def _check_site(self, kinds: list[Kind]) -> None:
        """What each kind of site runs: an encoder site no frontend or engine and its router as the door;
        a model cluster no router, shard or planner, its cluster tier the way to its encoder site, and an
        encoder only as its fallback (off unless named: its frontend and engines ask it over Dynamo RPC
        while the site is unreachable; docs/cache-tiers.md, "An encoder site's faults")."""
        if self.site == "encoder":
            extra = sorted({k for k in kinds if k in ("frontend", "engine", "cache-cluster")})
            if extra:
                raise ValueError(f"an encoder site runs encoders, a router and shared shards, not {', '.join(extra)}: "
                                 "those are a model cluster's (site: cluster)")
            if not {"encoder", "cache-router", "cache-shared"} <= set(kinds):
                raise ValueError("an encoder site needs an encoder, a cache-router (its door) and cache-shared shards")
            if self.tls.enabled and not self.clusters:
                raise ValueError("an encoder site with TLS admits the model clusters it names: set `clusters`")
        elif self.clusters:
            raise ValueError("`clusters` names who may call an encoder site: only a graph with site: encoder takes it")
        if self.site == "cluster":
            remote = sorted({k for k in kinds if k in ("cache-router", "cache-shared", "planner")})
            if remote:
                raise ValueError(f"a model cluster sends its misses to its encoder site; it runs no "
                                 f"{', '.join(remote)} (an encoder component is its fallback while the site is "
                                 "unreachable)")
            if "cache-cluster" not in kinds:
                raise ValueError("a model cluster reaches its encoder site through its cluster tier: add one")
            url = self.encoder_site.url
            if url is not None and url.startswith("https://") != self.tls.enabled:
                raise ValueError(f"encoder_site.url {url}: " + ("with TLS the encoder site is an https:// URL"
                                                                if self.tls.enabled else "an https:// encoder site "
                                                                "needs the graph's TLS (serve --tls-dir CA)"))
            if self.name == self.encoder_site.graph:
                raise ValueError(f"a model cluster's name ({self.name}) differs from its encoder site's graph "
                                 f"({self.encoder_site.graph}): the certificates tell them apart by it")

    def _check_planner(self) -> None:
        """At most one encode planner, scaling an encoder component that starts within its bounds;
        its options as the planner will read them (`--component` is the plan's to set)."""
        planners = self.of_kind("planner")
        if not planners:
            return
        if len(planners) > 1:
            raise ValueError("at most one planner component: two would fight over one count")
        name, p = planners[0]
        if p.replicas != 1:
            raise ValueError(f"components.{name}.replicas: a planner runs as one replica")
        encoders = self.of_kind("encoder")
        if len(encoders) != 1:
            raise ValueError(f"components.{name}: the encode planner scales the graph's one encoder component")
        try:
            s = check_args(p.args)
        except ValueError as e:
            raise ValueError(f"components.{name}.args: {e}") from None
        encoder, c = encoders[0]
        if not s.min_replicas <= c.replicas <= s.max_replicas:
            raise ValueError(f"components.{encoder}.replicas ({c.replicas}) is outside the planner's bounds "
                             f"[{s.min_replicas}, {s.max_replicas}]")

    @property
    def planner(self) -> tuple[str, Component] | None:
        found = self.of_kind("planner")
        return found[0] if found else None

    def of_kind(self, kind: str) -> list[tuple[str, Component]]:
        return [(n, c) for n, c in self.components.items() if c.kind == kind]

    @property
    def stock_frontend(self) -> bool:
        """The frontend is Dynamo's own: the encoder registers as its Encode worker, engines take its requests."""
        return any(c.stock for _, c in self.of_kind("frontend"))

    @property
    def inline_encoding(self) -> bool:
        """No encoder component: the engines encode media themselves (the aggregated baseline); a model
        cluster's encoders are its encoder site's."""
        return self.site == "single" and not self.of_kind("encoder")


def load_graph(path: str | Path) -> Graph:
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise GraphError(f"{path}: no such graph file") from None
    except yaml.YAMLError as e:
        raise GraphError(f"{path}: not valid YAML: {e}") from None
    try:
        return Graph.model_validate(doc)
    except ValidationError as e:
        lines = []
        for err in e.errors(include_url=False, include_input=False):
            where = ".".join(str(x) for x in err["loc"]) or "(top level)"
            lines.append(f"  {where}: {err['msg'].removeprefix('Value error, ')}")
        raise GraphError(f"{path}: invalid graph:\n" + "\n".join(lines)) from None


