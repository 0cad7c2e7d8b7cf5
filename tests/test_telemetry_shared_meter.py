"""Several Subscribers recording on one MeterProvider (one per broker or per team in a
process): each one's metrics are reported. The SDK keeps the first observable instrument of a
name on a meter and silently drops a later one's callbacks, so instruments are shared per meter."""

from __future__ import annotations

import asyncio

from reliable_sub import ManualClock, Outcome, Subscriber
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.testing.otel import recording_telemetry
from reliable_sub.testing.timing import drive_until
from tests.memory_world import serving

CONSUMED = "messaging.client.consumed.messages"
SUBSCRIPTION = "messaging.destination.subscription.name"


async def test_two_subscribers_on_one_meter_provider_both_report() -> None:
    with recording_telemetry() as recorded:
        clock = ManualClock()
        subscribers = []
        for name, count in (("billing", 2), ("shipping", 3)):
            broker = MemoryAdapter(clock=clock)
            broker.ensure_subscription_sync("orders", name)
            sub = Subscriber(broker, clock=clock, meter_provider=recorded.meter_provider)
            sub.handler(name)(lambda message: None)
            for _ in range(count):
                broker.publish_sync("orders", b"x")
            subscribers.append(sub)
        tasks = [await serving(sub, clock) for sub in subscribers]
        try:
            await drive_until(clock, lambda: [s.stats[Outcome.ACKED] for s in subscribers]
                              == [2, 3], 10.0, what="both subscriptions drained")
            assert recorded.sum(CONSUMED, **{SUBSCRIPTION: "billing"}) == 2
            assert recorded.sum(CONSUMED, **{SUBSCRIPTION: "shipping"}) == 3
            assert [p.value for p in recorded.points("reliable_sub.consumer.healthy")] == [1]
        finally:
            for sub in subscribers:
                await sub.shutdown(timeout=1)
            await asyncio.gather(*tasks)
        assert recorded.points("reliable_sub.consumer.healthy") == []


async def test_one_unhealthy_subscriber_makes_the_shared_health_point_zero() -> None:
    from tests.test_subscriber import FlakyBroker

    with recording_telemetry() as recorded:
        clock = ManualClock()
        flaky = FlakyBroker(clock=clock)
        steady = MemoryAdapter(clock=clock)
        subscribers = []
        for broker in (steady, flaky):  # the healthy one first: its point must not win
            broker.ensure_subscription_sync("t", "s")
            sub = Subscriber(broker, clock=clock, unhealthy_after=30)
            sub.handler("s")(lambda message: None)
            subscribers.append(sub)
        tasks = [await serving(sub, clock) for sub in subscribers]
        try:
            flaky.failures["receive"] = 10_000
            await drive_until(clock, lambda: not subscribers[1].healthy(), 60.0,
                              what="the flaky one unhealthy")
            assert subscribers[0].healthy()
            assert [p.value for p in recorded.points("reliable_sub.consumer.healthy")] == [0]
        finally:
            for sub in subscribers:
                await sub.shutdown(timeout=1)
            await asyncio.gather(*tasks)


