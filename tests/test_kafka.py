"""The Kafka adapter's own behaviour on a real broker (the ``kafka_broker`` fixture), beyond the
shipped suite: records other producers write, what a restart resumes from, the ordering modes,
settings, backpressure, the figures another process reads, and the missing extra."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

confluent_kafka = pytest.importorskip("confluent_kafka",
                                      reason='the Kafka tests need "reliable-sub[kafka]"')

from reliable_sub import ConfigurationError, UnknownSubscriptionError  # noqa: E402
from reliable_sub.adapters.kafka import KafkaAdapter  # noqa: E402
from reliable_sub.message import Delivery  # noqa: E402
from reliable_sub.testing.cleanup import delete_kafka_names  # noqa: E402
from tests.kafka_processes import KafkaBroker  # noqa: E402

# Seconds a test waits for what should come at once on loopback.
WITHIN = 20.0


class World:
    """A run's names and adapters on the test broker, deleted afterwards."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.prefix = f"kt-{uuid.uuid4().hex[:8]}"
        self.names: list[str] = [f"{self.prefix}-subscriptions", f"{self.prefix}-snapshots"]
        self.adapters: list[KafkaAdapter] = []

    def name(self, kind: str) -> str:
        name = f"{self.prefix}-{kind}-{len(self.names)}"
        self.names.append(name)
        return name

    def adapter(self, **options: Any) -> KafkaAdapter:
        options.setdefault("partitions", 1)
        options.setdefault("consumer_config", {"heartbeat.interval.ms": 100,
                                               "session.timeout.ms": 6000})
        adapter = KafkaAdapter(self.bootstrap, prefix=self.prefix, **options)
        self.adapters.append(adapter)
        return adapter

    def raw_producer(self) -> Any:
        return confluent_kafka.Producer({"bootstrap.servers": self.bootstrap})


@pytest_asyncio.fixture
async def world(kafka_broker: KafkaBroker) -> AsyncIterator[World]:
    made = World(kafka_broker.bootstrap)
    try:
        yield made
    finally:
        for adapter in made.adapters:
            await adapter.close()
        await delete_kafka_names(made.bootstrap, made.names)


async def receive_count(adapter: KafkaAdapter, subscription: str, count: int,
                        within: float = WITHIN) -> list[Delivery]:
    got: list[Delivery] = []
    give_up = time.monotonic() + within
    while len(got) < count and time.monotonic() < give_up:
        got += await adapter.receive(subscription, 100, 0.2)
    return got


def produce_raw(world: World, topic: str, records: list[dict[str, Any]]) -> None:
    producer = world.raw_producer()
    for record in records:
        producer.produce(topic, **record)
    assert producer.flush(WITHIN) == 0


# -- records from other producers ---------------------------------------------------------------


async def test_foreign_records_are_read_whatever_their_headers_keys_and_values(
        world: World) -> None:
    adapter = world.adapter()
    topic, sub = world.name("topic"), world.name("sub")
    await adapter.ensure_subscription(topic, sub, ack_deadline=5)
    produce_raw(world, topic, [
        {"value": b"repeated", "headers": [("h", b"first"), ("h", b"last"), ("n", None),
                                           ("bin", b"\xff\xfe\x00")]},
        {"value": b"binary key", "key": b"\xff\x00key"},
        {"value": None, "key": b"deleted-id"},  # a tombstone
        {"value": b"bare"},
        {"value": b"bad ours", "headers": [("reliable-sub-attributes", b"{not json")]},
        {"value": b"nested ours",
         "headers": [("reliable-sub-attributes", json.dumps({"a": {"b": "c"}}).encode())]},
    ])
    got = {d.message.data: d for d in await receive_count(adapter, sub, 6)}
    assert len(got) == 6
    repeated = got[b"repeated"].message
    assert repeated.attributes == {"h": "last", "n": "", "bin": "//4A"}
    assert got[b"binary key"].message.ordering_key == "base64:/wBrZXk="
    tombstone = got[b""].message
    assert (tombstone.ordering_key, tombstone.attributes) == ("deleted-id", {})
    bare = got[b"bare"]
    assert (bare.message.ordering_key, bare.message.attributes, bare.malformed) == (None, {}, None)
    assert "reliable-sub-attributes header: not JSON" in (got[b"bad ours"].malformed or "")
    assert "nested" in (got[b"nested ours"].malformed or "")
    for delivery in got.values():
        topic_of, partition, offset = delivery.message.id.split("/")
        assert (topic_of, partition) == (topic, "0") and offset.isdigit()
        assert delivery.message.publish_time is not None
    assert await adapter.ack(list(got.values())) == []


async def test_attributes_that_cannot_be_headers_travel_packed_and_come_back(
        world: World) -> None:
    adapter = world.adapter()
    topic, sub = world.name("topic"), world.name("sub")
    await adapter.ensure_subscription(topic, sub, ack_deadline=5)
    odd = {"nul\x00name": "v", "surrogate": "\ud800", "reliable-sub-attributes": "mine"}
    await adapter.publish(topic, b"odd", odd)
    [delivery] = await receive_count(adapter, sub, 1)
    assert delivery.message.attributes == odd
    await adapter.ack([delivery])


# -- commits --------------------------------------------------------------------------------------


async def test_a_restart_skips_what_was_acked_and_counts_deliveries_on(world: World) -> None:
    """Acked out of order: the commit stays below the first unacked record, and its metadata
    lets the next consumer skip the acked ones above it and count on from the deliveries
    made."""
    first = world.adapter()
    topic, sub = world.name("topic"), world.name("sub")
    await first.ensure_subscription(topic, sub, ack_deadline=30)
    ids = [await first.publish(topic, f"m{i}".encode()) for i in range(6)]
    taken = await receive_count(first, sub, 6)
    assert [d.message.id for d in taken] == ids
    assert await first.ack([taken[1], taken[3], taken[4]]) == []
    await first.close()  # commits and leaves the group; m0, m2, m5 were never settled

    second = world.adapter()
    again = await receive_count(second, sub, 3)
    assert [d.message.data for d in again] == [b"m0", b"m2", b"m5"]
    assert [d.message.delivery_attempt for d in again] == [2, 2, 2]
    assert await second.receive(sub, 100, 0.5) == []
    await second.ack(again)
    observer = world.adapter()  # a fresh adapter: the group's view, once the commit is in
    give_up = time.monotonic() + WITHIN  # an ack is committed a moment later (commit_interval)
    while (stats := await observer.subscription_stats(sub)).backlog != 0:
        assert time.monotonic() < give_up, f"the commit never came: {stats}"
        await asyncio.sleep(0.05)
    assert stats.in_flight == 0


async def test_the_figures_of_another_process_come_from_the_commit_metadata(
        world: World) -> None:
    consumer = world.adapter()
    topic, sub = world.name("topic"), world.name("sub")
    await consumer.ensure_subscription(topic, sub, ack_deadline=30)
    for i in range(5):
        await consumer.publish(topic, f"m{i}".encode())
    taken = await receive_count(consumer, sub, 5)
    await consumer.ack([taken[0], taken[2], taken[3]])
    assert (await consumer.subscription_stats(sub)).backlog == 2
    observer = world.adapter()
    give_up = time.monotonic() + WITHIN
    while (stats := await observer.subscription_stats(sub)).backlog != 2:
        assert time.monotonic() < give_up, f"the commit never came: {stats}"
        await asyncio.sleep(0.05)
    assert (stats.in_flight, stats.oldest_unacked_age) == (None, None), "not this one's to tell"


# -- ordering ---------------------------------------------------------------------------------


async def test_partition_order_hands_out_one_record_at_a_time(world: World) -> None:
    adapter = world.adapter()
    topic, sub = world.name("topic"), world.name("sub")
    await adapter.ensure_subscription(topic, sub, ack_deadline=5, ordering="partition")
    for key in "ABC":
        await adapter.publish(topic, key.encode(), ordering_key=key)
    seen = []
    for _ in range(3):
        [delivery] = await receive_count(adapter, sub, 1)
        assert await adapter.receive(sub, 100, 0.2) == [], "a second one while one is out"
        seen.append(delivery.message.ordering_key)
        await adapter.ack([delivery])
    assert seen == ["A", "B", "C"]


async def test_no_order_leaves_messages_without_an_ordering_key(world: World) -> None:
    adapter = world.adapter()
    topic, sub = world.name("topic"), world.name("sub")
    await adapter.ensure_subscription(topic, sub, ack_deadline=5, ordering=False)
    await adapter.publish(topic, b"x", ordering_key="A")
    [delivery] = await receive_count(adapter, sub, 1)
    assert delivery.message.ordering_key is None
    await adapter.ack([delivery])


# -- settings, names, backpressure -----------------------------------------------------------


async def test_settings_are_recorded_once_and_read_by_a_fresh_adapter(world: World) -> None:
    adapter = world.adapter()
    topic, other, sub = world.name("topic"), world.name("topic"), world.name("sub")
    await adapter.ensure_subscription(topic, sub, ack_deadline=7, ordering="partition")
    await adapter.ensure_subscription(topic, sub, ack_deadline=9)  # kept: the first settings
    fresh = world.adapter()
    assert await fresh.subscription_topic(sub) == topic
    assert await fresh.subscription_ack_deadline(sub) == 7.0
    with pytest.raises(ConfigurationError, match=f"already exists on topic '{topic}'"):
        await fresh.ensure_subscription(other, sub)
    with pytest.raises(UnknownSubscriptionError, match="create it with ensure_subscription"):
        await fresh.subscription_topic(world.name("sub"))


@pytest.mark.parametrize("bad", [{"ordering": "keys"}, {"start": "now"}, {"ack_deadline": 0},
                                 {"colour": "blue"}])
async def test_bad_subscription_options_are_refused_by_name(world: World,
                                                             bad: dict[str, Any]) -> None:
    adapter = world.adapter()
    with pytest.raises(ConfigurationError, match=next(iter(bad))):
        await adapter.ensure_subscription(world.name("topic"), world.name("sub"), **bad)
    with pytest.raises(ConfigurationError, match="letters, digits"):
        await adapter.ensure_topic("not/a/topic")


def test_librdkafka_prefetches_as_deep_as_the_buffer_unless_told_otherwise() -> None:
    assert KafkaAdapter(buffer=300)._consumer_config["queued.min.messages"] == 300
    assert KafkaAdapter()._consumer_config["queued.min.messages"] == 10_000
    told = KafkaAdapter(buffer=300, consumer_config={"queued.min.messages": 7})
    assert told._consumer_config["queued.min.messages"] == 7


async def test_a_slow_receiver_pauses_partitions_and_loses_nothing(world: World) -> None:
    adapter = world.adapter(buffer=20)
    topic, sub = world.name("topic"), world.name("sub")
    await adapter.ensure_subscription(topic, sub, ack_deadline=30)
    produce_raw(world, topic, [{"value": f"m{i}".encode()} for i in range(300)])
    [first] = await adapter.receive(sub, 1, WITHIN)
    consumer = adapter._consumers.all_of(sub)[0]
    give_up = time.monotonic() + WITHIN
    while not consumer._paused:
        assert time.monotonic() < give_up, "the partition was never paused"
        await asyncio.sleep(0.01)
    got = [first, *await receive_count(adapter, sub, 299)]
    assert sorted(int(d.message.data[1:]) for d in got) == list(range(300))
    give_up = time.monotonic() + WITHIN
    while consumer._paused:  # the poll thread resumes it between two polls
        assert time.monotonic() < give_up, "never resumed once drained"
        await asyncio.sleep(0.01)
    await adapter.ack(got)


# -- packaging --------------------------------------------------------------------------------


def test_importing_without_confluent_kafka_names_the_extra() -> None:
    script = (
        "import sys; sys.modules['confluent_kafka'] = None\n"
        "try:\n"
        "    import reliable_sub.adapters.kafka\n"
        "except ImportError as error:\n"
        "    print(type(error).__name__, error)\n"
        "else:\n"
        "    print('imported without confluent_kafka')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("MissingExtraError "), result.stdout + result.stderr
    assert 'pip install "reliable-sub[kafka]"' in result.stdout, result.stdout + result.stderr
