"""Policies: small frozen values that validate themselves on construction.

Every invalid value raises :class:`~reliable_sub.errors.ConfigurationError` (a ``ValueError``)
naming the field, the value given and the allowed range.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from .errors import ConfigurationError, Reject

# Redelivery delays are spread upward by up to this fraction so that a burst of failures does not
# come back as a burst; the upper bound is what the dedup window check has to cover.
BACKOFF_JITTER = 0.25


def _check_range(
    owner: str,
    name: str,
    value: float,
    low: float,
    high: float = math.inf,
    *,
    low_inclusive: bool = True,
) -> None:
    bracket = "[" if low_inclusive else "("
    upper = "inf)" if math.isinf(high) else f"{high:g}]"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(
            f"{owner}.{name} must be a number in {bracket}{low:g}, {upper}, got {value!r} "
            f"(a {type(value).__name__})"
        )
    ok_low = value >= low if low_inclusive else value > low
    if not (ok_low and value <= high) or math.isnan(value):
        raise ConfigurationError(
            f"{owner}.{name} must be in {bracket}{low:g}, {upper}, got {value!r}"
        )


def check_seconds(owner: str, name: str, value: object) -> float:
    """``value`` as float seconds; refuse anything but a number in (0, inf) (a bool too),
    naming ``owner.name``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigurationError(
            f"{owner}.{name} must be a number of seconds in (0, inf), got {value!r}"
        )
    return float(value)


def check_count(owner: str, name: str, value: object) -> None:
    """Refuse ``value`` unless it is an int of at least 1, naming ``owner.name``."""
    if not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{owner}.{name} must be an int in [1, inf), got {value!r}")


class _Default(float):
    """A default number of seconds, told apart from the same value given by a user: the
    Subscriber may fit it to what the broker allows, never a user's own."""

    __slots__ = ()


# An hour, or just under the broker's own limit where that is shorter (RabbitMQ's
# consumer_timeout: 30 minutes by default).
DEFAULT_MAX_LEASE_DURATION: float = _Default(3600.0)


def is_default(value: float) -> bool:
    """Whether ``value`` is a policy's default, not one a user gave."""
    return isinstance(value, _Default)


@dataclass(frozen=True)
class LeasePolicy:
    """How the lease manager keeps in-flight messages' ack deadlines ahead of their handlers.

    Attributes:
        min_extension: shortest extension in seconds (> 0); adapters clamp further to what their
            broker accepts (Pub/Sub: 10..600).
        max_extension: longest extension in seconds (>= min_extension).
        max_lease_duration: seconds after receipt when extension stops and the message is nacked
            for redelivery (> 0). Default: an hour, or just under the broker's own limit for
            an unacked delivery where that is shorter (RabbitMQ's ``consumer_timeout``).
        percentile: the percentile of observed processing time used as the extension (0, 100].
    """

    min_extension: float = 10.0
    max_extension: float = 600.0
    max_lease_duration: float = DEFAULT_MAX_LEASE_DURATION
    percentile: float = 99.0

    def __post_init__(self) -> None:
        _check_range("LeasePolicy", "min_extension", self.min_extension, 0, low_inclusive=False)
        _check_range("LeasePolicy", "max_extension", self.max_extension, self.min_extension)
        _check_range(
            "LeasePolicy", "max_lease_duration", self.max_lease_duration, 0, low_inclusive=False
        )
        _check_range("LeasePolicy", "percentile", self.percentile, 0, 100, low_inclusive=False)


def _default_retry_on() -> tuple[type[BaseException], ...]:
    return (ConnectionError, TimeoutError)


@dataclass(frozen=True)
class RetryPolicy:
    """Retries: first in process (tenacity), then by redelivery with exponential backoff.

    Attributes:
        min_backoff: redelivery delay in seconds after the first failed attempt (>= 0).
        max_backoff: cap on the redelivery delay in seconds (>= min_backoff).
        in_process_attempts: handler calls per delivery before it counts as failed (>= 1); only
            exceptions in ``retry_on`` are retried in process.
        retry_on: exception types treated as transient and retried in process.
        in_process_wait: seconds between in-process attempts, doubled each time (>= 0).
        non_retryable: exception types that fail a message for good, as
            :class:`~reliable_sub.Reject` does: dead-lettered after one attempt, never retried
            in process (they win over ``retry_on``).
    """

    min_backoff: float = 10.0
    max_backoff: float = 600.0
    in_process_attempts: int = 1
    retry_on: tuple[type[BaseException], ...] = field(default_factory=_default_retry_on)
    in_process_wait: float = 0.1
    non_retryable: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        _check_range("RetryPolicy", "min_backoff", self.min_backoff, 0)
        _check_range("RetryPolicy", "max_backoff", self.max_backoff, self.min_backoff)
        check_count("RetryPolicy", "in_process_attempts", self.in_process_attempts)
        _check_range("RetryPolicy", "in_process_wait", self.in_process_wait, 0)
        for name in ("retry_on", "non_retryable"):
            types = getattr(self, name)
            if not isinstance(types, tuple) or not all(
                isinstance(t, type) and issubclass(t, BaseException) for t in types
            ):
                raise ConfigurationError(
                    f"RetryPolicy.{name} must be a tuple of exception types, got {types!r}"
                )

    def is_permanent(self, error: BaseException | None) -> bool:
        """Whether ``error`` fails its message for good: a :class:`~reliable_sub.Reject`, or
        an instance of ``non_retryable``."""
        return isinstance(error, (Reject, *self.non_retryable))

    def _base_backoff(self, attempt: int) -> float:
        exponent = min(max(attempt, 1) - 1, 64)
        return min(self.max_backoff, self.min_backoff * 2.0**exponent)

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Redelivery delay after failed delivery ``attempt`` (1-based), jittered upward."""
        spread = (rng or random).uniform(1.0, 1.0 + BACKOFF_JITTER)
        return min(self.max_backoff, self._base_backoff(attempt) * spread)

    def max_backoff_for(self, attempt: int) -> float:
        """The largest delay :meth:`backoff` can return for ``attempt``."""
        return min(self.max_backoff, self._base_backoff(attempt) * (1.0 + BACKOFF_JITTER))


@dataclass(frozen=True)
class DeadLetterPolicy:
    """Where a message goes after ``max_delivery_attempts`` failed deliveries.

    The dead-letter copy carries the original data and attributes plus ``original-message-id``,
    ``original-subscription``, ``delivery-attempts``, ``error-type`` and ``error-message``; the
    original is acked only after that publish succeeded.
    """

    topic: str
    max_delivery_attempts: int = 5

    def __post_init__(self) -> None:
        if not isinstance(self.topic, str) or not self.topic.strip():
            raise ConfigurationError(
                f"DeadLetterPolicy.topic must be a non-empty topic name, got {self.topic!r}"
            )
        if not isinstance(self.max_delivery_attempts, int) or not (
            1 <= self.max_delivery_attempts <= 1000
        ):
            raise ConfigurationError(
                "DeadLetterPolicy.max_delivery_attempts must be an int in [1, 1000], "
                f"got {self.max_delivery_attempts!r}"
            )


@dataclass(frozen=True)
class FlowControl:
    """Bounds on work in flight (received and not yet acked or nacked) per Subscriber.

    Attributes:
        max_messages: messages in flight (>= 1). Receive asks the broker for no more than the
            free slots, so a slow handler backs pressure up to the broker.
        max_bytes: payload bytes whose handlers run at once (>= 1). A single message larger than
            this still runs, alone.
    """

    max_messages: int = 1000
    max_bytes: int = 100 * 1024 * 1024

    def __post_init__(self) -> None:
        check_count("FlowControl", "max_messages", self.max_messages)
        check_count("FlowControl", "max_bytes", self.max_bytes)


IDEMPOTENCY_KEY_MODES = ("hashed", "raw", "off")


@dataclass(frozen=True)
class TelemetryPolicy:
    """What the spans of delivery attempts carry (see :mod:`reliable_sub.telemetry`).

    Attributes:
        producer_as_parent: False (default): a delivery's span *links* to the producer's span
            (the conventions' advice for messaging: a consumer's work is its own trace); True:
            it is the producer span's *child*, so one trace runs from publish to processing.
        idempotency_key: ``"hashed"`` (default): ``reliable_sub.idempotency_key`` holds the
            first 16 hex digits of the key's SHA-256; ``"raw"``: the key itself (it may be an
            order or payment id: only if your traces may hold those); ``"off"``: not set.
        trace_first_attempts: the share of first delivery attempts traced in full (1.0, the
            default: all). Below 1, the dashboard mode: a first attempt left out starts no
            span, and gets one when it settles only if it did not succeed (retried,
            dead-lettered, duplicate, deferred, given back), made as it would have been but
            without the handler's child spans; a first attempt that succeeded leaves nothing.
            Redeliveries are always traced in full. The tracer provider's sampler still
            applies to every span made.
        backlog_interval: seconds between samples of each subscription's backlog at the
            broker (``reliable_sub.subscription.*`` gauges; the adapter's figures call for each),
            while metrics are recorded; None: never sampled.
    """

    producer_as_parent: bool = False
    idempotency_key: str = "hashed"
    trace_first_attempts: float = 1.0
    backlog_interval: float | None = 15.0

    def __post_init__(self) -> None:
        if not isinstance(self.producer_as_parent, bool):
            raise ConfigurationError(
                "TelemetryPolicy.producer_as_parent must be a bool, got "
                f"{self.producer_as_parent!r}"
            )
        ratio = self.trace_first_attempts
        if (not isinstance(ratio, int | float) or isinstance(ratio, bool)
                or not 0.0 <= ratio <= 1.0):
            raise ConfigurationError(
                "TelemetryPolicy.trace_first_attempts must be a number from 0 to 1 (the share "
                f"of first delivery attempts traced in full), got {ratio!r}"
            )
        interval = self.backlog_interval
        if interval is not None and (not isinstance(interval, int | float)
                                     or isinstance(interval, bool) or not interval > 0
                                     or interval == float("inf")):
            raise ConfigurationError(
                "TelemetryPolicy.backlog_interval must be a number of seconds > 0, or None "
                f"(never sampled), got {interval!r}"
            )
        if self.idempotency_key not in IDEMPOTENCY_KEY_MODES:
            raise ConfigurationError(
                f"TelemetryPolicy.idempotency_key must be one of {IDEMPOTENCY_KEY_MODES}, got "
                f"{self.idempotency_key!r}"
            )


__all__ = [
    "BACKOFF_JITTER",
    "IDEMPOTENCY_KEY_MODES",
    "DeadLetterPolicy",
    "FlowControl",
    "LeasePolicy",
    "RetryPolicy",
    "TelemetryPolicy",
    "check_count",
    "check_seconds",
]
