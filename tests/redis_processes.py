"""Processes for the crash and restart tests: a private redis-server, and consumer children.

Nothing here sleeps to synchronise: a child is followed through the lines it prints (read by a
thread into a queue, waited for with a deadline), and a server through PING, polled until a
deadline. Every wait is bounded, and every process is killed by whoever started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Real-time waits poll at this interval until their deadline.
POLL_INTERVAL = 0.01
# How long a process gets to start (a child imports the package, a server loads its AOF).
START_TIMEOUT = 15.0
# How long a SIGKILLed process gets to be reaped.
EXIT_TIMEOUT = 10.0


def poll_until_sync(check: Callable[[], bool], what: str, within: float = 10.0) -> None:
    """Call ``check()`` every POLL_INTERVAL until it is true, or fail after ``within`` s."""
    give_up = time.monotonic() + within
    while not check():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        time.sleep(POLL_INTERVAL)


async def poll_until(
    check: Callable[[], bool | Awaitable[bool]], what: str, within: float = 10.0
) -> None:
    """Evaluate ``check()`` (awaiting it if needed) every POLL_INTERVAL until it is true."""
    give_up = time.monotonic() + within
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(POLL_INTERVAL)


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RedisServer:
    """A private ``redis-server`` on a free loopback port, data in ``directory``.

    ``appendonly=True`` writes every command to the AOF before replying (appendfsync always), so
    the data survives a SIGKILL and a :meth:`start` on the same port and directory.
    """

    def __init__(self, directory: Path, *, appendonly: bool) -> None:
        executable = shutil.which("redis-server")
        if executable is None:
            message = "redis-server is not on PATH"
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(f"{message} (CI=true: a missing service is a failure, not a skip)")
            pytest.skip(message)
        self.executable = executable
        self.directory = directory
        self.appendonly = appendonly
        self.port = free_port()
        self.log_path = directory / "redis-server.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server (again, on the same port and directory) and wait for PING."""
        assert self.process is None, "already running"
        command = [
            self.executable,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "always",
            "--dir", str(self.directory),
            "--daemonize", "no",
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self.starts += 1
        self._wait_until_up()

    def _wait_until_up(self) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis(
            host="127.0.0.1", port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5,
            retry=Retry(NoBackoff(), 0),  # one try per poll: the poll loop is the retry
        )
        give_up = time.monotonic() + START_TIMEOUT
        try:
            while True:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise AssertionError(
                        f"redis-server on port {self.port} exited with {self.process.returncode}"
                        f":\n{self.log()}"
                    )
                try:
                    if client.ping():
                        return
                except redis.RedisError:  # refused, or still loading the AOF
                    pass
                if time.monotonic() > give_up:
                    raise AssertionError(
                        f"redis-server on port {self.port} did not answer PING within "
                        f"{START_TIMEOUT}s:\n{self.log()}"
                    )
                time.sleep(POLL_INTERVAL)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the server and reap it: no shutdown save, connections simply drop."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(timeout=EXIT_TIMEOUT)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return "(no log)"


class Child:
    """A Python child process whose output lines (stdout and stderr) are followed with deadlines."""

    def __init__(self, script: Path, *args: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            [sys.executable, str(script), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=REPO,
            env=env,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="child-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)  # end of output: the child exited

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, prefix: str, timeout: float = START_TIMEOUT) -> str:
        """The next output line starting with ``prefix``; fail on timeout or when the child ends."""
        give_up = time.monotonic() + timeout
        while True:
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"child printed no {prefix!r} line within {timeout}s; output:\n{self.output}"
                )
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                self._queue.put(None)
                raise AssertionError(
                    f"child exited ({self.process.wait(timeout=EXIT_TIMEOUT)}) before printing "
                    f"{prefix!r}; output:\n{self.output}"
                )
            self.lines.append(line)
            if line.startswith(prefix):
                return line

    async def line(self, prefix: str, timeout: float = START_TIMEOUT) -> str:
        """:meth:`wait_for_line` without blocking the event loop."""
        return await asyncio.to_thread(self.wait_for_line, prefix, timeout)

    def kill(self) -> int:
        """SIGKILL the child (if it still runs) and reap it; returns its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        status = self.process.wait(timeout=EXIT_TIMEOUT)
        self._reader.join(timeout=EXIT_TIMEOUT)
        with contextlib.suppress(queue.Empty):
            while True:
                line = self._queue.get_nowait()
                if line is not None:
                    self.lines.append(line)
        return status
