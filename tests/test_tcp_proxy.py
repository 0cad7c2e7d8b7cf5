"""reliable_sub.testing.tcp_proxy: bytes flow through; a stall holds them back both ways
without closing anything, accepts new connections meanwhile, and lets everything flow on when
it ends (by itself after N seconds, or on resume())."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from reliable_sub.testing.tcp_proxy import TcpProxy

GREETING = b"hello\n"
# Real seconds a step that should happen at once gets (generous: the machine may be loaded).
WITHIN = 10.0
# How long the tests look for a byte that must not come while the proxy is stalled.
QUIET = 0.3


class EchoServer:
    """Greets each connection, then echoes every line; counts what it received."""

    def __init__(self) -> None:
        self.received = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(GREETING)
        while line := await reader.readline():
            self.received += len(line)
            writer.write(line)
        writer.close()


@pytest_asyncio.fixture
async def echo() -> AsyncIterator[tuple[EchoServer, TcpProxy]]:
    server = EchoServer()
    port = await server.start()
    proxy = TcpProxy("127.0.0.1", port).start()
    try:
        yield server, proxy
    finally:
        proxy.close()
        assert server.server is not None
        server.server.close()


async def connect(proxy: TcpProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", proxy.port), WITHIN)


async def read_line(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.readline(), WITHIN)


async def test_bytes_flow_both_ways(echo: tuple[EchoServer, TcpProxy]) -> None:
    _, proxy = echo
    reader, writer = await connect(proxy)
    assert await read_line(reader) == GREETING
    writer.write(b"one\n")
    assert await read_line(reader) == b"one\n"
    assert proxy.connections == 1 and not proxy.stalled
    writer.close()


async def test_a_stall_holds_bytes_back_both_ways_without_closing_until_resume(
    echo: tuple[EchoServer, TcpProxy],
) -> None:
    server, proxy = echo
    reader, writer = await connect(proxy)
    assert await read_line(reader) == GREETING
    proxy.stall()
    assert proxy.stalled and proxy.resumed_at is None
    writer.write(b"held\n")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(reader.readline(), QUIET)
    assert server.received == 0, "nothing reached the server"
    # a new connection is accepted, but the server's greeting is held back too
    late_reader, late_writer = await connect(proxy)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(late_reader.readline(), QUIET)
    assert not reader.at_eof() and not late_reader.at_eof(), "nothing was closed"
    proxy.resume()
    assert await read_line(reader) == b"held\n"
    assert await read_line(late_reader) == GREETING
    assert proxy.resumed.is_set() and proxy.resumed_at is not None
    writer.close()
    late_writer.close()


async def test_a_stall_for_n_seconds_ends_by_itself(echo: tuple[EchoServer, TcpProxy]) -> None:
    _, proxy = echo
    reader, writer = await connect(proxy)
    assert await read_line(reader) == GREETING
    stalled_at = time.monotonic()
    proxy.stall(0.5)
    writer.write(b"later\n")
    assert await read_line(reader) == b"later\n"
    assert proxy.resumed_at is not None and proxy.resumed_at > stalled_at
    assert not proxy.stalled
    writer.close()


async def test_a_server_that_closes_closes_the_client_side(
    echo: tuple[EchoServer, TcpProxy],
) -> None:
    _, proxy = echo
    reader, writer = await connect(proxy)
    assert await read_line(reader) == GREETING
    writer.write_eof()  # the echo server's loop ends and it closes its side
    assert await asyncio.wait_for(reader.read(), WITHIN) == b""
    writer.close()


def test_stall_refuses_a_duration_that_is_not_positive() -> None:
    with TcpProxy("127.0.0.1", 1) as proxy, pytest.raises(ValueError, match="got 0"):
        proxy.stall(0)
