"""A private RabbitMQ node for fault trials: its own ports, cookie, configuration and data,
started, SIGKILLed and started again by a test (beside the shared node, never touching it).

Notes from making it work on Debian's package: the script under /usr/lib/rabbitmq/bin runs the
node as the calling user (the /usr/sbin wrapper switches to the user rabbitmq, its home and
cookie); ``HOME`` holds the cookie; the configuration and environment files are the node's own
(/etc/rabbitmq names the shared node's port); with ``RABBITMQ_ALLOW_INPUT`` and stdin a pipe the
script execs the Erlang VM, so a SIGKILL stops the VM itself.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from reliable_sub.testing.services import missing_service
from tests.redis_processes import EXIT_TIMEOUT, POLL_INTERVAL, PortTaken, ServerProcess, free_port

# A node boots in 4 to 7 s here; allow for a loaded machine (xdist, CI).
NODE_START_TIMEOUT = 60.0
# What a node prints once it has booted (its log goes to a file of its own by then).
BOOTED = " completed with "
# rabbitmqctl takes about half a second a call.
CTL_TIMEOUT = 60.0
# With the management plugin: queues' figures every second, not RabbitMQ's default 5 s, which
# would make a test of them wait seconds for each. Four settings: how often queues write them
# (collect_statistics_interval; a quorum queue's tick, quorum_tick_interval, ms) and how often
# the management agent collects them (its shortest sample interval, s; 1 is its least).
STATISTICS_INTERVAL_MS = 250
_FAST_FIGURES = f"""[
 {{rabbit, [{{collect_statistics_interval, {STATISTICS_INTERVAL_MS}}},
           {{quorum_tick_interval, {STATISTICS_INTERVAL_MS}}}]}},
 {{rabbitmq_management_agent, [{{sample_retention_policies,
     [{{global, [{{605, 1}}]}}, {{basic, [{{605, 1}}]}}, {{detailed, [{{10, 1}}]}}]}}]}}
].
"""


def _rabbitmq_script(name: str) -> str:
    """The script that runs ``name`` as the calling user. Debian's /usr/sbin wrappers switch
    to the user rabbitmq (its home, its Erlang cookie); the scripts they call do not."""
    behind = Path("/usr/lib/rabbitmq/bin") / name
    if behind.is_file():
        return str(behind)
    found = shutil.which(name)
    if found is None:
        missing_service(f"{name} is not on PATH (Debian package rabbitmq-server)")
    assert found is not None
    return found


class RabbitNode(ServerProcess):
    """A RabbitMQ node of its own: node name ``rs-<port>@localhost`` (beside the shared
    ``rabbit@localhost``, registered with the same epmd), AMQP and distribution on free
    loopback ports, and everything else in ``directory``: the Erlang cookie (``HOME``), the
    configuration (none of /etc/rabbitmq is read: it names the shared node's port), no plugins
    (with ``management``: the management plugin, its HTTP API on a free loopback port of its
    own, and queues' figures every second: _FAST_FIGURES), data (kept across
    :meth:`kill` and :meth:`start`) and logs."""

    def __init__(self, directory: Path, *, management: bool = False) -> None:
        self.server = _rabbitmq_script("rabbitmq-server")
        self.ctl_script = _rabbitmq_script("rabbitmqctl")
        self.directory = directory
        self.log_path = directory / "rabbitmq-server.out"
        self.process: subprocess.Popen[bytes] | None = None
        (directory / "rabbitmq-env.conf").write_text("")
        self.management = management
        plugins = "[rabbitmq_management]" if management else "[]"
        (directory / "enabled_plugins").write_text(f"{plugins}.\n")
        (directory / "advanced.config").write_text(_FAST_FIGURES if management else "[].\n")
        self._choose_ports()

    def _choose_ports(self) -> None:
        self.port = free_port()
        self.dist_port = free_port()
        self.node = f"rs-{self.port}@localhost"
        conf = f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
        if self.management:
            self.management_port = free_port()
            conf += (f"management.tcp.ip = 127.0.0.1\n"
                     f"management.tcp.port = {self.management_port}\n")
        (self.directory / "rabbitmq.conf").write_text(conf)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    @property
    def management_url(self) -> str:
        """The management plugin's HTTP API (a node started with ``management``)."""
        assert self.management, "this node runs without the management plugin"
        return f"http://guest:guest@127.0.0.1:{self.management_port}/"

    def _env(self) -> dict[str, str]:
        directory = self.directory
        inherited = {name: value for name, value in os.environ.items()
                     if not name.startswith(("RABBITMQ_", "ERL_"))}
        return dict(
            inherited,
            HOME=str(directory),  # the cookie: made on first start, read by rabbitmqctl
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_CONF_ENV_FILE=str(directory / "rabbitmq-env.conf"),
            RABBITMQ_CONFIG_FILE=str(directory / "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(directory / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(directory / "enabled_plugins"),
            RABBITMQ_MNESIA_BASE=str(directory / "mnesia"),
            RABBITMQ_LOG_BASE=str(directory / "log"),
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
            ERL_EPMD_ADDRESS="127.0.0.1",
            RABBITMQ_ALLOW_INPUT="true",
        )

    def _launch(self) -> None:
        """Start the node (again, on the same ports and data) and wait until it has booted."""
        assert self.process is None, "already running"
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [self.server], env=self._env(), cwd=self.directory, stdout=log,
                stderr=subprocess.STDOUT,
                # with input allowed the script execs the VM (otherwise it runs it as a child
                # and waits, and a SIGKILL leaves the VM's threads dying after the script is
                # reaped, its port still open): the input is a pipe that stays open and silent
                stdin=subprocess.PIPE,
                start_new_session=True,  # its own process group: kill() takes its helpers too
            )
        give_up = time.monotonic() + NODE_START_TIMEOUT
        # this start's output tells the boot is over ("Starting broker... completed with N
        # plugins."); the port is polled too (a listener alone could be another process's)
        while BOOTED not in self._this_start() or not self._listening():
            if self.process.poll() is not None:
                raise self.exited("rabbitmq-server", self.port)
            if time.monotonic() > give_up:
                raise AssertionError(f"RabbitMQ node {self.node} did not start within "
                                     f"{NODE_START_TIMEOUT}s:\n{self.log()}")
            time.sleep(POLL_INTERVAL)

    def _this_start(self) -> str:
        """What the node printed since this start began (its log goes to its output too)."""
        with contextlib.suppress(OSError), self.log_path.open("rb") as log:
            log.seek(self._log_offset)
            return log.read().decode(errors="replace")
        return ""

    def node_log(self, lines: int = 60) -> str:
        """The end of the node's own log (its output has the boot banner and little else)."""
        path = self.directory / "log" / f"{self.node}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as error:
            return f"(no log: {error})"

    def _listening(self) -> bool:
        ports = (self.port, self.management_port) if self.management else (self.port,)
        try:
            for port in ports:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    pass
        except OSError:
            return False
        return True

    def exited(self, name: str, port: int) -> AssertionError:
        """PortTaken when one of its ports was taken meanwhile (the AMQP listener's, or the
        distribution port), else the failure with the log."""
        error = super().exited(name, port)
        output = self._this_start()
        if "eaddrinuse" in output or "dist_port_already_used" in output:
            return PortTaken(str(error))
        return error

    def kill(self) -> None:
        """SIGKILL the node and its helper processes (no clean shutdown: connections drop);
        its data stays for the next :meth:`start`."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        # the VM itself: reaped once its last thread has exited, its sockets closed with it
        process.wait(timeout=EXIT_TIMEOUT)
        if process.stdin is not None:
            process.stdin.close()

    def ctl(self, *args: str) -> str:
        """``rabbitmqctl -n <node> -q ARGS``'s output (its failure fails the test)."""
        done = subprocess.run([self.ctl_script, "-n", self.node, "-q", *args], env=self._env(),
                              capture_output=True, text=True, timeout=CTL_TIMEOUT, check=False)
        if done.returncode != 0:
            raise AssertionError(f"rabbitmqctl {' '.join(args)} on {self.node} failed "
                                 f"({done.returncode}):\n{done.stdout}{done.stderr}")
        return done.stdout

    def save_queue_registry(self) -> None:
        """Write the node's dets tables to disk now, as it does by itself every 3 minutes.

        RabbitMQ 3.10's Ra keeps its directory of quorum-queue servers in a dets table: a node
        SIGKILLed within minutes of declaring a quorum queue comes back without the queue's
        server (no leader, ever: publishes are nacked, a consume times out). This stands for
        a queue declared long before the crash."""
        self.ctl("eval", "[dets:sync(Table) || Table <- dets:all()].")

    def connections(self) -> dict[str, str]:
        """The node's client connections: the pid of each, by the name the client gave it
        (the ``connection_name`` client property; the ``name`` column is the broker's, made of
        the addresses)."""
        found: dict[str, str] = {}
        listed = self.ctl("list_connections", "--no-table-headers", "pid", "client_properties")
        for line in listed.splitlines():
            pid, _, properties = line.partition("\t")
            named = re.search(r'\{"connection_name","([^"]*)"\}', properties)
            if pid.startswith("<") and named:
                found[named.group(1)] = pid
        return found
