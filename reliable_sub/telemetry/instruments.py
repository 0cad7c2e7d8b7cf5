"""The consumer's metric instruments on one meter, and each route's attribute sets and tallies.

The per-message counters (consumed messages, in flight, attempts, duplicates, dead letters) are
tallied in process, an integer addition per message, and reported by observable instruments
when a reader collects: the SDK's synchronous counters cost several microseconds a call, each
hashing its attribute set. The processing-time histogram is recorded per message.

``error.type`` is the exception's qualified class name, at most ``MAX_ERROR_TYPES`` distinct
ones per route; later ones are ``_OTHER`` (the conventions' fallback), so a handler raising
ever-new classes cannot grow the metric's series without bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from weakref import WeakKeyDictionary

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from ..outcome import Outcome
from . import semconv as sc

T = TypeVar("T")

# Distinct error.type values per route before the rest are _OTHER.
MAX_ERROR_TYPES = 20
OTHER_ERROR_TYPE = "_OTHER"


def error_type(error: BaseException) -> str:
    """``error.type``: the exception's qualified class name (low cardinality)."""
    kind = type(error)
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"



class ErrorTypes:
    """``error.type`` values with bounded cardinality: an exception's qualified class name, for
    the first ``MAX_ERROR_TYPES`` distinct classes; ``_OTHER`` for any later one."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        # by class; bounded, as a handler may make a class per call
        self._names: dict[type[BaseException], str] = {}

    def of(self, error: BaseException) -> str:
        kind = type(error)
        name = self._names.get(kind)
        if name is None:
            name = error_type(error)
            if name not in self._seen:
                if len(self._seen) < MAX_ERROR_TYPES:
                    self._seen.add(name)
                else:
                    name = OTHER_ERROR_TYPE
            if len(self._names) < 4 * MAX_ERROR_TYPES:
                self._names[kind] = name
        return name


class Tally:
    """A count under one attribute set, kept in process and reported when a reader collects.

    Updated from the event loop; read by the reader's thread (a number's read is atomic). A
    counter's is added to; a gauge's (the backlog figures) is replaced.
    """

    __slots__ = ("attributes", "value")

    def __init__(self, attributes: dict[str, Any]) -> None:
        self.attributes = attributes
        self.value: float = 0


class Tallies:
    """The tallies behind one observable instrument, one per attribute set."""

    def __init__(self) -> None:
        self._by_attributes: dict[frozenset[tuple[str, Any]], Tally] = {}

    def of(self, attributes: dict[str, Any]) -> Tally:
        """The tally for ``attributes`` (the same one for equal sets, across runs)."""
        key = frozenset(attributes.items())
        tally = self._by_attributes.get(key)
        if tally is None:
            tally = self._by_attributes[key] = Tally(attributes)
        return tally

    def drop(self, attributes: dict[str, Any]) -> None:
        """No point for ``attributes`` until :meth:`of` it again."""
        self._by_attributes.pop(frozenset(attributes.items()), None)

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(t.value, t.attributes) for t in list(self._by_attributes.values())]


class HealthGauge:
    """``reliable_sub.consumer.healthy``: 1 while the running Subscribers on this meter with
    the same attributes are all healthy, 0 while one is not (no point between runs)."""

    def __init__(self, meter: Meter) -> None:
        self._sources: dict[object, tuple[dict[str, Any], Callable[[], bool]]] = {}
        meter.create_observable_gauge(
            sc.CONSUMER_HEALTHY, [self.observe], unit="1",
            description="1 while the Subscriber is running and handling (healthy()), 0 while "
                        "not: a loop being restarted, or a call it depends on failing for "
                        "unhealthy_after seconds.")

    def watch(self, owner: object, attributes: dict[str, Any],
              healthy: Callable[[], bool]) -> None:
        """Report ``healthy()`` under ``attributes`` until :meth:`unwatch` of ``owner``."""
        self._sources[owner] = (attributes, healthy)

    def unwatch(self, owner: object) -> None:
        self._sources.pop(owner, None)

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        points: dict[frozenset[tuple[str, Any]], Observation] = {}
        for attributes, healthy in list(self._sources.values()):
            key = frozenset(attributes.items())
            value = 1 if healthy() else 0
            if key not in points or value == 0:
                points[key] = Observation(value, attributes)
        return list(points.values())


class BacklogGauges:
    """The three gauges on one meter, and their last values."""

    def __init__(self, meter: Meter) -> None:
        # last values, kept as tallies (a value is replaced, not added to)
        self.backlog, self.unacked, self.oldest_age = Tallies(), Tallies(), Tallies()
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


class Instruments:
    """The consumer metrics, on one meter: one set per meter (see :func:`instruments_for`)."""

    def __init__(self, meter: Meter) -> None:
        self.backlog = BacklogGauges(meter)
        self.health = HealthGauge(meter)
        self.consumed, self.inflight = Tallies(), Tallies()
        self.duplicates, self.dead_lettered = Tallies(), Tallies()
        self.duration = meter.create_histogram(
            sc.PROCESS_DURATION, unit="s", description="Duration of processing operation.",
            explicit_bucket_boundaries_advisory=sc.DURATION_BUCKETS)
        meter.create_observable_counter(
            sc.CONSUMED_MESSAGES, [self.consumed.observe], unit="{message}",
            description="Number of messages that were delivered to the application, by how "
                        "their delivery ended (reliable_sub.outcome).")
        self.extensions = meter.create_counter(
            sc.LEASE_EXTENSIONS, unit="{extension}",
            description="Ack-deadline extensions of deliveries whose handlers still run.")
        self.deadline = meter.create_gauge(
            sc.LEASE_DEADLINE_METRIC, unit="s",
            description="The current extension: the p99 (LeasePolicy.percentile) of "
                        "processing time, within the policy's bounds.")
        meter.create_observable_up_down_counter(
            sc.INFLIGHT, [self.inflight.observe], unit="{message}",
            description="Deliveries received and not yet settled at the broker.")
        meter.create_observable_counter(
            sc.DUPLICATES, [self.duplicates.observe], unit="{message}",
            description="Deliveries the dedup store had as completed: acked without running "
                        "the handler.")
        meter.create_observable_counter(
            sc.DEAD_LETTERED, [self.dead_lettered.observe], unit="{message}",
            description="Messages published to the dead-letter topic, by why "
                        "(reliable_sub.dead_letter.reason: rejected, max-delivery-attempts, "
                        "unreadable, running-too-long).")
        self.attempts = Tallies()
        meter.create_observable_counter(
            sc.ATTEMPTS, [self.attempts.observe], unit="{message}",
            description="Messages acked, by the delivery attempt on which they succeeded "
                        f"(reliable_sub.delivery.attempt: 1 to {sc.MAX_ATTEMPT_VALUE}, then "
                        f"{sc.LATER_ATTEMPTS!r}).")


class PerMeter(Generic[T]):
    """``made(meter)``: one ``factory(meter)`` per meter, shared by every caller recording
    there (kept while the meter lives).

    The SDK keeps the first observable instrument of a name on a meter and drops the callbacks
    of any later one: a second set on the same meter would never be reported.
    """

    def __init__(self, factory: Callable[[Meter], T]) -> None:
        self._factory = factory
        self._made: WeakKeyDictionary[Meter, T] = WeakKeyDictionary()

    def __call__(self, meter: Meter) -> T:
        found = self._made.get(meter)
        if found is None:
            found = self._made[meter] = self._factory(meter)
        return found


# The consumer instruments on a meter, shared by every Subscriber recording there.
instruments_for: PerMeter[Instruments] = PerMeter(Instruments)


@dataclass
class RouteTallies:
    """One subscription's tallies on one meter's instruments."""

    instruments: Instruments
    inflight: Tally
    duplicates: Tally
    # by reliable_sub.dead_letter.reason: a dashboard tells "rejected" from "attempts used up"
    dead_lettered: dict[str, Tally] = field(default_factory=dict)
    # by outcome, and error.type for failures
    consumed: dict[tuple[Outcome, str | None], Tally] = field(default_factory=dict)
    # by the attempt on which messages succeeded, capped (see semconv.MAX_ATTEMPT_VALUE)
    attempts: dict[int, Tally] = field(default_factory=dict)


@dataclass
class RouteTelemetry:
    """One subscription's span name, attribute sets and tallies, built once per run."""

    name: str
    span_attributes: dict[str, Any]
    metric_attributes: dict[str, Any]
    tallies: RouteTallies | None = None
    # the attribute sets of an outcome, and of a failure by outcome and error.type
    by_outcome: dict[tuple[Outcome, str | None], dict[str, Any]] = field(default_factory=dict)
    error_types: ErrorTypes = field(default_factory=ErrorTypes)

    def error_type_of(self, error: BaseException) -> str:
        """``error.type`` for ``error``: its class's name, or ``_OTHER`` once this route has
        seen ``MAX_ERROR_TYPES`` distinct ones."""
        return self.error_types.of(error)

    def outcome_attributes(self, outcome: Outcome, error: str | None = None) -> dict[str, Any]:
        """The route's attributes with ``outcome`` (and ``error.type``, for a failure)."""
        attributes = self.by_outcome.get((outcome, error))
        if attributes is None:
            attributes = {**self.metric_attributes, sc.OUTCOME: outcome.value}
            if error is not None:
                attributes[sc.ERROR_TYPE] = error
            self.by_outcome[(outcome, error)] = attributes
        return attributes

    def succeeded_on(self, tallies: RouteTallies, attempt: int) -> Tally:
        if attempt > sc.MAX_ATTEMPT_VALUE:
            attempt = sc.MAX_ATTEMPT_VALUE + 1
        tally = tallies.attempts.get(attempt)
        if tally is None:
            value = str(attempt) if attempt <= sc.MAX_ATTEMPT_VALUE else sc.LATER_ATTEMPTS
            tally = tallies.attempts[attempt] = tallies.instruments.attempts.of(
                {**self.metric_attributes, sc.ATTEMPT: value})
        return tally

    def consumed(self, tallies: RouteTallies, outcome: Outcome,
                 error: str | None = None) -> Tally:
        tally = tallies.consumed.get((outcome, error))
        if tally is None:
            tally = tallies.consumed[(outcome, error)] = tallies.instruments.consumed.of(
                self.outcome_attributes(outcome, error))
        return tally


__all__ = [
    "MAX_ERROR_TYPES",
    "OTHER_ERROR_TYPE",
    "BacklogGauges",
    "ErrorTypes",
    "HealthGauge",
    "Instruments",
    "PerMeter",
    "RouteTallies",
    "RouteTelemetry",
    "Tallies",
    "Tally",
    "error_type",
    "instruments_for",
]
