"""Typed bodies on every adapter: a dataclass body arrives decoded with its message, and a body
that does not decode is dead-lettered at its first attempt while its neighbours are handled.
(A dataclass keeps the suite free of pydantic; with pydantic installed it validates it.)"""

from __future__ import annotations

import dataclasses
from typing import Any

from reliable_sub import DeadLetterPolicy, Message, Outcome, Subscriber
from reliable_sub.dead_letters import DeadLetter
from reliable_sub.testing.harness import Harness, Recorder


@dataclasses.dataclass(frozen=True)
class _Order:
    sku: str
    quantity: int


@dataclasses.dataclass(frozen=True)
class DeadLetterSetup:
    """A topic and subscription, a dead-letter topic with a subscription to read it, and a
    Subscriber dead-lettering there (after 5 attempts), its outcomes recorded."""

    adapter: Any
    topic: str
    sub: str
    dlq_sub: str
    recorder: Recorder
    subscriber: Subscriber


async def dead_letter_setup(harness: Harness) -> DeadLetterSetup:
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    dlq_topic, dlq_sub = await harness.topic_and_subscription()
    recorder = Recorder()
    subscriber = harness.subscriber(
        adapter, on_outcome=recorder,
        dead_letter=DeadLetterPolicy(dlq_topic, max_delivery_attempts=5),
    )
    return DeadLetterSetup(adapter, topic, sub, dlq_sub, recorder, subscriber)


async def test_a_typed_body_is_decoded_and_a_bad_one_dead_lettered_at_once(
    harness: Harness,
) -> None:
    world = await dead_letter_setup(harness)
    adapter, topic, sub, dlq_sub = world.adapter, world.topic, world.sub, world.dlq_sub
    recorder, subscriber = world.recorder, world.subscriber
    seen: list[tuple[_Order, bytes]] = []

    @subscriber.handler(sub)
    async def handle(order: _Order, message: Message) -> None:
        seen.append((order, message.data))

    for payload in (b'{"sku": "a-1", "quantity": 2}', b"{not json", b'{"sku": "a-2"}'):
        await adapter.publish(topic, payload)
    async with harness.serving(subscriber):
        await harness.wait_until(
            lambda: [recorder.count(o) for o in (Outcome.DEAD_LETTERED, Outcome.ACKED)] == [2, 1],
            10 * harness.ack_deadline, "two dead letters and one ack",
        )
    assert seen == [(_Order("a-1", 2), b'{"sku": "a-1", "quantity": 2}')]
    assert recorder.count(Outcome.RETRY) == 0
    dead = await harness.receive_count(adapter, dlq_sub, 2)
    letters = sorted((DeadLetter.of(d) for d in dead), key=lambda letter: letter.data)
    assert [letter.data for letter in letters] == [b'{"sku": "a-2"}', b"{not json"]
    for letter in letters:
        assert (letter.reason, letter.handler_failures) == ("rejected", 1)
        assert "is not a valid _Order" in letter.error_message
    await adapter.ack(dead)


__all__ = [
    "DeadLetterSetup",
    "dead_letter_setup",
    "test_a_typed_body_is_decoded_and_a_bad_one_dead_lettered_at_once",
]
