"""The outbox relay's telemetry: send spans per row (see :class:`~.producer.SendSpans`) and
the outbox's metrics: rows published, and the backlog (pending rows, the age of the oldest,
parked rows) as gauges, sampled by a running relay."""

from __future__ import annotations

from opentelemetry.metrics import Meter, MeterProvider
from opentelemetry.trace import Tracer, TracerProvider

from . import semconv as sc
from .instruments import PerMeter
from .providers import meter_of, tracer_of

TABLE = "reliable_sub.outbox.table"


class OutboxTelemetry:
    """A relay's providers (default: the global ones, read at each use) and its instruments."""

    def __init__(self, table: str, tracer_provider: TracerProvider | None,
                 meter_provider: MeterProvider | None) -> None:
        self.attributes = {TABLE: table}
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider

    def tracer(self) -> Tracer | None:
        return tracer_of(self.tracer_provider)

    def instruments(self) -> _Instruments | None:
        meter = meter_of(self.meter_provider)
        return None if meter is None else _instruments_for(meter)

    def published(self, rows: int) -> None:
        instruments = self.instruments()
        if instruments is not None and rows:
            instruments.published.add(rows, self.attributes)

    def backlog(self, pending: int, oldest_age: float | None, parked: int) -> None:
        """The outbox's backlog (pending rows, the oldest one's age in seconds, parked rows)."""
        instruments = self.instruments()
        if instruments is None:
            return
        instruments.backlog.set(pending, self.attributes)
        instruments.oldest_age.set(oldest_age or 0.0, self.attributes)
        instruments.parked.set(parked, self.attributes)


class _Instruments:
    def __init__(self, meter: Meter) -> None:
        self.published = meter.create_counter(
            sc.OUTBOX_PUBLISHED, unit="{row}", description="Outbox rows published.")
        self.backlog = meter.create_gauge(
            sc.OUTBOX_BACKLOG, unit="{row}",
            description="Committed outbox rows not yet published (parked ones excluded).")
        self.oldest_age = meter.create_gauge(
            sc.OUTBOX_OLDEST_AGE, unit="s",
            description="Age of the oldest unpublished outbox row (0 when there is none).")
        self.parked = meter.create_gauge(
            sc.OUTBOX_PARKED, unit="{row}",
            description="Outbox rows parked after max_attempts failed publishes.")


# One set per meter, shared by every relay recording there.
_instruments_for: PerMeter[_Instruments] = PerMeter(_Instruments)

__all__ = ["OutboxTelemetry"]
