"""A subscription's figures (adapters with the ``Inspectable`` capability)."""

from __future__ import annotations

import asyncio
import time

import pytest

from reliable_sub.ports import Inspectable
from reliable_sub.testing.harness import Harness

# Real seconds a broker may take to apply an ack it has confirmed (generous: a loaded machine).
ACK_APPLIED_WITHIN = 20.0


async def test_stats_count_the_backlog_and_what_is_in_flight(harness: Harness) -> None:
    adapter = await harness.adapter()
    if not isinstance(adapter, Inspectable):
        pytest.skip(f"{harness.name} reports no figures")
    topic, sub = await harness.topic_and_subscription()
    empty = await adapter.subscription_stats(sub)
    assert empty.ack_deadline == harness.ack_deadline
    if empty.backlog is None:  # the broker reports no backlog (Pub/Sub: Cloud Monitoring)
        assert empty.in_flight is None
        return
    assert (empty.backlog, empty.in_flight, empty.oldest_unacked_age) == (0, 0, None)
    for n in range(3):
        await adapter.publish(topic, f"m-{n}".encode())
    [taken] = await harness.receive(adapter, sub, timeout=harness.tick, max_messages=1)
    await harness.pass_time(harness.tick)

    figures = await adapter.subscription_stats(sub)
    assert (figures.backlog, figures.in_flight) == (3, 1)
    assert figures.oldest_unacked_age is not None
    assert harness.tick * 0.9 <= figures.oldest_unacked_age < 10 * harness.ack_deadline
    assert await adapter.ack([taken]) == []
    # A broker may apply an ack after confirming its receipt (JetStream queues acks for the
    # consumer to process): poll until its figures have it, then compare exactly.
    give_up = time.monotonic() + ACK_APPLIED_WITHIN
    after = await adapter.subscription_stats(sub)
    while after.in_flight != 0 and time.monotonic() < give_up:
        await asyncio.sleep(0.02)
        after = await adapter.subscription_stats(sub)
    assert (after.backlog, after.in_flight) == (2, 0)
