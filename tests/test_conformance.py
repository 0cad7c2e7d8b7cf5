"""The shipped adapter suite, run against this package's seven adapters.

fakeredis stands in for Redis only on a laptop without one; under ``CI=true`` a missing Redis
fails the Redis class instead.
"""

from __future__ import annotations

import pytest

from reliable_sub.testing import (
    AdapterSuite,
    Harness,
    fakeredis_harness,
    memory_harness,
    nats_harness,
    pubsub_harness,
    redis_harness,
)
from reliable_sub.testing.adapter_suite import inspection
from reliable_sub.testing.harness import rabbitmq_harness
from reliable_sub.testing.harness_kafka import kafka_harness
from reliable_sub.testing.services import in_ci, rabbitmq_url, redis_available
from reliable_sub.testing.sqs_harness import sqs_harness
from tests.kafka_processes import KafkaBroker
from tests.nats_processes import NatsServer
from tests.rabbitmq_processes import RabbitNode
from tests.redis_processes import RedisClusterProcesses
from tests.sqs_processes import SqsServer


class TestMemoryAdapter(AdapterSuite):
    def make_harness(self) -> Harness:
        return memory_harness()


class TestRedisStreamsAdapter(AdapterSuite):
    """With 2 s leases, as on the cluster, NATS and RabbitMQ: with 1 s ones, CI's loaded run
    (MariaDB's tests now beside the others) starved a loop past the half second a lease is
    extended before it ends, and one extension was refused (the lease had lapsed), failing
    test_lease_keeps_a_long_handler_from_being_redelivered's ``refused == 0``."""

    def make_harness(self) -> Harness:
        return redis_harness(ack_deadline=2.0)


class TestRedisStreamsAdapterOnACluster(AdapterSuite):
    """On a Redis Cluster of 3 masters and 3 replicas (tests/conftest.py starts it).

    With 2 s leases, not 1 s: a lease is extended half a second before it ends when it lasts
    1 s, and on a loaded machine (two suites side by side) the cluster client's event loop lagged
    longer than that, so the lease lapsed and the consumer reclaimed its own running message.
    (The guarantee holds while extensions come in time; 1 s leases are a test's, not a
    deployment's.)"""

    cluster_url = ""

    @pytest.fixture(autouse=True)
    def _on_the_cluster(self, redis_cluster: RedisClusterProcesses) -> None:
        self.cluster_url = redis_cluster.url

    def make_harness(self) -> Harness:
        return redis_harness(self.cluster_url, name="redis-cluster", ack_deadline=2.0)


class TestNatsJetStreamAdapter(AdapterSuite):
    """On a private nats-server with JetStream (tests/conftest.py starts it).

    With 2 s leases, as on the cluster: with 1 s ones a loop starved past half a second (two
    suites side by side) let the server redeliver a message whose sync handler still ran, and a
    forced stop then gave back two deliveries of it where the test expected one (reproduced by
    blocking the loop 1.6 s: the redelivered copy even ran, its claim having lapsed too)."""

    nats_url = ""

    @pytest.fixture(autouse=True)
    def _on_the_server(self, nats_server: NatsServer) -> None:
        self.nats_url = nats_server.url

    def make_harness(self) -> Harness:
        return nats_harness(self.nats_url, ack_deadline=2.0)


class TestPubSubAdapter(AdapterSuite):
    def make_harness(self) -> Harness:
        return pubsub_harness()


if not in_ci() and not redis_available():  # a laptop without Redis: fakeredis stands in

    class TestRedisStreamsAdapterOnFakeredis(AdapterSuite):
        def make_harness(self) -> Harness:
            return fakeredis_harness()


class TestRabbitMQAdapter(AdapterSuite):
    """On the shared RabbitMQ (127.0.0.1:5672), each run with names of its own; 2 s leases, as
    on NATS."""

    def make_harness(self) -> Harness:
        return rabbitmq_harness(rabbitmq_url(), ack_deadline=2.0)


class TestKafkaAdapter(AdapterSuite):
    """On the run's single-node Kafka (KRaft; shared by the workers, tests/shared_servers.py), two
    partitions per topic, eager rebalancing (see kafka_harness); 2 s leases, as on NATS."""

    bootstrap = ""

    @pytest.fixture(autouse=True)
    def _on_the_broker(self, kafka_broker: KafkaBroker) -> None:
        self.bootstrap = kafka_broker.bootstrap

    def make_harness(self) -> Harness:
        return kafka_harness(self.bootstrap, ack_deadline=2.0)


class TestRabbitMQAdapterWithManagement:
    """The suite's figures test on a private RabbitMQ node with the management plugin (the
    shared node runs without it), the adapter given its ``management_url``. Only that test:
    nothing else in the suite reads the management API, and TestRabbitMQAdapter runs the rest
    (the whole suite again would add a minute and a half).

    5 s leases: the delivery the test holds must stay held while the figures catch up."""

    pytestmark = AdapterSuite.pytestmark
    harness = AdapterSuite.harness
    test_declared_features_match_the_capabilities = staticmethod(
        AdapterSuite.test_declared_features_match_the_capabilities)
    test_stats_count_the_backlog_and_what_is_in_flight = staticmethod(
        inspection.test_stats_count_the_backlog_and_what_is_in_flight)

    node: RabbitNode

    @pytest.fixture(autouse=True)
    def _on_the_node(self, rabbitmq_management_node: RabbitNode) -> None:
        self.node = rabbitmq_management_node

    def make_harness(self) -> Harness:
        return rabbitmq_harness(self.node.url, ack_deadline=5.0,
                                management_url=self.node.management_url)


class TestSqsAdapter(AdapterSuite):
    """On the session's private ElasticMQ (tests/conftest.py starts it: tests/sqs_processes.py),
    with 2 s visibility timeouts (as the other brokers' 2 s leases) and half-second ticks (SQS
    counts in whole seconds: see sqs_harness)."""

    client_options: dict[str, str] = {}

    @pytest.fixture(autouse=True)
    def _on_the_server(self, sqs_server: SqsServer) -> None:
        self.client_options = sqs_server.client_options

    def make_harness(self) -> Harness:
        return sqs_harness(self.client_options)
