"""The adapter contract itself: receive, ack, nack, deadlines, fan-out, ordering."""

from __future__ import annotations

from reliable_sub.message import Delivery
from reliable_sub.testing.harness import Harness


async def test_ack_removes_the_message(harness: Harness) -> None:
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    await adapter.publish(topic, b"one")
    [delivery] = await harness.receive(adapter, sub, timeout=harness.tick)
    assert delivery.message.data == b"one"
    assert await adapter.ack([delivery]) == []

    assert await harness.receive(adapter, sub, timeout=2 * harness.ack_deadline) == []


async def test_expired_deadline_redelivers_with_the_next_attempt(harness: Harness) -> None:
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    message_id = await adapter.publish(topic, b"forgotten", {"k": "v"})
    # the broker's deadline starts when it hands the message out, somewhere inside the call:
    # measured from before it, the bound below holds however late the call returns under load
    asked_at = harness.clock.now()
    [first] = await harness.receive(adapter, sub, timeout=harness.tick)
    assert first.message.delivery_attempt == 1

    [again] = await harness.receive(adapter, sub, timeout=3 * harness.ack_deadline)

    assert again.message.id == message_id == first.message.id
    assert again.message.delivery_attempt == 2
    assert again.message.attributes == {"k": "v"}
    assert harness.clock.now() - asked_at >= harness.ack_deadline * 0.99
    assert again.ack_id != first.ack_id
    if harness.features.refuses_stale_acks:
        assert await adapter.ack([first]) == [first], "a redelivered message's old ack id"
    assert await adapter.ack([again]) == []


async def test_nack_redelivers_after_the_delay(harness: Harness) -> None:
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    await adapter.publish(topic, b"later")
    [delivery] = await harness.receive(adapter, sub, timeout=harness.tick)
    delay = 3 * harness.tick
    nacked_at = harness.clock.now()
    await adapter.nack([delivery], delay)

    assert await harness.receive(adapter, sub, timeout=harness.tick) == []
    [again] = await harness.receive(adapter, sub, timeout=2 * delay)

    assert again.message.id == delivery.message.id
    assert again.message.delivery_attempt == 2
    assert harness.clock.now() - nacked_at >= delay * 0.99


async def test_nack_without_delay_redelivers_at_once(harness: Harness) -> None:
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    await adapter.publish(topic, b"again")
    [delivery] = await harness.receive(adapter, sub, timeout=harness.tick)
    nacked_at = harness.clock.now()
    await adapter.nack([delivery], 0.0)

    [again] = await harness.receive(adapter, sub, timeout=harness.ack_deadline)

    assert again.message.id == delivery.message.id
    assert harness.clock.now() - nacked_at < harness.ack_deadline / 2


async def test_extend_moves_the_deadline_and_stale_ids_are_refused(harness: Harness) -> None:
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    await adapter.publish(topic, b"long")
    [delivery] = await harness.receive(adapter, sub, timeout=harness.tick)

    for _ in range(3):
        await harness.pass_time(harness.ack_deadline * 0.6)
        assert await adapter.extend([delivery], harness.ack_deadline) == []
    assert await harness.receive(adapter, sub, timeout=harness.ack_deadline * 0.5) == []
    assert await adapter.ack([delivery]) == []
    if harness.features.refuses_stale_acks:
        assert await adapter.extend([delivery], harness.ack_deadline) == [delivery]


async def test_receive_respects_max_messages(harness: Harness) -> None:
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    for i in range(7):
        await adapter.publish(topic, f"m{i}".encode())
    first = await harness.receive(adapter, sub, timeout=harness.tick, max_messages=5)
    assert 1 <= len(first) <= 5
    rest = await harness.receive_count(adapter, sub, 7 - len(first), max_messages=5)
    assert len(first) + len(rest) == 7, "messages went missing"
    await adapter.ack(first + rest)
    assert sorted(d.message.data for d in first + rest) == [f"m{i}".encode() for i in range(7)]


async def test_fan_out_to_two_subscriptions(harness: Harness) -> None:
    adapter = await harness.adapter()
    harness.needs("fan_out")
    topic, sub_a = await harness.topic_and_subscription()
    sub_b = harness.name_for("sub")
    await adapter.ensure_subscription(topic, sub_b, ack_deadline=harness.ack_deadline)
    ids = [await adapter.publish(topic, f"e{i}".encode()) for i in range(5)]

    for sub in (sub_a, sub_b):
        got = await harness.receive_count(adapter, sub, 5)
        assert sorted(d.message.id for d in got) == sorted(ids), f"{sub} is missing messages"
        assert {d.message.subscription for d in got} == {sub}
        await adapter.ack(got)


async def test_ensure_subscription_is_idempotent(harness: Harness) -> None:
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    await adapter.publish(topic, b"kept")
    await adapter.ensure_subscription(topic, sub, ack_deadline=harness.ack_deadline)
    [delivery] = await harness.receive(adapter, sub, timeout=harness.tick)
    assert delivery.message.data == b"kept"
    await adapter.ack([delivery])


async def test_ordering_keys_deliver_in_order(harness: Harness) -> None:
    """Per key, messages are acked in publish order by a consumer that processes them in the
    order received and, when it nacks one, nacks the rest of that key in the batch too."""
    adapter = await harness.adapter()
    harness.needs("ordering")
    topic, sub = await harness.topic_and_subscription(ordering=True)
    for i in range(6):
        await adapter.publish(topic, f"a{i}".encode(), ordering_key="A")
        await adapter.publish(topic, f"b{i}".encode(), ordering_key="B")

    acked: dict[str, list[bytes]] = {"A": [], "B": []}
    nacked_a2 = False
    while sum(map(len, acked.values())) < 12:
        batch = await harness.receive(adapter, sub, timeout=3 * harness.ack_deadline)
        assert batch, "ordered messages went missing"
        blocked: set[str] = set()
        to_ack: list[Delivery] = []
        to_nack: list[Delivery] = []
        for delivery in batch:
            key, data = delivery.message.ordering_key or "", delivery.message.data
            if key in blocked or data in acked[key]:
                (to_nack if key in blocked else to_ack).append(delivery)
                continue
            if data == b"a2" and not nacked_a2:  # fail it once: nothing after it may overtake
                nacked_a2 = True
                blocked.add(key)
                to_nack.append(delivery)
                continue
            acked[key].append(data)
            to_ack.append(delivery)
        await adapter.ack(to_ack)
        if to_nack:
            await adapter.nack(to_nack, 0.0)
    assert acked["A"] == [f"a{i}".encode() for i in range(6)]
    assert acked["B"] == [f"b{i}".encode() for i in range(6)]
    assert nacked_a2


__all__ = [
    "test_ack_removes_the_message",
    "test_ensure_subscription_is_idempotent",
    "test_expired_deadline_redelivers_with_the_next_attempt",
    "test_extend_moves_the_deadline_and_stale_ids_are_refused",
    "test_fan_out_to_two_subscriptions",
    "test_nack_redelivers_after_the_delay",
    "test_nack_without_delay_redelivers_at_once",
    "test_ordering_keys_deliver_in_order",
    "test_receive_respects_max_messages",
]
