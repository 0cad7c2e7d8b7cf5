"""What a Subscriber tells its operator: logs, outcomes, health; and the claim it shows handlers.

All on the in-memory broker with a ManualClock (the behaviour is the same on every adapter).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest

from reliable_sub import (
    Claimed,
    DeadLetterPolicy,
    DedupKey,
    InProgress,
    LeasePolicy,
    ManualClock,
    MemoryDedupStore,
    Message,
    Outcome,
    Subscriber,
    current_claim,
)
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.message import Delivery
from reliable_sub.testing.timing import drive_until
from tests.memory_world import serving, setup


async def test_failures_and_the_lifecycle_are_logged_by_default(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", 3))

    @sub.handler("billing")
    def charge(message: Message) -> None:
        raise ValueError(f"order {message.data.decode()} has no amount")

    caplog.set_level(logging.INFO, logger="reliable_sub")
    broker.publish_sync("orders", b"C-3")
    task = await serving(sub, clock)
    await drive_until(clock, lambda: sub.stats[Outcome.DEAD_LETTERED] == 1, 60, what="DLQ")
    await sub.shutdown(timeout=1)
    await task

    records = [r for r in caplog.records if r.name.startswith("reliable_sub")]
    failures = [r for r in records if "failed (attempt" in r.getMessage()]
    assert [r.levelno for r in failures] == [logging.WARNING, logging.WARNING]
    assert failures[0].exc_info is not None, "the first failure carries its traceback"
    assert failures[1].exc_info is None, "later attempts do not repeat it"
    assert failures[0].message_id == "1" and failures[0].subscription == "billing"  # type: ignore[attr-defined]
    assert failures[0].outcome == "retried" and failures[0].failures == 1  # type: ignore[attr-defined]
    [dead] = [r for r in records if "dead-lettered" in r.getMessage()]
    assert dead.levelno == logging.ERROR
    assert "order C-3 has no amount" in dead.getMessage()
    lifecycle = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert any(m.startswith("started: subscriptions ['billing']") for m in lifecycle)
    assert any(m.startswith("stop requested") for m in lifecycle)
    assert any(m.startswith("drained") for m in lifecycle)
    assert any(m.startswith("stopped: {") and "dead_lettered" in m for m in lifecycle)
    assert capsys.readouterr().out == "", "nothing is printed on stdout"


async def test_an_ack_the_broker_refuses_is_not_counted_as_acked() -> None:
    class Refusing(MemoryAdapter):
        async def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
            await super().ack(deliveries)
            return list(deliveries)  # as after a takeover: the ack id was stale

    clock = ManualClock()
    broker = Refusing(clock=clock)
    broker.ensure_subscription_sync("orders", "billing")
    seen: list[Outcome] = []
    sub = Subscriber(broker, clock=clock, on_outcome=lambda m, o: seen.append(o))
    sub.handler("billing")(lambda message: None)
    broker.publish_sync("orders", b"x")
    task = await serving(sub, clock)
    await drive_until(clock, lambda: bool(seen), 10, what="settle")
    await sub.shutdown(timeout=1)
    await task
    assert seen == [Outcome.ACK_REFUSED]
    assert sub.stats[Outcome.ACKED] == 0
    assert sub.stats.acks_refused == 1


async def test_a_claim_that_lapsed_under_its_handler_is_fenced_off() -> None:
    class NoRenewals(MemoryDedupStore):
        async def renew(self, claims, lease_ttl):  # type: ignore[no-untyped-def]
            raise ConnectionError("store unreachable")

    clock, broker, _ = setup()
    store = NoRenewals(clock=clock)
    peer = MemoryDedupStore(clock=clock, owner="peer")
    peer._records, peer._lock = store._records, store._lock
    sub = Subscriber(broker, clock=clock, dedup=store)
    release = asyncio.Event()
    tokens: list[str] = []

    @sub.handler("billing")
    async def charge(message: Message) -> str:
        claim = current_claim()
        assert claim is not None
        tokens.append(claim.token)
        await release.wait()
        return "charged"

    broker.publish_sync("orders", b"x", {"idempotency-key": "pay-1"})
    task = await serving(sub, clock)
    await drive_until(clock, lambda: bool(tokens), 5, what="handler start")
    key = DedupKey(broker.dedup_namespace("billing"), "pay-1")
    clock.advance(60)  # the claim lapses: renewals fail
    taken = await peer.claim(key, 3600)
    assert isinstance(taken, Claimed) and taken.token != tokens[0]
    release.set()
    await drive_until(clock, lambda: sub.stats.lost_claims == 1, 30, what="the fenced completion")
    await sub.shutdown(timeout=1)
    await task
    assert isinstance(await store.claim(key, 10), InProgress), "the peer's claim is untouched"
    assert tokens[0].startswith(store.owner)


async def test_a_crashed_loop_is_logged_restarted_and_reported_unhealthy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from reliable_sub._runtime.receiver import Receiver

    clock, broker, sub = setup()
    handled: list[bytes] = []
    sub.handler("billing")(lambda message: handled.append(message.data))
    original = Receiver._admit
    crashes = [RuntimeError("a bug in the receive loop")]

    async def admit_with_a_bug(self, lane, deliveries):  # type: ignore[no-untyped-def]
        if crashes:
            await self.config.adapter.nack(deliveries, 0)  # what the bug leaves: redelivered
            raise crashes.pop()
        return await original(self, lane, deliveries)

    caplog.set_level(logging.ERROR, logger="reliable_sub")
    Receiver._admit = admit_with_a_bug  # type: ignore[method-assign]
    try:
        broker.publish_sync("orders", b"x")
        task = await serving(sub, clock)
        await drive_until(clock, lambda: not crashes, 5, what="the crash")
        assert not sub.healthy(), "a loop being restarted is not healthy"
        assert sub.running
        await drive_until(clock, lambda: handled == [b"x"], 30, what="the restarted loop")
        clock.advance(5)
        assert sub.healthy()
        await sub.shutdown(timeout=1)
        await task
    finally:
        Receiver._admit = original  # type: ignore[method-assign]
    [error] = [r for r in caplog.records if "receive loop of 'billing' failed" in r.getMessage()]
    assert error.exc_info is not None and "restarting it" in error.getMessage()


async def test_a_handler_that_swallows_its_cancellation_cannot_hang_the_stop(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from reliable_sub._runtime import shutdown as _runtime

    monkeypatch.setattr(_runtime, "CANCEL_GRACE", 0.1)
    clock, broker, sub = setup(dedup=MemoryDedupStore())
    started = asyncio.Event()
    stubborn = asyncio.Event()

    @sub.handler("billing")
    async def stubborn_handler(message: Message) -> None:
        started.set()
        while not stubborn.is_set():
            try:
                await stubborn.wait()
            except asyncio.CancelledError:
                continue  # swallowed

    broker.publish_sync("orders", b"x")
    task = await serving(sub, clock)
    await drive_until(clock, started.is_set, 5, what="start")
    await asyncio.wait_for(sub.shutdown(timeout=0.05), 10)
    await task
    stubborn.set()
    assert "ignored its cancellation" in caplog.text
    assert sub.stats[Outcome.STOPPED] == 1


async def test_a_loop_whose_cancellation_is_lost_cannot_hang_the_stop(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before Python 3.12, asyncio.wait_for loses a cancellation that arrives as the call it
    awaits completes, and carries on (redis-py sends every command through it): a background
    loop cancelled there runs on, and a stop waiting for it never ended. It is cancelled
    again."""
    from opentelemetry.sdk.metrics import MeterProvider

    from reliable_sub._runtime import supervisor

    monkeypatch.setattr(supervisor, "CANCEL_AGAIN_AFTER", 0.05)
    clock, broker, sub = setup(meter_provider=MeterProvider())
    sub.handler("billing")(lambda message: None)
    sampling = asyncio.Event()
    cancellations = 0
    real_stats = broker.subscription_stats

    async def stats_losing_a_cancellation(subscription: str):  # type: ignore[no-untyped-def]
        nonlocal cancellations
        sampling.set()
        while True:  # one sample that takes long, and loses the first cancellation
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancellations += 1
                if cancellations > 1:
                    raise
        return await real_stats(subscription)

    monkeypatch.setattr(broker, "subscription_stats", stats_losing_a_cancellation)
    caplog.set_level(logging.WARNING, logger="reliable_sub")
    task = await serving(sub, clock)
    await drive_until(clock, sampling.is_set, 5, what="the backlog sampler's first sample")
    stopping = asyncio.ensure_future(sub.shutdown(timeout=1))
    done, _ = await asyncio.wait({task}, timeout=10)
    assert done, "the stop waits for ever for the backlog sampler"
    await stopping
    assert cancellations == 2
    assert "backlog sampler still runs" in caplog.text and "cancelling it again" in caplog.text


async def test_max_lease_duration_bounds_an_async_handler_too() -> None:
    clock, broker, sub = setup(lease=LeasePolicy(max_lease_duration=30),
                               dedup=MemoryDedupStore())
    starts: list[float] = []

    @sub.handler("billing")
    async def forever(message: Message) -> None:
        starts.append(clock.now())
        await asyncio.Event().wait()

    broker.publish_sync("orders", b"x")
    task = await serving(sub, clock)
    await drive_until(clock, lambda: len(starts) == 2, 120, what="the retry")
    await sub.shutdown(timeout=0.1)
    await task
    assert 25 <= starts[1] - starts[0] <= 40
    assert sub.stats[Outcome.RETRY] == 1
