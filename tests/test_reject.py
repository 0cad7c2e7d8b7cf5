"""Permanent failures (``Reject``, ``RetryPolicy.non_retryable``) without a dead-letter policy:
nothing is dropped. (With one, the shipped adapter suite runs them on every adapter:
reliable_sub/testing/adapter_suite/failures.py.)"""

from __future__ import annotations

import logging

import pytest

from reliable_sub import ConfigurationError, Message, Outcome, Reject, RetryPolicy
from tests.memory_world import serve_until, setup


async def test_without_a_dead_letter_policy_a_rejection_is_logged_and_redelivered_late(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, broker, sub = setup(retry=RetryPolicy(min_backoff=1, max_backoff=300))
    calls: list[float] = []

    @sub.handler("billing")
    async def handle(message: Message) -> None:
        calls.append(clock.now())
        raise Reject("no such account")

    broker.publish_sync("orders", b"order-1")
    await serve_until(sub, lambda: len(calls) == 2, "the redelivery", 1000, clock)
    assert calls[1] - calls[0] >= 300, "redelivered after max_backoff, not min_backoff"
    assert sub.stats[Outcome.RETRY] >= 1 and sub.stats["rejected"] == 0
    [record] = [r for r in caplog.records if "rejected" in r.getMessage()][:1]
    assert record.levelno == logging.ERROR
    assert "no such account" in record.getMessage()
    assert "no dead-letter policy" in record.getMessage()


def test_non_retryable_must_be_exception_types() -> None:
    with pytest.raises(ConfigurationError, match="non_retryable must be a tuple of exception"):
        RetryPolicy(non_retryable=(KeyError, "ValueError"))  # type: ignore[arg-type]


def test_what_counts_as_permanent() -> None:
    policy = RetryPolicy(non_retryable=(KeyError,))
    assert policy.is_permanent(Reject("x"))
    assert policy.is_permanent(KeyError("x"))
    assert not policy.is_permanent(ValueError("x"))
    assert not policy.is_permanent(None)
    assert not RetryPolicy().is_permanent(KeyError("x"))


async def test_a_rejection_s_span_says_why_it_was_dead_lettered() -> None:
    from reliable_sub import DeadLetterPolicy
    from reliable_sub.testing.otel import recording_telemetry

    with recording_telemetry() as recorded:
        clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", 5))

        @sub.handler("billing")
        async def handle(message: Message) -> None:
            raise Reject("no such account")

        broker.publish_sync("orders", b"order-1")
        await serve_until(sub, lambda: sub.stats[Outcome.DEAD_LETTERED] == 1,
                          "the dead letter", 100, clock)
        [span] = recorded.spans("process billing")
    assert span.attributes is not None
    assert span.attributes["error.type"] == "reliable_sub.errors.Reject"
    [event] = [e for e in span.events if e.name == "reliable_sub.dead_letter.published"]
    assert event.attributes is not None
    assert event.attributes["reliable_sub.dead_letter.reason"] == "rejected"
