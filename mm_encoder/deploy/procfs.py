"""The live processes of this machine as /proc lists them: what serve's leftover check and the
nginx reload wait read (no dependency for four fields of /proc/<pid>/stat), and the TCP sockets a
graph's processes listen on (the tests' loopback-only check)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple


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
    """Live processes (not zombies) whose process group is one of the graph's sessions."""
    return [p.pid for p in processes() if p.pgid in groups]


def listeners(groups: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket held by a process in one of `groups`:
    the sockets' inodes from /proc/net/tcp{,6}, their owners from /proc/<pid>/fd."""
    listening: dict[str, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[3] != "0A":  # TCP_LISTEN
                    continue
                host, port = f[1].split(":")
                listening[f[9]] = (_address(host), int(port, 16))
    out = []
    for pid in leftover_pids(groups):
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:[") and target[8:-1] in listening:
                        out.append((pid, *listening[target[8:-1]]))
    return sorted(set(out))


def _address(hex_host: str) -> str:
    """/proc/net's hex address -> text: IPv4, or IPv6, both as 4-byte words in host (little-endian) order."""
    raw = bytes.fromhex(hex_host)
    return str(ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))))


def cpu_ns(pid: int) -> int:
    """A process's CPU time so far, all its threads together (the scheduler's run time, ns); 0 once gone."""
    total = 0
    with contextlib.suppress(OSError):  # the process, or a thread, that just exited
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                total += int((task / "schedstat").read_text().split()[0])
    return total
