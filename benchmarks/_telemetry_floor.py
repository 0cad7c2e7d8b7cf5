"""The variants of ``benchmarks.telemetry``, their providers, and the SDK's floor: a loop that
makes the spans and records the metric values a Subscriber does for one delivery, with the same
SDK, processor and exporter, and nothing else. What a Subscriber costs beyond that floor is
ours."""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NoOpTracerProvider, SpanKind

from reliable_sub import TelemetryPolicy
from reliable_sub.telemetry import semconv as sc

# The periodic metric reader's interval: long enough not to run during a timed run.
METRIC_EXPORT_INTERVAL_MS = 60_000

OFF, API = "off (no-op providers)", "API alone (no SDK)"
SDK, SAMPLED = "SDK (batch spans, metrics)", "SDK, 1% of traces sampled"
METRICS_ONLY, SPANS_ONLY = "SDK, metrics only", "SDK, spans only"
DASHBOARD = "SDK, dashboard mode (1% of first attempts)"
VARIANTS = (OFF, API, METRICS_ONLY, SPANS_ONLY, SDK, SAMPLED, DASHBOARD)
WORK_VARIANTS = (OFF, SDK, SAMPLED, DASHBOARD)
WORK = "memory, 0.5 ms handler"
SAMPLED_RATIO = 0.01


class NoOpSpanExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class NoOpMetricExporter(MetricExporter):
    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000,
               **kwargs: Any) -> MetricExportResult:
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        return None


def providers(variant: str) -> tuple[dict[str, Any], list[Any]]:
    """The Subscriber's provider arguments for ``variant``, and what to shut down after."""
    if variant == OFF:
        return {"tracer_provider": NoOpTracerProvider(),
                "meter_provider": NoOpMeterProvider()}, []
    if variant == API:
        return {}, []
    options: dict[str, Any] = {"tracer_provider": NoOpTracerProvider(),
                               "meter_provider": NoOpMeterProvider()}
    owned: list[Any] = []
    if variant == DASHBOARD:  # the default sampler: the policy decides
        options["telemetry"] = TelemetryPolicy(trace_first_attempts=SAMPLED_RATIO)
    if variant != METRICS_ONLY:
        sampler = ParentBased(TraceIdRatioBased(SAMPLED_RATIO)) if variant == SAMPLED else None
        tracer_provider = TracerProvider(sampler=sampler)
        tracer_provider.add_span_processor(BatchSpanProcessor(NoOpSpanExporter()))
        options["tracer_provider"] = tracer_provider
        owned.append(tracer_provider)
    if variant != SPANS_ONLY:
        reader = PeriodicExportingMetricReader(
            NoOpMetricExporter(), export_interval_millis=METRIC_EXPORT_INTERVAL_MS)
        meter_provider = MeterProvider(metric_readers=[reader])
        options["meter_provider"] = meter_provider
        owned.append(meter_provider)
    return options, owned


def floor_seconds(variant: str, messages: int, system: str = "memory",
                  open_spans: int = 1) -> float:
    """Seconds the SDK takes, with ``variant``'s providers, for what a Subscriber records for
    ``messages`` first-try successes of a no-op handler: a ``process`` span with the same
    attributes (its outcome set before it ends), the processing time recorded in the same
    histogram under the same attribute set (the counters are ours: tallied in process, read
    when a reader collects). 0 without an SDK.

    ``open_spans``: how many spans are open at once, the oldest ended first (1: each ends
    before the next starts). A Subscriber keeps one open per message in flight: up to
    ``FlowControl.max_messages``."""
    if variant in (OFF, API):
        return 0.0
    options, owned = providers(variant)
    try:
        tracer = options["tracer_provider"].get_tracer("reliable_sub")
        meter = options["meter_provider"].get_meter("reliable_sub")
        duration = meter.create_histogram(
            sc.PROCESS_DURATION, unit="s",
            explicit_bucket_boundaries_advisory=sc.DURATION_BUCKETS)
        base = {sc.MESSAGING_SYSTEM: system, sc.OPERATION_NAME: sc.PROCESS,
                sc.DESTINATION_NAME: "bench-topic",
                sc.subscription_attribute(system): "bench-sub"}
        span_base = {**base, sc.OPERATION_TYPE: sc.PROCESS}
        base[sc.CONSUMER_GROUP_NAME] = "bench-sub"  # metrics name it on every system
        acked = {**base, sc.OUTCOME: "acked"}
        # the dashboard mode decides per first attempt; the sampled variant's sampler does
        ratio = SAMPLED_RATIO if variant == DASHBOARD else 1.0
        draw = random.Random(0).random
        spans: deque[Any] = deque()
        started = time.perf_counter()
        for number in range(messages):
            if ratio >= 1.0 or draw() < ratio:
                spans.append(tracer.start_span(
                    "process bench-sub", context=Context(), kind=SpanKind.CONSUMER,
                    attributes={**span_base, sc.MESSAGE_ID: str(number), sc.BODY_SIZE: 64,
                                sc.DELIVERY_ATTEMPT: 1, sc.HANDLER: "noop_handler",
                                sc.IDEMPOTENCY_KEY: "0123456789abcdef"}))
                if len(spans) >= open_spans:
                    span = spans.popleft()
                    span.set_attribute(sc.OUTCOME, "acked")
                    span.end()
            duration.record(1e-5, acked)
        for span in spans:
            span.set_attribute(sc.OUTCOME, "acked")
            span.end()
        return time.perf_counter() - started
    finally:
        for provider in owned:
            provider.shutdown()
