"""One machine as a site for a graph's plan: loopback, a free port per replica (the frontend on the
graph's port), files in the run directory, Dynamo's file discovery in `run_dir/dynamo-store`, and
with TLS a certificate per replica from the run directory's CA (`security.issuing`)."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import stat
from datetime import timedelta
from pathlib import Path

from ..core.errors import GraphError
from ..core.topology import Kind
from ..graph.planned import Address, Site, TlsFiles
from ..graph.schema import Component, Graph
from ..security.issuing import Issuer
from ..security.tenants import make_key

LOOPBACK = "127.0.0.1"
ANY = ("0.0.0.0", "::")  # a bind address that is no address to connect to


def connect_host(host: str) -> str:
    """Where this machine reaches a listener bound to `host` (every interface: loopback)."""
    return LOOPBACK if host in ANY else host


def is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


PORTS_ENV = "MM_ENCODER_PORTS"  # LOW-HIGH: where serve picks its components' ports (a firewall's, a test worker's)
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def port_range() -> range:
    """The ports serve gives its components: `$MM_ENCODER_PORTS` (`LOW-HIGH`), else those below the
    kernel's ephemeral range. A port is chosen seconds before its component binds it: outside the
    ephemeral range, no client connection's local port takes it meanwhile (one did: two graphs on one
    machine, a frontend port taken by a test's own connection)."""
    given = os.environ.get(PORTS_ENV)
    if given:
        low, _, high = given.partition("-")
        try:
            if 1024 <= int(low) < int(high) <= 65535:
                return range(int(low), int(high) + 1)
        except ValueError:
            pass
        raise GraphError(f"{PORTS_ENV}={given!r}: a range LOW-HIGH of ports between 1024 and 65535")
    try:
        ephemeral_low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    return range(10000, max(ephemeral_low, 11000))


_HANDED_OUT: set[int] = set()  # every port this process gave out: planned ports are bound only later


def free_port() -> int:
    """A port of `port_range()` that nothing listens on now and that this process has not given out
    before, at random (two graphs starting at once rarely pick one port; the bind check catches one
    already taken). Never one given out before: a component's port is planned before etcd and NATS
    start, and bound only after, so a free port can still be promised to another."""
    ports = port_range()
    for port in random.sample(ports, min(len(ports), 4096)):
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise GraphError(f"no free port in {ports.start}-{ports.stop - 1} ({PORTS_ENV} sets the range)")


def private_run_dir(path: Path) -> Path:
    """The run directory, made 0700 if absent; refused if another user owns it or others may write in it
    (under /tmp anyone could have made it first, to read the graph's keys or swap its files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise GraphError(f"run directory {path} is not a directory (a link or a file): pass another --run-dir")
    if st.st_uid != os.geteuid():
        raise GraphError(f"run directory {path} belongs to user {st.st_uid}, not to this one ({os.geteuid()}): "
                         "another user could read its keys or swap its files; pass another --run-dir")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise GraphError(f"run directory {path} is writable by its group or others (mode "
                         f"{stat.S_IMODE(st.st_mode):o}): chmod 700 it or pass another --run-dir")
    return path


class LocalSite(Site):
    """`bind`: where the site's door listens, the one component other hosts call (a model cluster's or a
    single graph's frontend, an encoder site's router), on its fixed port; everything else on loopback."""

    def __init__(self, graph: Graph, run_dir: Path, bind: str = LOOPBACK):
        self.graph = graph
        self.run_dir = run_dir
        self.bind = bind
        # resolved here: components start in the run directory, where a relative path means nothing
        self.checkpoint_dir = (str(Path(graph.llm.checkpoint).resolve()) if graph.llm.checkpoint
                               else str(run_dir / "checkpoint" / f"kimi-k2.5-{graph.llm.preset}"))
        self._ports: dict[tuple[str, int], int] = {}
        self.environ = dict(os.environ)  # as serve started: later changes (the scaling thread's) are not the graph's
        t = graph.tls
        self.issuer = Issuer(run_dir / "tls", t.ca_dir, graph=graph.name, trust_domain=t.trust_domain,
                             lifetime=timedelta(seconds=t.cert_lifetime_s),
                             plane_lifetime=timedelta(seconds=t.dynamo_cert_lifetime_s),
                             ca_lifetime=timedelta(days=t.ca_lifetime_days),
                             hosts=() if is_loopback(bind) or bind in ANY else (bind,)) if t.enabled else None

    def checkpoint_of(self, name: str, component: Component) -> str:
        """A component's own checkpoint (an encoder site's model), resolved as the graph's is."""
        return str(Path(component.checkpoint).resolve()) if component.checkpoint else self.checkpoint_dir

    def tls_files(self, replica: str) -> TlsFiles:
        assert self.issuer is not None  # the plan asks only with the graph's TLS on
        return TlsFiles(*self.issuer.files(replica), *self.issuer.plane_files(replica)[:2])

    def tenant_key(self) -> str:
        """The graph's key file, else this run's own (`make_key`: made once, kept across restarts)."""
        key_file = self.graph.tenants.key_file
        return str(Path(key_file).resolve() if key_file else make_key(self.run_dir / "tenant.key"))

    def ops_listen(self, name: str, kind: Kind, replica: int) -> Address:
        return self.listen(f"{name}:ops", kind, replica)

    @property
    def door_port(self) -> int:
        return self.graph.site_port if self.graph.site == "encoder" else self.graph.frontend_port

    def is_door(self, name: str, kind: Kind, replica: int) -> bool:
        """The component other hosts call (not its ops port): a frontend, or an encoder site's router."""
        door_kind = "cache-router" if self.graph.site == "encoder" else "frontend"
        return kind == door_kind and ":" not in name and replica == 0

    def listen(self, name: str, kind: Kind, replica: int) -> Address:
        door = self.is_door(name, kind, replica)
        if (name, replica) not in self._ports:
            port = self.door_port if door else free_port()
            # a port just freed may be handed out again: never give two components one port
            while not door and port in {self.door_port, *self._ports.values()}:
                port = free_port()
            self._ports[(name, replica)] = port
        return self.bind if door else LOOPBACK, self._ports[(name, replica)]

    def reach(self, name: str, kind: Kind, replicas: int) -> list[str]:
        if kind == "engine":  # found through Dynamo's discovery, not by address
            return []
        return [f"{connect_host(host)}:{port}" for host, port in (self.listen(name, kind, i) for i in range(replicas))]

    def tier_dirs(self, replica: str) -> tuple[str, str]:
        return str(self.run_dir / f"nginx-{replica}"), str(self.run_dir / f"cache-{replica}")

    def dynamo_env(self, kind: Kind) -> dict[str, str]:
        env = {
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_FILE_KV": str(self.run_dir / "dynamo-store"),
            # every Dynamo listener on loopback: request plane, response streams, system server
            "DYN_TCP_RPC_HOST": LOOPBACK,
            "DYN_TCP_RESPONSE_STREAM_HOST": LOOPBACK,
            "DYN_SYSTEM_HOST": LOOPBACK,
            "DYN_EVENT_PLANE_HOST": LOOPBACK,  # the KV event publisher (ZMQ) binds 0.0.0.0 without it
            "DYN_SELF_HOST_METADATA": "0",
            "DYN_LOG": self.environ.get("DYN_LOG", "warn"),
        }
        if "DYN_TCP_MAX_MESSAGE_SIZE" in self.environ:  # the caller's own limit wins over the plan's
            env["DYN_TCP_MAX_MESSAGE_SIZE"] = self.environ["DYN_TCP_MAX_MESSAGE_SIZE"]
        return env


def ready_note(issuer: Issuer | None, bind: str = LOOPBACK) -> str:
    """What serve's ready line says of TLS: the CA clients pass, or that the graph runs without."""
    if issuer is None and not is_loopback(bind):
        return f"WITHOUT TLS ON {bind}: anyone on that network can call it and read what it answers"
    if issuer is None:
        return "without TLS (loopback only; --tls for certificates on every hop)"
    return f"TLS on every hop; clients pass its CA: curl --cacert {issuer.ca_file}"
