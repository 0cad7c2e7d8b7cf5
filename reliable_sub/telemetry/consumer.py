"""The telemetry stage of the delivery path: a span per delivery attempt, and its metrics.

The runtime calls this stage at each step of a delivery (never more than a method call when it
is off: the runtime then holds None):

=====================  ====================================================================
``received``           the span ``process {subscription}`` starts (kind CONSUMER), linked to
                       (or the child of) the producer's context in the message's attributes
``dedup_verdict``      event ``reliable_sub.dedup``: claimed, completed or in_progress
``context_of``         the span as the current one of the handler's task (and thread)
``extended``           event ``reliable_sub.lease.extended`` per extension; lease metrics
``retried``            event ``reliable_sub.retry`` per in-process retry
``dead_lettered``      event ``reliable_sub.dead_letter.published``
``settled``            the outcome once the broker confirmed it; status, exception; the
                       span ends; the delivery's metrics are recorded
=====================  ====================================================================

Metric attributes are a handful of low-cardinality values (system, destination, subscription,
outcome, error type), built once per subscription and outcome: never a message id.

The per-message counters (consumed messages, in flight, duplicates, dead letters) are tallied in
process, an integer addition per message, and reported by observable instruments when a reader
collects: the SDK's synchronous counters cost several microseconds a call, each hashing its
attribute set. The histograms (processing time, attempts) are recorded per message.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from random import Random
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, Tracer, TracerProvider

from .._text import safe_str
from ..outcome import Outcome
from ..policy import TelemetryPolicy
from ..ports import Claimed, ClaimResult, Completed
from . import semconv as sc
from .deferred import DeferredSpan, unsampled_context
from .guard import never_raises, record_error, report
from .instruments import Instruments, RouteTallies, RouteTelemetry, error_type, instruments_for
from .propagation import extract, producer_span_context
from .providers import meter_of, tracer_of

if TYPE_CHECKING:
    from .._runtime.inflight import InFlight

# Outcomes that end a span with status ERROR: the handler failed.
_FAILED = frozenset({Outcome.RETRY, Outcome.DEAD_LETTERED})
# read for every message: see reliable_sub/_runtime/members.py
_ACKED, _DUPLICATE = Outcome.ACKED, Outcome.DUPLICATE
# Outcomes that give the message back to the broker, with a redelivery delay.
_NACKED = frozenset({Outcome.RETRY, Outcome.DEFERRED, Outcome.REQUEUED, Outcome.STOPPED})
# an outcome's attribute value: a dict lookup, where ``outcome.value`` runs enum's descriptor
_VALUE_OF = {outcome: outcome.value for outcome in Outcome}
# The empty context a delivery's span starts from (a Context cannot be changed: one serves all)
_ROOT = Context()


class SubscriberTelemetry:
    """A Subscriber's telemetry settings, and its instruments (made once, kept across runs).

    Args:
        tracer_provider, meter_provider: where spans and metrics go (default: the global
            providers, read when each run starts).
        policy: what spans carry.
    """

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        policy: TelemetryPolicy | None = None,
    ) -> None:
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.policy = policy or TelemetryPolicy()

    def for_run(self, system: str, rng: Random | None = None) -> DeliveryTelemetry | None:
        """This run's stage for a broker of ``system``, or None when nothing would be
        recorded (no SDK configured). ``rng`` draws which first attempts are traced."""
        tracer = tracer_of(self.tracer_provider)
        meter = meter_of(self.meter_provider)
        if tracer is None and meter is None:
            return None
        instruments = instruments_for(meter) if meter is not None else None
        return DeliveryTelemetry(tracer, instruments, self.policy, system, rng)



class DeliveryTelemetry:
    """Spans and metrics of one run's deliveries (see the module's docstring)."""

    def __init__(self, tracer: Tracer | None, instruments: Instruments | None,
                 policy: TelemetryPolicy, system: str, rng: Random | None = None) -> None:
        self.tracer = tracer
        self.instruments = instruments
        self.policy = policy
        self.system = system
        self._gcp = system == sc.GCP_PUBSUB
        self._rng = rng or Random()
        self._first_attempts = policy.trace_first_attempts  # the ratio traced in full

    def route(self, subscription: str, topic: str, ack_deadline: float,
              connection: dict[str, str | int] | None = None) -> RouteTelemetry:
        """One subscription's attribute sets; ``connection``: the adapter's server and client
        attributes, for its spans only (a metric's series stay one per subscription)."""
        base = {
            sc.MESSAGING_SYSTEM: self.system,
            sc.OPERATION_NAME: sc.PROCESS,
            sc.DESTINATION_NAME: topic,
            sc.subscription_attribute(self.system): subscription,
        }
        span_attributes: dict[str, Any] = {**base, sc.OPERATION_TYPE: sc.PROCESS,
                                           **(connection or {})}
        # every metric names the subscription as a consumer group too, whatever the system:
        # one label a dashboard filters every system's series by (a duplicate value, no series)
        base[sc.CONSUMER_GROUP_NAME] = subscription
        if self._gcp:
            span_attributes[sc.GCP_ACK_DEADLINE] = int(ack_deadline)
        tallies = None
        if self.instruments is not None:
            instruments = self.instruments
            tallies = RouteTallies(instruments, instruments.inflight.of(base),
                                    instruments.duplicates.of(base))
        return RouteTelemetry(f"{sc.PROCESS} {subscription}", span_attributes, base, tallies)

    # -- the steps of a delivery ---------------------------------------------------------------

    @never_raises
    def received(self, route: RouteTelemetry, items: Sequence[InFlight[Any]],
                 handler: str) -> None:
        if route.tallies is not None:
            route.tallies.inflight.value += len(items)
        if self.tracer is None:
            return
        ratio, draw = self._first_attempts, self._rng.random
        for item in items:
            if (ratio < 1.0 and item.delivery.message.delivery_attempt == 1
                    and draw() >= ratio):
                item.span = DeferredSpan(handler)  # decided when it settles
            else:
                item.span = self._start_span(route, item, handler)

    def _start_span(self, route: RouteTelemetry, item: InFlight[Any], handler: str,
                    start_time: int | None = None) -> Any:
        message = item.delivery.message
        producer = extract(message.attributes) if message.attributes else None
        producer_span = producer_span_context(producer)
        parent: Context | None = None
        links: list[Link] = []
        if producer_span is not None:
            if self.policy.producer_as_parent:
                parent = producer
            else:
                links.append(Link(producer_span))
        attributes = {
            **route.span_attributes,
            sc.MESSAGE_ID: message.id,
            sc.BODY_SIZE: len(message.data),
            sc.DELIVERY_ATTEMPT: message.delivery_attempt,
            sc.HANDLER: handler,
        }
        if self._gcp:
            attributes[sc.GCP_DELIVERY_ATTEMPT] = message.delivery_attempt
            if message.ordering_key:
                attributes[sc.GCP_ORDERING_KEY] = message.ordering_key
        mode = self.policy.idempotency_key
        if mode != "off":
            key = message.idempotency_key
            attributes[sc.IDEMPOTENCY_KEY] = (
                key if mode == "raw"
                # surrogatepass: a key with a lone surrogate (possible on Redis) still hashes
                else hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16])
        return self.tracer.start_span(  # type: ignore[union-attr]
            route.name, context=parent or _ROOT, kind=SpanKind.CONSUMER,
            attributes=attributes, links=links, start_time=start_time)

    def _made_late(self, route: RouteTelemetry, item: InFlight[Any],
                   deferred: DeferredSpan) -> Any:
        """The span of a deferred delivery whose outcome asks for one, as it would have been."""
        span = self._start_span(route, item, deferred.handler, deferred.start)
        for name, attributes, timestamp in deferred.events or ():
            span.add_event(name, attributes, timestamp)
        return span

    @never_raises
    def dedup_verdict(self, item: InFlight[Any], verdict: ClaimResult) -> None:
        span = item.span
        if span is not None and span.is_recording():
            event: dict[str, Any]
            if isinstance(verdict, Completed):
                event = {sc.DEDUP_VERDICT: "completed"}
            else:
                name = "claimed" if isinstance(verdict, Claimed) else "in_progress"
                event = {sc.DEDUP_VERDICT: name, sc.DEDUP_FAILURES: verdict.failures}
            span.add_event(sc.EVENT_DEDUP, event)

    def context_of(self, item: InFlight[Any]) -> Context:
        """The context a handler runs in: its delivery's span (set) as the current span (an
        unsampled one for a deferred delivery)."""
        try:
            if type(item.span) is DeferredSpan:
                return unsampled_context(self._rng)
            return trace.set_span_in_context(item.span, _ROOT)
        except Exception:
            report("DeliveryTelemetry.context_of")
            return _ROOT

    @never_raises
    def deadline_is(self, route: RouteTelemetry, seconds: float) -> None:
        """The lease deadline gauge's value for ``route`` before any extension."""
        if self.instruments is not None:
            self.instruments.deadline.set(seconds, route.metric_attributes)

    @never_raises
    def extended(self, route: RouteTelemetry, items: Sequence[InFlight[Any]], seconds: float,
                 observed: float | None) -> None:
        if self.instruments is not None:
            self.instruments.extensions.add(len(items), route.metric_attributes)
            self.instruments.deadline.set(seconds, route.metric_attributes)
        if self.tracer is None:
            return
        event = {sc.LEASE_EXTENSION: seconds}
        if observed is not None:
            event[sc.LEASE_OBSERVED] = observed
        for item in items:
            span = item.span
            if span is not None and span.is_recording():
                span.add_event(sc.EVENT_LEASE_EXTENDED, event)

    @never_raises
    def retried(self, item: InFlight[Any], attempt: int, error: BaseException | None) -> None:
        span = item.span
        if span is not None and span.is_recording():
            event: dict[str, Any] = {sc.RETRY_ATTEMPT: attempt}
            if error is not None:
                event["exception.type"] = error_type(error)
                event["exception.message"] = safe_str(error, 1000)
            span.add_event(sc.EVENT_RETRY, event)

    @never_raises
    def dead_lettered(self, route: RouteTelemetry, item: InFlight[Any], topic: str,
                      reason: str) -> None:
        tallies = route.tallies
        if tallies is not None:
            tally = tallies.dead_lettered.get(reason)
            if tally is None:
                tally = tallies.dead_lettered[reason] = tallies.instruments.dead_lettered.of(
                    {**route.metric_attributes, sc.DEAD_LETTER_REASON: reason})
            tally.value += 1
        span = item.span
        if span is not None and span.is_recording():
            span.add_event(sc.EVENT_DEAD_LETTER,
                           {sc.DEAD_LETTER_TOPIC: topic, sc.DEAD_LETTER_REASON: reason})

    @never_raises
    def settled(self, route: RouteTelemetry, item: InFlight[Any], outcome: Outcome,
                delay: float) -> None:
        error = item.error if outcome in _FAILED else None
        tallies = route.tallies
        if tallies is not None:
            kind = None if error is None else route.error_type_of(error)
            tallies.inflight.value -= 1
            route.consumed(tallies, outcome, kind).value += 1
            instruments = tallies.instruments
            if item.duration is not None:
                instruments.duration.record(item.duration, route.outcome_attributes(outcome, kind))
            if outcome is _ACKED:
                route.succeeded_on(tallies, item.delivery.message.delivery_attempt).value += 1
            elif outcome is _DUPLICATE:
                tallies.duplicates.value += 1
        span = item.span
        if span is None:
            return
        item.span = None
        if type(span) is DeferredSpan:
            if outcome is _ACKED or self.tracer is None:
                return  # a first attempt that succeeded, and the ratio left out
            span = self._made_late(route, item, span)
        if span.is_recording():
            span.set_attribute(sc.OUTCOME, _VALUE_OF[outcome])
            if outcome in _NACKED:
                span.set_attribute(sc.REDELIVERY_DELAY, delay)
            if error is not None:  # spans are not aggregated: the full name, uncapped
                name = error_type(error)
                span.set_attribute(sc.ERROR_TYPE, name)
                record_error(span, error, name)
                span.set_status(Status(StatusCode.ERROR, f"{_VALUE_OF[outcome]}: {name}"))
        span.end()


__all__ = ["DeliveryTelemetry", "RouteTelemetry", "SubscriberTelemetry", "error_type"]
