"""What tests and benchmarks read of the processes they started, from /proc: the TCP ports a
graph's processes listen on (the loopback-only checks) and a process's CPU time (the benches)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from mm_encoder.runtime import procfs


def listeners(groups: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket held by a process in one of `groups`."""
    listening = procfs.tcp_sockets(procfs.LISTEN)
    return sorted({(pid, *listening[inode]) for pid in procfs.leftover_pids(groups)
                   for inode in procfs.socket_fds(pid) if inode in listening})


def cpu_ns(pid: int) -> int:
    """A process's CPU time so far, all its threads together (the scheduler's run time, ns); 0 once gone."""
    total = 0
    with contextlib.suppress(OSError):  # the process, or a thread, that just exited
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                total += int((task / "schedstat").read_text().split()[0])
    return total
