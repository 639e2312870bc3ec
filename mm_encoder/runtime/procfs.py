"""This machine's processes and TCP sockets as /proc lists them (no dependency for a few fields):
serve's leftover check and its nginx reload wait read the process table, the frontend's drain finds
its own listener (Dynamo's HTTP server runs in Rust) and counts its clients' connections."""

from __future__ import annotations

import contextlib
import ipaddress
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

LISTEN, ESTABLISHED = "0A", "01"  # /proc/net/tcp's states


class Proc(NamedTuple):
    pid: int
    ppid: int
    pgid: int


def processes() -> Iterator[Proc]:
    """Every process that is not a zombie (one that exited and was not reaped yet holds nothing)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            yield Proc(int(entry.name), int(fields[1]), int(fields[2]))


def leftover_pids(groups: set[int]) -> list[int]:
    """Live processes (not zombies) whose process group is one of `groups` (sessions a launcher started)."""
    return [p.pid for p in processes() if p.pgid in groups]


def children(pid: int) -> set[int]:
    """The live child processes of `pid` (an nginx master's workers)."""
    return {p.pid for p in processes() if p.ppid == pid}


def tcp_sockets(state: str) -> dict[str, tuple[str, int]]:
    """This network namespace's TCP sockets in `state` (LISTEN, ESTABLISHED): inode -> (local address, port)."""
    out: dict[str, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == state:
                    host, port = f[1].split(":")
                    out[f[9]] = (_address(host), int(port, 16))
    return out


def socket_fds(pid: int | str = "self") -> dict[str, int]:
    """The sockets a process holds: inode -> one of its descriptors for it (empty once it is gone)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    out[target[8:-1]] = int(fd.name)
    return out


def _address(hex_host: str) -> str:
    """/proc/net's hex address -> text: IPv4, or IPv6, both as 4-byte words in host (little-endian) order."""
    raw = bytes.fromhex(hex_host)
    return str(ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))))
