"""RabbitMQ when the broker itself acts (#44): it cancels a consumer (its queue deleted), the
prefetch is more than a handler can take, and a memory alarm blocks publishing connections.

Each test counts what its handler saw, outside the adapter. The alarm is raised on a private
node (it blocks every publishing connection of a node), the others run on the shared one.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from reliable_sub import (
    DeadLetterPolicy,
    FlowControl,
    LeasePolicy,
    Message,
    Outcome,
    RetryPolicy,
    Subscriber,
)
from reliable_sub.clock import SystemClock
from reliable_sub.testing.services import rabbitmq_url
from reliable_sub.testing.timing import drive_until
from tests.rabbitmq_processes import RabbitNode

aio_pika = pytest.importorskip("aio_pika")

from reliable_sub.adapters.rabbitmq import RabbitMQAdapter  # noqa: E402
from tests.test_rabbitmq import Names, names  # noqa: E402, F401 (the fixture)

WITHIN = 30.0


async def until(predicate: object, what: str, within: float = WITHIN) -> None:
    await drive_until(SystemClock(), predicate, within, what=what)  # type: ignore[arg-type]


@pytest.fixture
async def serving() -> AsyncIterator[list[Subscriber]]:
    """Subscribers a test starts with ``serve``; shut down at its end."""
    started: list[Subscriber] = []
    tasks: list[asyncio.Task[None]] = []

    def serve(sub: Subscriber) -> None:
        started.append(sub)
        tasks.append(asyncio.ensure_future(sub.serve()))

    yield serve  # type: ignore[misc]
    for sub in started:
        await sub.shutdown(timeout=5)
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_consumer_the_broker_cancels_consumes_again_once_its_queue_is_back(
        names: Names, serving) -> None:  # noqa: F811
    """The queue deleted under a running Subscriber: the broker cancels its consumer. Every
    receive then fails (the queue is missing), healthy() says so, and once the queue is
    declared again the next publish is handled."""
    url = rabbitmq_url()
    adapter = RabbitMQAdapter(url, prefix=names.prefix)
    topic, queue = names.topic("orders"), names.subscription("billing")
    await adapter.ensure_subscription(topic, queue, ack_deadline=10)
    seen: list[bytes] = []
    sub = Subscriber(adapter, receive_timeout=0.2, unhealthy_after=1.0)
    sub.handler(queue)(lambda message: seen.append(message.data))
    serving(sub)
    await adapter.publish(topic, b"before")
    await until(lambda: seen == [b"before"], "the first message")

    connection = await aio_pika.connect(url)  # an operator deletes the queue
    try:
        await (await connection.channel()).queue_delete(queue)
    finally:
        await connection.close()
    await until(lambda: not sub.healthy(), "healthy() to tell the missing queue")
    assert adapter.stats["consumers_cancelled"] == 1
    assert any(f"receiving from {queue!r}" in problem and "does not exist" in problem
               for problem in sub.problems()), sub.problems()
    assert not adapter.consuming(queue)

    await adapter.ensure_subscription(topic, queue, ack_deadline=10)
    await adapter.publish(topic, b"after")
    await until(lambda: seen == [b"before", b"after"], "the message after the queue is back")
    await until(sub.healthy, "healthy again")
    assert adapter.consuming(queue)
    await adapter.close()


async def test_a_handler_that_takes_one_at_a_time_gets_every_message_at_its_first_attempt(
        names: Names, serving) -> None:  # noqa: F811
    """``max_concurrency=1`` and handlers longer than the ack deadline: the prefetch is what the
    handler can take, so nothing waits in the adapter's buffer to be given back (each give-back
    counted a delivery: first attempts arrived as 2, 3, 4..., and a delivery limit dropped
    messages no handler had seen)."""
    adapter = RabbitMQAdapter(rabbitmq_url(), prefix=names.prefix)
    topic, queue = names.topic("orders"), names.subscription("one-at-a-time")
    dlq_topic = names.topic("orders-dlq")
    await adapter.ensure_topic(dlq_topic)
    # the documented backstop: the broker's limit just above the Subscriber's attempts
    await adapter.ensure_subscription(topic, queue, ack_deadline=0.5, delivery_limit=3)
    await adapter.ensure_subscription(dlq_topic, names.subscription("dlq"), ack_deadline=10)
    attempts: dict[bytes, list[int]] = {}

    sub = Subscriber(adapter, receive_timeout=0.1,
                     dead_letter=DeadLetterPolicy(dlq_topic, max_delivery_attempts=2),
                     lease=LeasePolicy(min_extension=0.5))

    @sub.handler(queue, max_concurrency=1)
    async def slow(message: Message) -> None:
        attempts.setdefault(message.data, []).append(message.delivery_attempt)
        await asyncio.sleep(0.7)  # longer than the ack deadline: the lease keeps it

    payloads = [f"m{i}".encode() for i in range(6)]
    for payload in payloads:
        await adapter.publish(topic, payload)
    serving(sub)
    await until(lambda: sub.stats[Outcome.ACKED] == len(payloads), "every message acked")
    assert {payload: runs[0] for payload, runs in attempts.items()} == dict.fromkeys(payloads, 1)
    assert sub.stats[Outcome.DEAD_LETTERED] == 0
    await adapter.close()


@pytest.fixture(scope="module")
def alarm_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitNode]:
    """A private node whose memory alarm a test may raise (the shared node's would block the
    whole suite's publishers)."""
    node = RabbitNode(Path(tmp_path_factory.mktemp("rabbitmq-alarm")))
    try:
        node.start()
        yield node
    finally:
        node.kill()


async def test_a_memory_alarm_blocks_publishing_and_the_acks_go_on(
        alarm_node: RabbitNode, serving) -> None:
    """The broker blocks the connections that publish during a memory alarm. A handler's
    failure publishes a delayed copy (nack with a delay), which waits for the alarm to lift;
    the other deliveries are acked meanwhile (with a prefetch of 10, 60 messages pass only if
    acks reach the broker), and healthy() names the blocked connection."""
    adapter = RabbitMQAdapter(alarm_node.url, prefix="alarm")
    await adapter.ensure_subscription("orders", "billing", ack_deadline=10)
    runs: Counter[bytes] = Counter()

    sub = Subscriber(adapter, receive_timeout=0.1, flow_control=FlowControl(max_messages=10),
                     retry=RetryPolicy(min_backoff=0.2, max_backoff=0.2))

    @sub.handler("billing")
    def handle(message: Message) -> None:
        runs[message.data] += 1
        if message.data.endswith(b"0") and runs[message.data] == 1:
            raise ConnectionError("the payment API is down")  # once: a retry with a delay

    payloads = [f"m{i:02d}".encode() for i in range(60)]
    failing = {p for p in payloads if p.endswith(b"0")}
    for payload in payloads:
        await adapter.publish("orders", payload)
    alarm_node.ctl("set_vm_memory_high_watermark", "0.0000001")
    try:
        serving(sub)
        await until(lambda: set(runs) == set(payloads), "every message handled once")
        await until(lambda: sub.stats[Outcome.ACKED] == len(payloads) - len(failing),
                    "the acks of every message that did not fail")
        await until(lambda: not sub.healthy(), "healthy() to tell the blocked publishing")
        assert any("blocked the publishing connection" in p for p in sub.problems())
        assert sub.stats[Outcome.RETRY] == 0, "a delayed copy was confirmed during the alarm"
    finally:
        alarm_node.ctl("set_vm_memory_high_watermark", "0.4")
    await until(lambda: sub.stats[Outcome.ACKED] == len(payloads), "every message acked")
    await until(sub.healthy, "healthy once the alarm lifted")
    assert all(runs[p] == (2 if p in failing else 1) for p in payloads), runs
    await adapter.close()


async def test_a_dead_letter_to_a_topic_with_no_queue_is_redelivered_not_lost(
        names: Names, serving) -> None:  # noqa: F811
    """The dead-letter topic exists (an exchange) but no queue is bound: the broker returns the
    copy. It used to be acked all the same, and the message was gone; now the dead letter
    fails, the original stays, and once a queue is bound the dead letter arrives there."""
    adapter = RabbitMQAdapter(rabbitmq_url(), prefix=names.prefix)
    topic, queue = names.topic("orders"), names.subscription("billing")
    dlq_topic = names.topic("orders-dlq")
    await adapter.ensure_subscription(topic, queue, ack_deadline=10)
    await adapter.ensure_topic(dlq_topic)  # what the old start-up hint said to do: no queue
    runs: list[int] = []
    sub = Subscriber(adapter, receive_timeout=0.1,
                     dead_letter=DeadLetterPolicy(dlq_topic, max_delivery_attempts=1),
                     retry=RetryPolicy(min_backoff=0.1, max_backoff=0.2))

    @sub.handler(queue)
    def poison(message: Message) -> None:
        runs.append(message.delivery_attempt)
        raise ValueError("cannot parse order")

    await adapter.publish(topic, b"poison")
    serving(sub)
    await until(lambda: len(runs) >= 2, "the poison message redelivered after a refused copy")
    assert sub.stats[Outcome.DEAD_LETTERED] == 0
    dlq = names.subscription("dlq")
    await adapter.ensure_subscription(dlq_topic, dlq, ack_deadline=10)
    await until(lambda: sub.stats[Outcome.DEAD_LETTERED] == 1, "the dead letter, once bound")
    [letter] = await adapter.receive(dlq, 10, 5.0)
    assert letter.message.data == b"poison"
    assert letter.message.attributes["dead-letter-reason"] == "max-delivery-attempts"
    await adapter.ack([letter])
    assert await adapter.receive(dlq, 10, 0.3) == []  # one copy, not one per refused try
    await adapter.close()


async def test_a_publish_to_a_missing_topic_fails_alone(names: Names) -> None:  # noqa: F811
    """One publish to a topic that does not exist, among others in flight: it fails alone,
    naming its topic; the others are published, and their topic stays known. (The existence
    check ran on the shared publishing channel, whose NOT_FOUND closed it under every publish
    in flight: they failed with an UnknownTopicError about a topic that exists.)"""
    from reliable_sub.errors import UnknownTopicError
    from reliable_sub.ports import Outgoing

    adapter = RabbitMQAdapter(rabbitmq_url(), prefix=names.prefix)
    topic, queue = names.topic("orders"), names.subscription("billing")
    await adapter.ensure_subscription(topic, queue, ack_deadline=10)
    missing = names.topic("never-made")
    batch = [Outgoing(topic, f"m{i}".encode(), None, None) for i in range(20)]
    batch.insert(10, Outgoing(missing, b"lost?", None, None))
    results = await adapter.publish_many(batch)
    assert isinstance(results[10], UnknownTopicError) and missing in str(results[10])
    assert all(isinstance(r, str) for i, r in enumerate(results) if i != 10), results
    received: list[bytes] = []
    while len(received) < 20:
        got = await adapter.receive(queue, 50, 2.0)
        assert got, f"only {len(received)} of 20 arrived"
        received += [d.message.data for d in got]
        await adapter.ack(got)
    assert sorted(received) == sorted(m.data for m in batch if m.topic == topic)

    # an exchange deleted behind the adapter's back, its name still cached: its publish
    # closes the channel under the others, which are sent again
    gone = names.topic("deleted-later")
    await adapter.ensure_topic(gone)
    await adapter.publish(gone, b"cached")
    connection = await aio_pika.connect(rabbitmq_url())
    try:
        await (await connection.channel()).exchange_delete(gone)
    finally:
        await connection.close()
    batch = [Outgoing(topic, f"n{i}".encode(), None, None) for i in range(20)]
    batch.insert(5, Outgoing(gone, b"lost?", None, None))
    results = await adapter.publish_many(batch)
    assert isinstance(results[5], UnknownTopicError) and gone in str(results[5])
    assert all(isinstance(r, str) for i, r in enumerate(results) if i != 5), [
        (i, r) for i, r in enumerate(results) if not isinstance(r, str)]
    await adapter.close()


def test_names_amqp_cannot_carry_are_refused_where_they_are_given() -> None:
    """pamqp refuses names outside AMQP's characters with a bare ``ValueError: Invalid value for
    queue``; a subscription whose delay queues' names would pass 255 bytes made every backoff
    fail to declare its queue (and give back at once, healthy all along)."""
    from reliable_sub.errors import ConfigurationError

    adapter = RabbitMQAdapter(rabbitmq_url(), prefix="p")
    for bad in ("orders!", "заказы", "a" * 256, "amq.orders", ""):
        with pytest.raises(ConfigurationError, match="letters, digits, spaces or any of"):
            adapter.ensure_subscription_sync("orders", bad)
    just_fits = "s" * 255  # as a queue, but not with ".delay." and a length in ms after it
    with pytest.raises(ConfigurationError, match=r"use at most 234 characters"):
        adapter.ensure_subscription_sync("orders", just_fits)


async def test_a_changed_delivery_limit_or_ack_deadline_is_said(
        names: Names, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    from reliable_sub.errors import ConfigurationError

    adapter = RabbitMQAdapter(rabbitmq_url(), prefix=names.prefix)
    topic, queue = names.topic("orders"), names.subscription("billing")
    await adapter.ensure_subscription(topic, queue, ack_deadline=10, delivery_limit=5)
    with pytest.raises(ConfigurationError, match="a queue's arguments cannot change"):
        await adapter.ensure_subscription(topic, queue, ack_deadline=10, delivery_limit=6)
    caplog.clear()
    await adapter.ensure_subscription(topic, queue, delivery_limit=5)  # the deadline it has
    assert not [r for r in caplog.records if "keeps the ack deadline" in r.getMessage()]
    await adapter.ensure_subscription(topic, queue, ack_deadline=30, delivery_limit=5)
    [warning] = [r.getMessage() for r in caplog.records if "keeps the ack deadline" in
                 r.getMessage()]
    assert "10s, not the 30s asked for" in warning
    assert await adapter.subscription_ack_deadline(queue) == 10
    await adapter.close()


async def test_delayed_nacks_that_fail_are_said_in_health(
        names: Names, serving) -> None:  # noqa: F811
    """A delay queue that cannot be declared (here: one of that name exists with other
    arguments) gives the delivery back at once; healthy() used to stay True meanwhile."""
    from reliable_sub.adapters._rabbitmq_topology import delay_bucket

    url = rabbitmq_url()
    adapter = RabbitMQAdapter(url, prefix=names.prefix)
    topic, queue = names.topic("orders"), names.subscription("billing")
    await adapter.ensure_subscription(topic, queue, ack_deadline=10)
    blocker = f"{names.prefix}.delay.{queue}.{delay_bucket(0.5)}"
    names.queues.append(blocker)
    connection = await aio_pika.connect(url)
    try:
        await (await connection.channel()).declare_queue(blocker, durable=True)  # no TTL
    finally:
        await connection.close()
    runs: list[int] = []
    sub = Subscriber(adapter, receive_timeout=0.1,
                     retry=RetryPolicy(min_backoff=0.5, max_backoff=0.5))

    @sub.handler(queue)
    def flaky(message: Message) -> None:
        runs.append(message.delivery_attempt)
        if len(runs) < 3:
            raise ConnectionError("the payment API is down")

    await adapter.publish(topic, b"x")
    serving(sub)
    await until(lambda: any(f"delayed nacks of {queue!r} fail" in p for p in sub.problems()),
                "health to tell the failing delay path")
    assert sub.running and not sub.healthy()
    await until(lambda: sub.stats[Outcome.ACKED] == 1, "the third attempt's ack")
    await adapter.close()
