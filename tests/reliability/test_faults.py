"""Faults of whole components under `mm-encoder serve` (real processes on loopback, the generated
tiny Kimi-K2.5 checkpoint): what a SIGKILL leaves behind, and what `serve` says about it."""

from __future__ import annotations

import os
import signal

import pytest

from harness.serve_fixtures import MODEL, Served, chat, sample_tokens
from harness.topology import free_port, require_nginx
from mm_encoder.runtime.procfs import leftover_pids

pytestmark = pytest.mark.slow  # a whole graph of subprocesses; `make test-quick` skips it


def test_9_a_shard_master_killed_leaves_no_orphan_and_serve_checks_every_session(tmp_path):
    """Issue 13, 9: SIGKILL to a shard's nginx master only (its workers, cache manager and loader
    survive it and keep the port, `reuseport`). With --restart, the old session is cleared before
    the shard comes back, and the final leftover check covers every session ever started."""
    require_nginx()
    run_dir, port = tmp_path / "run", free_port()
    served = Served("graphs/epd.yaml", run_dir, port, "--restart")
    try:
        served.wait_for("ready: OpenAI base URL", 240)
        master = served.component("shared-0")["pid"]
        assert len(leftover_pids({master})) > 1  # the master and its workers share its session
        os.kill(master, signal.SIGKILL)  # the master alone
        served.wait_for("shared-0 restarted", 60)
        assert leftover_pids({master}) == []  # nothing of the old shard is left
        assert chat(port)["usage"]["prompt_tokens"] == sample_tokens(run_dir / "checkpoint" / MODEL)
    finally:
        if served.proc.poll() is None:
            served.stop()
    assert leftover_pids({master}) == []
