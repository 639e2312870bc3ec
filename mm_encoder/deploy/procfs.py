"""The live processes of this machine as /proc lists them: what serve's leftover check and the
nginx reload wait read (no dependency for four fields of /proc/<pid>/stat)."""

from __future__ import annotations

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
