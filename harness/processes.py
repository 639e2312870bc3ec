"""The one way the tests and benchmarks start a process of their own.

A whole graph goes through `mm-encoder serve` (`mm_encoder/serve/`'s GraphRunner): `serve_fixtures.Served`
runs it as one `Process`. A test or benchmark that starts one component by hand, to test or measure
that process, starts it as a `Process` too: in its own session, its output (stdout and stderr
together) kept in memory and, with `log`, in a file; ready when it prints a line (`wait_for`) or when
a URL answers (`wait_url`); stopped by PID and then by its process group, so that nothing it started
is left (`stop`, also on leaving a `with` block).
"""

from __future__ import annotations

import codecs
import contextlib
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from mm_encoder.runtime.procfs import leftover_pids


class Process:
    def __init__(self, argv: Sequence[str], *, name: str | None = None, env: dict[str, str] | None = None,
                 cwd: Path | str | None = None, log: Path | None = None, on_line: Callable[[str], None] | None = None):
        """`env`: the whole environment (default: this process's); `on_line`: called with each line of
        its output as it comes (in the reader's thread)."""
        self.name = name or Path(argv[0]).name
        self.argv = list(argv)
        self.log = log
        self.on_line = on_line
        self.started = time.monotonic()
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line came (time.monotonic())
        self._changed = threading.Condition()
        self._eof = False
        self.popen = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                      start_new_session=True)
        self._reader = threading.Thread(target=self._read, name=f"output of {self.name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """Whatever the pipe holds at each read: what one write put there (a multi-line message printed
        at once) is seen whole by a waiter, never a part of it."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        fd, pending = self.popen.stdout.fileno(), ""
        with self.log.open("a") if self.log else contextlib.nullcontext() as out:
            while True:
                chunk = os.read(fd, 1 << 16)
                text = decoder.decode(chunk, final=not chunk)
                if out is not None and text:
                    out.write(text)
                    out.flush()
                lines = (pending + text).splitlines(keepends=True)
                pending = lines.pop() if chunk and lines and not lines[-1].endswith(("\n", "\r")) else ""
                for line in lines if self.on_line is not None else ():
                    self.on_line(line)
                with self._changed:
                    self.times += [time.monotonic()] * len(lines)
                    self.lines += lines
                    self._eof = not chunk
                    self._changed.notify_all()
                if not chunk:
                    return

    # --- what it is doing ---------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def tail(self, lines: int = 30) -> str:
        return "".join(self.lines[-lines:])

    def wait_line(self, match: Callable[[str], bool], timeout: float) -> str | None:
        """The first line of its output that `match`es, as soon as it is printed; None if none is
        printed within `timeout` or before its output ends."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if match(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    return None
                self._changed.wait(left)

    def wait_for(self, needle: str, timeout: float) -> str:
        """The first line holding `needle` (its ready line); AssertionError with its output's tail if it
        exits or stays silent for `timeout` seconds."""
        line = self.wait_line(lambda text: needle in text, timeout)
        if line is None:
            how = f"exited with {self._exit_status()}" if self._eof else f"did not within {timeout:.0f} s"
            raise AssertionError(f"{self.name} printed no {needle!r} ({how}); its last output:\n{self.tail()}")
        return line

    def _exit_status(self) -> int | None:
        """Its exit status once its output has ended (it exits right after); None if it has not."""
        try:
            return self.popen.wait(5)
        except subprocess.TimeoutExpired:
            return None

    def wait_url(self, url: str, timeout: float, accept: Callable[[bytes], bool] = lambda body: True) -> None:
        """Until `url` answers 200 (with a body `accept` takes); AssertionError if the process exits first
        or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError, ValueError, KeyError), urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200 and accept(r.read()):
                    return
            if self.poll() is not None or time.monotonic() > deadline:
                how = f"exited with {self.poll()}" if self.poll() is not None else f"not within {timeout:.0f} s"
                raise AssertionError(f"{self.name}: {url} did not answer ({how}); its last output:\n{self.tail()}")
            with self._changed:  # a new line or 50 ms, whichever comes first
                self._changed.wait(0.05)

    # --- stopping -----------------------------------------------------------------------------

    def send_signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 30, group: bool = False) -> int:
        """`sig` to the process (`group`: to its whole process group), SIGKILL after `grace_s`; then SIGKILL
        to its process group (what it started and left behind). Returns its exit status."""
        if self.popen.poll() is None:
            if group:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.popen.pid, sig)
            else:
                self.popen.send_signal(sig)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10  # SIGKILL is delivered asynchronously: until the group is gone
        while leftover_pids({self.popen.pid}) and time.monotonic() < deadline:
            time.sleep(0.01)
        self._reader.join(10)
        return self.popen.returncode

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
