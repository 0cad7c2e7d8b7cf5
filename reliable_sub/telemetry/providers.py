"""Tracers and meters from the providers a user gives, or the global ones.

When no OpenTelemetry SDK is configured (the API's proxy or no-op providers), there is nothing
to record: :func:`tracer_of` and :func:`meter_of` return None and the delivery path skips
telemetry altogether, so the API alone costs nothing per message. Providers are read when a run
starts: set the SDK's global providers before starting a Subscriber or relay.
"""

from __future__ import annotations

from opentelemetry import metrics, trace
from opentelemetry.metrics import Meter, MeterProvider, NoOpMeterProvider
from opentelemetry.trace import NoOpTracerProvider, ProxyTracerProvider, Tracer, TracerProvider

from .._version import __version__
from .semconv import SCHEMA_URL, SCOPE

try:  # the API's stand-in before an SDK provider is set (private in opentelemetry-api)
    from opentelemetry.metrics._internal import _ProxyMeterProvider as ProxyMeterProvider
except ImportError:  # pragma: no cover - a future API that moves it: treat nothing as a proxy
    ProxyMeterProvider = NoOpMeterProvider  # type: ignore[misc,assignment]


# The last provider asked and what it gave (None: it records nothing): publish asks once per
# message; an SDK's get_tracer builds a new tracer (about 10 µs) on every call, and the
# isinstance checks against the API's ABCs cost most of a microsecond.
_last_tracer: tuple[TracerProvider | None, Tracer | None] = (None, None)
_last_meter: tuple[MeterProvider | None, Meter | None] = (None, None)


def tracer_of(provider: TracerProvider | None) -> Tracer | None:
    """Our tracer from ``provider`` (default: the global one), or None if it records nothing."""
    global _last_tracer
    provider = provider if provider is not None else trace.get_tracer_provider()
    last_provider, tracer = _last_tracer
    if provider is not last_provider:
        tracer = (None if isinstance(provider, ProxyTracerProvider | NoOpTracerProvider)
                  else provider.get_tracer(SCOPE, __version__, schema_url=SCHEMA_URL))
        _last_tracer = (provider, tracer)
    return tracer


def meter_of(provider: MeterProvider | None) -> Meter | None:
    """Our meter from ``provider`` (default: the global one), or None if it records nothing."""
    global _last_meter
    provider = provider if provider is not None else metrics.get_meter_provider()
    last_provider, meter = _last_meter
    if provider is not last_provider:
        meter = (None if isinstance(provider, ProxyMeterProvider | NoOpMeterProvider)
                 else provider.get_meter(SCOPE, __version__, schema_url=SCHEMA_URL))
        _last_meter = (provider, meter)
    return meter


__all__ = ["meter_of", "tracer_of"]
