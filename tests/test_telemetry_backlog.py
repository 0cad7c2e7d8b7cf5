"""Each subscription's backlog at the broker as gauges (#28): sampled off the delivery path
while metrics are recorded, one broker call per subscription per interval; a figure the broker
does not tell, or a failed sample, has no point rather than a made-up zero."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from reliable_sub import (
    ConfigurationError,
    ManualClock,
    Message,
    Outcome,
    RetryPolicy,
    Subscriber,
    TelemetryPolicy,
)
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.ports import SubscriptionStats
from reliable_sub.testing.otel import Recorded, recording_telemetry
from reliable_sub.testing.timing import drive_until
from tests.memory_world import serving

INTERVAL = 10.0
BACKLOG, UNACKED, OLDEST = ("reliable_sub.subscription.backlog",
                            "reliable_sub.subscription.unacked",
                            "reliable_sub.subscription.oldest_age")


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    with recording_telemetry() as recorded:
        yield recorded


class CountingAdapter(MemoryAdapter):
    """The MemoryAdapter, counting its figure calls; ``figures`` replaces its answers."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock=clock)
        self.stats_calls = 0
        self.figures: Any = None  # None: the real ones; an exception: raised

    async def subscription_stats(self, subscription: str) -> SubscriptionStats:
        self.stats_calls += 1
        if isinstance(self.figures, BaseException):
            raise self.figures
        if self.figures is not None:
            return self.figures
        return await super().subscription_stats(subscription)


def world(interval: float | None = INTERVAL) -> tuple[ManualClock, CountingAdapter, Subscriber]:
    clock = ManualClock()
    broker = CountingAdapter(clock)
    broker.ensure_subscription_sync("orders", "billing")
    sub = Subscriber(broker, clock=clock, retry=RetryPolicy(min_backoff=1, max_backoff=2),
                     telemetry=TelemetryPolicy(backlog_interval=interval))
    return clock, broker, sub


def gauge(recorded: Recorded, name: str) -> dict[str, float]:
    return {point.attributes["messaging.destination.subscription.name"]: point.value
            for point in recorded.points(name)}


async def test_the_backlog_unacked_and_oldest_age_of_each_subscription(
        recorded: Recorded) -> None:
    clock, broker, sub = world()
    broker.ensure_subscription_sync("orders", "audit")
    release = asyncio.Event()
    held: list[str] = []

    @sub.handler("billing")
    async def charge(message: Message) -> None:
        held.append(message.id)
        await release.wait()

    sub.handler("audit")(lambda message: None)
    for n in range(5):
        broker.publish_sync("orders", f"m-{n}".encode())
    task = await serving(sub, clock)
    try:
        await drive_until(clock, lambda: len(held) == 5 and sub.stats[Outcome.ACKED] == 5,
                          60, what="billing holding five, audit acking five")
        calls = broker.stats_calls
        clock.advance(INTERVAL)  # the next sample
        await drive_until(clock, lambda: broker.stats_calls == calls + 2, 1,
                          what="one sample of each subscription")
        assert gauge(recorded, BACKLOG) == {"billing": 5, "audit": 0}
        assert gauge(recorded, UNACKED) == {"billing": 5, "audit": 0}
        ages = gauge(recorded, OLDEST)
        assert ages["audit"] == 0.0, "caught up: nothing waits"
        assert ages["billing"] >= INTERVAL
        release.set()
        await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 10, 60, what="the acks")
        calls = broker.stats_calls
        clock.advance(INTERVAL)
        await drive_until(clock, lambda: broker.stats_calls == calls + 2, 1, what="a sample")
        assert gauge(recorded, BACKLOG) == {"billing": 0, "audit": 0}
        assert gauge(recorded, OLDEST) == {"billing": 0.0, "audit": 0.0}
    finally:
        release.set()
        await sub.shutdown(timeout=1)
        await task


async def test_figures_the_broker_does_not_tell_and_failed_samples_have_no_point(
        recorded: Recorded, caplog: pytest.LogCaptureFixture) -> None:
    clock, broker, sub = world()
    broker.figures = SubscriptionStats(None, None, None, 10.0)  # as the Pub/Sub emulator
    sub.handler("billing")(lambda message: None)
    task = await serving(sub, clock)
    try:
        await drive_until(clock, lambda: broker.stats_calls >= 1, 1, what="a sample")
        assert gauge(recorded, BACKLOG) == gauge(recorded, UNACKED) == {}
        assert gauge(recorded, OLDEST) == {}, "an unknown backlog is not a caught-up one"
        broker.figures = None
        clock.advance(INTERVAL)
        await drive_until(clock, lambda: broker.stats_calls >= 2, 1, what="a sample")
        assert gauge(recorded, BACKLOG) == {"billing": 0}
        broker.figures = ConnectionError("the broker went away")
        for calls in (3, 4):
            clock.advance(INTERVAL)
            await drive_until(clock, lambda c=calls: broker.stats_calls >= c, 1, what="a sample")
        assert gauge(recorded, BACKLOG) == {}, "no stale value after a failed sample"
        warnings = [r for r in caplog.records if "sampling the backlog" in r.getMessage()]
        assert len(warnings) == 1, "logged once per streak of failures"
        assert "the broker went away" in warnings[0].getMessage()
        assert sub.healthy(), "a failed sample is not a failure to handle messages"
    finally:
        await sub.shutdown(timeout=1)
        await task


@pytest.mark.parametrize(("interval", "metrics"), [(INTERVAL, False), (None, True)])
async def test_nothing_is_sampled_without_metrics_or_with_no_interval(
        interval: float | None, metrics: bool) -> None:
    clock, broker, sub = world(interval)
    sub.handler("billing")(lambda message: None)
    broker.publish_sync("orders", b"x")
    with recording_telemetry() if metrics else contextlib.nullcontext():
        task = await serving(sub, clock)
        try:
            await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 1, 60,
                              what="the message")
            for _ in range(3):
                clock.advance(INTERVAL)
                await drive_until(clock, lambda: True, 1)
        finally:
            await sub.shutdown(timeout=1)
            await task
    assert broker.stats_calls == 0


@pytest.mark.parametrize("interval", [0, -1.0, float("inf"), float("nan"), "15", True])
def test_a_backlog_interval_that_is_not_seconds_is_refused(interval: object) -> None:
    with pytest.raises(ConfigurationError, match="backlog_interval"):
        TelemetryPolicy(backlog_interval=interval)  # type: ignore[arg-type]


async def test_the_health_gauge_is_healthy_as_it_goes_and_has_no_point_between_runs(
        recorded: Recorded) -> None:
    """#28: reliable_sub.consumer.healthy, 1 or 0 as healthy() says (the alert's input)."""
    from tests.test_subscriber import FlakyBroker

    clock = ManualClock()
    broker = FlakyBroker(clock=clock)
    broker.ensure_subscription_sync("t", "s")
    sub = Subscriber(broker, clock=clock, unhealthy_after=30)
    sub.handler("s")(lambda message: None)

    def healthy() -> list[float]:
        return [point.value for point in recorded.points("reliable_sub.consumer.healthy")]

    assert healthy() == [], "not running: no point"
    task = await serving(sub, clock)
    try:
        assert healthy() == [1]
        broker.failures["receive"] = 10_000
        await drive_until(clock, lambda: not sub.healthy(), 60.0, what="unhealthy")
        assert healthy() == [0]
        broker.failures["receive"] = 0
        await drive_until(clock, sub.healthy, 60.0, what="healthy again")
        assert healthy() == [1]
    finally:
        await sub.shutdown(timeout=1)
        await task
    assert healthy() == [], "stopped: no point"


async def test_figures_the_broker_only_estimates_are_marked_approximate() -> None:
    """#49: SQS's counts are estimates: their points say so (the oldest age, none on SQS, is
    not an estimate of theirs)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from reliable_sub.clock import SystemClock
    from reliable_sub.telemetry.backlog import APPROXIMATE, BacklogSampler, Sampled
    from reliable_sub.telemetry.instruments import BacklogGauges

    class Estimating:
        approximate = True

        async def subscription_stats(self, subscription: str) -> SubscriptionStats:
            return SubscriptionStats(7, 2, None, 30.0, approximate=self.approximate)

    reader = InMemoryMetricReader()
    gauges = BacklogGauges(MeterProvider(metric_readers=[reader]).get_meter("test"))
    adapter = Estimating()
    sampled = Sampled("billing", {"messaging.destination.subscription.name": "billing"})
    sampler = BacklogSampler(adapter, gauges, [sampled], SystemClock(), 60)
    await sampler.sample(sampled)

    def points() -> dict[str, list[tuple[float, bool]]]:
        data = reader.get_metrics_data()
        found: dict[str, list[tuple[float, bool]]] = {}
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    found[metric.name] = [(p.value, bool((p.attributes or {}).get(APPROXIMATE)))
                                          for p in metric.data.data_points]
        return found

    assert points()["reliable_sub.subscription.backlog"] == [(7, True)]
    assert points()["reliable_sub.subscription.unacked"] == [(2, True)]
    adapter.approximate = False
    await sampler.sample(sampled)
    assert (7, False) in points()["reliable_sub.subscription.backlog"]
