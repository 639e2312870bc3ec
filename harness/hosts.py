"""Several hosts on this machine: network namespaces on one bridge (`../shared/docs/hosts.md`).

`Hosts(n)` makes n hosts, each a network namespace with one veth link to a bridge in the root
namespace, addressed from 198.18.0.0/15 (RFC 2544's benchmarking range): host i is 198.18.<net>.i,
the bridge 198.18.<net>.254, <net> a /24 no other route of this machine uses. Names carry a random
tag, so two test workers never meet. Processes started with `Hosts.popen_argv` live in a host's
network; faults are a link taken down (`cut`: packets dropped, timeouts rather than refusals), a
host's processes killed (`kill_host`), and a link shaped with the token-bucket filter (`shape`).
`close` kills whatever still runs in the namespaces, removes every link, namespace and the bridge,
and checks that `ip netns list` lists none of them.

Needs root (CAP_NET_ADMIN): `available()` says why not, for a test's skip.
"""

from __future__ import annotations

import fcntl
import os
import random
import signal
import subprocess
import time
from collections.abc import Sequence

NET = "198.18"
LOCK = "/run/lock/mm-encoder-hosts.lock" if os.path.isdir("/run/lock") else "/tmp/mm-encoder-hosts.lock"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def available() -> str | None:
    """None where namespaces can be made here; else why not (a test skips with it)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); this runs as another user"
    probe = f"mmprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _free_net() -> int:
    used = _ip("-4", "addr").stdout + _ip("-4", "route").stdout
    for net in random.sample(range(1, 254), 253):
        if f"{NET}.{net}." not in used:
            return net
    raise RuntimeError(f"no free /24 in {NET}.0.0/16")


class Hosts:
    def __init__(self, n: int):
        self.n = n
        self.tag = f"{random.randrange(16**4):04x}"
        self.bridge = f"mm{self.tag}br"
        self.made: list[str] = []
        try:
            with open(LOCK, "a") as lock:  # two test workers never pick one /24: the pick and the bridge at once
                fcntl.flock(lock, fcntl.LOCK_EX)
                self.net = _free_net()
                _ip("link", "add", self.bridge, "type", "bridge")
                _ip("addr", "add", f"{NET}.{self.net}.254/24", "dev", self.bridge)
            self._make()
        except BaseException:
            self.close(check=False)
            raise

    def ns(self, i: int) -> str:
        """Host i's namespace (1-based, as its address)."""
        return f"mm{self.tag}h{i}"

    def addr(self, i: int) -> str:
        return f"{NET}.{self.net}.{i}"

    def veth(self, i: int) -> tuple[str, str]:
        """Host i's link: its root-side end, its own end."""
        return f"mm{self.tag}h{i}a", f"mm{self.tag}h{i}b"

    def _make(self) -> None:
        _ip("link", "set", self.bridge, "up")
        for i in range(1, self.n + 1):
            ns, (root_end, own_end) = self.ns(i), self.veth(i)
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("link", "add", root_end, "type", "veth", "peer", "name", own_end)
            _ip("link", "set", own_end, "netns", ns)
            _ip("link", "set", root_end, "master", self.bridge)
            _ip("link", "set", root_end, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", own_end)
            _ip("-n", ns, "link", "set", own_end, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def popen_argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """`argv` run in host i's network (`ip netns exec` execs it: its pid is the command's)."""
        return ["ip", "netns", "exec", self.ns(i), *argv]

    def run(self, i: int, argv: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.popen_argv(i, argv), capture_output=True, text=True, timeout=timeout)

    def cut(self, i: int) -> None:
        """Host i's link down: its packets dropped both ways (open connections stall, new ones time out)."""
        _ip("link", "set", self.veth(i)[0], "down")

    def restore(self, i: int) -> None:
        _ip("link", "set", self.veth(i)[0], "up")

    def shape(self, i: int, rate: str, burst: str = "1mb", latency: str = "50ms") -> None:
        """Host i's link limited to `rate` (e.g. 1gbit) both ways, with the kernel's token-bucket filter."""
        root_end, own_end = self.veth(i)
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        subprocess.run(["tc", "qdisc", "replace", "dev", root_end, *tbf], check=True, timeout=30)
        subprocess.run(self.popen_argv(i, ["tc", "qdisc", "replace", "dev", own_end, *tbf]), check=True, timeout=30)

    def unshape(self, i: int) -> None:
        root_end, own_end = self.veth(i)
        subprocess.run(["tc", "qdisc", "del", "dev", root_end, "root"], capture_output=True, timeout=30)
        subprocess.run(self.popen_argv(i, ["tc", "qdisc", "del", "dev", own_end, "root"]), capture_output=True,
                       timeout=30)

    def pids(self, i: int) -> list[int]:
        out = _ip("netns", "pids", self.ns(i), check=False).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, i: int, timeout: float = 30) -> int:
        """Every process in host i's network killed (SIGKILL: a host lost, nothing stops cleanly); how many."""
        killed = 0
        deadline = time.monotonic() + timeout
        while (pids := self.pids(i)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        if self.pids(i):
            raise RuntimeError(f"processes still in {self.ns(i)} after {timeout} s: {self.pids(i)}")
        return killed

    @staticmethod
    def _netns() -> set[str]:
        return {line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()}

    def close(self, check: bool = True) -> None:
        """Everything made removed: the processes left in each host, the namespaces, links and bridge."""
        made, self.made = self.made, []
        for i, ns in enumerate(made, start=1):
            self.kill_host(i)
            _ip("netns", "del", ns, check=False)
            _ip("link", "del", self.veth(i)[0], check=False)
        _ip("link", "del", self.bridge, check=False)
        if check:  # only ours: other tests may make theirs meanwhile
            left = self._netns() & set(made)
            assert not left, f"network namespaces left behind: {sorted(left)}"

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
