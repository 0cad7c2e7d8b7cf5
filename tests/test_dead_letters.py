"""A dead-letter copy's attributes back as the publisher set them (the suite runs the tools
themselves on every adapter: reliable_sub/testing/adapter_suite/dead_letter_tools.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from reliable_sub import Message
from reliable_sub.dead_letters import publisher_attributes
from reliable_sub.middleware.dead_letter import DEAD_LETTER_ATTRIBUTES, dead_letter_attributes

OURS = list(DEAD_LETTER_ATTRIBUTES)
# Names a publisher might use: ordinary ones, ours, and ours behind one "publisher-" prefix.
NAMES = st.sampled_from(["shop", "idempotency-key", *OURS, *(f"publisher-{n}" for n in OURS)])


def copy_of(attributes: dict[str, str]) -> dict[str, str]:
    message = Message(id="m-1", data=b"x", attributes=attributes, subscription="billing")
    return dead_letter_attributes(message, 3, ValueError("bad"))


@given(st.dictionaries(NAMES, st.text(max_size=5), max_size=8))
def test_the_publisher_s_attributes_come_back_unchanged(attributes: dict[str, str]) -> None:
    assert publisher_attributes(copy_of(attributes)) == attributes


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
