"""The RabbitMQ adapter beyond the shipped suite (#29): messages from other AMQP publishers,
the delay queues, the prefetch a Subscriber sets."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from decimal import Decimal
from typing import Any

import pytest

from reliable_sub import FlowControl, Message, Outcome, Subscriber
from reliable_sub.clock import SystemClock
from reliable_sub.errors import InvalidMessageError
from reliable_sub.testing.services import rabbitmq_url
from reliable_sub.testing.timing import drive_until

WITHIN = 20.0

aio_pika = pytest.importorskip("aio_pika")
from pamqp.commands import Basic  # noqa: E402

from reliable_sub.adapters._rabbitmq_topology import delay_bucket  # noqa: E402
from reliable_sub.adapters.rabbitmq import RabbitMQAdapter  # noqa: E402


class Names:
    """Names of one test's own, and their removal at the end."""

    def __init__(self) -> None:
        self.prefix = f"rmq-{uuid.uuid4().hex[:8]}"
        self.queues: list[str] = []
        self.exchanges: list[str] = []

    def topic(self, name: str) -> str:
        self.exchanges.append(f"{self.prefix}-{name}")
        return self.exchanges[-1]

    def subscription(self, name: str) -> str:
        queue = f"{self.prefix}-{name}"
        self.queues += [queue, f"{self.prefix}.settings.{queue}"]
        return queue

    async def remove(self, url: str) -> None:
        connection = await aio_pika.connect(url)
        try:
            channel = await connection.channel()
            for queue in self.queues:
                await channel.queue_delete(queue)
            for exchange in self.exchanges:
                await channel.exchange_delete(exchange)
        finally:
            await connection.close()


@pytest.fixture
async def names() -> AsyncIterator[Names]:
    made = Names()
    yield made
    await made.remove(rabbitmq_url())


async def serve_until(sub: Subscriber, until: Any, what: str) -> None:
    task = asyncio.ensure_future(sub.serve())
    try:
        await drive_until(SystemClock(), until, WITHIN, what=what)
    finally:
        await sub.shutdown(timeout=5)
        await task


async def test_headers_of_every_amqp_type_from_another_publisher_become_text(
        names: Names) -> None:
    url = rabbitmq_url()
    adapter = RabbitMQAdapter(url, prefix=names.prefix)
    topic, queue = names.topic("orders"), names.subscription("billing")
    await adapter.ensure_subscription(topic, queue, ack_deadline=10)
    connection = await aio_pika.connect(url)
    try:  # a foreign client: headers of every type, a body that is not UTF-8
        channel = await connection.channel()
        exchange = await channel.get_exchange(topic)
        headers = {
            "text": "plain", "flag": True, "small": 7, "big": 2**40, "ratio": 0.25,
            "money": Decimal("12.50"), "when": datetime(2026, 11, 27, 12, 0, 0),
            "raw": bytearray(b"\xff\xfe"), "utf8": bytearray("é".encode()), "nothing": None,
            "table": {"a": 1, "b": [True, "x"]}, "array": [1, "two", 3.0],
            "x-request-id": "req-1",
        }
        amqp = await channel.get_underlay_channel()
        for _ in range(2):
            await amqp.basic_publish(b"\xff\x00 binary", exchange=exchange.name,
                                     routing_key="",
                                     properties=Basic.Properties(headers=headers))
    finally:
        await connection.close()
    seen: list[Message] = []
    sub = Subscriber(adapter, receive_timeout=0.2)
    sub.handler(queue)(seen.append)
    await serve_until(sub, lambda: sub.stats[Outcome.ACKED] + sub.stats[Outcome.DUPLICATE] == 2,
                      "the two foreign messages")
    await adapter.close()
    first = seen[0]
    assert first.data == b"\xff\x00 binary"
    assert first.attributes == {
        "text": "plain", "flag": "True", "small": "7", "big": str(2**40), "ratio": "0.25",
        "money": "12.50", "when": first.attributes["when"], "raw": "//4=", "utf8": "é",
        "nothing": "", "table": '{"a":1,"b":[true,"x"]}', "array": '[1,"two",3.0]',
        "x-request-id": "req-1",
    }
    assert first.attributes["when"].startswith("2026-11-27T12:00:00")


def test_a_message_without_message_id_gets_a_digest_of_itself() -> None:
    """aiormq always sets a message_id, other clients need not: such a message is named by a
    digest of its body and properties (RabbitMQ's own headers left out)."""
    from types import SimpleNamespace

    from reliable_sub.adapters._rabbitmq_messages import message_id

    def raw(body: bytes, **headers: Any) -> Any:
        return SimpleNamespace(message_id=None, body=body, headers=headers, correlation_id=None,
                               timestamp=None, app_id="billing", type=None, reply_to=None,
                               content_type=None)

    one = message_id(raw(b"x", k="v"))
    assert one.startswith("sha256:")
    assert message_id(raw(b"x", k="v", **{"x-delivery-count": 3})) == one, "redelivered: same"
    assert message_id(raw(b"y", k="v")) != one
    assert message_id(raw(b"x", k="w")) != one


async def test_an_ordering_key_that_is_not_unicode_is_refused_at_publish(
        names: Names) -> None:
    adapter = RabbitMQAdapter(rabbitmq_url(), prefix=names.prefix)
    topic = names.topic("orders")
    await adapter.ensure_topic(topic)
    with pytest.raises(InvalidMessageError, match="ordering key"):
        await adapter.publish(topic, b"x", ordering_key="k-\ud800")
    assert isinstance(await adapter.publish(topic, b"x", ordering_key="k-1"), str)
    await adapter.close()


def test_a_delay_is_rounded_up_by_at_most_the_square_root_of_two() -> None:
    for delay in (0.0, 0.05, 0.1, 0.101, 0.3, 1.0, 7.7, 60.0, 3600.0, 86_400.0):
        millis = delay_bucket(delay)
        assert millis >= delay * 1000
        assert millis <= max(100, delay * 1000 * 2**0.5 + 1)
    assert len({delay_bucket(d / 10) for d in range(1, 36_000)}) <= 30, "few queues per hour"


async def test_a_delayed_copy_comes_back_with_its_count_and_takes_no_prefetch(
        names: Names) -> None:
    """nack(delay) moves the message to a delay queue: the channel's prefetch (1 here) is free
    for the next message meanwhile; the copy returns as the next attempt, same id."""
    adapter = RabbitMQAdapter(rabbitmq_url(), prefix=names.prefix)
    topic, queue = names.topic("orders"), names.subscription("billing")
    await adapter.ensure_subscription(topic, queue, ack_deadline=10)
    adapter.set_prefetch(queue, 1)
    first_id = await adapter.publish(topic, b"first", {"k": "v"})
    await adapter.publish(topic, b"second")
    [first] = await adapter.receive(queue, 10, 5.0)
    assert first.message.data == b"first"
    await adapter.nack([first], 1.0)
    [second] = await adapter.receive(queue, 10, 5.0)
    assert second.message.data == b"second", "the delayed one holds no prefetch"
    await adapter.ack([second])
    loop = asyncio.get_running_loop()
    began = loop.time()
    [again] = await adapter.receive(queue, 10, 5.0)
    assert (again.message.id, again.message.data, again.message.attributes) == (
        first_id, b"first", {"k": "v"})
    assert again.message.delivery_attempt == 2
    assert await adapter.ack([first]) == [first], "the delayed delivery's ack id is stale"
    await adapter.ack([again])
    assert loop.time() - began <= 5.0
    names.queues.append(f"{names.prefix}.delay.{queue}.{delay_bucket(1.0)}")
    await adapter.close()


async def test_a_delay_queue_deleted_behind_the_adapters_back_is_declared_again(
        names: Names, caplog: pytest.LogCaptureFixture) -> None:
    """A delay queue deleted behind the adapter's back (an operator's clean-up): the broker
    routes the copy nowhere and confirms it all the same. Acking the delivery then would lose
    the message; the adapter declares the queue again and the copy goes into it."""
    url = rabbitmq_url()
    adapter = RabbitMQAdapter(url, prefix=names.prefix)
    topic, queue = names.topic("orders"), names.subscription("billing")
    delay_queue = f"{names.prefix}.delay.{queue}.{delay_bucket(0.1)}"
    names.queues.append(delay_queue)
    await adapter.ensure_subscription(topic, queue, ack_deadline=10)
    message_id = await adapter.publish(topic, b"first")
    [first] = await adapter.receive(queue, 10, 5.0)
    await adapter.nack([first], 0.1)  # declares the delay queue, and remembers it
    [second] = await adapter.receive(queue, 10, 5.0)
    assert (second.message.id, second.message.delivery_attempt) == (message_id, 2)
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        await channel.queue_delete(delay_queue)
        await adapter.nack([second], 0.1)
        third = await adapter.receive(queue, 10, 5.0)
        assert third, "the delivery was acked with its copy routed nowhere: lost"
        assert (third[0].message.id, third[0].message.delivery_attempt) == (message_id, 3)
        await channel.declare_queue(delay_queue, passive=True)  # declared again (or raises)
    finally:
        await connection.close()
    assert await adapter.ack(third) == []
    assert "does not exist (any more): 1 copies routed nowhere; declaring it again" in (
        caplog.text)
    await adapter.close()


async def test_a_copy_that_cannot_be_routed_at_all_goes_back_at_once(
        names: Names, caplog: pytest.LogCaptureFixture) -> None:
    """The delay queue gone even when declared again (here: a name the broker never has):
    the delivery is given back at once, not acked. With a 60 s delay, getting it back within
    seconds tells it was given back, not held back."""
    adapter = RabbitMQAdapter(rabbitmq_url(), prefix=names.prefix)
    topic, queue = names.topic("orders"), names.subscription("billing")
    await adapter.ensure_subscription(topic, queue, ack_deadline=10)

    async def nowhere(subscription: str, delay: float, known: set[str]) -> str:
        return f"{names.prefix}.nowhere"

    adapter._topology.delay_queue = nowhere  # type: ignore[method-assign]
    message_id = await adapter.publish(topic, b"first")
    [first] = await adapter.receive(queue, 10, 5.0)
    await adapter.nack([first], 60.0)
    again = await adapter.receive(queue, 10, 5.0)
    assert again, "the delivery was acked with its copy routed nowhere: lost"
    assert (again[0].message.id, again[0].message.delivery_attempt) == (message_id, 2)
    assert await adapter.ack(again) == []
    assert "1 copies routed nowhere; given back at once" in caplog.text
    await adapter.close()


async def test_copies_of_one_message_for_two_delay_queues_keep_their_own_results(
        names: Names) -> None:
    """aiormq matches a returned message to its publish by message id, and a delayed copy keeps
    its message's id. One message on two subscriptions, nacked on both at once, the first's
    delay queue deleted: its copy's return must not be taken for the second's (one delivery
    acked with its copy nowhere, or the other's copy published twice)."""
    url = rabbitmq_url()
    adapter = RabbitMQAdapter(url, prefix=names.prefix)
    topic = names.topic("orders")
    first, second = names.subscription("billing"), names.subscription("audit")
    for queue in (first, second):
        await adapter.ensure_subscription(topic, queue, ack_deadline=10)
        names.queues.append(f"{names.prefix}.delay.{queue}.{delay_bucket(0.1)}")
    message_id = await adapter.publish(topic, b"order")
    for queue in (first, second):  # each delay queue declared, and remembered
        [delivery] = await adapter.receive(queue, 10, 5.0)
        await adapter.nack([delivery], 0.1)
    [on_first] = await adapter.receive(first, 10, 5.0)
    [on_second] = await adapter.receive(second, 10, 5.0)
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        await channel.queue_delete(f"{names.prefix}.delay.{first}.{delay_bucket(0.1)}")
    finally:
        await connection.close()
    # the first's copy goes out first, the second's right after, both unconfirmed at once
    await asyncio.gather(adapter.nack([on_first], 0.1), adapter.nack([on_second], 0.1))
    for queue in (first, second):
        back = await adapter.receive(queue, 10, 5.0)
        assert [(d.message.id, d.message.delivery_attempt) for d in back] == [
            (message_id, 3)], queue
        assert await adapter.ack(back) == []
    assert await adapter.receive(second, 10, 1.0) == [], "the second's delivery came twice"
    await adapter.close()


async def test_a_subscriber_sets_the_prefetch_to_its_flow_control_window(
        names: Names) -> None:
    adapter = RabbitMQAdapter(rabbitmq_url(), prefix=names.prefix, prefetch=500)
    topic, queue = names.topic("orders"), names.subscription("billing")
    await adapter.ensure_subscription(topic, queue, ack_deadline=10)
    sub = Subscriber(adapter, flow_control=FlowControl(max_messages=3), receive_timeout=0.2)
    sub.handler(queue)(lambda message: None)
    await adapter.publish(topic, b"x")
    await serve_until(sub, lambda: sub.stats[Outcome.ACKED] == 1, "the message")
    assert adapter._prefetch == {queue: 3}
    await adapter.close()


async def test_a_lease_that_may_outlast_the_consumer_timeout_is_warned_about(
        names: Names, caplog: pytest.LogCaptureFixture) -> None:
    """RabbitMQ closes the channel of a delivery unacked past consumer_timeout (30 min). The
    default max_lease_duration (1 h) is fitted under it, quietly (every RabbitMQ Subscriber
    warned at start with default settings, #44); a user's own value past it is warned about."""
    from reliable_sub import LeasePolicy

    adapter = RabbitMQAdapter(rabbitmq_url(), prefix=names.prefix)
    topic, queue = names.topic("orders"), names.subscription("billing")
    await adapter.ensure_subscription(topic, queue, ack_deadline=10)
    assert adapter.capabilities.max_lease_duration == 1800.0
    for lease, warned, used in ((None, False, 1440.0),
                                (LeasePolicy(min_extension=5), False, 1440.0),
                                (LeasePolicy(max_lease_duration=3600), True, 3600.0),
                                (LeasePolicy(max_lease_duration=1200), False, 1200.0)):
        caplog.clear()
        sub = Subscriber(adapter, lease=lease, receive_timeout=0.2)
        sub.handler(queue)(lambda message: None)
        await adapter.publish(topic, b"x")
        await serve_until(sub, lambda s=sub: s.stats[Outcome.ACKED] == 1, "the message")
        found = [r.getMessage() for r in caplog.records if "consumer_timeout" in r.getMessage()]
        assert bool(found) is warned, (lease, found)
        if warned:
            assert "max_lease_duration=3600s" in found[0] and "1800s" in found[0]
        [route] = sub._routes.values()
        assert route.lease.max_lease_duration == used, lease
    await adapter.close()


async def test_acks_close_together_share_one_frame_and_close_writes_them(names: Names) -> None:
    """Acks of one moment go out as one ``basic.ack multiple`` (the settler acks each settled
    batch: a few messages each); acks still waiting when the adapter closes are written first,
    not lost to a requeue."""
    url = rabbitmq_url()
    adapter = RabbitMQAdapter(url, prefix=names.prefix)
    topic, queue = names.topic("orders"), names.subscription("billing")
    await adapter.ensure_subscription(topic, queue, ack_deadline=10)
    for n in range(50):
        await adapter.publish(topic, b"%d" % n)
    taken: list[Any] = []
    while len(taken) < 50:
        taken += await adapter.receive(queue, 50, 5.0)
    consumer = adapter._links.get().consumers[queue]
    channel = await consumer.channel.get_underlay_channel()
    frames: list[tuple[int, bool]] = []
    original = channel.basic_ack

    async def counted(tag: int, multiple: bool = False) -> Any:
        frames.append((tag, multiple))
        return await original(tag, multiple=multiple)

    channel.basic_ack = counted  # type: ignore[method-assign]
    for start in range(0, 40, 8):  # five settled batches of eight
        assert await adapter.ack(taken[start:start + 8]) == []
    await consumer.flush_acks()
    assert frames == [(int(taken[39].ack_id.split(".")[1]), True)], "one frame for forty acks"
    assert await adapter.ack(taken[40:]) == []
    await adapter.close()  # the last ten's acks are waiting: written before the close
    assert len(frames) == 2
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        assert declared.declaration_result.message_count == 0, "every ack reached the broker"
    finally:
        await connection.close()
