"""An adapter's publish telemetry: the send span around each publish, and the publish-side
metrics of the OpenTelemetry messaging conventions.

=======================================  =====================================================
``messaging.client.sent.messages``       messages the adapter tried to publish, by destination
                                         and ``error.type`` (absent when the broker took it)
``messaging.client.operation.duration``  seconds per publish operation (one message, or one
                                         ``publish_many`` batch), by destination and
                                         ``error.type``
=======================================  =====================================================

Each of our adapters holds a :class:`PublishTelemetry` and publishes through it, so every
publish counts: the user's own, the dead-letter publish, the outbox relay's. By default it
records on OpenTelemetry's global providers; a Subscriber or :class:`~reliable_sub.outbox.
OutboxRelay` given providers binds them to its adapter (``adapter.instrument_publishes``), so
the publishes made through that adapter go where its deliveries go. With no SDK configured a
publish pays two provider lookups and nothing more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from opentelemetry.metrics import Histogram, Meter, MeterProvider
from opentelemetry.trace import Tracer, TracerProvider

from .._checks import check_with
from ..ports import InstrumentsPublishes, Outgoing
from . import semconv as sc
from .guard import report
from .instruments import ErrorTypes, PerMeter, Tallies, Tally
from .producer import send_span
from .providers import meter_of, tracer_of

logger = logging.getLogger("reliable_sub.telemetry")

# Attribute sets kept per meter; past this many (ever-new topic names), built per publish.
_MAX_CACHED = 1024


class PublishInstruments:
    """The publish-side metrics on one meter, shared by every adapter recording there (the SDK
    drops the callbacks of a second observable instrument of a name on a meter)."""

    def __init__(self, meter: Meter) -> None:
        self.sent = Tallies()
        meter.create_observable_counter(
            sc.SENT_MESSAGES, [self.sent.observe], unit="{message}",
            description="Number of messages the producer attempted to send to the broker "
                        "(error.type set when the broker refused one or the publish failed).")
        self.duration: Histogram = meter.create_histogram(
            sc.OPERATION_DURATION, unit="s",
            description="Duration of messaging operation initiated by a producer or consumer "
                        "client (here: each publish, or publish_many batch).",
            explicit_bucket_boundaries_advisory=sc.DURATION_BUCKETS)
        self.error_types = ErrorTypes()
        self._attributes: dict[tuple[str, str | None, str | None], dict[str, Any]] = {}
        self._tallies: dict[tuple[str, str | None, str | None], Tally] = {}

    def attributes(self, system: str, topic: str | None, error: str | None) -> dict[str, Any]:
        key = (system, topic, error)
        found = self._attributes.get(key)
        if found is None:
            found = {sc.MESSAGING_SYSTEM: system, sc.OPERATION_NAME: sc.SEND,
                     sc.OPERATION_TYPE: sc.SEND}
            if topic is not None:
                found[sc.DESTINATION_NAME] = topic
            if error is not None:
                found[sc.ERROR_TYPE] = error
            if len(self._attributes) < _MAX_CACHED:
                self._attributes[key] = found
        return found

    def count(self, system: str, topic: str, error: str | None, messages: int = 1) -> None:
        key = (system, topic, error)
        tally = self._tallies.get(key)
        if tally is None:
            tally = self.sent.of(self.attributes(system, topic, error))
            if len(self._tallies) < _MAX_CACHED:
                self._tallies[key] = tally
        tally.value += messages


# The publish instruments on a meter (one set per meter).
publish_instruments_for: PerMeter[PublishInstruments] = PerMeter(PublishInstruments)


class PublishTelemetry:
    """What one adapter's publishes record, and on which providers.

    Args:
        system: the broker's ``messaging.system``.
        connection: the adapter's ``server.*`` and ``messaging.client.id`` attributes, for the
            send spans (asked once, on the first traced publish).
    """

    def __init__(self, system: str,
                 connection: Callable[[], dict[str, str | int]] | None = None) -> None:
        self.system = system
        self.tracer_provider: TracerProvider | None = None
        self.meter_provider: MeterProvider | None = None
        self._connection = connection
        self._span_attributes: dict[str, str | int] | None = None

    def bind(self, tracer_provider: TracerProvider | None = None,
             meter_provider: MeterProvider | None = None, *, warn: bool = False) -> None:
        """Record on these providers from now on (None leaves that one as it was); ``warn``:
        log a WARNING when one replaces another already bound (bound implicitly, by a
        Subscriber or relay, rather than by the user)."""
        for name, given in (("tracer_provider", tracer_provider),
                            ("meter_provider", meter_provider)):
            if given is None:
                continue
            bound = getattr(self, name)
            if warn and bound is not None and bound is not given:
                logger.warning("this %s adapter's publishes were recorded on another %s; "
                               "from now on on the one given last (give one adapter the same "
                               "providers everywhere)", self.system, name)
            setattr(self, name, given)

    def send(self, topic: str, attributes: dict[str, str] | None
             ) -> AbstractContextManager[dict[str, str] | None]:
        """Around one publish to ``topic``: yields the attributes to publish (the send span's
        context injected when tracing); records the metrics when it ends."""
        tracer = tracer_of(self.tracer_provider)
        meter = meter_of(self.meter_provider)
        if meter is None:
            if tracer is None:
                return nullcontext(attributes)
            return self._span(tracer, topic, attributes)
        return self._measured(tracer, publish_instruments_for(meter), topic, attributes)

    def sent_many(self, messages: Sequence[Outgoing], results: Sequence[str | Exception],
                  started: float) -> None:
        """The metrics of one ``publish_many`` call begun at ``started`` (``time.perf_counter``),
        whose results (an id or the error) are ``results``."""
        meter = meter_of(self.meter_provider)
        if meter is None or not messages:
            return
        try:
            instruments = publish_instruments_for(meter)
            seconds = time.perf_counter() - started
            first_error: str | None = None
            for message, result in zip(messages, results, strict=True):
                error = None
                if isinstance(result, Exception):
                    error = instruments.error_types.of(result)
                    first_error = first_error or error
                instruments.count(self.system, message.topic, error)
            topics = {message.topic for message in messages}
            # one operation: a destination only if it had one, the first error if any failed
            instruments.duration.record(seconds, instruments.attributes(
                self.system, topics.pop() if len(topics) == 1 else None, first_error))
        except Exception:
            report("publish metrics")

    def _span(self, tracer: Tracer, topic: str, attributes: dict[str, str] | None
              ) -> AbstractContextManager[dict[str, str] | None]:
        return send_span(self.system, topic, attributes, tracer=tracer,
                         span_attributes=self._connection_attributes())

    @contextmanager
    def _measured(self, tracer: Tracer | None, instruments: PublishInstruments, topic: str,
                  attributes: dict[str, str] | None) -> Iterator[dict[str, str] | None]:
        error: str | None = None
        started = time.perf_counter()
        try:
            with (self._span(tracer, topic, attributes) if tracer is not None
                  else nullcontext(attributes)) as carried:
                yield carried
        except BaseException as failure:
            error = instruments.error_types.of(failure)
            raise
        finally:
            try:
                instruments.duration.record(time.perf_counter() - started,
                                            instruments.attributes(self.system, topic, error))
                instruments.count(self.system, topic, error)
            except Exception:
                report("publish metrics")

    def _connection_attributes(self) -> dict[str, str | int] | None:
        if self._span_attributes is None and self._connection is not None:
            try:
                self._span_attributes = dict(self._connection())
            except Exception:
                report("connection_attributes")
                self._span_attributes = {}
        return self._span_attributes or None


class InstrumentedPublishing:
    """A mixin for adapters: :attr:`_publishing`, the :class:`PublishTelemetry` each publish
    goes through (made on first use from the adapter's ``capabilities.messaging_system`` and
    its ``connection_attributes``), and :meth:`instrument_publishes`."""

    @property
    def _publishing(self) -> PublishTelemetry:
        found: PublishTelemetry | None = self.__dict__.get("_publish_telemetry")
        if found is None:
            system = self.capabilities.messaging_system  # type: ignore[attr-defined]
            made = PublishTelemetry(system, getattr(self, "connection_attributes", None))
            found = self.__dict__.setdefault("_publish_telemetry", made)
        return found

    def instrument_publishes(self, tracer_provider: TracerProvider | None = None,
                             meter_provider: MeterProvider | None = None) -> None:
        """Record this adapter's publishes (send spans, ``messaging.client.sent.messages``,
        ``messaging.client.operation.duration``) on these providers instead of the global
        ones. A Subscriber or OutboxRelay given providers binds them for you; call this after
        it to choose otherwise (``NoOpTracerProvider()``: publishes untraced)."""
        where = f"{type(self).__name__}.instrument_publishes"
        check_with(f"{where}(tracer_provider=)", tracer_provider, "get_tracer",
                   "an OpenTelemetry TracerProvider", "pass the SDK's TracerProvider(), or None")
        check_with(f"{where}(meter_provider=)", meter_provider, "get_meter",
                   "an OpenTelemetry MeterProvider", "pass the SDK's MeterProvider(), or None")
        self._publishing.bind(tracer_provider, meter_provider)


def instrument_publishes(adapter: object, tracer_provider: TracerProvider | None,
                         meter_provider: MeterProvider | None) -> None:
    """Bind the providers a Subscriber or relay was given to its adapter's publishes, if it
    records them (:class:`~reliable_sub.ports.InstrumentsPublishes`) and any was given."""
    if tracer_provider is None and meter_provider is None:
        return
    if isinstance(adapter, InstrumentedPublishing):
        adapter._publishing.bind(tracer_provider, meter_provider, warn=True)
    elif isinstance(adapter, InstrumentsPublishes):
        adapter.instrument_publishes(tracer_provider, meter_provider)


__all__ = ["InstrumentedPublishing", "PublishInstruments", "PublishTelemetry",
           "instrument_publishes", "publish_instruments_for"]
