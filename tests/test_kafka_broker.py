"""The private Kafka brokers of the tests (tests/kafka_processes.py) serve real clients: records
go in and come out on one node, survive its crash, and on a cluster of three an acks=all write
goes on after the leader of its partition is killed, which rejoins when started again."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from tests.kafka_processes import KafkaBroker, KafkaCluster
from tests.redis_processes import POLL_INTERVAL, poll_until_sync

confluent_kafka = pytest.importorskip("confluent_kafka",
                                      reason='the Kafka tests need "reliable-sub[kafka]"')
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

# Loopback round trips take milliseconds; these bound a broker that stopped answering.
CLIENT_TIMEOUT = 30.0


def _topic(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def create_topic(bootstrap: str, name: str, partitions: int, replicas: int = -1) -> None:
    """Create ``name`` and wait for the broker's answer (``-1``: the broker's default RF)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(name, partitions, replicas)],
                                  operation_timeout=CLIENT_TIMEOUT)
    futures[name].result(timeout=CLIENT_TIMEOUT)


def produce(bootstrap: str, topic: str, values: list[bytes], **config: Any) -> list[Any]:
    """Send ``values`` (idempotent, acks=all) and return their delivery reports' errors."""
    errors: list[Any] = []
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap,
                                         "enable.idempotence": True, "acks": "all", **config})
    for value in values:
        producer.produce(topic, value=value, key=value[-1:],
                         headers=[("attempt", b"\x00\xff")],
                         on_delivery=lambda error, _message: errors.append(error))
    assert producer.flush(CLIENT_TIMEOUT) == 0, "records left unsent"
    return errors


def consume(bootstrap: str, topic: str, count: int, group: str | None = None) -> list[Any]:
    """Read ``count`` records of ``topic`` from the start, as a member of a new group, and
    commit their offsets."""
    consumer = confluent_kafka.Consumer({
        "bootstrap.servers": bootstrap, "group.id": group or _topic("group"),
        "auto.offset.reset": "earliest", "enable.auto.commit": False,
    })
    records: list[Any] = []
    try:
        consumer.subscribe([topic])
        give_up = time.monotonic() + CLIENT_TIMEOUT
        while len(records) < count:
            assert time.monotonic() < give_up, f"{len(records)} of {count} records consumed"
            for message in consumer.consume(num_messages=count, timeout=POLL_INTERVAL * 10):
                assert message.error() is None, message.error()
                records.append(message)
        consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    return records


def test_a_single_broker_takes_records_and_gives_them_to_a_group(
        kafka_broker: KafkaBroker) -> None:
    topic = _topic("single")
    create_topic(kafka_broker.bootstrap, topic, partitions=2)
    values = [f"record-{number}".encode() for number in range(10)]
    assert produce(kafka_broker.bootstrap, topic, values) == [None] * 10
    group = _topic("group")
    records = consume(kafka_broker.bootstrap, topic, 10, group)
    assert sorted(record.value() for record in records) == sorted(values)
    assert records[0].headers() == [("attempt", b"\x00\xff")]
    consumer = confluent_kafka.Consumer({"bootstrap.servers": kafka_broker.bootstrap,
                                         "group.id": group})
    try:
        committed = consumer.committed([confluent_kafka.TopicPartition(topic, partition)
                                        for partition in (0, 1)], timeout=CLIENT_TIMEOUT)
    finally:
        consumer.close()
    assert sum(partition.offset for partition in committed) == 10


def test_a_killed_broker_starts_again_with_its_records(private_kafka_broker: KafkaBroker) -> None:
    topic = _topic("crash")
    create_topic(private_kafka_broker.bootstrap, topic, partitions=1)
    assert produce(private_kafka_broker.bootstrap, topic, [b"before the crash"]) == [None]
    port = private_kafka_broker.port
    private_kafka_broker.kill()
    private_kafka_broker.start()
    assert private_kafka_broker.port == port
    values = [record.value() for record in consume(private_kafka_broker.bootstrap, topic, 1)]
    assert values == [b"before the crash"]


def test_a_cluster_keeps_taking_acks_all_writes_when_a_leader_dies(
        kafka_cluster: KafkaCluster) -> None:
    topic = _topic("failover")
    create_topic(kafka_cluster.bootstrap, topic, partitions=1, replicas=3)

    def partition() -> tuple[int, tuple[int, ...]]:
        """Partition 0's leader (-1: none) and in-sync replicas, as a running node sees them."""
        error, partitions = kafka_cluster.metadata([topic]).topics[topic]
        if error or 0 not in partitions:
            return -1, ()
        return partitions[0].leader, partitions[0].isr

    def isr() -> tuple[int, ...]:
        return partition()[1]

    poll_until_sync(lambda: len(isr()) == 3, "three in-sync replicas", within=CLIENT_TIMEOUT)
    assert produce(kafka_cluster.bootstrap, topic, [b"first"]) == [None]
    killed = kafka_cluster.kill_leader(topic, 0)
    try:
        poll_until_sync(lambda: partition()[0] not in (-1, killed.node_id)
                        and killed.node_id not in isr(),
                        "a new leader, without the killed node in the ISR", within=CLIENT_TIMEOUT)
        assert produce(kafka_cluster.bootstrap, topic, [b"second"]) == [None]
        values = [record.value() for record in consume(kafka_cluster.bootstrap, topic, 2)]
        assert values == [b"first", b"second"]
    finally:
        killed.start()
    poll_until_sync(lambda: killed.node_id in isr(), "the restarted node back in the ISR",
                    within=CLIENT_TIMEOUT)
    kafka_cluster.wait_until_serving()
