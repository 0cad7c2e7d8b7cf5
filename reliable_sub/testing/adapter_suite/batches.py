"""Batch handlers on every adapter: the messages received together arrive in one call as
decoded bodies with their Messages; a body that does not decode is dead-lettered alone, a
message the handler names in its BatchResult fails alone, and the rest are acked once. A call
that raises for one poison message is bisected: only the poison one is dead-lettered."""

from __future__ import annotations

from reliable_sub import BatchResult, Message, Outcome, Reject
from reliable_sub.dead_letters import DeadLetter
from reliable_sub.testing.adapter_suite.bodies import _Order, dead_letter_setup
from reliable_sub.testing.harness import Harness


async def test_a_typed_batch_fails_and_acks_each_message_on_its_own(harness: Harness) -> None:
    world = await dead_letter_setup(harness)
    adapter, topic, sub, dlq_sub = world.adapter, world.topic, world.sub, world.dlq_sub
    recorder, subscriber = world.recorder, world.subscriber
    seen: list[_Order] = []

    @subscriber.handler(sub, batch=True, max_batch=10, max_wait=harness.tick)
    async def handle(orders: list[_Order], messages: list[Message]) -> BatchResult:
        seen.extend(orders)
        return BatchResult(failed={message.id: Reject("out of stock") for order, message
                                   in zip(orders, messages, strict=True) if order.sku == "gone"})

    for payload in (b'{"sku": "a", "quantity": 1}', b"{not json", b'{"sku": "gone", '
                    b'"quantity": 1}', b'{"sku": "b", "quantity": 2}'):
        await adapter.publish(topic, payload)
    async with harness.serving(subscriber):
        await harness.wait_until(
            lambda: [recorder.count(o) for o in (Outcome.DEAD_LETTERED, Outcome.ACKED)] == [2, 2],
            10 * harness.ack_deadline, "two dead letters and two acks",
        )
    assert sorted(order.sku for order in seen) == ["a", "b", "gone"]  # each handled once
    assert recorder.count(Outcome.RETRY) == 0
    dead = await harness.receive_count(adapter, dlq_sub, 2)
    letters = sorted((DeadLetter.of(d) for d in dead), key=lambda letter: letter.data)
    assert [letter.data for letter in letters] == [b'{"sku": "gone", "quantity": 1}',
                                                   b"{not json"]
    assert {(letter.reason, letter.handler_failures) for letter in letters} == {("rejected", 1)}
    assert "out of stock" in letters[0].error_message
    assert "is not a valid _Order" in letters[1].error_message
    await adapter.ack(dead)


async def test_a_batch_raising_for_one_poison_message_dead_letters_it_alone(
    harness: Harness,
) -> None:
    world = await dead_letter_setup(harness)
    adapter, topic, sub, dlq_sub = world.adapter, world.topic, world.sub, world.dlq_sub
    recorder, subscriber = world.recorder, world.subscriber
    handled: list[bytes] = []

    @subscriber.handler(sub, batch=True, max_batch=10, max_wait=harness.tick)
    async def handle(messages: list[Message]) -> None:
        if any(message.data == b"poison" for message in messages):
            raise Reject("a poison message in the batch")  # dead-letters what it fails alone
        handled.extend(message.data for message in messages)

    payloads = [b"a", b"b", b"poison", b"c", b"d"]
    for payload in payloads:
        await adapter.publish(topic, payload)
    async with harness.serving(subscriber):
        await harness.wait_until(
            lambda: recorder.count(Outcome.DEAD_LETTERED) + recorder.count(Outcome.ACKED) == 5,
            10 * harness.ack_deadline, "five settled",
        )
    counts = [recorder.count(o) for o in (Outcome.DEAD_LETTERED, Outcome.ACKED)]
    assert counts == [1, 4], f"dead-lettered and acked: {counts}"
    assert sorted(handled) == [b"a", b"b", b"c", b"d"]  # each once, on its first delivery
    assert recorder.count(Outcome.RETRY) == 0
    dead = await harness.receive_count(adapter, dlq_sub, 1)
    assert [(letter.data, letter.reason) for letter in map(DeadLetter.of, dead)] == [
        (b"poison", "rejected")]
    await adapter.ack(dead)


__all__ = [
    "test_a_batch_raising_for_one_poison_message_dead_letters_it_alone",
    "test_a_typed_batch_fails_and_acks_each_message_on_its_own",
]
