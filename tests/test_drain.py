"""frontend.drain.stop_listening: how the frontend stops accepting before Dynamo's HTTP server
closes (issue 13: no request is cut off at a frontend restart). A real listener on loopback."""

from __future__ import annotations

import asyncio

import pytest

from mm_encoder.frontend.drain import open_connections, stop_listening


async def test_stop_listening_refuses_new_connections_and_keeps_accepted_ones():
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(64):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"before")
        assert await reader.readexactly(6) == b"before"  # accepted by the server

        assert open_connections(port) == 1  # the server's end of it
        assert stop_listening(port) == 1
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"after")  # the connection accepted before is still served
        assert await reader.readexactly(5) == b"after"
        writer.close()
        await writer.wait_closed()
        await asyncio.wait_for(_until(lambda: open_connections(port) == 0), 10)
        assert stop_listening(port + 1 if port < 65535 else port - 1) == 0  # no listener of ours there
    finally:
        server.close()


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)  # polling /proc: the kernel's table has no event
