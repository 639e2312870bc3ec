"""A running tier reloaded with a new configuration (its upstreams, as encoders come and go), with
no request dropped: nginx's graceful reload (HUP) starts new workers on the new config while the
old ones finish what they hold."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from ..core.errors import CacheTierError
from ..runtime.procfs import children
from .config import TierConfig
from .nginx import prepare


def nginx_master(pid: int, cfg: TierConfig) -> int:
    """The tier `pid`'s nginx master: `pid` itself where the tier became nginx, its child where it supervises
    nginx (with TLS: `supervise.py`), as nginx's pid file in the run directory names it."""
    try:
        master = int((cfg.resolved_run_dir() / "nginx.pid").read_text())
    except (OSError, ValueError):
        return pid
    return master if master == pid or master in children(pid) else pid


def reload_tier(pid: int, cfg: TierConfig, cwd: Path, *, old_gone: bool, timeout_s: float = 30.0) -> bool:
    """Rewrite the config of the tier `pid` (its nginx master, or the tier that supervises it) as `cfg`, check
    it, and reload it. Returns once a new worker serves and, with `old_gone`, every old one has finished and
    exited: True, or False if some were still busy at `timeout_s`."""
    pid = nginx_master(pid, cfg)
    cmd, conf = prepare(cfg)
    test = subprocess.run([*cmd, "-t", "-q"], capture_output=True, text=True, cwd=cwd)
    if test.returncode != 0:
        raise CacheTierError(f"nginx rejected the reloaded {conf}:\n{test.stderr.strip()}")
    old = children(pid)
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = children(pid)
        if now - old and (not old_gone or not now & old):
            return True
        time.sleep(0.05)
    if not children(pid) - old:
        raise CacheTierError(f"nginx {pid} did not reload {conf} within {timeout_s:.0f} s")
    return False
