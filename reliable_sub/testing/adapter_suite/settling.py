"""Results are recorded before acks, and a slow or failing store or broker call never lets a
message run twice (memory and Redis; Redis with its dedup store on the same server, so the
completions ride in the ack script)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from typing import Any, cast

from reliable_sub import Claimed, DedupKey, Message, Outcome, RetryPolicy
from reliable_sub._runtime.settler import RETRY_WAIT_MAX, RETRY_WAIT_MIN
from reliable_sub.message import Delivery
from reliable_sub.ports import AcksWithCompletions, Adapter
from reliable_sub.testing.harness import Harness, Recorder, drain


def failures_spanning(seconds: float) -> int:
    """How many failed tries of a settle call keep it retrying for more than ``seconds``."""
    tries, waited = 0, 0.0
    while waited <= seconds:
        waited += min(RETRY_WAIT_MAX, RETRY_WAIT_MIN * 2**tries)
        tries += 1
    return tries


class Flaky:
    """Wraps an adapter or a store: the named calls fail a given number of times first."""

    def __init__(self, inner: Any, **failures: int) -> None:
        self._inner = inner
        self.failures = dict(failures)
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name not in self.failures:
            return attribute

        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if self.failures[name] > 0:
                self.failures[name] -= 1
                raise ConnectionError(f"{name}: connection reset")
            return await attribute(*args, **kwargs)

        return call


async def run_one_charge(harness: Harness, adapter: Any, store: Any, recorder: Recorder,
                         runs: Counter[str], retry: RetryPolicy | None = None) -> str:
    topic, sub = await harness.topic_and_subscription()
    subscriber = harness.subscriber(adapter, dedup=store, on_outcome=recorder,
                                    retry=retry or harness.retry_policy())

    @subscriber.handler(sub)
    async def charge(message: Message) -> str:
        runs[message.id] += 1
        return "charged"

    message_id = await harness.adapters[0].publish(topic, b"pay", {"idempotency-key": "pay-1"})
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: bool(recorder.outcomes), 30 * harness.ack_deadline,
                                 "the settle to be confirmed")
    assert await drain(harness, sub) == []
    recorder.stats = subscriber.stats  # type: ignore[attr-defined]
    return message_id


async def test_a_failing_completion_is_retried_and_the_message_never_runs_twice(
    harness: Harness,
) -> None:
    harness.needs("subscriber_logic")
    adapter = await harness.adapter()
    retries = failures_spanning(1.5 * harness.ack_deadline)
    store = harness.dedup_store()
    if isinstance(adapter, AcksWithCompletions) and adapter.shares_store(store):
        # the completions are written by the ack script: make that fail, patched on the
        # instance (a wrapper object would not pass the typed capability check)
        failing = Flaky(adapter, ack_with_completions=retries)
        cast(Any, adapter).ack_with_completions = failing.ack_with_completions
        broker: Adapter = adapter
    else:
        failing = Flaky(store, complete_many=retries)
        store, broker = cast(Any, failing), adapter
    recorder, runs = Recorder(), Counter[str]()
    message_id = await run_one_charge(harness, broker, store, recorder, runs)
    assert runs == {message_id: 1}, "the handler ran again while its result was being written"
    assert recorder.outcomes == [(message_id, Outcome.ACKED)]
    assert sum(failing.calls.values()) == retries + 1
    # a failed completion is a store error, in the Redis ack script too (#9's miscount)
    assert recorder.stats.store_errors == retries  # type: ignore[attr-defined]


async def test_a_failing_ack_is_retried_after_the_result_is_recorded(
    harness: Harness,
) -> None:
    harness.needs("subscriber_logic")
    adapter = await harness.adapter()
    retries = failures_spanning(1.5 * harness.ack_deadline)
    store = harness.dedup_store()
    broker = Flaky(adapter, ack=retries, ack_with_completions=retries)
    recorder, runs = Recorder(), Counter[str]()
    message_id = await run_one_charge(harness, broker, store, recorder, runs)
    assert runs == {message_id: 1}
    assert recorder.outcomes == [(message_id, Outcome.ACKED)]


async def test_one_stuck_ack_call_does_not_hold_up_the_others(harness: Harness) -> None:
    harness.needs("subscriber_logic")
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    release = asyncio.Event()
    stuck: list[str] = []

    class StuckOnce:
        def __init__(self, inner: Adapter) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        async def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
            if not stuck:
                stuck.extend(d.message.id for d in deliveries)
                await release.wait()
            return await self._inner.ack(deliveries)

    recorder = Recorder()
    subscriber = harness.subscriber(cast(Adapter, StuckOnce(adapter)), on_outcome=recorder)
    subscriber.handler(sub)(lambda message: None)
    async with harness.serving(subscriber):
        await adapter.publish(topic, b"first")
        await harness.wait_until(lambda: bool(stuck), 3 * harness.ack_deadline, "stuck ack")
        for i in range(5):
            await adapter.publish(topic, f"later-{i}".encode())
        await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 5,
                                 3 * harness.ack_deadline, "the later acks")
        assert [i for i, _ in recorder.outcomes if i in stuck] == []
        release.set()
        await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 6,
                                 3 * harness.ack_deadline, "the stuck ack")


async def test_an_unreadable_stored_result_does_not_wedge_its_batch(
    harness: Harness,
) -> None:
    harness.needs("subscriber_logic")
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    store = harness.dedup_store()
    namespace = adapter.dedup_namespace(sub)
    await _write_unreadable(store, DedupKey(namespace, "k-bad"))
    recorder, handled = Recorder(), Counter[bytes]()
    subscriber = harness.subscriber(adapter, dedup=store, on_outcome=recorder)

    @subscriber.handler(sub)
    async def handle(message: Message) -> None:
        handled[message.data] += 1

    await adapter.publish(topic, b"bad", {"idempotency-key": "k-bad"})
    await adapter.publish(topic, b"good", {"idempotency-key": "k-good"})
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: len(recorder.outcomes) == 2, 3 * harness.ack_deadline,
                                 "both settled")
    assert sorted(o for _, o in recorder.outcomes) == [Outcome.ACKED, Outcome.DUPLICATE]
    assert handled == {b"good": 1}
    assert await drain(harness, sub) == []


async def _write_unreadable(store: Any, key: DedupKey) -> None:
    if hasattr(store, "write_raw"):
        store.write_raw(key, "not json {", 60)
    else:
        await store.client.set(store.redis_key(key), b"c:not json {", px=60_000)


async def test_a_deferral_waits_at_least_a_second_even_with_zero_backoff(
    harness: Harness,
) -> None:
    harness.needs("subscriber_logic")
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    peer = harness.dedup_store(owner="peer")
    key = DedupKey(adapter.dedup_namespace(sub), "busy")
    held = await peer.claim(key, 3600)
    assert isinstance(held, Claimed)
    recorder = Recorder()
    subscriber = harness.subscriber(adapter, dedup=harness.dedup_store(), on_outcome=recorder,
                                    retry=RetryPolicy(min_backoff=0, max_backoff=0))
    subscriber.handler(sub)(lambda message: None)
    await adapter.publish(topic, b"x", {"idempotency-key": "busy"})
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: recorder.count(Outcome.DEFERRED) >= 1,
                                 3 * harness.ack_deadline, "a deferral")
        start = harness.clock.now()
        await harness.pass_time(3.0)
        elapsed = harness.clock.now() - start
    deferrals = recorder.count(Outcome.DEFERRED)
    assert deferrals <= elapsed + 2, f"{deferrals} deferrals in {elapsed:.1f}s: a spin"
    await peer.release(held, 0)


__all__ = [
    "test_a_deferral_waits_at_least_a_second_even_with_zero_backoff",
    "test_a_failing_ack_is_retried_after_the_result_is_recorded",
    "test_a_failing_completion_is_retried_and_the_message_never_runs_twice",
    "test_an_unreadable_stored_result_does_not_wedge_its_batch",
    "test_one_stuck_ack_call_does_not_hold_up_the_others",
]
