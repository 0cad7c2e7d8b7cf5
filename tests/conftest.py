"""Test-wide settings: hypothesis profiles (``--hypothesis-profile=nightly`` for a long hunt)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings

from tests import shared_servers
from tests.chaos import lane_of
from tests.kafka_processes import KafkaBroker, KafkaCluster
from tests.nats_processes import NatsServer
from tests.rabbitmq_processes import RabbitNode
from tests.redis_processes import RedisClusterProcesses
from tests.sqs_processes import SqsServer

# fixtures shared by the outbox tests: outbox (every database), shared_outbox, pg_outbox; and the
# stacks of a hung test's tasks, printed before its timeout
pytest_plugins = ["tests.outbox_support", "tests.hang_report"]

_SLOW_IS_FINE = [HealthCheck.too_slow, HealthCheck.data_too_large]

# CI: a bounded search that runs in seconds.
settings.register_profile("ci", max_examples=20, stateful_step_count=25, deadline=None,
                          suppress_health_check=_SLOW_IS_FINE)
# A long search, for a nightly job or before a release. Run it and "hunt" with --timeout=0: a
# state machine's whole search is one test, and takes longer than the suite's 120 s per test.
settings.register_profile("nightly", max_examples=1000, stateful_step_count=60, deadline=None,
                          suppress_health_check=_SLOW_IS_FINE)
# Longer than CI, shorter than nightly: for checking a fix or a revert by hand.
settings.register_profile("hunt", max_examples=300, stateful_step_count=40, deadline=None,
                          suppress_health_check=_SLOW_IS_FINE)
settings.load_profile("ci")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the run's first process: xdist's, or pytest alone
        shared_servers.configure()


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        shared_servers.unconfigure()


def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    """Under xdist, each lane of chaos scenarios (tests/chaos/__init__.py) is one unit of work,
    run by one worker one after the other (each loads the machine with consumer processes),
    while the other workers run the rest. The suites run on the shared Redis Cluster are
    another unit, so that one worker starts a cluster, not each; so are the tests on the
    RabbitMQ node with the management plugin. (xdist's own ``xdist_group`` marks do not reach
    the node ids under pytest 9.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ChaosOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("tests/chaos/"):
                return lane_of(nodeid)
            if ".md::" in nodeid:  # a Markdown file's snippets share one namespace, in order
                return nodeid.split("::", 1)[0]
            if "test_rabbitmq_management.py" in nodeid or "WithManagement::" in nodeid:
                return "rabbitmq-management"
            return "cluster" if "OnACluster::" in nodeid else nodeid

    return ChaosOnOneWorker(config, log)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    """A private Redis Cluster (3 masters, 3 replicas) for this session's worker."""
    yield from running(RedisClusterProcesses(tmp_path_factory.mktemp("redis-cluster")))


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A private ``nats-server -js`` for this session's worker."""
    yield from running(NatsServer(tmp_path_factory.mktemp("nats-server")))


@pytest.fixture(scope="session")
def rabbitmq_management_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitNode]:
    """A private RabbitMQ node with the management plugin (the shared node runs without it)
    for this session's worker."""
    yield from running(RabbitNode(tmp_path_factory.mktemp("rabbitmq-management"),
                                  management=True))


@pytest.fixture(scope="session")
def kafka_broker() -> KafkaBroker:
    """The run's Kafka node (KRaft, broker and controller in one JVM), shared by every worker
    (tests/shared_servers.py): ``kafka_broker.bootstrap`` is its ``127.0.0.1:port``. Its
    topics are the tests' own; a test that kills or restarts a node starts a private one."""
    return KafkaBroker.attached(shared_servers.shared("kafka-broker", KafkaBroker.start_shared))


@pytest.fixture
def private_kafka_broker(tmp_path: Path) -> Iterator[KafkaBroker]:
    """A Kafka node of one test's own, for a test that kills or restarts it: the run's shared
    one must not go away under other tests."""
    yield from running(KafkaBroker(tmp_path))


@pytest.fixture
def kafka_cluster(tmp_path: Path) -> Iterator[KafkaCluster]:
    """A private Kafka cluster of three KRaft nodes (replication factor 3, min.insync.replicas
    2) for one test, which may kill a node (and starts it again). Not kept for the session:
    three idle nodes would cost a third of a core for the rest of the run."""
    yield from running(KafkaCluster(tmp_path / "kafka-cluster"))


@pytest.fixture(scope="session")
def sqs_server() -> SqsServer:
    """The run's SQS-compatible server (ElasticMQ: tests/sqs_processes.py), shared by every
    worker (tests/shared_servers.py), its queues and messages on disk. Clients take its
    ``client_options``; a test that kills it starts a private one."""
    return SqsServer.attached(shared_servers.shared("sqs-server", SqsServer.start_shared))


@pytest.fixture
def private_sqs_server(tmp_path: Path) -> Iterator[SqsServer]:
    """An ElasticMQ of one test's own (its queues and messages on disk), for a test that kills
    it: the run's shared one must not go away under other tests."""
    yield from running(SqsServer(tmp_path, persistent=True))


Server = TypeVar("Server", RedisClusterProcesses, NatsServer, RabbitNode, KafkaBroker,
                 KafkaCluster, SqsServer)


def running(server: Server) -> Iterator[Server]:
    """Start ``server`` for a fixture's life, and kill it at the end (also after a failed
    start)."""
    try:
        server.start()
        yield server
    finally:
        server.kill()


@pytest.fixture(autouse=True)
def _postgres_application_name(request: pytest.FixtureRequest) -> Iterator[None]:
    """Name every PostgreSQL connection a test opens (and its subprocesses) after the test, in
    ``pg_stat_activity.application_name``: who holds connections when the server runs out."""
    previous = os.environ.get("PGAPPNAME")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    os.environ["PGAPPNAME"] = f"{worker} {request.node.name}"[:63]
    yield
    if previous is None:
        os.environ.pop("PGAPPNAME", None)
    else:
        os.environ["PGAPPNAME"] = previous
