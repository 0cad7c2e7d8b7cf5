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
