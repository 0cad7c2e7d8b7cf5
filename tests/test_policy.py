from __future__ import annotations

import random

import pytest

from reliable_sub import (
    ConfigurationError,
    DeadLetterPolicy,
    FlowControl,
    LeasePolicy,
    MemoryDedupStore,
    RetryPolicy,
    Subscriber,
)
from reliable_sub.adapters.memory import MemoryAdapter


@pytest.mark.parametrize(
    ("factory", "field", "allowed"),
    [
        (lambda: LeasePolicy(min_extension=0), "min_extension", "(0, inf)"),
        (lambda: LeasePolicy(min_extension=20, max_extension=10), "max_extension", "[20, inf)"),
        (lambda: LeasePolicy(max_lease_duration=-1), "max_lease_duration", "(0, inf)"),
        (lambda: LeasePolicy(percentile=101), "percentile", "(0, 100]"),
        (lambda: LeasePolicy(percentile=float("nan")), "percentile", "(0, 100]"),
        (lambda: RetryPolicy(min_backoff=-1), "min_backoff", "[0, inf)"),
        (lambda: RetryPolicy(min_backoff=5, max_backoff=1), "max_backoff", "[5, inf)"),
        (lambda: RetryPolicy(in_process_attempts=0), "in_process_attempts", "[1, inf)"),
        (lambda: RetryPolicy(retry_on=(ValueError, "x")), "retry_on", "exception types"),
        (lambda: DeadLetterPolicy(""), "topic", "non-empty"),
        (lambda: DeadLetterPolicy("dlq", 0), "max_delivery_attempts", "[1, 1000]"),
        (lambda: FlowControl(max_messages=0), "max_messages", "[1, inf)"),
        (lambda: FlowControl(max_bytes=-5), "max_bytes", "[1, inf)"),
    ],
)
def test_invalid_values_name_the_field_and_the_allowed_range(factory, field, allowed) -> None:
    with pytest.raises(ValueError) as raised:
        factory()
    assert isinstance(raised.value, ConfigurationError)
    assert field in str(raised.value)
    assert allowed in str(raised.value)


def test_policies_are_frozen() -> None:
    policy = LeasePolicy()
    with pytest.raises(AttributeError):
        policy.min_extension = 1  # type: ignore[misc]


def test_backoff_grows_exponentially_with_bounded_jitter() -> None:
    policy = RetryPolicy(min_backoff=10, max_backoff=100)
    rng = random.Random(7)
    for attempt, base in [(1, 10), (2, 20), (3, 40), (4, 80)]:
        delays = [policy.backoff(attempt, rng) for _ in range(200)]
        assert min(delays) >= base
        assert max(delays) <= min(100, base * 1.25)
        assert max(delays) <= policy.max_backoff_for(attempt)
        assert len(set(delays)) > 1, "no jitter"
    assert policy.backoff(50, rng) == 100
    assert policy.max_backoff_for(1000) == 100


def test_dedup_window_shorter_than_the_redelivery_span_is_refused() -> None:
    broker = MemoryAdapter()
    retry = RetryPolicy(min_backoff=10, max_backoff=100)
    lease = LeasePolicy(max_lease_duration=600)
    # backoffs for attempts 1..4: 12.5 + 25 + 50 + 100 = 187.5; plus 600 of lease
    with pytest.raises(ConfigurationError) as raised:
        Subscriber(broker, dedup=MemoryDedupStore(), retry=retry, lease=lease,
                   dead_letter=DeadLetterPolicy("dlq", 5), dedup_ttl=700)
    message = str(raised.value)
    assert "dedup_ttl=700s" in message and "787.5s" in message
    Subscriber(broker, dedup=MemoryDedupStore(), retry=retry, lease=lease,
               dead_letter=DeadLetterPolicy("dlq", 5), dedup_ttl=787.5)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"dedup_ttl": 0}, "dedup_ttl"), ({"sync_workers": 0}, "sync_workers"),
     ({"receive_batch": 0}, "receive_batch"), ({"receive_timeout": -1}, "receive_timeout")],
)
def test_bad_subscriber_arguments_are_refused(kwargs, field) -> None:
    with pytest.raises(ConfigurationError, match=field):
        Subscriber(MemoryAdapter(), **kwargs)
