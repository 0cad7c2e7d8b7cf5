"""Record OpenTelemetry spans and metrics in a test (needs ``opentelemetry-sdk``).

::

    with recording_telemetry() as recorded:
        ...  # publish, run a Subscriber
        [span] = recorded.spans("process orders-sub")
        assert recorded.sum("messaging.client.consumed.messages", **{"reliable_sub.outcome":
                                                                    "acked"}) == 1

:func:`recording_telemetry` installs SDK providers as OpenTelemetry's *global* ones (so adapters'
``publish`` spans are recorded too: publishing has no provider of its own), with an in-memory
span exporter and metric reader, and puts the API's defaults back afterwards. OpenTelemetry lets
a process set its globals once; this helper resets that guard, as OpenTelemetry's own test
utilities do, so use it in tests only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from reliable_sub.errors import MissingExtraError

try:
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.util._once import Once
except ImportError as error:  # pragma: no cover - exercised without the SDK
    raise MissingExtraError("reliable_sub.testing.otel", "otel",
                            error.name or "opentelemetry-sdk") from error


@dataclass
class Recorded:
    """What the providers recorded."""

    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    exporter: InMemorySpanExporter
    reader: InMemoryMetricReader

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        """Finished spans (named ``name``), in the order they ended."""
        return [span for span in self.exporter.get_finished_spans()
                if name is None or span.name == name]

    def points(self, metric: str) -> list[Any]:
        """The data points of ``metric`` collected now (cumulative)."""
        data = self.reader.get_metrics_data()
        found: list[Any] = []
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for item in scope.metrics:
                    if item.name == metric:
                        found.extend(item.data.data_points)
        return found

    def sum(self, metric: str, **attributes: Any) -> float:
        """The sum of ``metric``'s points (a counter's value, a histogram's sum) whose
        attributes include ``attributes``."""
        total = 0.0
        for point in self.points(metric):
            if all(point.attributes.get(k) == v for k, v in attributes.items()):
                total += point.sum if hasattr(point, "sum") else point.value
        return total

    def count(self, metric: str, **attributes: Any) -> int:
        """How many values a histogram ``metric`` recorded with ``attributes``."""
        return sum(point.count for point in self.points(metric)
                   if all(point.attributes.get(k) == v for k, v in attributes.items()))


@contextmanager
def recording_telemetry(*, install: bool = True) -> Iterator[Recorded]:
    """SDK providers recording in memory, for the block: OpenTelemetry's global ones, or with
    ``install=False`` only yours to pass (``Subscriber(tracer_provider=recorded.tracer_provider,
    ...)``), the globals left as they are."""
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    if install:
        _reset_globals()
        trace.set_tracer_provider(tracer_provider)
        metrics.set_meter_provider(meter_provider)
    try:
        yield Recorded(tracer_provider, meter_provider, exporter, reader)
    finally:
        if install:
            _reset_globals()
        tracer_provider.shutdown()
        meter_provider.shutdown()


def _reset_globals() -> None:
    """Back to the API's defaults (proxies that record nothing)."""
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    from opentelemetry.metrics import _internal as metrics_internal

    metrics_internal._METER_PROVIDER_SET_ONCE = Once()
    metrics_internal._METER_PROVIDER = None


__all__ = ["Recorded", "recording_telemetry"]
