"""A tier with TLS keeps serving the certificate its files hold now: nginx reads its certificate, key and CA
once per (re)load, and on Kubernetes the kubelet rewrites a mounted Secret in place when cert-manager renews
it. So `mm-encoder cache up --tls-cert ...` runs nginx as its child instead of becoming it, reads the three
files every `--tls-watch-s` seconds and, when their contents differ from the last reading, sends nginx
SIGHUP: a graceful reload (new workers handshake with the new files, the old ones finish their requests).

Contents, not modification times: the kubelet swaps the Secret's `..data` symlink to a new directory, so a
file's own mtime need not change, and a touch without a new certificate is no reason to reload. A reading
that fails (a file missing for an instant) is no change; the next one decides.

The supervisor passes QUIT (graceful stop), TERM, INT (fast stop) and HUP (reload) on to nginx and exits
with nginx's status, so that it stands where nginx stood: PID 1 of a pod, serve's tier process."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

WATCH_S = 5.0  # well inside any renewal window (cert-manager renews at two thirds of a life of an hour or more)
FORWARDED = (signal.SIGQUIT, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def fingerprint(paths: Sequence[Path]) -> bytes | None:
    """The SHA-256 of the files' contents, in order; None if one cannot be read now."""
    h = hashlib.sha256()
    try:
        for p in paths:
            data = p.read_bytes()
            h.update(len(data).to_bytes(8, "big") + data)
    except OSError:
        return None
    return h.digest()


class Watch:
    """Whether the files' contents changed since the last reading that succeeded."""

    def __init__(self, paths: Sequence[Path]):
        self.paths = list(paths)
        self.last = fingerprint(self.paths)

    def changed(self) -> bool:
        now = fingerprint(self.paths)
        if now is None or now == self.last:
            return False
        self.last = now
        return True


def supervise(cmd: Sequence[str], files: Sequence[Path], interval_s: float = WATCH_S) -> int:
    """Run `cmd` (nginx in the foreground) until it exits, reloading it with SIGHUP whenever `files` change,
    passing it the signals this process gets; its exit status (128 + N for a signal N, as a shell reports)."""
    holder: list[subprocess.Popen[bytes]] = []
    pending: list[int] = []

    def forward(sig: int, _frame: FrameType | None) -> None:
        if holder:
            holder[0].send_signal(sig)
        else:  # before nginx started: passed on once it has
            pending.append(sig)

    for forwarded in FORWARDED:
        signal.signal(forwarded, forward)
    watch = Watch(files)
    proc = subprocess.Popen(list(cmd))
    holder.append(proc)
    for sig in pending:
        proc.send_signal(sig)
    while True:
        try:
            code = proc.wait(timeout=interval_s)
            break
        except subprocess.TimeoutExpired:
            if watch.changed():
                print(f"mm-encoder cache: {', '.join(map(str, files))} changed: reloading nginx", file=sys.stderr,
                      flush=True)
                proc.send_signal(signal.SIGHUP)
    return code if code >= 0 else 128 - code
