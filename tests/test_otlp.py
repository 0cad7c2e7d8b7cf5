"""examples/otlp.py exports over OTLP/gRPC: what a collector receives from it.

A gRPC server on a free loopback port implements OTLP's trace and metrics services (the
``opentelemetry-proto`` stubs a collector implements) and keeps what is exported to it; the
example runs as a child process pointed at it by ``OTEL_EXPORTER_OTLP_ENDPOINT``. The exporter
is in the ``dev`` extra.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.redis_processes import free_port

REPO = Path(__file__).resolve().parent.parent


class Collector(trace_service_pb2_grpc.TraceServiceServicer,
                metrics_service_pb2_grpc.MetricsServiceServicer):
    """Keeps the span names, resource attributes and metric names exported to it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[str, str]] = []  # (scope, span name)
        self.metrics: set[str] = set()
        self.services: set[str] = set()

    def Export(self, request, context):  # type: ignore[no-untyped-def]
        with self.lock:
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
                for resource_spans in request.resource_spans:
                    self._resource(resource_spans.resource)
                    for scope in resource_spans.scope_spans:
                        self.spans += [(scope.scope.name, s.name) for s in scope.spans]
                return trace_service_pb2.ExportTraceServiceResponse()
            for resource_metrics in request.resource_metrics:
                self._resource(resource_metrics.resource)
                for scope in resource_metrics.scope_metrics:
                    self.metrics |= {m.name for m in scope.metrics}
            return metrics_service_pb2.ExportMetricsServiceResponse()

    def _resource(self, resource) -> None:  # type: ignore[no-untyped-def]
        for attribute in resource.attributes:
            if attribute.key == "service.name":
                self.services.add(attribute.value.string_value)


@pytest.fixture
def collector() -> Iterator[tuple[Collector, int]]:
    found = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(found, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(found, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield found, port
    finally:
        server.stop(grace=None)


def test_the_otlp_example_exports_spans_and_metrics_to_a_collector(
    collector: tuple[Collector, int],
) -> None:
    found, port = collector
    env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
               OTEL_SERVICE_NAME="shipping-test")
    done = subprocess.run([sys.executable, "examples/otlp.py"], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "shipping order 42" in done.stdout
    # The providers' shutdown flushed before the child exited: everything has arrived.
    assert ("reliable_sub", "send orders") in found.spans
    assert ("reliable_sub", "process shipping") in found.spans
    assert {"messaging.client.consumed.messages", "messaging.process.duration",
            "reliable_sub.delivery.attempts"} <= found.metrics
    assert found.services == {"shipping-test"}
