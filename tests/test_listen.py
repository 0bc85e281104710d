"""The listening sockets of ``llamaspec serve`` (``llamaspec.server.run.bind``)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from llamaspec.server.run import bind


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_accepted_connections_have_nodelay(host):
    """asyncio turns Nagle off only on accepted sockets whose protocol says TCP; with it on, a keep-alive
    client that sends a request in two writes (headers, then body) waits for a delayed ACK, ~40 ms."""
    try:
        sock = bind(host, 0)
    except Exception as e:  # no IPv6 on this machine
        pytest.skip(str(e))
    assert sock.proto == socket.IPPROTO_TCP
    seen: list[int] = []

    async def main() -> None:
        async def handle(reader, writer):
            s = writer.get_extra_info("socket")
            seen.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        port = sock.getsockname()[1]
        async with server:
            _, w = await asyncio.open_connection(host, port)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            w.close()

    asyncio.run(main())
    assert seen and seen[0] != 0
