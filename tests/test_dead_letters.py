"""A dead-letter copy's attributes back as the publisher set them (the suite runs the tools
themselves on every adapter: reliable_sub/testing/adapter_suite/dead_letter_tools.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from reliable_sub import Message
from reliable_sub.dead_letters import publisher_attributes
from reliable_sub.middleware.dead_letter import DEAD_LETTER_ATTRIBUTES, dead_letter_attributes
from reliable_sub.ports import LAYOUT_ATTRIBUTES

OURS = list(DEAD_LETTER_ATTRIBUTES)
# Names a publisher might use: ordinary ones, ours, and ours behind one "publisher-" prefix;
# and the layout attributes of a message from another producer (``redis-fields`` ...).
RENAMED = [*OURS, *LAYOUT_ATTRIBUTES]
NAMES = st.sampled_from(["shop", "idempotency-key", *RENAMED,
                         *(f"publisher-{n}" for n in RENAMED)])


def copy_of(attributes: dict[str, str]) -> dict[str, str]:
    message = Message(id="m-1", data=b"x", attributes=attributes, subscription="billing")
    return dead_letter_attributes(message, 3, ValueError("bad"))


@given(st.dictionaries(NAMES, st.text(max_size=5), max_size=8))
def test_the_publisher_s_attributes_come_back_unchanged(attributes: dict[str, str]) -> None:
    assert publisher_attributes(copy_of(attributes)) == attributes


def test_layout_attributes_are_renamed_in_the_copy_and_restored() -> None:
    """So the copy is written in the adapter's own layout, and a replay in the original."""
    copy = copy_of({"redis-data-field": "__data__"})
    assert "redis-data-field" not in copy
    assert copy["publisher-redis-data-field"] == "__data__"
    assert publisher_attributes(copy) == {"redis-data-field": "__data__"}


def test_only_our_attributes_are_dropped() -> None:
    copy = copy_of({"shop": "a"})
    assert set(copy) == {"shop", *OURS}
    assert publisher_attributes(copy) == {"shop": "a"}


async def test_a_scan_ends_although_held_messages_come_back_while_it_runs() -> None:
    """On Redis a held message whose ack deadline passes is reclaimed by the scan's own next
    receive: the scan must still end (before, it could go round for as long as that kept
    happening) and list each message once."""
    import uuid

    from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
    from reliable_sub.dead_letters import DeadLetterQueue
    from reliable_sub.testing.services import redis_url

    prefix = f"dlq-scan-{uuid.uuid4().hex[:8]}"
    adapter = RedisStreamsAdapter(redis_url(), consumer="ops", key_prefix=prefix)
    topic, sub = f"{prefix}-dlq", f"{prefix}-ops"
    try:
        await adapter.ensure_subscription(topic, sub, ack_deadline=0.05)
        for n in range(5):
            await adapter.publish(topic, f"dead-{n}".encode(), {"original-message-id": str(n)})
        letters = await DeadLetterQueue(adapter, sub, wait=0.3).peek(limit=10)
        assert sorted(letter.original_message_id for letter in letters) == list("01234")
    finally:
        client = adapter.client
        await client.delete(topic, *[key async for key in client.scan_iter(f"{prefix}*")])
        await adapter.close()


class RefailingBroker:
    """A memory broker on which every message published to ``orders`` fails again at once: a
    fresh dead-letter copy of it lands in the queue (a handler still broken, no backoff)."""

    def __init__(self) -> None:
        from reliable_sub.adapters.memory import MemoryAdapter

        self.broker = MemoryAdapter()
        self.broker.ensure_subscription_sync("orders", "billing")
        self.broker.ensure_subscription_sync("orders-dlq", "dlq-ops")
        self.copies = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.broker, name)

    async def publish(self, topic: str, data: bytes, attributes: dict[str, str] | None = None,
                      ordering_key: str | None = None) -> str:
        message_id = await self.broker.publish(topic, data, attributes, ordering_key)
        if topic == "orders":
            self.copies += 1
            failed = Message(id=message_id, data=data, attributes=attributes or {},
                             subscription="billing")
            await self.broker.publish("orders-dlq", data,
                                      dead_letter_attributes(failed, 1, ValueError("still")))
        return message_id


async def test_replaying_everything_replays_what_was_there_when_it_began() -> None:
    """Before, copies dead-lettered during the run were replayed too: with a handler still
    broken, the replay went round for ever."""
    import asyncio

    from reliable_sub.dead_letters import DeadLetterQueue

    broker = RefailingBroker()
    failed = Message(id="m-1", data=b"order-1", attributes={}, subscription="billing")
    await broker.broker.publish("orders-dlq", b"order-1",
                                dead_letter_attributes(failed, 1, ValueError("bad")))
    queue = DeadLetterQueue(broker, "dlq-ops", wait=0.05)  # type: ignore[arg-type]

    report = await asyncio.wait_for(queue.replay(), timeout=10)

    assert len(report.replayed) == 1 and broker.copies == 1
    [left] = await queue.peek()
    assert left.original_message_id != "m-1", "the new copy stays for the operator to see"


async def test_a_dead_letter_topic_with_no_subscription_is_warned_about_and_loses_nothing(
        caplog) -> None:
    """On the in-process broker (as on Pub/Sub and RabbitMQ) a topic keeps nothing without a
    subscription. The Subscriber says so at start, and a dead letter published there while it
    has none fails (UnroutableError): the message is redelivered, not acked into nothing."""
    import asyncio
    import logging

    from reliable_sub import DeadLetterPolicy, Outcome, RetryPolicy, Subscriber, SystemClock
    from reliable_sub.adapters.memory import MemoryAdapter
    from reliable_sub.testing.timing import drive_until

    broker = MemoryAdapter()
    broker.ensure_subscription_sync("orders", "billing", ack_deadline=10)
    broker.ensure_topic_sync("orders-dlq")
    sub = Subscriber(broker, receive_timeout=0.05,
                     dead_letter=DeadLetterPolicy("orders-dlq", max_delivery_attempts=1),
                     retry=RetryPolicy(min_backoff=0.01, max_backoff=0.02))
    runs: list[int] = []

    @sub.handler("billing")
    def poison(message: Message) -> None:
        runs.append(message.delivery_attempt)
        raise ValueError("cannot parse")

    broker.publish_sync("orders", b"poison")
    with caplog.at_level(logging.WARNING, logger="reliable_sub.subscriber"):
        task = asyncio.ensure_future(sub.serve())
        try:
            await drive_until(SystemClock(), lambda: len(runs) >= 3, 10.0,
                              what="three tries of the poison message")
            assert sub.stats[Outcome.DEAD_LETTERED] == 0
            broker.ensure_subscription_sync("orders-dlq", "orders-dlq-sub")
            await drive_until(SystemClock(), lambda: sub.stats[Outcome.DEAD_LETTERED] == 1,
                              10.0, what="the dead letter, once the topic has a subscription")
        finally:
            await sub.shutdown(timeout=5)
            await task
    assert any("dead-letter topic 'orders-dlq' has no subscription" in r.getMessage()
               and "are redelivered" in r.getMessage() for r in caplog.records)
    [letter] = await broker.receive("orders-dlq-sub", 10, 0)
    assert letter.message.data == b"poison"
