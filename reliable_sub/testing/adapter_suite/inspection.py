"""A subscription's figures (adapters with the ``Inspectable`` capability)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from reliable_sub.ports import Inspectable, Prefetches, SubscriptionStats
from reliable_sub.testing.harness import Harness

# Real seconds a broker may take to apply an ack it has confirmed (generous: a loaded machine).
ACK_APPLIED_WITHIN = 20.0
# Between readings of figures that are not yet what is expected.
POLL = 0.02


async def test_stats_count_the_backlog_and_what_is_in_flight(harness: Harness) -> None:
    adapter = await harness.adapter()
    if not isinstance(adapter, Inspectable):
        pytest.skip(f"{harness.name} reports no figures")
    topic, sub = await harness.topic_and_subscription()
    lag = harness.features.figures_lag
    empty = await figures_once(adapter, sub, lag, lambda f: f.backlog is not None)
    assert empty.ack_deadline == harness.ack_deadline
    if empty.backlog is None:  # the broker reports no backlog (Pub/Sub: Cloud Monitoring)
        assert empty.in_flight is None
        return
    assert (empty.backlog, empty.in_flight, empty.oldest_unacked_age) == (0, 0, None)
    pushes = isinstance(adapter, Prefetches)
    if isinstance(adapter, Prefetches):  # a broker that pushes ahead (RabbitMQ) counts what
        adapter.set_prefetch(sub, 1)     # it pushed as unacked: one at a time
    for n in range(3):
        await adapter.publish(topic, f"m-{n}".encode())
    [taken] = await harness.receive(adapter, sub, timeout=harness.tick, max_messages=1)
    await harness.pass_time(harness.tick)

    figures = await figures_once(adapter, sub, lag,
                                 lambda f: (f.backlog, f.in_flight) == (3, 1))
    assert (figures.backlog, figures.in_flight) == (3, 1)
    if harness.features.oldest_age:
        assert figures.oldest_unacked_age is not None
        assert harness.tick * 0.9 <= figures.oldest_unacked_age < 10 * harness.ack_deadline
    else:
        assert figures.oldest_unacked_age is None, "an age the broker does not tell is unknown"
    assert await adapter.ack([taken]) == []
    if pushes:  # it pushed the next one as the ack landed: closing gives that back
        await adapter.close()
    # A broker may apply an ack after confirming its receipt (JetStream queues acks for the
    # consumer to process): poll until its figures have it, then compare exactly.
    after = await figures_once(adapter, sub, ACK_APPLIED_WITHIN + lag,
                               lambda f: f.in_flight == 0)
    assert (after.backlog, after.in_flight) == (2, 0)


async def figures_once(adapter: Inspectable, subscription: str, within: float,
                       wanted: Callable[[SubscriptionStats], bool]) -> SubscriptionStats:
    """The first reading of ``subscription``'s figures that is ``wanted``, or the last one
    ``within`` seconds allow (the first, when that is 0)."""
    give_up = time.monotonic() + within
    figures = await adapter.subscription_stats(subscription)
    while not wanted(figures) and time.monotonic() < give_up:
        await asyncio.sleep(POLL)
        figures = await adapter.subscription_stats(subscription)
    return figures


__all__ = ["test_stats_count_the_backlog_and_what_is_in_flight"]
