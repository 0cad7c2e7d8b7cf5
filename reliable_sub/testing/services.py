"""The services tests and benchmarks run against: Redis, and the official Pub/Sub emulator.

For tests: ``redis_url()`` and ``emulator_host()`` return a reachable service or skip the
calling test -- and fail it under ``CI=true``, where a missing service is a failure, never a
skip. For benchmarks and scripts: :class:`EmulatorProcess` starts and stops an emulator.

* Redis: ``RELIABLE_SUB_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``).
* PostgreSQL: ``RELIABLE_SUB_POSTGRES_URL`` (default ``postgresql://postgres@127.0.0.1:5432/test``).
* MariaDB: ``RELIABLE_SUB_MARIADB_URL`` (default ``mariadb://root@127.0.0.1:3306/test``).
* RabbitMQ: ``RELIABLE_SUB_AMQP_URL`` (default ``amqp://guest:guest@127.0.0.1:5672/``).
* The emulator (Debian package ``google-cloud-cli-pubsub-emulator``, needs a JDK) is started on a
  free loopback port on first use; ``PUBSUB_EMULATOR_HOST`` is set for the Google clients.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

DEFAULT_REDIS_URL = os.environ.get("RELIABLE_SUB_REDIS_URL", "redis://127.0.0.1:6379/0")
DEFAULT_AMQP_URL = os.environ.get("RELIABLE_SUB_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
# A local Redis answers a PING in well under a millisecond; this only bounds a black-holed host.
PING_TIMEOUT = 1.0
EMULATOR_PACKAGE = "google-cloud-cli-pubsub-emulator"
KNOWN_LAUNCHER = "/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator"
# The JVM starts in a few seconds here; allow for a loaded CI machine.
EMULATOR_START_TIMEOUT = 60.0
EMULATOR_STOP_TIMEOUT = 30.0
# Polling the emulator's log for it to listen, with the deadline above.
PORT_POLL = 0.1
# A free port taken before the emulator bound it is replaced, this many times in all.
EMULATOR_PORT_ATTEMPTS = 5


def in_ci() -> bool:
    """Whether a missing service must fail the tests (``CI=true``) rather than skip them."""
    return os.environ.get("CI", "").lower() == "true"


def missing_service(problem: str) -> None:
    """Skip the calling test for ``problem``; fail it under ``CI=true``."""
    if in_ci():
        pytest.fail(f"{problem} (CI=true: a missing service is a failure, not a skip)")
    pytest.skip(problem)


# -- RabbitMQ ------------------------------------------------------------------------------------


def rabbitmq_url(url: str = DEFAULT_AMQP_URL) -> str:
    """``url`` once a TCP connection to its broker opens; else skip the test (fail it when
    ``CI=true``)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672),
                                      timeout=PING_TIMEOUT):
            pass
    except OSError as error:
        missing_service(f"RabbitMQ at {parts.hostname}:{parts.port or 5672} is unreachable: "
                        f"{error}")
    return url


# -- Redis ---------------------------------------------------------------------------------------


def redis_url(url: str = DEFAULT_REDIS_URL) -> str:
    """``url`` once Redis answers a PING there; else skip the test (fail it when ``CI=true``)."""
    problem = _ping(url)
    if problem is not None:
        missing_service(f"Redis at {url} is unreachable: {problem}")
    return url


def redis_available(url: str = DEFAULT_REDIS_URL) -> bool:
    """Whether Redis answers at ``url`` (no skip, no failure: for choosing what to run)."""
    return _ping(url) is None


@functools.cache
def _ping(url: str) -> str | None:
    """None when Redis at ``url`` answers a PING, else why not (asked once per process)."""
    try:
        import redis
    except ImportError:
        return 'the redis package is not installed (pip install "reliable-sub[redis]")'
    client = redis.Redis.from_url(
        url, socket_connect_timeout=PING_TIMEOUT, socket_timeout=PING_TIMEOUT
    )
    try:
        client.ping()
    except redis.RedisError as error:
        return f"{type(error).__name__}: {error}"
    finally:
        client.close()
    return None


# -- PostgreSQL ----------------------------------------------------------------------------------

DEFAULT_POSTGRES_URL = os.environ.get(
    "RELIABLE_SUB_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


def postgres_url(url: str = DEFAULT_POSTGRES_URL) -> str:
    """``url`` once PostgreSQL answers there; else skip the test (fail it when ``CI=true``)."""
    return _answering("PostgreSQL", url, _postgres_problem(url))


def _answering(service: str, url: str, problem: str | None) -> str:
    if problem is not None:
        missing_service(f"{service} at {url} is unreachable: {problem}")
    return url


@functools.cache
def _postgres_problem(url: str) -> str | None:
    try:
        import psycopg
    except ImportError:
        return 'psycopg is not installed (pip install "reliable-sub[sql]")'
    try:
        psycopg.connect(url, connect_timeout=2).close()
    except psycopg.Error as error:
        return f"{type(error).__name__}: {error}".strip()
    return None


# -- MariaDB --------------------------------------------------------------------------------------

DEFAULT_MARIADB_URL = os.environ.get(
    "RELIABLE_SUB_MARIADB_URL", "mariadb://root@127.0.0.1:3306/test"
)


def mariadb_url(url: str = DEFAULT_MARIADB_URL) -> str:
    """``url`` once MariaDB answers there; else skip the test (fail it when ``CI=true``)."""
    return _answering("MariaDB", url, _mariadb_problem(url))


@functools.cache
def _mariadb_problem(url: str) -> str | None:
    try:
        import pymysql
        from sqlalchemy.engine import make_url
    except ImportError:
        return 'PyMySQL is not installed (pip install "reliable-sub[mysql]")'
    parts = make_url(url)
    try:
        pymysql.connect(host=parts.host, port=parts.port or 3306, user=parts.username,
                        password=parts.password or "", database=parts.database,
                        connect_timeout=2).close()
    except pymysql.Error as error:
        return f"{type(error).__name__}: {error}".strip()
    return None


def sql_url(database: str) -> str:
    """The URL of a test database: ``"postgresql"`` and ``"mariadb"`` the shared servers
    (skipping, or failing under ``CI=true``, when unreachable), ``"sqlite"`` a throwaway file."""
    if database == "postgresql":
        return postgres_url()
    if database == "mariadb":
        return mariadb_url()
    if database == "sqlite":
        return "sqlite://"
    raise ValueError(f"sql_url: no test database {database!r} (postgresql, mariadb, sqlite)")


# -- the Pub/Sub emulator ------------------------------------------------------------------------


def emulator_launcher() -> str | None:
    """The emulator's launcher: on PATH, in the package's file list (dpkg -L), or known path."""
    found = shutil.which("cloud-pubsub-emulator")
    if found:
        return found
    try:
        listing = subprocess.run(["dpkg", "-L", EMULATOR_PACKAGE], capture_output=True,
                                 text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        listing = []
    for line in listing:
        if line.endswith("bin/cloud-pubsub-emulator"):
            return line
    return KNOWN_LAUNCHER if os.path.exists(KNOWN_LAUNCHER) else None


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _PortTaken(Exception):
    """The emulator could not bind its port: another process took it after it was chosen."""


class EmulatorProcess:
    """One emulator process on a loopback port (a free one, unless given).

    :meth:`start` raises ``RuntimeError`` saying what is wrong (not installed, exited, did not
    listen, its given port in use); :meth:`stop` kills its whole process group (the launcher
    script and its JVM). A free port chosen for it and taken before the emulator bound it (a
    server of another test, or of a suite running beside this one) is replaced by another.
    """

    def __init__(self, port: int | None = None) -> None:
        self._port_given = port is not None
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = ""

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        path = emulator_launcher()
        if path is None:
            raise RuntimeError(
                f"the Pub/Sub emulator is not installed (apt-get install {EMULATOR_PACKAGE})"
            )
        for attempt in range(1, EMULATOR_PORT_ATTEMPTS + 1):
            try:
                self._launch(path)
                return
            except _PortTaken:
                if self._port_given or attempt == EMULATOR_PORT_ATTEMPTS:
                    raise RuntimeError(
                        f"the Pub/Sub emulator could not bind port {self.port}: another "
                        f"process listens there; see {self.log_path}") from None
                self.port = free_port()

    def _launch(self, path: str) -> None:
        with tempfile.NamedTemporaryFile(prefix="pubsub-emulator-", suffix=".log",
                                         delete=False) as log:
            self.log_path = log.name
            self.process = subprocess.Popen(
                [path, "--host=127.0.0.1", f"--port={self.port}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        # Up when its own log says so: a connection to the port could reach whoever took it.
        listening = f"listening on {self.port}"
        give_up_at = time.monotonic() + EMULATOR_START_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the Pub/Sub emulator exited with "
                                   f"{self.process.returncode}; see {self.log_path}")
            with open(self.log_path, errors="replace") as log_file:
                said = log_file.read()
            if listening in said:
                return
            if "BindException" in said:  # it logs this and then keeps running
                self.stop()
                raise _PortTaken(self.port)
            if time.monotonic() > give_up_at:
                self.stop()
                raise RuntimeError(
                    f"the Pub/Sub emulator did not listen on {self.port} within "
                    f"{EMULATOR_START_TIMEOUT:g}s; see {self.log_path}"
                )
            time.sleep(PORT_POLL)  # polling its log with a deadline, not synchronisation

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=EMULATOR_STOP_TIMEOUT)


_emulator: list[EmulatorProcess] = []  # the one this test process started, if any


def emulator_host() -> str:
    """``host:port`` of a running emulator, started on first use and stopped at exit (and
    ``PUBSUB_EMULATOR_HOST`` set); skips the test without one, fails it under ``CI=true``."""
    if _emulator:
        return _emulator[0].host
    emulator = EmulatorProcess()
    try:
        emulator.start()
    except RuntimeError as error:
        missing_service(str(error))
    atexit.register(emulator.stop)
    os.environ["PUBSUB_EMULATOR_HOST"] = emulator.host
    _emulator.append(emulator)
    return emulator.host


def restart_emulator() -> None:
    """Kill the emulator and start it again on the same port (all its state is lost)."""
    kill_emulator()
    start_emulator_again()


def kill_emulator() -> None:
    """Stop the emulator this process started; :func:`start_emulator_again` reuses its port."""
    _emulator[0].stop()


def start_emulator_again() -> None:
    """Start an emulator on the port of the one :func:`kill_emulator` stopped: empty."""
    new = EmulatorProcess(_emulator[0].port)
    new.start()
    atexit.register(new.stop)
    _emulator[0] = new


__all__ = [
    "EmulatorProcess",
    "emulator_host",
    "emulator_launcher",
    "free_port",
    "in_ci",
    "kill_emulator",
    "mariadb_url",
    "missing_service",
    "postgres_url",
    "rabbitmq_url",
    "redis_available",
    "redis_url",
    "restart_emulator",
    "sql_url",
    "start_emulator_again",
]
