"""The dead-letter tools (``reliable_sub.dead_letters``) on a real dead-letter queue."""

from __future__ import annotations

from collections import Counter

from reliable_sub import DeadLetterPolicy, Message, Outcome
from reliable_sub.dead_letters import DeadLetterQueue, UnknownDeadLetterError
from reliable_sub.testing.harness import Harness, Recorder


async def test_dead_letters_can_be_listed_shown_replayed_after_a_fix_and_purged(
    harness: Harness,
) -> None:
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    dlq_topic, dlq_sub = await harness.topic_and_subscription()
    # longer than the Redis adapter's reclaim interval (a tenth of the ack deadline), so that a
    # given-back message is reclaimed within a scan's quiet receives
    queue = DeadLetterQueue(adapter, dlq_sub, wait=2 * harness.tick)
    fixed = False
    runs: Counter[str] = Counter()  # handler runs per idempotency key
    recorder = Recorder()
    subscriber = harness.subscriber(
        adapter, dedup=harness.dedup_store(), on_outcome=recorder,
        dead_letter=DeadLetterPolicy(dlq_topic, max_delivery_attempts=2))

    @subscriber.handler(sub)
    async def ship(message: Message) -> None:
        runs[message.idempotency_key] += 1
        if not fixed:
            raise ValueError(f"cannot ship {message.data.decode()}")

    async with harness.serving(subscriber):
        await adapter.publish(topic, b"order-1", {"idempotency-key": "order-1", "shop": "a"})
        await adapter.publish(topic, b"order-2", {"error-type": "the publisher's own"})
        await adapter.publish(topic, b"order-3")
        await harness.wait_until(lambda: recorder.count(Outcome.DEAD_LETTERED) == 3,
                                 20 * harness.ack_deadline, "three dead letters")

        letters = await harness.call(queue.peek())
        assert sorted(letter.data for letter in letters) == [b"order-1", b"order-2", b"order-3"]
        by_data = {letter.data: letter for letter in letters}
        first = by_data[b"order-1"]
        assert first.attributes == {"idempotency-key": "order-1", "shop": "a"}
        assert (first.original_subscription, first.handler_failures) == (sub, 2)
        assert first.error_type == "builtins.ValueError"
        assert first.error_message == "cannot ship order-1"
        assert by_data[b"order-2"].attributes == {"error-type": "the publisher's own"}, (
            "an attribute named like ours comes back under its own name")
        assert len(await harness.call(queue.peek())) == 3, "peeking leaves them in the queue"
        shown = await harness.call(queue.show(by_data[b"order-3"].id))
        assert shown == by_data[b"order-3"]
        try:
            await harness.call(queue.show("no-such-id"))
            raise AssertionError("show of an unknown id must fail")
        except UnknownDeadLetterError as error:
            assert "no-such-id" in str(error)

        # replayed before the fix: it fails again, with every attempt (not one) to go
        second = by_data[b"order-2"]
        again = await harness.call(queue.replay([second.id]))
        assert again.replayed == [second.id]
        await harness.wait_until(lambda: recorder.count(Outcome.DEAD_LETTERED) == 4,
                                 20 * harness.ack_deadline, "dead-lettered again")
        assert runs[second.original_message_id] == 4, "two runs before, two fresh attempts"

        fixed = True  # the fix is deployed; replay two of the others
        replay_ids = [first.id, by_data[b"order-3"].id]
        report = await harness.call(queue.replay([*replay_ids, "no-such-id"]))
        assert sorted(report.replayed) == sorted(replay_ids)
        assert report.missing == ["no-such-id"] and report.failed == {}
        await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 2,
                                 10 * harness.ack_deadline, "the replayed messages handled")
        assert runs["order-1"] == 3, "two failed runs, then one with fresh attempts"
        third_key = by_data[b"order-3"].original_message_id
        assert runs[third_key] == 3, "replayed under its original idempotency key"
        assert recorder.count(Outcome.DEAD_LETTERED) == 4, "nothing dead-lettered again"

        purged = await harness.call(queue.purge())
        assert (purged.purged, purged.missing) == (1, [])
        assert await harness.call(queue.peek()) == []


__all__ = ["test_dead_letters_can_be_listed_shown_replayed_after_a_fix_and_purged"]
