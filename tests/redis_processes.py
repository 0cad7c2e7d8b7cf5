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
# A cluster node unreachable this long (ms) is failed over to its replica.
CLUSTER_NODE_TIMEOUT_MS = 2000


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


def free_cluster_port() -> int:
    """A free loopback port whose cluster bus port (10,000 higher) is free too; Redis refuses
    ports above 55535 in cluster mode."""
    import random

    for _ in range(1000):
        port = random.randrange(20_000, 55_000)
        try:
            with socket.socket() as first, socket.socket() as second:
                first.bind(("127.0.0.1", port))
                second.bind(("127.0.0.1", port + 10_000))
        except OSError:
            continue
        return port
    raise AssertionError("no free pair of ports for a cluster node")


class PortTaken(AssertionError):
    """A server could not bind the free port chosen for it: another process (a server of
    another test, or of a suite running beside this one) took it between the choice and the
    bind."""


# A first start whose port was taken is tried again on new ports, this many times in all.
PORT_ATTEMPTS = 5


class ServerProcess:
    """What the private servers of the tests share: finding the executable (a missing one fails
    under ``CI=true`` and skips elsewhere), a start that moves to new ports when its free ones
    were taken meanwhile, a SIGKILL, and the tail of the log for messages."""

    process: subprocess.Popen[bytes] | None
    log_path: Path
    started = False  # once up, a restart keeps its ports (clients and cluster peers know them)
    _log_offset = 0

    def start(self) -> None:
        """Start the server and wait until it is up."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
                self._launch()
            except PortTaken:
                self.process = None
                if self.started or attempt == PORT_ATTEMPTS:
                    raise
                self._choose_ports()
                continue
            self.started = True
            return

    def _launch(self) -> None:
        raise NotImplementedError

    def _choose_ports(self) -> None:
        raise NotImplementedError

    def exited(self, name: str, port: int) -> AssertionError:
        """The error for a server that exited while starting (PortTaken if it could not bind)."""
        assert self.process is not None
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_offset)
                this_start = log.read().decode(errors="replace")
        except OSError:
            this_start = ""
        kind = PortTaken if "address already in use" in this_start.lower() else AssertionError
        return kind(f"{name} on port {port} exited with {self.process.returncode}:\n{self.log()}")

    @staticmethod
    def find_executable(name: str, hint: str = "") -> str:
        executable = shutil.which(name)
        if executable is None:
            message = f"{name} is not on PATH{hint}"
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(f"{message} (CI=true: a missing service is a failure, not a skip)")
            pytest.skip(message)
        return executable

    def kill(self) -> None:
        """SIGKILL the server and reap it: no clean shutdown, connections simply drop; what it
        wrote to disk stays for the next :meth:`start`."""
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


class RedisServer(ServerProcess):
    """A private ``redis-server`` on a free loopback port, data in ``directory``.

    ``appendonly=True`` writes every command to the AOF before replying (appendfsync always), so
    the data survives a SIGKILL and a :meth:`start` on the same port and directory.
    """

    def __init__(self, directory: Path, *, appendonly: bool, cluster: bool = False) -> None:
        self.executable = self.find_executable("redis-server")
        self.directory = directory
        self.appendonly = appendonly
        self.cluster = cluster
        self._choose_ports()
        self.log_path = directory / "redis-server.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def _choose_ports(self) -> None:
        self.port = free_cluster_port() if self.cluster else free_port()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _launch(self) -> None:
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
        if self.cluster:
            command += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                        "--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS)]
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
                    raise self.exited("redis-server", self.port)
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

    def role(self) -> str:
        """``master`` or ``slave`` (ROLE's first field)."""
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port)
        try:
            return str(client.execute_command("ROLE")[0], "utf-8")
        finally:
            client.close()


class RedisClusterProcesses:
    """A Redis Cluster of 3 masters and 3 replicas: six private ``redis-server`` processes on
    free loopback ports, joined by ``redis-cli --cluster create --cluster-replicas 1``."""

    def __init__(self, directory: Path, masters: int = 3) -> None:
        self.servers = []
        for number in range(2 * masters):
            node = directory / f"node-{number}"
            node.mkdir(parents=True, exist_ok=True)
            self.servers.append(RedisServer(node, appendonly=False, cluster=True))

    @property
    def url(self) -> str:
        """A ``redis+cluster://`` URL naming every node as a seed (any one that answers
        gives the library's clients the whole topology)."""
        seeds = ",".join(f"127.0.0.1:{server.port}" for server in self.servers)
        return f"redis+cluster://{seeds}/0"

    def start(self) -> None:
        for server in self.servers:
            server.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise AssertionError("redis-cli is not on PATH (it joins the cluster)")
        created = subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.servers),
             "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True, text=True, timeout=60, check=False)
        if created.returncode != 0:
            raise AssertionError(f"redis-cli --cluster create failed:\n{created.stdout}"
                                 f"{created.stderr}")
        poll_until_sync(self._ready, "cluster_state:ok on every node", within=START_TIMEOUT)

    def _ready(self) -> bool:
        """Every node sees the cluster ok, and every replica has synced with its master (a
        replica that never synced would not take over when its master dies)."""
        import redis

        for server in self.servers:
            client = redis.Redis(host="127.0.0.1", port=server.port)
            try:
                if b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                    return False
                replication = client.info("replication")
                if replication["role"] == "slave" and replication["master_link_status"] != "up":
                    return False
            finally:
                client.close()
        return True

    def kill(self) -> None:
        for server in self.servers:
            server.kill()


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
        """What the child printed so far (lines not yet waited for included)."""
        with contextlib.suppress(queue.Empty):
            while True:
                line = self._queue.get_nowait()
                if line is None:
                    self._queue.put(None)
                    break
                self.lines.append(line)
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
