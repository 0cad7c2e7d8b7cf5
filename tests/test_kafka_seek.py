"""Seek and snapshots on the Kafka adapter beyond the shipped suite (which seeks with the
adapter's own consumer owning every partition): a seek from outside a group with no member
(the operator's case: consumers stopped, ``reliable-sub seek`` run), what a snapshot keeps of
the records settled above the committed offset, and the refusal while a consumer elsewhere owns
partitions."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

pytest.importorskip("confluent_kafka", reason='the Kafka tests need "reliable-sub[kafka]"')

import tests.test_kafka as kafka_tests
from reliable_sub.adapters.kafka import KafkaAdapter, SeekRefusedError
from reliable_sub.message import Delivery
from tests.test_kafka import World, receive_count

world = kafka_tests.world  # the fixture: names and adapters on the test broker, deleted after


def data(deliveries: list[Delivery]) -> list[bytes]:
    return sorted(delivery.message.data for delivery in deliveries)


async def subscribed(world: World, partitions: int = 1) -> tuple[KafkaAdapter, str, str]:
    adapter = world.adapter(partitions=partitions)
    topic, sub = world.name("topic"), world.name("group")
    await adapter.ensure_subscription(topic, sub)
    return adapter, topic, sub


async def test_a_snapshot_from_outside_the_group_keeps_what_was_settled_above_its_offset(
        world: World) -> None:
    """Acked out of order (0 and 2 of 0-3), the group commits offset 1 and, in the metadata,
    2 settled: a snapshot taken by an adapter with no consumer reads that, and a seek to it
    while the group has no member (the consumers stopped) brings back 1 and 3, not 2."""
    first, topic, sub = await subscribed(world)
    for number in range(4):
        await first.publish(topic, f"m{number}".encode())
    got = sorted(await receive_count(first, sub, 4), key=lambda d: d.message.data)
    assert data(got) == [b"m0", b"m1", b"m2", b"m3"]
    assert await first.ack([got[0], got[2]]) == []
    await first.close()  # commits, leaves the group

    operator = world.adapter()
    snapshot = await operator.create_snapshot(sub, world.name("snap"))
    assert (snapshot.subscription, snapshot.topic) == (sub, topic)
    assert snapshot.created is not None

    second = world.adapter()
    rest = await receive_count(second, sub, 2)
    assert data(rest) == [b"m1", b"m3"]
    assert await second.ack(rest) == []
    await second.close()
    idle = world.adapter()
    assert await receive_count(idle, sub, 1, within=1.0) == []
    await idle.close()

    await operator.seek(sub, snapshot=snapshot.name)

    third = world.adapter()
    again = await receive_count(third, sub, 3, within=3.0)
    assert data(again) == [b"m1", b"m3"], "what was unacked at the snapshot comes back, only"
    await operator.delete_snapshot(snapshot.name)
    assert await operator.list_snapshots(sub) == []


async def test_a_seek_to_a_time_moves_each_partition_to_its_first_record_from_then(
        world: World) -> None:
    """Two partitions, records before and after a cut on one, only before on the other: the
    one comes back from the cut, the other stays at its end (a group with no member, moved
    from outside)."""
    adapter, topic, sub = await subscribed(world, partitions=2)
    producer = world.raw_producer()

    def produce(value: bytes, partition: int) -> None:
        producer.produce(topic, value, partition=partition)
        assert producer.flush(10) == 0

    for partition in (0, 1):
        produce(f"early-{partition}".encode(), partition)
    early = await receive_count(adapter, sub, 2)
    cut = max(d.message.publish_time for d in early if d.message.publish_time) + timedelta(
        milliseconds=1)
    while datetime.now(timezone.utc) <= cut:  # the next record is stamped after the cut
        pass
    produce(b"late", 0)
    late = await receive_count(adapter, sub, 1)
    assert await adapter.ack(early + late) == []
    await adapter.close()

    await world.adapter().seek(sub, to=cut)

    again = await receive_count(world.adapter(), sub, 2, within=3.0)
    assert data(again) == [b"late"]


async def test_a_seek_is_refused_while_a_consumer_elsewhere_owns_partitions(
        world: World) -> None:
    consumer, topic, sub = await subscribed(world)
    await consumer.publish(topic, b"held")
    assert len(await receive_count(consumer, sub, 1)) == 1

    with pytest.raises(SeekRefusedError, match=r"owned by consumers outside this adapter.*"
                                               r"stop those consumers"):
        await world.adapter().seek(sub, to=datetime.now(timezone.utc))

    assert await receive_count(consumer, sub, 1, within=0.5) == [], "nothing moved"
