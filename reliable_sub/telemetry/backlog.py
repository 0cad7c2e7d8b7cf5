"""What each subscription holds at the broker, as gauges: the operator's "which consumer is
behind, and by how much".

While metrics are recorded (an SDK meter provider), a run asks the adapter for each of its
subscriptions' figures (:class:`~reliable_sub.ports.Inspectable`, one or two round trips to
the broker each) every ``TelemetryPolicy.backlog_interval`` seconds, off the delivery path, and
keeps the last answer for the reader:

=========================================  ===============================================
``reliable_sub.subscription.backlog``      messages not yet acked, delivered or not
``reliable_sub.subscription.unacked``      of those, delivered and not yet acked or given back
``reliable_sub.subscription.oldest_age``   seconds since the oldest unacked one was published
=========================================  ===============================================

A figure the broker does not tell (the Pub/Sub emulator tells none: Cloud Monitoring holds them)
has no point at all rather than a zero; neither has one whose last sample failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from ..clock import Clock
from ..ports import Inspectable
from . import semconv as sc

logger = logging.getLogger("reliable_sub.subscriber")


class _Latest:
    """One gauge's last values, one per attribute set (None: no point)."""

    def __init__(self) -> None:
        self.values: dict[frozenset[tuple[str, Any]], tuple[dict[str, Any], float | None]] = {}

    def set(self, attributes: dict[str, Any], value: float | None) -> None:
        self.values[frozenset(attributes.items())] = (attributes, value)

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(value, attributes)
                for attributes, value in list(self.values.values()) if value is not None]


class HealthGauge:
    """``reliable_sub.consumer.healthy``: 1 while the running Subscriber on this meter is
    healthy, 0 while not (no point between runs)."""

    def __init__(self, meter: Meter) -> None:
        self._source: tuple[dict[str, Any], Callable[[], bool]] | None = None
        meter.create_observable_gauge(
            sc.CONSUMER_HEALTHY, [self.observe], unit="1",
            description="1 while the Subscriber is running and handling (healthy()), 0 while "
                        "not: a loop being restarted, or a call it depends on failing for "
                        "unhealthy_after seconds.")

    def watch(self, attributes: dict[str, Any], healthy: Callable[[], bool]) -> None:
        self._source = (attributes, healthy)

    def unwatch(self) -> None:
        self._source = None

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        source = self._source
        if source is None:
            return []
        attributes, healthy = source
        return [Observation(1 if healthy() else 0, attributes)]


class BacklogGauges:
    """The three gauges on one meter, and their last values."""

    def __init__(self, meter: Meter) -> None:
        self.backlog, self.unacked, self.oldest_age = _Latest(), _Latest(), _Latest()
        meter.create_observable_gauge(
            sc.SUBSCRIPTION_BACKLOG, [self.backlog.observe], unit="{message}",
            description="Messages of the subscription not yet acked at the broker, delivered "
                        "or not (sampled every TelemetryPolicy.backlog_interval).")
        meter.create_observable_gauge(
            sc.SUBSCRIPTION_UNACKED, [self.unacked.observe], unit="{message}",
            description="Messages of the subscription delivered to any consumer and not yet "
                        "acked or given back.")
        meter.create_observable_gauge(
            sc.SUBSCRIPTION_OLDEST_AGE, [self.oldest_age.observe], unit="s",
            description="Seconds since the oldest unacked message of the subscription was "
                        "published.")


@dataclass
class Sampled:
    """One subscription to sample, and the attributes of its points."""

    subscription: str
    attributes: dict[str, Any]


class BacklogSampler:
    """Samples each subscription's figures every ``interval`` seconds into ``gauges``."""

    def __init__(self, adapter: Inspectable, gauges: BacklogGauges,
                 subscriptions: Sequence[Sampled], clock: Clock, interval: float) -> None:
        self._adapter = adapter
        self._gauges = gauges
        self._subscriptions = subscriptions
        self._clock = clock
        self._interval = interval
        self._failing: set[str] = set()  # logged once per streak of failures

    async def run(self) -> None:
        """Sample now, then every ``interval`` seconds, until cancelled."""
        while True:
            for sampled in self._subscriptions:
                await self.sample(sampled)
            await self._clock.sleep(self._interval)

    async def sample(self, sampled: Sampled) -> None:
        gauges, attributes = self._gauges, sampled.attributes
        try:
            figures = await self._adapter.subscription_stats(sampled.subscription)
        except Exception as error:
            if sampled.subscription not in self._failing:
                self._failing.add(sampled.subscription)
                logger.warning("sampling the backlog of %r failed (its gauges have no point "
                               "until a sample succeeds): %s", sampled.subscription, error)
            for gauge in (gauges.backlog, gauges.unacked, gauges.oldest_age):
                gauge.set(attributes, None)
            return
        self._failing.discard(sampled.subscription)
        oldest = figures.oldest_unacked_age
        if oldest is None and figures.backlog == 0:
            oldest = 0.0  # caught up: nothing waits (an unknown backlog stays unknown)
        gauges.backlog.set(attributes, figures.backlog)
        gauges.unacked.set(attributes, figures.in_flight)
        gauges.oldest_age.set(attributes, oldest)


__all__ = ["BacklogGauges", "BacklogSampler", "HealthGauge", "Sampled"]
