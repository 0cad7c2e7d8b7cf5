"""AMQP message properties as attributes (#44 item 12), on the shared RabbitMQ broker.

``correlation_id``, ``reply_to``, ``type``, ``app_id``, ``priority``, ``content_encoding``,
``user_id`` and ``expiration`` reached neither a handler's attributes nor a dead-letter copy: a
FastStream or aio-pika publisher's correlation id was gone from the only copy of a dead letter,
and a replay went out without it. They are attributes now (the property's name with ``-`` for
``_``, as ``content_type`` has always been ``content-type``), and publishing an attribute of such
a name sets the property, so an aio-pika or FastStream consumer reads it where it looks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from reliable_sub import DeadLetterPolicy, Message, Outcome, Reject
from reliable_sub.dead_letters import DeadLetterQueue
from reliable_sub.testing.harness import Harness, rabbitmq_harness
from reliable_sub.testing.services import rabbitmq_url

aio_pika = pytest.importorskip("aio_pika")

WITHIN = 20.0
EXPIRATION = 60.0  # seconds: aio-pika sends "60000" (milliseconds, as AMQP has it)
# What a handler sees of an aio-pika message with every property set (FOREIGN below).
FOREIGN_ATTRIBUTES = {
    "tenant": "t-1", "content-type": "application/json", "content-encoding": "utf-8",
    "correlation-id": "corr-1", "reply-to": "replies", "type": "order.created",
    "app-id": "shop", "priority": "5", "user-id": "guest", "expiration": "60000",
}
# The properties a publish sets from attributes; user_id and expiration are read only.
WRITTEN = {"content_type": "application/json", "content_encoding": "utf-8",
           "correlation_id": "corr-1", "reply_to": "replies", "type": "order.created",
           "app_id": "shop", "priority": 5}


def foreign(**properties: Any) -> Any:
    """An aio-pika message as another service publishes it (``user_id`` must be the
    connection's user: RabbitMQ refuses any other)."""
    fields = {"correlation_id": "corr-1", "reply_to": "replies", "type": "order.created",
              "app_id": "shop", "priority": 5, "user_id": "guest", "expiration": EXPIRATION,
              "content_type": "application/json", "content_encoding": "utf-8",
              "headers": {"tenant": "t-1"}, **properties}
    return aio_pika.Message(b'{"order": 1}', **fields)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    made = rabbitmq_harness(rabbitmq_url())
    try:
        yield made
    finally:
        await made.close()


class Amqp:
    """A plain aio-pika connection: publishes as another service would, and reads a topic
    through a queue of its own, as an aio-pika or FastStream consumer would."""

    def __init__(self, connection: Any, channel: Any) -> None:
        self.connection, self.channel = connection, channel

    async def publish(self, topic: str, message: Any) -> None:
        exchange = await self.channel.get_exchange(topic)
        await exchange.publish(message, routing_key="")

    async def tap(self, topic: str) -> Any:
        queue = await self.channel.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind(topic)
        return queue


@pytest.fixture
async def amqp() -> AsyncIterator[Amqp]:
    connection = await aio_pika.connect(rabbitmq_url())
    try:
        yield Amqp(connection, await connection.channel())
    finally:
        await connection.close()


async def get_one(queue: Any) -> Any:
    message = await queue.get(timeout=5, fail=False)
    for _ in range(50):
        if message is not None:
            return message
        message = await queue.get(timeout=5, fail=False)
    raise AssertionError(f"nothing arrived in {queue.name}")


def properties_of(raw: Any) -> dict[str, Any]:
    return {name: getattr(raw, name) for name in WRITTEN}


async def test_foreign_properties_reach_the_handler_the_dead_letter_and_the_replay(
    harness: Harness, amqp: Amqp,
) -> None:
    adapter: Any = await harness.adapter()
    topic, subscription = await harness.topic_and_subscription()
    dlq_topic, dlq_subscription = await harness.topic_and_subscription()
    await amqp.publish(topic, foreign())
    handled: list[Message] = []
    subscriber = harness.subscriber(adapter, dead_letter=DeadLetterPolicy(dlq_topic, 2))

    @subscriber.handler(subscription)
    async def handle(message: Message) -> None:
        handled.append(message)
        raise Reject("refused")

    async with harness.serving(subscriber):
        await harness.wait_until(lambda: subscriber.stats[Outcome.DEAD_LETTERED] == 1, WITHIN,
                                 "the message dead-lettered")
    assert [m.attributes for m in handled] == [FOREIGN_ATTRIBUTES]
    queue = DeadLetterQueue(adapter, dlq_subscription, wait=0.3)
    [letter] = await queue.peek()
    assert letter.attributes == FOREIGN_ATTRIBUTES, "the dead letter lost the properties"

    tap = await amqp.tap(topic)  # a consumer of the topic that reads properties natively
    report = await queue.replay([letter.id])
    assert report.replayed == [letter.id]
    replayed = await get_one(tap)
    assert properties_of(replayed) == WRITTEN
    assert replayed.expiration is None, "a replay must not expire where the original did not"
    assert replayed.user_id is None


async def test_a_delayed_redelivery_keeps_the_properties(harness: Harness, amqp: Amqp) -> None:
    adapter: Any = await harness.adapter()
    topic, subscription = await harness.topic_and_subscription()
    await amqp.publish(topic, foreign())
    [first] = await harness.receive_count(adapter, subscription, 1)
    await adapter.nack([first], 0.1)
    [again] = await harness.receive_count(adapter, subscription, 1)
    assert again.message.delivery_attempt == 2
    assert again.message.attributes == FOREIGN_ATTRIBUTES
    await adapter.ack([again])


async def test_publishing_such_attributes_sets_the_native_properties(
    harness: Harness, amqp: Amqp,
) -> None:
    adapter: Any = await harness.adapter()
    topic, subscription = await harness.topic_and_subscription()
    tap = await amqp.tap(topic)
    attributes = {"correlation-id": "c-2", "reply-to": "r", "type": "t", "app-id": "a",
                  "priority": "7", "content-encoding": "gzip", "content-type": "text/plain",
                  "user-id": "someone", "expiration": "1"}
    await adapter.publish(topic, b"x", attributes)
    raw = await get_one(tap)
    assert properties_of(raw) == {
        "content_type": "text/plain", "content_encoding": "gzip", "correlation_id": "c-2",
        "reply_to": "r", "type": "t", "app_id": "a", "priority": 7}
    assert (raw.user_id, raw.expiration) == (None, None), "read-only: never sent as properties"
    [delivery] = await harness.receive_count(adapter, subscription, 1)
    assert delivery.message.attributes == attributes, "not the attributes published"
    await adapter.ack([delivery])


@pytest.mark.parametrize("attributes", [
    {"priority": "high"}, {"priority": "05"}, {"priority": "256"},
    {"correlation-id": "c" * 300}, {"reply-to": ""},
])
async def test_a_value_the_property_cannot_carry_travels_as_a_header_only(
    harness: Harness, amqp: Amqp, attributes: dict[str, str],
) -> None:
    adapter: Any = await harness.adapter()
    topic, subscription = await harness.topic_and_subscription()
    tap = await amqp.tap(topic)
    await adapter.publish(topic, b"x", attributes)
    raw = await get_one(tap)
    assert (raw.priority, raw.correlation_id, raw.reply_to) == (0, None, None)
    [delivery] = await harness.receive_count(adapter, subscription, 1)
    assert delivery.message.attributes == attributes
    await adapter.ack([delivery])


async def test_the_property_wins_over_a_header_of_the_same_name(
    harness: Harness, amqp: Amqp,
) -> None:
    """What every AMQP client reads as the correlation id is the property."""
    adapter: Any = await harness.adapter()
    topic, subscription = await harness.topic_and_subscription()
    await amqp.publish(topic, aio_pika.Message(
        b"x", correlation_id="from-property", headers={"correlation-id": "from-header"}))
    [delivery] = await harness.receive_count(adapter, subscription, 1)
    assert delivery.message.attributes == {"correlation-id": "from-property"}
    await adapter.ack([delivery])


async def test_a_faststream_correlation_id_reaches_the_handler(harness: Harness) -> None:
    from faststream.rabbit import ExchangeType, RabbitBroker, RabbitExchange

    adapter: Any = await harness.adapter()
    topic, subscription = await harness.topic_and_subscription()
    broker = RabbitBroker(rabbitmq_url())
    await broker.connect()
    try:
        await broker.publish({"order": 3}, exchange=RabbitExchange(
            topic, type=ExchangeType.FANOUT, declare=False), correlation_id="corr-3")
    finally:
        await broker.stop()
    [delivery] = await harness.receive_count(adapter, subscription, 1)
    assert delivery.message.attributes["correlation-id"] == "corr-3"
    assert delivery.message.attributes["content-type"] == "application/json"
    await adapter.ack([delivery])
