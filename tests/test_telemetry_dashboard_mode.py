"""The dashboard mode of tracing (``TelemetryPolicy.trace_first_attempts`` below 1): every
delivery that did not succeed on its first attempt has its span, first-try successes leave
nothing unless the ratio picked them, and a handler's child spans nest under a kept span and
are never recorded under a dropped one."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from opentelemetry import trace

from reliable_sub import (
    ConfigurationError,
    ManualClock,
    MemoryDedupStore,
    Message,
    Outcome,
    RetryPolicy,
    Subscriber,
    TelemetryPolicy,
)
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.testing.otel import Recorded, recording_telemetry
from reliable_sub.testing.timing import drive_until
from tests.memory_world import serving, setup

SPAN = "process billing"
CHILD = "charge the card"
MESSAGE_ID, ATTEMPT, OUTCOME = (
    "messaging.message.id", "reliable_sub.delivery_attempt", "reliable_sub.outcome")


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    with recording_telemetry() as recorded:
        yield recorded


def dashboard(**options: object) -> tuple[ManualClock, MemoryAdapter, Subscriber]:
    """``setup()``'s broker and topics, a Subscriber in the dashboard mode with a dedup store
    on the same clock."""
    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("orders", "billing")
    sub = Subscriber(broker, clock=clock, dedup=MemoryDedupStore(clock=clock),
                     retry=RetryPolicy(min_backoff=1, max_backoff=2),
                     telemetry=TelemetryPolicy(trace_first_attempts=0.0), **options)
    return clock, broker, sub


async def test_only_what_did_not_succeed_at_once_is_traced(recorded: Recorded) -> None:
    clock, broker, sub = dashboard()
    tracer = recorded.tracer_provider.get_tracer("the-app")
    current: list[tuple[bytes, int, bool, bool]] = []

    @sub.handler("billing")
    async def charge(message: Message) -> None:
        context = trace.get_current_span().get_span_context()
        current.append((message.data, message.delivery_attempt, context.is_valid,
                        context.trace_flags.sampled))
        with tracer.start_as_current_span(CHILD):
            pass
        if message.data == b"flaky" and message.delivery_attempt == 1:
            raise ConnectionError("the card network hung up")

    broker.publish_sync("orders", b"ok")
    flaky = broker.publish_sync("orders", b"flaky")
    broker.publish_sync("orders", b"dup", {"idempotency-key": "order-7"})
    copy = broker.publish_sync("orders", b"dup", {"idempotency-key": "order-7"})
    task = await serving(sub, clock)
    try:
        await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 3
                          and sub.stats[Outcome.DUPLICATE] == 1, 60, what="four deliveries")
    finally:
        await sub.shutdown(timeout=1)
        await task

    # first attempts ran under a valid, unsampled span of their own; the redelivery under its
    # recorded span
    assert sorted(current) == [(b"dup", 1, True, False), (b"flaky", 1, True, False),
                               (b"flaky", 2, True, True), (b"ok", 1, True, False)]
    spans = {(s.attributes[MESSAGE_ID], s.attributes[ATTEMPT]): s for s in recorded.spans(SPAN)}
    # the failed attempt and its redelivery; the copy, deferred while its twin ran (the same
    # receive), then a duplicate: no span of a first-try success
    assert {key: s.attributes[OUTCOME] for key, s in spans.items()} == {
        (flaky, 1): "retried", (flaky, 2): "acked", (copy, 1): "deferred",
        (copy, 2): "duplicate"}
    retried, again, deferred = spans[flaky, 1], spans[flaky, 2], spans[copy, 1]
    # made after the fact, as a span made at the start would have ended
    assert retried.status.status_code is trace.StatusCode.ERROR
    assert retried.attributes["error.type"] == "ConnectionError"
    assert retried.start_time is not None and retried.end_time is not None
    assert retried.start_time < retried.end_time
    [verdict] = [e for e in deferred.events if e.name == "reliable_sub.dedup"]
    assert verdict.attributes["reliable_sub.dedup.verdict"] == "in_progress"
    assert deferred.start_time <= verdict.timestamp <= deferred.end_time
    # children: only the kept span's, nested under it; none stray as a root of its own
    [child] = recorded.spans(CHILD)
    assert child.parent is not None and child.parent.span_id == again.context.span_id


async def test_the_ratio_picks_first_attempts_traced_in_full(recorded: Recorded) -> None:
    clock, broker, sub = setup(telemetry=TelemetryPolicy(trace_first_attempts=0.25),
                               rng=random.Random(7))
    picks = random.Random(7)
    expected = sum(picks.random() < 0.25 for _ in range(40))
    sub.handler("billing")(lambda message: None)
    for i in range(40):
        broker.publish_sync("orders", f"m{i}".encode())
    task = await serving(sub, clock)
    try:
        await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 40, 60, what="40 acks")
    finally:
        await sub.shutdown(timeout=1)
        await task
    assert 0 < expected < 40
    assert len(recorded.spans(SPAN)) == expected


@pytest.mark.parametrize("ratio", [1.5, -0.1, "0.5", True, float("nan")])
def test_a_ratio_that_is_not_a_share_is_refused(ratio: object) -> None:
    with pytest.raises(ConfigurationError, match="trace_first_attempts"):
        TelemetryPolicy(trace_first_attempts=ratio)  # type: ignore[arg-type]
