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
has no point at all rather than a zero; neither has one whose last sample failed. Figures the
broker only estimates (SQS's) carry the attribute ``reliable_sub.figures.approximate: true``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..clock import Clock
from ..ports import Inspectable
from .instruments import BacklogGauges, Tallies

logger = logging.getLogger("reliable_sub.subscriber")


# On the points of figures the broker only estimates (SubscriptionStats.approximate).
APPROXIMATE = "reliable_sub.figures.approximate"


@dataclass
class Sampled:
    """One subscription to sample, and the attributes of its points."""

    subscription: str
    attributes: dict[str, Any]

    def __post_init__(self) -> None:
        self.estimated = {**self.attributes, APPROXIMATE: True}


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
                gauge.drop(attributes)
                gauge.drop(sampled.estimated)
            return
        self._failing.discard(sampled.subscription)
        oldest = figures.oldest_unacked_age
        if oldest is None and figures.backlog == 0:
            oldest = 0.0  # caught up: nothing waits (an unknown backlog stays unknown)
        counted = sampled.estimated if figures.approximate else attributes
        _set(gauges.backlog, counted, figures.backlog)
        _set(gauges.unacked, counted, figures.in_flight)
        _set(gauges.oldest_age, attributes, oldest)


def _set(gauge: Tallies, attributes: dict[str, Any], value: float | None) -> None:
    """``gauge``'s value under ``attributes`` now: None (unknown) is no point at all."""
    if value is None:
        gauge.drop(attributes)
    else:
        gauge.of(attributes).value = value


__all__ = ["BacklogSampler", "Sampled"]
