"""Spans and metrics to an OpenTelemetry Collector over OTLP (gRPC), as a service would set it up.

The providers are made once at start-up and set as the global ones; every Subscriber and relay
started afterwards uses them. The collector's address comes from ``OTEL_EXPORTER_OTLP_ENDPOINT``
(default ``http://localhost:4317``), the service's name from ``OTEL_SERVICE_NAME``.

Run it with ``python examples/otlp.py`` next to a collector (``otelcol`` with an ``otlp``
receiver). Needs ``pip install "reliable-sub[otel]" opentelemetry-exporter-otlp-proto-grpc``.
``tests/test_otlp.py`` runs it against a gRPC server that speaks OTLP and checks what arrives.
"""

from __future__ import annotations

import asyncio
import os

from opentelemetry import metrics, trace
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from reliable_sub import Message, Outcome, Subscriber
from reliable_sub.adapters.memory import MemoryAdapter


def set_up_telemetry() -> tuple[TracerProvider, MeterProvider]:
    """Global providers exporting to the collector: 100% of traces here; in production a
    ratio such as 0.05 keeps the cost down."""
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4317")
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "shipping")})
    tracer_provider = TracerProvider(resource=resource,
                                     sampler=ParentBased(TraceIdRatioBased(1.0)))
    tracer_provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    meter_provider = MeterProvider(resource=resource, metric_readers=[
        PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint, insecure=True),
                                      export_interval_millis=15_000)])
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    return tracer_provider, meter_provider


async def consume_one() -> None:
    broker = MemoryAdapter()
    broker.ensure_subscription_sync("orders", "shipping")
    settled = asyncio.Event()
    # the global providers, read when the run starts
    sub = Subscriber(broker, on_outcome=lambda message, outcome: settled.set())

    @sub.handler("shipping")
    async def ship(message: Message) -> None:
        print(f"shipping order {message.data.decode()}")

    await broker.publish("orders", b"42")  # a "send orders" span
    serving = asyncio.ensure_future(sub.serve())
    try:
        await asyncio.wait_for(settled.wait(), timeout=30)
    finally:
        await sub.shutdown(timeout=5)
        await serving
    if sub.stats[Outcome.ACKED] != 1:
        raise SystemExit(f"expected one acked message, got {dict(sub.stats.outcomes)}")


def main() -> None:
    tracer_provider, meter_provider = set_up_telemetry()
    try:
        asyncio.run(consume_one())
    finally:
        # Flush: without it the last batch of spans and metrics is lost at exit.
        tracer_provider.shutdown()
        meter_provider.shutdown()


if __name__ == "__main__":
    main()
