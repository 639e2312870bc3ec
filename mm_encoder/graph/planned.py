"""What a plan is made of (`graph.plan` makes it): per component and per replica, the typed facts
every site starts or renders it from, and the `Site` a plan is made for."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..cache_tiers.config import TierConfig
from ..core.dtypes import TorchName
from ..core.errors import GraphError
from ..core.topology import Kind
from .schema import Component

Address = tuple[str, int]


@dataclass(frozen=True)
class TlsFiles:
    """A replica's certificate and key, and the deployment's CA, as the replica sees them; and where a site
    gives Dynamo's planes (which read a certificate once) one of their own, that one's files."""

    cert: str
    key: str
    ca: str
    plane_cert: str = ""
    plane_key: str = ""

    @property
    def plane(self) -> TlsFiles:
        """The files Dynamo's planes read: their own where the site gives them, else the replica's."""
        return TlsFiles(self.plane_cert or self.cert, self.plane_key or self.key, self.ca)

    def dynamo_env(self, runtime: Mapping[str, str]) -> dict[str, str]:
        """Dynamo's own TLS settings for a process presenting these files: its etcd and NATS clients where
        those run over TLS (`runtime`: their addresses), and the TCP transport both ways, client certificates
        required (the request plane, and the response streams, which are TCP whatever the request plane).
        etcd's three take the PEM text itself, not paths (Dynamo 1.6.1): they live in the process's
        environment only, never in state.json."""
        env: dict[str, str] = {}
        if runtime.get("NATS_SERVER", "").startswith("tls://"):
            env |= {"NATS_TLS_CA_CERT_PATH": self.ca, "NATS_TLS_CLIENT_CERT_PATH": self.cert,
                    "NATS_TLS_CLIENT_KEY_PATH": self.key}
        if runtime.get("ETCD_ENDPOINTS", "").startswith("https://"):
            env |= {"ETCD_AUTH_CA": Path(self.ca).read_text(), "ETCD_AUTH_CLIENT_CERT": Path(self.cert).read_text(),
                    "ETCD_AUTH_CLIENT_KEY": Path(self.key).read_text()}
        return env | {"DYN_TCP_TLS_CERT_PATH": self.cert, "DYN_TCP_TLS_KEY_PATH": self.key,
                      "DYN_TCP_TLS_CLIENT_CA_CERT_PATH": self.ca, "DYN_TCP_TLS_CA_CERT_PATH": self.ca,
                      "DYN_TCP_TLS_CLIENT_CERT_PATH": self.cert, "DYN_TCP_TLS_CLIENT_KEY_PATH": self.key}


@dataclass(frozen=True)
class Chain:
    """The cache chain as components reach it: its first level's URL and the route through it."""

    url: str
    route: str


@dataclass(frozen=True)
class Replica:
    name: str  # the component's name, plus -N for replicas beyond one (on one machine)
    index: int
    http: Address | None  # where it serves HTTP (None: an engine)
    ops: Address | None = None  # with TLS: its health, status and metrics in plaintext (encoders, tiers)
    tls: TlsFiles | None = None  # with TLS: its certificate
    tier: TierConfig | None = None  # a cache tier's whole configuration, the graph's own options included
    argv: tuple[str, ...] = ()  # after `python -m <module>`: rendered last, from the above (`graph.argv`)

    @property
    def port(self) -> int | None:
        return self.http[1] if self.http else None

    @property
    def ops_port(self) -> int | None:
        return self.ops[1] if self.ops else None


@dataclass(frozen=True)
class ComponentPlan:
    name: str
    kind: Kind
    component: Component  # the graph's entry: replicas, image, resources, its own args
    module: str
    replicas: tuple[Replica, ...]
    env: dict[str, str]  # the Dynamo environment, then the graph's `env` (which wins)
    health_path: str | None  # GET on the replica's port (its ops port with TLS) that answers 200 once ready
    reads_model: bool  # it reads the checkpoint directory
    callers: frozenset[str] = frozenset()  # the roles that may call its HTTP port (`core.topology`)
    tls: bool = False  # the graph's TLS: its HTTP hops are HTTPS with client certificates
    chain: Chain | None = None  # the cache chain it names (encoders for the stock frontend, engines, frontend)
    wire_dtype: TorchName | None = None  # the rows' dtype it packs (encoders) or asks for (the frontend)


class Site(ABC):
    """Where a plan runs."""

    checkpoint_dir: str  # the model's checkpoint directory as components see it
    connector: str = "virtual"  # how an encode planner's decisions are carried out (planner/settings.py)

    def checkpoint_of(self, name: str, component: Component) -> str:
        """The checkpoint directory component `name` reads: its own (an encoder site's model), else the graph's."""
        if component.checkpoint is not None:
            raise GraphError("an encoder component's own `checkpoint` is not supported on this site yet")
        return self.checkpoint_dir

    @abstractmethod
    def listen(self, name: str, kind: Kind, replica: int) -> Address:
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

    def tls_files(self, replica: str) -> TlsFiles:
        """With TLS: replica `replica`'s certificate and key and the deployment's CA, as it sees them."""
        raise GraphError("`tls` is not supported on this site yet")

    def tenant_key(self) -> str:
        """With tenants (`tenants.header`): the file the frontend keys the tenants' scopes by, as it sees it."""
        raise GraphError("`tenants` is not supported on this site yet")

    def ops_listen(self, name: str, kind: Kind, replica: int) -> Address:
        """With TLS: where replica `replica` of an encoder or tier serves its status in plaintext."""
        raise GraphError("`tls` is not supported on this site yet")

    def server_name(self, name: str, kind: Kind) -> str | None:
        """With TLS: the name component `name`'s certificate carries for those that call it, which a tier
        checks its next level's certificate for (None: the tier's default, the site's certificates' host)."""
        return None
