"""Telemetry: a span per delivery attempt, linked to the producer's, and the consumer metrics.

Needs ``opentelemetry-sdk`` (the suite records with :func:`reliable_sub.testing.otel.
recording_telemetry`); without it these tests are skipped.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import pytest

from reliable_sub import DeadLetterPolicy, Message, Outcome
from reliable_sub.testing.harness import Harness, Recorder

CONSUMED = "messaging.client.consumed.messages"


def _recording() -> AbstractContextManager[Any]:
    otel = pytest.importorskip("reliable_sub.testing.otel", reason="needs opentelemetry-sdk")
    recording: AbstractContextManager[Any] = otel.recording_telemetry()
    return recording


async def test_each_attempt_is_a_span_linked_to_the_producer_with_its_outcome(
    harness: Harness,
) -> None:
    from opentelemetry.trace import SpanKind, StatusCode

    with _recording() as recorded:
        adapter = await harness.adapter()
        topic, sub = await harness.topic_and_subscription()
        recorder = Recorder()
        subscriber = harness.subscriber(adapter, on_outcome=recorder)
        attempts: list[int] = []

        @subscriber.handler(sub)
        async def flaky(message: Message) -> None:
            attempts.append(message.delivery_attempt)
            if len(attempts) < 3:
                raise ConnectionError(f"not yet (attempt {len(attempts)})")

        message_id = await adapter.publish(topic, b"flaky", {"order": "42"})
        async with harness.serving(subscriber):
            await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 1,
                                     30 * harness.ack_deadline, "the third attempt")
        [send] = recorded.spans(f"send {topic}")
        spans = recorded.spans(f"process {sub}")
        failures = recorded.sum(CONSUMED, **{"reliable_sub.outcome": "retried"})
        successes = recorded.sum(CONSUMED, **{"reliable_sub.outcome": "acked"})
        durations = recorded.count("messaging.process.duration",
                                   **{"messaging.destination.name": topic})
        succeeded_on = {point.attributes["reliable_sub.delivery.attempt"]: point.value
                        for point in recorded.points("reliable_sub.delivery.attempts")}

    assert send.kind is SpanKind.PRODUCER
    assert [s.attributes["reliable_sub.delivery_attempt"] for s in spans] == [1, 2, 3]
    assert [s.attributes["reliable_sub.outcome"] for s in spans] == ["retried", "retried",
                                                                      "acked"]
    system = harness.capabilities.messaging_system
    for span in spans:
        assert span.kind is SpanKind.CONSUMER
        assert [(link.context.trace_id, link.context.span_id) for link in span.links] == \
            [(send.context.trace_id, send.context.span_id)], "linked to the producer"
        assert span.context.trace_id != send.context.trace_id, "a trace of its own (a link)"
        attributes = span.attributes
        assert attributes["messaging.system"] == system
        assert attributes["messaging.operation.type"] == "process"
        assert attributes["messaging.destination.name"] == topic
        assert sub in (attributes.get("messaging.destination.subscription.name"),
                       attributes.get("messaging.consumer.group.name"))
        assert attributes["messaging.message.id"] == message_id
        assert attributes["messaging.message.body.size"] == len(b"flaky")
        assert "reliable_sub.idempotency_key" in attributes
        assert attributes["reliable_sub.idempotency_key"] != message_id, "hashed by default"
    for span in spans[:2]:
        assert span.status.status_code is StatusCode.ERROR
        assert span.attributes["error.type"] == "ConnectionError"
        assert [e.name for e in span.events if e.name == "exception"] == ["exception"]
    assert spans[2].status.status_code is StatusCode.UNSET
    assert (failures, successes, durations) == (2, 1, 3)
    assert succeeded_on == {"3": 1}, "one message acked, counted by the attempt it succeeded on"


async def test_a_duplicate_ends_its_span_as_duplicate(harness: Harness) -> None:
    with _recording() as recorded:
        adapter = await harness.adapter()
        topic, sub = await harness.topic_and_subscription()
        recorder = Recorder()
        subscriber = harness.subscriber(adapter, dedup=harness.dedup_store(),
                                        on_outcome=recorder)
        handled: list[bytes] = []

        @subscriber.handler(sub)
        async def charge(message: Message) -> None:
            handled.append(message.data)

        async with harness.serving(subscriber):
            await adapter.publish(topic, b"charge", {"idempotency-key": "order-7"})
            await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 1,
                                     20 * harness.ack_deadline, "the first copy")
            await adapter.publish(topic, b"charge", {"idempotency-key": "order-7"})
            await harness.wait_until(lambda: recorder.count(Outcome.DUPLICATE) == 1,
                                     20 * harness.ack_deadline, "the duplicate")
        spans = recorded.spans(f"process {sub}")
        duplicates = recorded.sum("reliable_sub.dedup.duplicates")
    assert handled == [b"charge"]
    outcomes = [s.attributes["reliable_sub.outcome"] for s in spans]
    assert outcomes == ["acked", "duplicate"]
    verdicts = [[e.attributes["reliable_sub.dedup.verdict"] for e in s.events
                 if e.name == "reliable_sub.dedup"] for s in spans]
    assert verdicts == [["claimed"], ["completed"]]
    assert spans[0].attributes["reliable_sub.idempotency_key"] == \
        spans[1].attributes["reliable_sub.idempotency_key"]
    assert duplicates == 1


async def test_a_poison_message_ends_dead_lettered(harness: Harness) -> None:
    with _recording() as recorded:
        adapter = await harness.adapter()
        topic, sub = await harness.topic_and_subscription()
        dlq_topic, _ = await harness.topic_and_subscription()
        recorder = Recorder()
        subscriber = harness.subscriber(
            adapter, on_outcome=recorder,
            dead_letter=DeadLetterPolicy(dlq_topic, max_delivery_attempts=2))

        @subscriber.handler(sub)
        async def poison(message: Message) -> None:
            raise ValueError("cannot parse")

        await adapter.publish(topic, b"poison")
        async with harness.serving(subscriber):
            await harness.wait_until(lambda: recorder.count(Outcome.DEAD_LETTERED) == 1,
                                     30 * harness.ack_deadline, "dead-lettering")
        spans = recorded.spans(f"process {sub}")
        [dead_letter_send] = recorded.spans(f"send {dlq_topic}")
        dead_lettered = recorded.sum("reliable_sub.dead_lettered", **{
            "reliable_sub.dead_letter.reason": "max-delivery-attempts"})
    assert [s.attributes["reliable_sub.outcome"] for s in spans] == ["retried",
                                                                      "dead_lettered"]
    last = spans[-1]
    events = [e for e in last.events if e.name == "reliable_sub.dead_letter.published"]
    assert [e.attributes["reliable_sub.dead_letter.topic"] for e in events] == [dlq_topic]
    assert [e.attributes["reliable_sub.dead_letter.reason"] for e in events] == [
        "max-delivery-attempts"]
    assert last.attributes["error.type"] == "ValueError"
    assert dead_letter_send.parent is not None
    assert dead_letter_send.parent.span_id == last.context.span_id, \
        "the dead-letter publish is a child of the attempt that dead-lettered"
    assert dead_lettered == 1


__all__ = [
    "test_a_duplicate_ends_its_span_as_duplicate",
    "test_a_poison_message_ends_dead_lettered",
    "test_each_attempt_is_a_span_linked_to_the_producer_with_its_outcome",
]
