"""The Pub/Sub emulator's process: up when its own log says it listens (a connection could reach
whoever took its port), and a free port taken before it bound is replaced by another."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from reliable_sub.testing import services
from reliable_sub.testing.services import EmulatorProcess, emulator_launcher, missing_service


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port some other process listens on."""
    if emulator_launcher() is None:
        missing_service("the Pub/Sub emulator is not installed")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield int(listener.getsockname()[1])


def test_a_free_port_taken_before_the_bind_is_replaced(
    taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = iter([taken_port])
    free_port = services.free_port
    monkeypatch.setattr(services, "free_port", lambda: next(ports, None) or free_port())
    emulator = EmulatorProcess()
    try:
        emulator.start()
        assert emulator.port != taken_port
        with open(emulator.log_path) as log:
            assert f"listening on {emulator.port}" in log.read()
    finally:
        emulator.stop()


def test_a_given_port_in_use_is_a_clear_error(taken_port: int) -> None:
    emulator = EmulatorProcess(taken_port)
    with pytest.raises(RuntimeError, match=f"could not bind port {taken_port}: another process"):
        emulator.start()
    assert emulator.process is None
