"""How the frontend shuts down without cutting a request off: it refuses new requests, stops its
listener from accepting (Dynamo's HTTP server runs in Rust, so the socket is found through /proc),
and waits for clients' open connections to go quiet."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import TYPE_CHECKING

from ..runtime import procfs

if TYPE_CHECKING:
    from .provider import ProcessorFactory
    from .settings import FrontendSettings

log = logging.getLogger(__name__)
QUIET_S = 1.0  # a drain closes clients' connections once none has carried a request for this long


async def drain(factory: ProcessorFactory, s: FrontendSettings) -> None:
    """Shut down without cutting a request off, within `--drain-timeout-s`:
    1. new requests get 503 `draining` while those in flight finish;
    2. the listener stops accepting: new connections are refused, so a client knows nothing was sent;
    3. while clients keep sending on their open connections, they still get the 503; once every
       connection is closed, or none has carried a request for `QUIET_S`, Dynamo closes the rest.
    Why 3: closing a keep-alive connection races a request the client is sending on it (it would
    see a reset), and Dynamo's HTTP server cannot say `Connection: close` on the 503 instead."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + s.drain_timeout_s
    if not await factory.drain(s.drain_timeout_s):
        log.warning("drain: requests still in flight after %.0f s", s.drain_timeout_s)
        return
    if not stop_listening(s.http_port):
        log.warning("drain: no listener found on port %d to stop", s.http_port)
    while (open_connections(s.http_port) and time.monotonic() - factory.last_request() < QUIET_S
           and loop.time() < deadline):
        await asyncio.sleep(0.1)  # polling the kernel's connection table; there is no event for it
    left = open_connections(s.http_port)
    if left:
        log.info("drain: closing %d idle client connections", left)
    await factory.drain(max(0.0, deadline - loop.time()))


def stop_listening(port: int) -> int:
    """Stop this process's listening TCP sockets on `port` from accepting: new connections are
    refused (the client knows nothing was sent) while connections already accepted are answered.
    For servers whose listener this code does not own (Dynamo's HTTP server runs in Rust).
    Returns how many sockets were stopped."""
    listening = {inode for inode, (_, p) in procfs.tcp_sockets(procfs.LISTEN).items() if p == port}
    stopped = 0
    for inode, fd in procfs.socket_fds().items():
        if inode in listening:
            # shutdown acts on the socket, not the descriptor: through a duplicate, the owner's
            # accept() fails from now on and Linux answers new SYNs with a reset
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RD)
                stopped += 1
    return stopped


def open_connections(port: int) -> int:
    """Established TCP connections on local `port` (clients' keep-alive connections included)."""
    return sum(1 for _, p in procfs.tcp_sockets(procfs.ESTABLISHED).values() if p == port)
