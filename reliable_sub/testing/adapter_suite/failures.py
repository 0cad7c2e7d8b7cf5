"""Failures are counted as handler failures, bounded, and visible."""

from __future__ import annotations

import logging
import threading
from collections import Counter

import pytest

from reliable_sub import (
    Claimed,
    DeadLetterPolicy,
    DedupKey,
    LeasePolicy,
    Message,
    Outcome,
    Reject,
    Subscriber,
)
from reliable_sub.dead_letters import DeadLetter
from reliable_sub.ports import Adapter
from reliable_sub.testing.harness import Harness, Recorder


async def test_only_handler_failures_use_up_attempts_across_deferrals_and_restarts(
    harness: Harness,
) -> None:
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    dlq_topic, dlq_sub = await harness.topic_and_subscription()
    key = DedupKey(adapter.dedup_namespace(sub), "poison-1")
    peer = harness.dedup_store(owner="peer")
    held = await peer.claim(key, 2 * harness.ack_deadline)  # a peer that then dies
    assert isinstance(held, Claimed)
    calls: list[int] = []

    def consumer(recorder: Recorder, dead_letter: DeadLetterPolicy) -> Subscriber:  # each new
        subscriber = harness.subscriber(adapter, dedup=harness.dedup_store(),
                                        on_outcome=recorder, dead_letter=dead_letter)

        @subscriber.handler(sub)
        async def poison(message: Message) -> None:
            calls.append(message.delivery_attempt)
            raise ValueError("cannot parse")

        return subscriber

    policy = DeadLetterPolicy(dlq_topic, max_delivery_attempts=3)
    await adapter.publish(topic, b"poison", {"idempotency-key": "poison-1"})
    first = Recorder()
    async with harness.serving(consumer(first, policy)):
        await harness.wait_until(lambda: first.count(Outcome.RETRY) == 2,
                                 20 * harness.ack_deadline, "two failures")
    assert first.count(Outcome.DEFERRED) >= 1, "the dead peer's claim deferred it first"
    second = Recorder()
    async with harness.serving(consumer(second, policy)):  # a restart: counts must survive
        await harness.wait_until(lambda: second.count(Outcome.DEAD_LETTERED) == 1,
                                 20 * harness.ack_deadline, "dead-lettering")
    assert len(calls) == 3, f"the handler ran {len(calls)} times for max_delivery_attempts=3"
    [dead] = await harness.receive(adapter, dlq_sub, timeout=harness.ack_deadline)
    assert dead.message.attributes["handler-failures"] == "3"
    assert int(dead.message.attributes["delivery-attempts"]) >= 3
    await adapter.ack([dead])


async def test_a_rejected_message_is_dead_lettered_at_its_first_failure(harness: Harness) -> None:
    """``Reject`` and a ``non_retryable`` type skip in-process retries and backoff, even when
    ``retry_on`` would take them; other failures keep their attempts."""
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    dlq_topic, dlq_sub = await harness.topic_and_subscription()
    recorder = Recorder()
    calls: Counter[bytes] = Counter()
    subscriber = harness.subscriber(
        adapter, on_outcome=recorder,
        retry=harness.retry_policy(in_process_attempts=3, in_process_wait=0,
                                   retry_on=(Exception,), non_retryable=(KeyError,)),
        dead_letter=DeadLetterPolicy(dlq_topic, max_delivery_attempts=5),
    )

    @subscriber.handler(sub)
    async def handle(message: Message) -> None:
        calls[message.data] += 1
        if message.data == b"negative":
            raise Reject("amount must be positive, got -5")
        if message.data == b"unknown":
            raise KeyError("sku-404")
        if calls[message.data] == 1:  # a transient failure: retried in process
            raise ConnectionError("reset")

    for payload in (b"negative", b"unknown", b"fine"):
        await adapter.publish(topic, payload)
    async with harness.serving(subscriber):
        await harness.wait_until(
            lambda: [recorder.count(o) for o in (Outcome.DEAD_LETTERED, Outcome.ACKED)] == [2, 1],
            10 * harness.ack_deadline, "two rejections and one ack",
        )
    assert calls == {b"negative": 1, b"unknown": 1, b"fine": 2}
    assert recorder.count(Outcome.RETRY) == 0, "nothing waited for a backoff"
    assert subscriber.stats["rejected"] == 2
    dead = await harness.receive_count(adapter, dlq_sub, 2)
    letters = {d.message.data: DeadLetter.of(d) for d in dead}
    assert set(letters) == {b"negative", b"unknown"}
    assert {letter.reason for letter in letters.values()} == {"rejected"}
    assert [letters[b"negative"].handler_failures, letters[b"unknown"].handler_failures] == [1, 1]
    assert letters[b"negative"].error_type == "reliable_sub.errors.Reject"
    assert letters[b"negative"].error_message == "amount must be positive, got -5"
    assert letters[b"unknown"].error_type == "builtins.KeyError"
    await adapter.ack(dead)


async def test_a_hung_sync_handler_starves_nothing_and_is_dead_lettered_in_the_end(
    harness: Harness,
) -> None:
    """Consumer A's only worker thread hangs; B joins. The hung message is dead-lettered after
    its periods of max_lease_duration, and each other message runs once. Where peers take what
    a consumer gives back, B runs them while A is still hung; where a partition's messages go
    to its owner only (``partition_owned``), B runs those of its partitions and A those of its
    own once its thread is free."""
    harness.needs("subscriber_logic")
    consumer_a, consumer_b = await harness.adapter(), await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    dlq_topic, dlq_sub = await harness.topic_and_subscription()
    max_lease = 6 * harness.ack_deadline
    policy = DeadLetterPolicy(dlq_topic, max_delivery_attempts=2)
    lease = LeasePolicy(min_extension=harness.ack_deadline, max_lease_duration=max_lease)
    release = threading.Event()
    effects: Counter[tuple[str, bytes]] = Counter()
    hung = threading.Event()
    recorders = {"a": Recorder(), "b": Recorder()}

    def consumer(name: str, adapter: Adapter, workers: int) -> Subscriber:
        subscriber = harness.subscriber(
            adapter, dedup=harness.dedup_store(owner=name), sync_workers=workers, lease=lease,
            dead_letter=policy, on_outcome=recorders[name],
        )

        @subscriber.handler(sub)
        def handle(message: Message) -> None:
            if message.data == b"hang":
                hung.set()
                release.wait(120)
            effects[(name, message.data)] += 1

        return subscriber

    for payload in (b"hang", b"q1", b"q2", b"q3"):
        await harness.adapters[0].publish(topic, payload)
    def queued_effects(by: str | None = None) -> int:
        return sum(n for (name, data), n in effects.items()
                   if data != b"hang" and by in (None, name))

    async with harness.serving(consumer("a", consumer_a, workers=1)):
        try:
            await harness.wait_until(hung.is_set, 3 * harness.ack_deadline, "the hang")
            async with harness.serving(consumer("b", consumer_b, workers=4)):
                try:
                    if not harness.features.partition_owned:
                        # the queued ones are given back at max_lease_duration and run by B
                        await harness.wait_until(
                            lambda: queued_effects("b") == 3, 6 * max_lease,
                            "the queued messages to be run by the healthy consumer")
                        # A ran none of them: its one thread is hung. It gives them back at
                        # max_lease_duration ("requeued"); on a machine so loaded that A's
                        # leases lapsed first, B took them over before that, and A's give-back
                        # comes after B ran them.
                        assert queued_effects("a") == 0, effects
                        await harness.wait_until(
                            lambda: sum(recorders["a"].count(o) for o in (
                                Outcome.REQUEUED, Outcome.ACK_REFUSED)) >= 3,
                            6 * max_lease, "A to give the queued messages back")
                    # each further max_lease_duration the hung handler runs counts as a failure
                    await harness.wait_until(
                        lambda: sum(r.count(Outcome.DEAD_LETTERED)
                                    for r in recorders.values()) == 1,
                        6 * max_lease, "the hung message to be dead-lettered (by either consumer)",
                    )
                    if harness.features.partition_owned:
                        # B ran those of its partitions; those of A's wait for A's one thread
                        # (given back, they come back to A, the partition's owner), and run
                        # once it is free
                        release.set()
                        await harness.wait_until(
                            lambda: queued_effects() == 3, 6 * max_lease,
                            "the queued messages to be run once the hung thread is free")
                finally:
                    # before B's stop: on a machine so loaded that A's claim lapsed, B runs the
                    # hung message too, and its stop waits for that thread
                    release.set()
        finally:
            release.set()  # before A's stop, which waits for the thread
        await harness.wait_until(lambda: effects[("a", b"hang")] == 1,
                                 3 * harness.ack_deadline, "the hung thread to end")
    assert sum(n for (_, data), n in effects.items() if data != b"hang") == 3, effects
    [dead] = await harness.receive(harness.adapters[0], dlq_sub, timeout=harness.ack_deadline)
    assert dead.message.data == b"hang"
    assert dead.message.attributes["error-type"] == "reliable_sub.errors.HandlerTimeoutError"


async def test_an_async_handler_blocking_the_loop_is_named_in_a_warning(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    import time

    harness.needs("subscriber_logic")
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    recorder = Recorder()
    subscriber = harness.subscriber(adapter, on_outcome=recorder, loop_lag_warning=0.2)

    @subscriber.handler(sub)
    async def blocker(message: Message) -> None:
        time.sleep(0.8)  # noqa: ASYNC251 - blocking the loop is the mistake under test

    caplog.set_level(logging.INFO, logger="reliable_sub")
    await adapter.publish(topic, b"x")
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 1,
                                 3 * harness.ack_deadline, "ack")
    warnings = [r for r in caplog.records if "event loop has been blocked" in r.getMessage()]
    assert warnings, caplog.text
    assert "blocker" in warnings[0].getMessage()
    assert warnings[0].levelno == logging.WARNING
    # the watchdog thread logs the all-clear once it sees the loop answer: maybe just after
    await harness.wait_real(lambda: "the event loop is free again" in caplog.text, 5.0,
                            "the watchdog's all-clear")


async def test_a_claim_past_max_lease_is_renewed_on_its_own_schedule(
    harness: Harness,
) -> None:
    """Once a delivery's broker lease is gone its claim is still renewed, but at its own pace,
    not every lease tick (#8.7: 1,900 renewals in 20 s)."""
    harness.needs("subscriber_logic")
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    renewals: list[float] = []
    store = harness.dedup_store()
    renew = store.renew

    async def counting_renew(claims, lease_ttl):
        renewals.append(harness.clock.now())
        return await renew(claims, lease_ttl)

    store.renew = counting_renew  # type: ignore[method-assign]
    release = threading.Event()
    recorder = Recorder()
    lease = LeasePolicy(min_extension=harness.ack_deadline / 5,
                        max_lease_duration=2 * harness.ack_deadline)
    subscriber = harness.subscriber(adapter, dedup=store, lease=lease, on_outcome=recorder)

    @subscriber.handler(sub)
    def long_job(message: Message) -> None:
        release.wait(120)

    await adapter.publish(topic, b"x")
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: bool(renewals), 3 * harness.ack_deadline, "a renewal")
        start = harness.clock.now()
        await harness.pass_time(8 * harness.ack_deadline)  # well past max_lease_duration
        elapsed = harness.clock.now() - start
        release.set()
    during = [t for t in renewals if start <= t <= start + elapsed]
    # the claim lasts max(ack deadline, min_extension): renewed about every 60-80 % of that
    assert len(during) <= elapsed / (0.5 * harness.ack_deadline) + 2, (
        f"{len(during)} renewals in {elapsed:.1f}s"
    )
    assert len(during) >= 3, "the claim must stay renewed while the thread runs"


__all__ = [
    "test_a_claim_past_max_lease_is_renewed_on_its_own_schedule",
    "test_a_hung_sync_handler_starves_nothing_and_is_dead_lettered_in_the_end",
    "test_a_rejected_message_is_dead_lettered_at_its_first_failure",
    "test_an_async_handler_blocking_the_loop_is_named_in_a_warning",
    "test_only_handler_failures_use_up_attempts_across_deferrals_and_restarts",
]
