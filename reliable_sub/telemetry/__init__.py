"""OpenTelemetry for reliable-sub: a span per delivery attempt, metrics, and context from producer
to consumer (``opentelemetry-api`` only; install an SDK, e.g. the ``otel`` extra, to record).

* :mod:`~reliable_sub.telemetry.semconv` -- every span, attribute, event and metric name
  (messaging semantic conventions v1.27.0, and ours under ``reliable_sub.*``);
* :mod:`~reliable_sub.telemetry.consumer` -- the delivery path's telemetry stage;
* :mod:`~reliable_sub.telemetry.producer` -- :func:`send_span`, around each publish;
* :mod:`~reliable_sub.telemetry.propagation` -- :func:`inject` and :func:`extract` of trace
  context in message attributes, through the configured propagator;
* :mod:`~reliable_sub.telemetry.providers` -- the tracer and meter of a run (None without an SDK).

``Subscriber(tracer_provider=..., meter_provider=..., telemetry=TelemetryPolicy(...))`` and
``OutboxRelay(tracer_provider=..., meter_provider=...)`` take the providers; the global ones by
default, read when a run starts.
"""

from ..policy import TelemetryPolicy
from . import semconv
from .consumer import SubscriberTelemetry
from .producer import send_span
from .propagation import extract, inject

__all__ = ["SubscriberTelemetry", "TelemetryPolicy", "extract", "inject", "semconv", "send_span"]
