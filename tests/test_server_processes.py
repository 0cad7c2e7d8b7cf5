"""The tests' private servers: a free port taken by someone else before the server binds it (a
server of another test, or of a suite running beside this one) moves a first start to new
ports; a restart keeps its ports, so it reports the clash instead."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.nats_processes import NatsServer
from tests.redis_processes import PortTaken, RedisServer, ServerProcess

SERVERS: dict[str, Callable[[Path], ServerProcess]] = {
    "redis": lambda directory: RedisServer(directory, appendonly=False),
    "redis-cluster-node": lambda directory: RedisServer(directory, appendonly=False,
                                                        cluster=True),
    "nats": NatsServer,
}


@pytest.fixture
def taken() -> Iterator[Callable[[int], None]]:
    sockets: list[socket.socket] = []

    def take(port: int) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        sockets.append(listener)

    yield take
    for listener in sockets:
        listener.close()


@pytest.mark.parametrize("kind", list(SERVERS))
def test_a_first_start_moves_off_a_port_taken_meanwhile(
    kind: str, tmp_path: Path, taken: Callable[[int], None]
) -> None:
    server = SERVERS[kind](tmp_path)
    chosen: int = server.port  # type: ignore[attr-defined]
    taken(chosen)
    try:
        server.start()
        assert server.port != chosen  # type: ignore[attr-defined]
        server.kill()
        server.start()  # a restart: on the port it moved to
    finally:
        server.kill()


def test_a_restart_keeps_its_port_and_says_it_was_taken(
    tmp_path: Path, taken: Callable[[int], None]
) -> None:
    server = RedisServer(tmp_path, appendonly=False)
    server.start()
    port = server.port
    server.kill()
    taken(port)
    with pytest.raises(PortTaken, match="exited with 1"):
        server.start()
    assert server.port == port
