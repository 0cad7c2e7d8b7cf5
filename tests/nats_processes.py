"""A private ``nats-server`` with JetStream, for the NATS tests (restarts, takeovers).

Like :mod:`tests.redis_processes`: nothing sleeps to synchronise; the server is polled through
its monitoring endpoint (``/healthz?js-enabled-only=true``) until a deadline.
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.redis_processes import POLL_INTERVAL, START_TIMEOUT, ServerProcess, free_port


class NatsServer(ServerProcess):
    """``nats-server -js`` on free loopback ports, its JetStream store in ``directory`` (kept
    across :meth:`kill` and :meth:`start`, as a restarted production server keeps its disk)."""

    def __init__(self, directory: Path) -> None:
        self.executable = self.find_executable("nats-server", " (Debian package nats-server)")
        self.directory = directory
        self._choose_ports()
        self.log_path = directory / "nats-server.log"
        self.process: subprocess.Popen[bytes] | None = None

    def _choose_ports(self) -> None:
        self.port = free_port()
        self.monitor_port = free_port()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _launch(self) -> None:
        """Start the server (again, on the same ports and store) and wait until JetStream is
        healthy."""
        assert self.process is None, "already running"
        command = [
            self.executable, "-js", "-a", "127.0.0.1", "-p", str(self.port),
            "-m", str(self.monitor_port), "-sd", str(self.directory / "jetstream"),
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self._wait_until_healthy()

    def _wait_until_healthy(self) -> None:
        health = f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true"
        give_up = time.monotonic() + START_TIMEOUT
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise self.exited("nats-server", self.port)
            try:
                with urllib.request.urlopen(health, timeout=0.5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):  # not listening yet, or JetStream not up
                pass
            if time.monotonic() > give_up:
                raise AssertionError(
                    f"nats-server on port {self.port} was not healthy within {START_TIMEOUT}s:\n"
                    f"{self.log()}"
                )
            time.sleep(POLL_INTERVAL)
