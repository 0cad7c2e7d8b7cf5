"""Private Apache Kafka brokers for the tests: one KRaft node, or a cluster of three.

Each node is one JVM, broker and controller combined (``process.roles=broker,controller``), on
free loopback ports, its data and log in its own directory (a pytest tmp dir): the storage is
formatted once (``kafka.tools.StorageTool format``), then ``java -cp '<jars>/*' kafka.Kafka
server.properties`` runs it. The jars come from :mod:`tests.maven_jars` (a per-machine cache).

Like :mod:`tests.redis_processes`: nothing sleeps to synchronise. A node is up when its own start
says so in its log and a Metadata request (:mod:`tests.kafka_requests`, no client library) to its
port answers with this cluster's id and lists the node (a broker is listed once registered and
unfenced); then its group and transaction coordinators and producer ids are made ready (a
client's first use would wait seconds for them otherwise). Everything is polled until a
deadline, and every process is stopped by its pid.
"""

from __future__ import annotations

import base64
import contextlib
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from reliable_sub.testing.services import missing_service
from tests.kafka_requests import (
    GROUP,
    TRANSACTION,
    Metadata,
    fetch_metadata,
    find_coordinator,
    init_producer_id,
)
from tests.maven_jars import JarsUnavailable, classpath
from tests.redis_processes import (
    EXIT_TIMEOUT,
    POLL_INTERVAL,
    PORT_ATTEMPTS,
    PortTaken,
    ServerProcess,
    free_port,
)

# The broker's main class, and the tool that formats a node's storage (both in kafka_2.13's jar:
# Kafka 4.x keeps them in Scala's ``kafka`` package).
KAFKA_MAIN = "kafka.Kafka"
STORAGE_TOOL = "kafka.tools.StorageTool"
# A node starts in about 2 s here (a first, empty one; 4 to 5 s after a SIGKILL, see
# SESSION_TIMEOUT_MS); allow for a loaded machine (xdist, CI).
START_TIMEOUT = 60.0
# A node given SIGTERM shuts down cleanly in a second or two; one whose quorum is gone can hang
# waiting for it, and is SIGKILLed after this.
STOP_TIMEOUT = 20.0
# The storage format is a short JVM run.
FORMAT_TIMEOUT = 60.0
# What a node's log says at the end of its start.
STARTED = "Kafka Server started"
# Small and quick to start, for a machine of two cores that runs other work too: a small heap,
# the serial collector (no GC threads competing for the cores), and C1 only (most of the JIT's
# work at start-up is C2's; a test broker never runs long enough to need its code). Measured
# here: a start in 2.5-3.0 s for 3 CPU-seconds (format, run, stop), against 3.3-3.6 s and 5
# CPU-seconds with the JVM's defaults (G1, all JIT tiers).
JVM_OPTIONS = (
    "-Xms64m", "-Xmx384m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
    "-Djava.awt.headless=true",
    # slf4j-simple (tests/kafka/pom.xml) to stderr, which goes to the node's log file
    "-Dorg.slf4j.simpleLogger.showDateTime=true",
    "-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS",
)
# How long the controller waits for a broker's heartbeat before fencing it (moving its
# partitions' leadership away). It is also how long a SIGKILLed node's next start waits: the
# controller refuses its new registration (DUPLICATE_BROKER_REGISTRATION) until the old one's
# session has expired. Kafka's 9 s default would make every failover and crash test wait that
# long; heartbeats every HEARTBEAT_MS keep a live node well inside 3 s on a loaded machine.
SESSION_TIMEOUT_MS = 3000
HEARTBEAT_MS = 500
# Few partitions for the internal topics (default 50): a group's or a transaction's coordinator
# loads its partition on first use, and fewer make a first group join or transaction fast.
INTERNAL_TOPIC_PARTITIONS = 4


def new_cluster_id() -> str:
    """A random cluster id in Kafka's format (a UUID, URL-safe base64, unpadded), never one
    that starts with "-": the storage tool's argument parser takes that for an option and
    fails ("--cluster-id: expected one argument"), as Kafka's own Uuid.randomUuid avoids."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def _classpath() -> str:
    try:
        return classpath("kafka")
    except JarsUnavailable as error:
        missing_service(f"the Kafka broker's jars are unavailable: {error}")
        raise  # not reached: missing_service skips or fails


def settings_for(replicas: int) -> dict[str, str]:
    """The broker settings that depend on how many nodes there are: one keeps one copy of
    everything; three keep three and acknowledge acks=all writes from two (one node may die)."""
    in_sync = "1" if replicas == 1 else "2"
    return {
        "default.replication.factor": str(replicas),
        "min.insync.replicas": in_sync,
        "offsets.topic.replication.factor": str(replicas),
        "offsets.topic.num.partitions": str(INTERNAL_TOPIC_PARTITIONS),
        "transaction.state.log.replication.factor": str(replicas),
        "transaction.state.log.min.isr": in_sync,
        "transaction.state.log.num.partitions": str(INTERNAL_TOPIC_PARTITIONS),
        "share.coordinator.state.topic.replication.factor": str(replicas),
        "share.coordinator.state.topic.min.isr": in_sync,
        "share.coordinator.state.topic.num.partitions": str(INTERNAL_TOPIC_PARTITIONS),
        "group.initial.rebalance.delay.ms": "0",  # a first group join is not held back 3 s
    }


class KafkaBroker(ServerProcess):
    """One KRaft node (broker and controller) on free loopback ports, its data in ``directory``
    (kept across :meth:`kill`, :meth:`stop` and :meth:`start`, as a restarted production
    broker keeps its disk). Alone, it is its own quorum; in a :class:`KafkaCluster` the cluster
    sets :attr:`peers` and :attr:`replicas`."""

    def __init__(self, directory: Path, *, node_id: int = 1, cluster_id: str | None = None,
                 settings: dict[str, str] | None = None,
                 jvm_options: tuple[str, ...] = JVM_OPTIONS) -> None:
        self.java = self.find_executable("java", " (a JDK 17 or newer runs Kafka 4)")
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.node_id = node_id
        self.cluster_id = cluster_id or new_cluster_id()
        self.settings = dict(settings or {})
        self.jvm_options = jvm_options
        self.peers: list[KafkaBroker] = [self]  # the quorum's voters, this node among them
        self.replicas = 1
        self.log_path = directory / "kafka.log"
        self.config_path = directory / "server.properties"
        self.data = directory / "data"
        self.process: subprocess.Popen[bytes] | None = None
        self._choose_ports()

    def _choose_ports(self) -> None:
        self.port = free_port()
        self.controller_port = free_port()

    @classmethod
    def start_shared(cls, directory: Path) -> dict[str, Any]:
        """Start a node in ``directory`` for the whole run (tests/shared_servers.py); what
        :meth:`attached` needs to reach it."""
        broker = cls(directory)
        broker.start()
        assert broker.process is not None
        return {"pid": broker.process.pid, "directory": str(directory), "port": broker.port,
                "controller_port": broker.controller_port, "cluster_id": broker.cluster_id}

    @classmethod
    def attached(cls, record: dict[str, Any]) -> KafkaBroker:
        """The node :meth:`start_shared` started, as seen from another process: its address
        and metadata, not its process (the run's first process kills it at the end)."""
        broker = cls(Path(record["directory"]), cluster_id=record["cluster_id"])
        broker.port, broker.controller_port = record["port"], record["controller_port"]
        broker.started = True
        return broker

    @property
    def bootstrap(self) -> str:
        """``host:port`` for a client's ``bootstrap.servers``."""
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def properties(self) -> dict[str, str]:
        voters = ",".join(f"{peer.node_id}@127.0.0.1:{peer.controller_port}"
                          for peer in self.peers)
        return {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},"
                         f"CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.data),
            "broker.session.timeout.ms": str(SESSION_TIMEOUT_MS),
            "broker.heartbeat.interval.ms": str(HEARTBEAT_MS),
            **settings_for(self.replicas),
            **self.settings,
        }

    def _write_config(self) -> None:
        lines = [f"{name}={value}" for name, value in self.properties().items()]
        self.config_path.write_text("\n".join(lines) + "\n")

    def _format(self, classpath: str) -> None:
        """Format the storage, once: a formatted node keeps its data across restarts."""
        if (self.data / "meta.properties").exists():
            return
        command = [self.java, *self.jvm_options, "-cp", classpath, STORAGE_TOOL, "format",
                   "--cluster-id", self.cluster_id, "--config", str(self.config_path)]
        with self.log_path.open("ab") as log:
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=FORMAT_TIMEOUT, check=False)
        if done.returncode != 0:
            raise AssertionError(f"{STORAGE_TOOL} format for Kafka node {self.node_id} exited "
                                 f"with {done.returncode}:\n{self.log()}")

    def _launch(self) -> None:
        self.spawn()
        self.wait_until_serving()
        self.warm_up()

    def spawn(self) -> None:
        """Start the JVM (again, on the same ports and data), not waiting for it."""
        assert self.process is None, "already running"
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        classpath = _classpath()
        self._write_config()
        self._format(classpath)
        command = [self.java, *self.jvm_options, "-cp", classpath, KAFKA_MAIN,
                   str(self.config_path)]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=self.directory)

    def wait_until_serving(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until this start is over and the node serves (it answers Metadata with this
        cluster's id and lists itself and every other running node of the cluster); raise with
        the log's tail otherwise."""
        give_up = time.monotonic() + timeout
        expected = {peer.node_id for peer in self.peers if peer is self or peer.running}
        while True:
            assert self.process is not None, "not started"
            if self.process.poll() is not None:
                raise self.exited(f"Kafka node {self.node_id}", self.port)
            if STARTED in self._this_start():
                with contextlib.suppress(OSError):
                    metadata = fetch_metadata(self.port)
                    if (metadata.cluster_id == self.cluster_id
                            and expected <= set(metadata.brokers)):
                        return
            if time.monotonic() > give_up:
                raise AssertionError(f"Kafka node {self.node_id} on port {self.port} did not "
                                     f"serve within {timeout}s:\n{self.log()}")
            time.sleep(POLL_INTERVAL)

    def warm_up(self, timeout: float = START_TIMEOUT) -> None:
        """Ask until a group coordinator, a transaction coordinator and a producer id can be
        had: the first asks create the internal topics (``__consumer_offsets``,
        ``__transaction_state``) and fetch a block of producer ids from the controller."""
        asks = {
            "a group coordinator": lambda: find_coordinator(self.port, "warm-up", GROUP),
            "a transaction coordinator":
                lambda: find_coordinator(self.port, "warm-up", TRANSACTION),
            "a producer id": lambda: init_producer_id(self.port),
        }
        give_up = time.monotonic() + timeout
        for what, ask in asks.items():
            while True:
                error: int | str = "no answer"
                with contextlib.suppress(OSError):
                    error = ask()
                if error == 0:
                    break
                if self.process is None or self.process.poll() is not None:
                    raise self.exited(f"Kafka node {self.node_id}", self.port)
                if time.monotonic() > give_up:
                    raise AssertionError(f"Kafka node {self.node_id} gave no {what} within "
                                         f"{timeout}s (last error: {error}):\n{self.log()}")
                time.sleep(POLL_INTERVAL)

    def _this_start(self) -> str:
        with contextlib.suppress(OSError), self.log_path.open("rb") as log:
            log.seek(self._log_offset)
            return log.read().decode(errors="replace")
        return ""

    def metadata(self, topics: list[str] | None = None) -> Metadata:
        return fetch_metadata(self.port, topics)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM (a controlled shutdown: leadership moves away first), SIGKILL after
        ``timeout``; its data stays for the next :meth:`start`."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGKILL)
                process.wait(timeout=EXIT_TIMEOUT)
        self.process = None

    def restart(self) -> None:
        """Stop (cleanly) and start again on the same ports and data."""
        self.stop()
        self.start()


class KafkaCluster:
    """Three KRaft nodes, each broker and controller: a quorum of three voters, topics with three
    replicas of which two must acknowledge an acks=all write (``min.insync.replicas=2``), so one
    node may be killed and writes go on once the survivors have elected new leaders."""

    def __init__(self, directory: Path, size: int = 3,
                 jvm_options: tuple[str, ...] = JVM_OPTIONS) -> None:
        cluster_id = new_cluster_id()
        self.brokers = [KafkaBroker(directory / f"node-{node}", node_id=node,
                                    cluster_id=cluster_id, jvm_options=jvm_options)
                        for node in range(1, size + 1)]
        for broker in self.brokers:
            broker.peers = self.brokers
            broker.replicas = size

    @property
    def bootstrap(self) -> str:
        return ",".join(broker.bootstrap for broker in self.brokers)

    def start(self) -> None:
        """Start every node at once (a node's start waits for a quorum of its peers), moving
        them all to new ports when one was taken before its first start bound it."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                for broker in self.brokers:
                    broker.spawn()
                for broker in self.brokers:
                    broker.wait_until_serving()
                self.brokers[0].warm_up()  # internal topics of three replicas: all must serve
            except PortTaken:
                first_start = not any(broker.started for broker in self.brokers)
                self.kill()
                if not first_start or attempt == PORT_ATTEMPTS:
                    raise
                for broker in self.brokers:
                    broker._choose_ports()
                continue
            for broker in self.brokers:
                broker.started = True
            return

    def broker(self, node_id: int) -> KafkaBroker:
        return next(broker for broker in self.brokers if broker.node_id == node_id)

    def metadata(self, topics: list[str] | None = None) -> Metadata:
        """Metadata from the first running node that answers."""
        for broker in self.brokers:
            if broker.running:
                with contextlib.suppress(OSError):
                    return broker.metadata(topics)
        raise AssertionError("no node of the Kafka cluster answers a Metadata request")

    def leader(self, topic: str, partition: int = 0) -> KafkaBroker:
        """The node leading ``topic``'s ``partition`` now."""
        error, partitions = self.metadata([topic]).topics[topic]
        if error or partition not in partitions or partitions[partition].leader < 0:
            raise AssertionError(f"{topic}[{partition}] has no leader (error code {error})")
        return self.broker(partitions[partition].leader)

    def kill_leader(self, topic: str, partition: int = 0) -> KafkaBroker:
        """SIGKILL the node leading ``topic``'s ``partition``; returns it (its :meth:`start`
        brings it back with its data)."""
        leader = self.leader(topic, partition)
        leader.kill()
        return leader

    def wait_until_serving(self, timeout: float = START_TIMEOUT) -> None:
        """Every node serves, and each sees all of them (after a restart: the node rejoined)."""
        for broker in self.brokers:
            broker.wait_until_serving(timeout)

    def stop(self) -> None:
        for broker in self.brokers:
            broker.stop()

    def kill(self) -> None:
        for broker in self.brokers:
            broker.kill()

