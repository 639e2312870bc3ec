"""One tier's configuration, `TierConfig`: every option from the command line or `MM_CACHE_<OPTION>`,
the defaults here the only ones. A graph's plan builds each tier replica's config as a typed object
(`tier_options` reads the graph's own `args` for it) and renders its command line with `tier_flags`;
`mm-encoder serve` reloads a running tier from the object itself."""

from __future__ import annotations

import functools
import os
import re
import tempfile
from collections.abc import Collection, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import CliSettingsSource, SettingsConfigDict, SettingsError
from typing_extensions import TypeAliasType

from ..core.topology import callers
from ..security import pki
from ..security.tls import PATH, TlsOptions

_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})$")
_GRAPH = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
# A model name the tiers route by (X-MM-Model, --next-model) and a graph names (`serves`).
MODEL_NAME = re.compile(r"[A-Za-z0-9._/-]{1,200}")
_SIZE = re.compile(r"^[0-9]+[kmgKMG]?$")
_TIME = re.compile(r"^[0-9]+(ms|s|m|h|d)?$")
# What --help shows for a value (pydantic-settings prints a type alias by its name).
HOST_PORT = TypeAliasType("HOST_PORT", str)
HOST_PORTS = TypeAliasType("HOST_PORTS", tuple[str, ...])  # the flag once per address, or a,b
ROLES = TypeAliasType("ROLES", tuple[str, ...])  # certificate roles (OU): the flag once per role, or a,b
MODEL_ADDRESSES = TypeAliasType("MODEL_ADDRESSES", tuple[str, ...])  # MODEL=host:port, the flag once per pair
GRAPHS = TypeAliasType("GRAPHS", tuple[str, ...])  # graph names: the flag once per graph, or a,b
SIZE = TypeAliasType("SIZE", str)  # an nginx size: 512k, 64m, 1g
TIME = TypeAliasType("TIME", str)  # an nginx time: 500ms, 30s, 10m, 24h

# How long a tier waits for the next level: above the slowest encode plus the inner tiers' lock
# waits. The cluster tier waits on the shared tier, which may itself wait a lock age (600 s).
READ_TIMEOUTS = {"cluster": "1500s", "shared": "900s", "router": "900s"}
# A model cluster's tier to its encoder site, across the network (`--site-breaker`): a lost SYN is resent
# after 1 s, so 2 s tells an unreachable site from a slow one; the read timeout bounds a request sent on a
# kept-alive connection over a link that went down (no error comes back, only silence), and stays above
# the site's encode of a large image with its queue (raise it for long videos).
SITE_CONNECT_TIMEOUT, SITE_READ_TIMEOUT, CONNECT_TIMEOUT = "2s", "60s", "5s"
_CLI = {"cli_kebab_case": True, "cli_implicit_flags": True}


class TierConfig(TlsOptions):
    """One nginx process: a cache tier (`cluster` or `shared`) or the stateless `router`; with
    --tls-cert/--tls-key/--tls-ca, HTTPS to callers whose certificate's spiffe:// ID is of its graph with
    a role in --tls-allow, HTTPS to the next level, the tier's status in plaintext on --ops-listen only."""

    model_config = SettingsConfigDict(
        env_prefix="MM_CACHE_", extra="forbid", frozen=True, populate_by_name=True, cli_hide_none_type=True,
        cli_prog_name="mm-encoder cache", cli_exit_on_error=False, **_CLI,  # type: ignore[typeddict-item]
    )

    tier: Literal["cluster", "shared", "router"]
    listen: HOST_PORT = "127.0.0.1:8081"
    next: HOST_PORTS = Field((), description="the next level, once per server: the shared tier's router, "
                                      "or the encoders")
    direct: HOST_PORTS = Field((), description="the encoders, for X-Cache-Route ...,direct (none: --next)")
    next_model: MODEL_ADDRESSES = Field((), description="an encoder of one model, MODEL=host:port, once per encoder "
                                        "and model: requests naming that model (X-MM-Model) go to its encoders, "
                                        "others to --direct (an encoder site's shared tier, several models)")
    shards: HOST_PORTS = Field((), alias="shard", description="router only: a shard tier, by stable name, "
                                        "once per shard")
    run_dir: PATH | None = Field(None, description="config, pid and temp files (null: a temp dir per tier and port)")
    cache_dir: PATH | None = Field(None, description="the cache, on tmpfs (null: /dev/shm/mm-encoder-cache/"
                                   "<tier>-<port>)")
    max_size: SIZE = Field("1g", description="the cache's size on disk (nginx max_size)")
    keys_zone: SIZE = Field("64m", description="shared memory for the cache's keys (about 8000 keys per MB)")
    valid: TIME = Field("24h", description="how long a cached answer is served")
    lock_timeout: TIME = Field("600s", description="how long identical misses wait for the first one")
    lock_age: TIME = Field("600s", description="after this, one more waiter may go to the origin")
    read_timeout: TIME | None = Field(None, description="waiting for the next level (null: 1500s for the cluster "
                                      "tier, 900s for the others; 60s with --site-breaker)")
    connect_timeout: TIME | None = Field(None, description="connecting to the next level (null: 5s; 2s with "
                                         "--site-breaker)")
    site_breaker: bool = Field(False, description="the next level is an encoder site across the network (serve sets "
                               "it for a model cluster's tier): after a connect failure or timeout the site is "
                               "marked down for --site-retry-s and misses fail at once with 503 "
                               "encoder_site_unreachable and Retry-After, then one request probes it; hits are "
                               "served throughout (docs/cache-tiers.md, \"An encoder site's faults\")")
    site_retry_s: int = Field(5, ge=1, le=3600, description="with --site-breaker: how long the site stays marked "
                              "down after a failure before one request probes it (nginx fail_timeout), and the "
                              "503's Retry-After")
    client_max_body_size: SIZE = "96m"
    client_body_buffer_size: SIZE = "1m"
    workers: str = Field("auto", description="nginx worker processes: a number or auto")
    drop_client_key: bool = Field(False, description="ignore a caller's X-Cache-Key instead of checking it against "
                                  "the body's sha256 (the key either way; a key that differs: 400 bad_cache_key)")
    log_level: Literal["debug", "info", "notice", "warn", "error", "crit"] = "warn"
    cluster_name: str = Field("", pattern=r"^([a-z0-9-]{1,63})?$",
                              description="cluster tier only: the model cluster it serves, sent on as X-MM-Cluster "
                              "(whatever its caller sent) so the levels behind count requests per cluster (serve, "
                              "render-k8s: the graph's name; none: with TLS its graph, else the caller's header)")
    tls_allow: ROLES = Field((), description="with TLS: a role (of the caller's spiffe:// ID) that may call this tier, "
                                       "once per role (none: the tier's callers, core/topology.py)")
    tls_allow_graphs: GRAPHS = Field((), description="with TLS: another graph whose callers (of a role in "
                                     "--tls-allow) may call this tier, once per graph: an encoder site's router "
                                     "admits its model clusters' tiers (none: its own graph's only)")
    tls_server_name: str = Field("localhost", pattern=r"^[A-Za-z0-9.-]+$",
                                 description="with TLS: the DNS name the next level's certificate must carry "
                                 "(serve: its role's, <role>.<graph>.<trust domain>)")
    tls_direct_server_name: str | None = Field(None, pattern=r"^[A-Za-z0-9.-]+$",
                                               description="with TLS: the name the encoders of a cluster tier's "
                                               "direct route must carry (null: --tls-server-name)")
    ops_listen: HOST_PORT | None = Field(None, description="with TLS: where /_cache/stats, /metrics, /_cache/health "
                                       "and /_cache/status answer in plaintext (loopback or the pod network)")
    user: str = Field(
        "root", pattern=r"^[A-Za-z0-9_.-]+( [A-Za-z0-9_.-]+)?$",
        description="worker user when started as root (nginx `user`); non-root starts ignore it. root so that "
        "run directories inside private (0700) temp dirs work; pass e.g. nobody with directories it can reach",
    )

    @field_validator("listen")
    @classmethod
    def _address(cls, v: str) -> str:
        if not _ADDRESS.match(v):
            raise ValueError(f"{v!r} is not host:port")
        return v

    @field_validator("ops_listen")
    @classmethod
    def _ops_address(cls, v: str | None) -> str | None:
        return None if v is None else cls._address(v)

    @field_validator("tls_allow")
    @classmethod
    def _roles(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [r for r in v if r not in pki.ROLES]
        if unknown:
            raise ValueError(f"unknown roles {unknown}; roles are {', '.join(pki.ROLES)}")
        return v

    @field_validator("tls_allow_graphs")
    @classmethod
    def _graphs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [g for g in v if not _GRAPH.fullmatch(g)]
        if bad:
            raise ValueError(f"{bad}: a graph's name is a DNS-1123 label")
        return v

    @field_validator("next_model")
    @classmethod
    def _model_addresses(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for pair in v:
            model, _, address = pair.rpartition("=")
            if not MODEL_NAME.fullmatch(model):
                raise ValueError(f"{pair!r} is not MODEL=host:port (a model name of [A-Za-z0-9._/-])")
            cls._address(address)
        return v

    @property
    def models(self) -> dict[str, tuple[str, ...]]:
        """--next-model by model (case-insensitive, as the encoders match a name): its encoders' addresses."""
        out: dict[str, tuple[str, ...]] = {}
        for pair in self.next_model:
            model, _, address = pair.rpartition("=")
            out[model.lower()] = (*out.get(model.lower(), ()), address)
        return out

    @field_validator("next", "direct", "shards")
    @classmethod
    def _addresses(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for a in v:
            cls._address(a)
        return v

    @field_validator("max_size", "keys_zone", "client_max_body_size", "client_body_buffer_size")
    @classmethod
    def _size(cls, v: str) -> str:
        if not _SIZE.match(v):
            raise ValueError(f"{v!r} is not an nginx size (like 512k, 64m, 1g)")
        return v

    @field_validator("valid", "lock_timeout", "lock_age", "read_timeout", "connect_timeout")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        if v is not None and not _TIME.match(v):
            raise ValueError(f"{v!r} is not an nginx time (like 500ms, 30s, 10m, 24h)")
        return v

    @field_validator("workers")
    @classmethod
    def _workers(cls, v: str) -> str:
        if v != "auto" and not v.isdigit():
            raise ValueError("workers is a number or auto")
        return v

    @model_validator(mode="after")
    def _check(self) -> TierConfig:
        if self.tier == "router":
            if not self.shards:
                raise ValueError("a router needs at least one --shard")
            if self.next or self.direct or self.next_model:
                raise ValueError("a router takes --shard, not --next/--direct/--next-model")
        elif not self.next:
            raise ValueError(f"a {self.tier} tier needs --next (the next level, or the encoders)")
        elif self.shards:
            raise ValueError("--shard is for the router")
        if self.cluster_name and self.tier != "cluster":
            raise ValueError("--cluster-name is for a cluster tier (the levels behind it label by what it sends)")
        if self.site_breaker and self.tier != "cluster":
            raise ValueError("--site-breaker is a model cluster's tier's, whose next level is its encoder site")
        if (self.ops_listen is not None or self.tls_allow or self.tls_allow_graphs) and not self.tls:
            raise ValueError("--ops-listen, --tls-allow and --tls-allow-graphs go with TLS (--tls-cert, --tls-key, "
                             "--tls-ca)")
        return self

    @property
    def callers(self) -> tuple[str, ...]:
        """With TLS: the roles that may call this tier."""
        return self.tls_allow or tuple(sorted(callers(f"cache-{self.tier}")))

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    @property
    def timeout(self) -> str:
        """How long it waits for the next level."""
        return self.read_timeout or (SITE_READ_TIMEOUT if self.site_breaker else READ_TIMEOUTS[self.tier])

    @property
    def connect(self) -> str:
        """How long it waits to connect to the next level."""
        return self.connect_timeout or (SITE_CONNECT_TIMEOUT if self.site_breaker else CONNECT_TIMEOUT)

    @property
    def cluster(self) -> str:
        """The calling cluster this tier names for itself: --cluster-name, else with TLS a cluster tier's own
        graph (what the router labels it by, from its certificate); "" lets the caller's header decide."""
        if self.cluster_name or self.tier != "cluster" or not self.tls:
            return self.cluster_name
        return self.identity.graph

    def resolved_run_dir(self) -> Path:
        return self.run_dir or Path(tempfile.gettempdir()) / f"mm-encoder-cache-{self.tier}-{self.port}"

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir is not None:
            return self.cache_dir
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else self.resolved_run_dir()
        return base / "mm-encoder-cache" / f"{self.tier}-{self.port}"


@functools.lru_cache(maxsize=64)
def tier_options(args: tuple[str, ...]) -> Mapping[str, Any]:
    """The options a tier's command-line `args` set, by field name, as its own parser reads them (no
    environment); a ValueError naming the problem otherwise (a graph's `args`, checked before anything
    starts). Parsed once per graph component: the plan types them, the argv rendering leaves them out."""
    if not args:
        return MappingProxyType({})
    try:
        values: dict[str, Any] = CliSettingsSource(TierConfig, cli_parse_args=list(args), cli_exit_on_error=False,
                                                   **_CLI)()  # type: ignore[arg-type]
    except SettingsError as e:
        raise ValueError(str(e)) from None
    names = {info.alias: name for name, info in TierConfig.model_fields.items() if info.alias}
    return MappingProxyType({names.get(k, k): v for k, v in values.items()})


def tier_flags(cfg: TierConfig, exclude: Collection[str] = ()) -> list[str]:
    """The command-line flags that make `cfg` again: each field that differs from its default, but `exclude`."""
    out: list[str] = []
    for name, info in TierConfig.model_fields.items():
        value = getattr(cfg, name)
        if name in exclude or value == info.default:
            continue
        flag = "--" + (info.alias or name).replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, tuple):
            out += [x for v in value for x in (flag, str(v))]
        else:
            out += [flag, str(value)]
    return out
