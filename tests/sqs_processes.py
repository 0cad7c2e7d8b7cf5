"""Private SQS-compatible servers for the SQS tests: ElasticMQ (the CI server) and moto's server.

:class:`SqsServer` is the one the suite runs on: ElasticMQ, the more faithful of the two where
the adapter depends on SQS's behaviour (``tests/sqs/FIDELITY.md``): an extension with a stale
receipt handle refused, FIFO deduplication kept after the first copy was deleted, batch and
attribute limits enforced, and (``persistent=True``, its H2 store) queues and messages, in
flight or not, kept across a SIGTERM or a SIGKILL. :class:`MotoServer` is there for what
ElasticMQ lacks (SNS topics fanning out to SQS queues, the 12-hour visibility cap, a queue's own
MaximumMessageSize, AWS's legacy error codes) and for the fidelity probe.

Like :mod:`tests.nats_processes`: nothing sleeps to synchronise; a server is up once this
start's log says so and an HTTP request is answered, polled until a deadline. Each runs on a
free loopback port, logs to a file in its directory, is stopped by its pid (:meth:`stop`:
SIGTERM, then SIGKILL after a deadline; :meth:`kill`: SIGKILL at once) and started again on the
same port by :meth:`start`. Clients take :attr:`client_options` (the endpoint, a region and
dummy credentials: neither server checks signatures), or a child process :attr:`environment`.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from reliable_sub.testing.services import missing_service
from tests.maven_jars import JarsUnavailable, classpath
from tests.redis_processes import (
    EXIT_TIMEOUT,
    POLL_INTERVAL,
    PortTaken,
    ServerProcess,
    free_port,
)

# The class every ElasticMQ server release starts from (its jar's Main-Class).
MAIN_CLASS = "org.elasticmq.server.Main"

# The region the servers name in queue ARNs and the clients sign for; any valid name works.
REGION = "us-east-1"
# Neither server checks signatures; botocore signs with whatever it is given.
DUMMY_CREDENTIALS = {"aws_access_key_id": "test", "aws_secret_access_key": "test"}
# ElasticMQ's account id in its queue URLs and ARNs (its default); moto's is 123456789012.
ELASTICMQ_ACCOUNT = "000000000000"
# ElasticMQ's JVM starts in ~1-1.5 s here, moto in ~0.3 s; allow for a loaded CI machine.
SQS_START_TIMEOUT = 60.0
# A SIGTERMed server gets this long to close (ElasticMQ flushes its H2 store) before a SIGKILL.
STOP_TIMEOUT = 10.0
# One readiness request; the poll loop retries it until the deadline.
PROBE_TIMEOUT = 1.0
# The JVM for a test server: the serial collector (one GC thread, not one per core: the machine
# is shared) and the client compiler only, which halves the start (2.1 s -> 0.9 s) and is fast
# enough for tests; a benchmark passes its own options. The heap bound keeps four xdist
# workers' servers from claiming a quarter of RAM each.
TEST_JVM_OPTIONS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xmx512m")
# What ElasticMQ logs once its SQS endpoint listens, and when its port was taken (it logs the
# BindException and keeps running).
ELASTICMQ_STARTED = "=== ElasticMQ server ("
ADDRESS_IN_USE = "address already in use"

_ELASTICMQ_CONF = """include classpath("application.conf")

node-address {{ protocol = http, host = "127.0.0.1", port = {port}, context-path = "" }}
rest-sqs {{ enabled = true, bind-port = {port}, bind-hostname = "127.0.0.1", sqs-limits = strict }}
generate-node-address = false
aws {{ region = "{region}", accountId = "{account}" }}
messages-storage {{
  enabled = {persistent}
  uri = "jdbc:h2:{store}{h2_options}"
}}
"""
# H2 writes its commits to the file after a delay by default (~1 s): a SIGKILL then lost the last
# second's queues and messages. With none, a SIGKILL right after a reply kept every change in
# the fidelity probe's trials (a killed process loses nothing the OS already has).
H2_OPTIONS = ";WRITE_DELAY=0"


class _HttpSqsServer(ServerProcess):
    """What both servers share: a loopback port, an HTTP readiness probe, SIGTERM/SIGKILL."""

    name = "sqs server"
    port: int

    def _choose_ports(self) -> None:
        self.port = free_port()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def client_options(self) -> dict[str, str]:
        """Keyword arguments for ``boto3.client("sqs", ...)`` / aiobotocore's
        ``create_client``: this server's endpoint, :data:`REGION` and dummy credentials."""
        return {"endpoint_url": self.endpoint_url, "region_name": REGION, **DUMMY_CREDENTIALS}

    @property
    def environment(self) -> dict[str, str]:
        """The same as standard AWS variables, for a child process's environment."""
        return {
            "AWS_ENDPOINT_URL_SQS": self.endpoint_url,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ACCESS_KEY_ID": DUMMY_CREDENTIALS["aws_access_key_id"],
            "AWS_SECRET_ACCESS_KEY": DUMMY_CREDENTIALS["aws_secret_access_key"],
        }

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _probe(self) -> bool:
        """Whether the server answers one request now."""
        raise NotImplementedError

    def _started(self, this_start: str) -> bool:
        """Whether this start's output says the server is up (a listener alone could be
        another process's)."""
        return True

    def _launch(self) -> None:
        """Start the server (again, on the same port and directory) and wait until it answers."""
        assert self.process is None, "already running"
        command = self._command()
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.log_path.parent,
            )
        give_up = time.monotonic() + SQS_START_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise self.exited(self.name, self.port)
            this_start = self._this_start()
            if ADDRESS_IN_USE in this_start.lower():
                self.kill()
                raise PortTaken(f"{self.name} could not bind port {self.port}:\n{self.log()}")
            if self._started(this_start) and self._probe():
                return
            if time.monotonic() > give_up:
                self.kill()
                raise AssertionError(f"{self.name} on port {self.port} did not answer within "
                                     f"{SQS_START_TIMEOUT:g}s:\n{self.log()}")
            time.sleep(POLL_INTERVAL)

    def _this_start(self) -> str:
        with contextlib.suppress(OSError), self.log_path.open("rb") as log:
            log.seek(self._log_offset)
            return log.read().decode(errors="replace")
        return ""

    def stop(self) -> None:
        """SIGTERM the server and reap it; SIGKILL it if it has not exited after
        :data:`STOP_TIMEOUT`."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=STOP_TIMEOUT)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the server and reap it (a crash: nothing is flushed)."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(timeout=EXIT_TIMEOUT)


def _answers(request: urllib.request.Request | str) -> bool:
    try:
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):  # not listening yet (an HTTP error is one too)
        return False


class ElasticMqServer(_HttpSqsServer):
    """ElasticMQ (``org.elasticmq:elasticmq-server_2.13``, on the JDK) on a free loopback port,
    its configuration, log and (``persistent=True``) H2 store of queues and messages in
    ``directory``. Without persistence a restart starts empty, as moto's does; with it, the
    queues and messages come back, a message in flight stays hidden until its timeout passes
    (then comes back with its receive count), and its receipt handle still deletes it."""

    name = "ElasticMQ"

    def __init__(self, directory: Path, *, persistent: bool = False,
                 jvm_options: tuple[str, ...] = TEST_JVM_OPTIONS,
                 port: int | None = None) -> None:
        self.java = self.find_executable("java", " (a JDK 17: Debian package openjdk-17-jre)")
        try:
            self.classpath = classpath("elasticmq")
        except JarsUnavailable as error:
            missing_service(str(error))
        self.directory = directory
        self.persistent = persistent
        self.jvm_options = jvm_options
        self.log_path = directory / "elasticmq.log"
        self.config_path = directory / "elasticmq.conf"
        self.process: subprocess.Popen[bytes] | None = None
        if port is None:
            self._choose_ports()
        else:  # a running server's (its configuration written already)
            self.port = port

    @classmethod
    def start_shared(cls, directory: Path) -> dict[str, Any]:
        """Start a server in ``directory`` for the whole run (tests/shared_servers.py); what
        :meth:`attached` needs to reach it."""
        server = cls(directory, persistent=True)
        server.start()
        assert server.process is not None
        return {"pid": server.process.pid, "directory": str(directory), "port": server.port}

    @classmethod
    def attached(cls, record: dict[str, Any]) -> ElasticMqServer:
        """The server :meth:`start_shared` started, as seen from another process: its
        address, not its process (the run's first process kills it at the end)."""
        server = cls(Path(record["directory"]), persistent=True, port=record["port"])
        server.started = True
        return server

    def _choose_ports(self) -> None:
        self.port = free_port()
        self.config_path.write_text(_ELASTICMQ_CONF.format(
            port=self.port, region=REGION, account=ELASTICMQ_ACCOUNT,
            persistent="true" if self.persistent else "false",
            store=(self.directory / "elasticmq-h2").as_posix(), h2_options=H2_OPTIONS,
        ))

    def _command(self) -> list[str]:
        return [self.java, *self.jvm_options, "-cp", self.classpath,
                f"-Dconfig.file={self.config_path}", MAIN_CLASS]

    def _started(self, this_start: str) -> bool:
        return ELASTICMQ_STARTED in this_start and " started in " in this_start

    def _probe(self) -> bool:
        return _answers(f"{self.endpoint_url}/?Action=ListQueues")


class MotoServer(_HttpSqsServer):
    """moto's server mode (``python -m moto.server``, every AWS service moto mocks on one
    port: SQS and SNS among them), in memory: a restart starts empty."""

    name = "moto_server"

    def __init__(self, directory: Path) -> None:
        try:
            import moto.server  # noqa: F401  (installed with the server's extra?)
        except ImportError as error:
            missing_service(f'moto\'s server is not installed (pip install "moto[server]"): '
                            f"{error}")
        self.directory = directory
        self.log_path = directory / "moto_server.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._choose_ports()

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]

    def _probe(self) -> bool:
        return _answers(f"{self.endpoint_url}/moto-api/data.json")


# The server of the suite's SQS tests (see the module docstring).
SqsServer = ElasticMqServer
