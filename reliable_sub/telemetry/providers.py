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


# The last provider asked and what it gave: publish asks for the global tracer once per message,
# and an SDK's get_tracer builds a new tracer (about 10 µs) on every call.
_last_tracer: tuple[TracerProvider | None, Tracer | None] = (None, None)
_last_meter: tuple[MeterProvider | None, Meter | None] = (None, None)


def tracer_of(provider: TracerProvider | None) -> Tracer | None:
    """Our tracer from ``provider`` (default: the global one), or None if it records nothing."""
    global _last_tracer
    provider = provider if provider is not None else trace.get_tracer_provider()
    if isinstance(provider, ProxyTracerProvider | NoOpTracerProvider):
        return None
    last_provider, tracer = _last_tracer
    if last_provider is not provider or tracer is None:
        tracer = provider.get_tracer(SCOPE, __version__, schema_url=SCHEMA_URL)
        _last_tracer = (provider, tracer)
    return tracer


def meter_of(provider: MeterProvider | None) -> Meter | None:
    """Our meter from ``provider`` (default: the global one), or None if it records nothing."""
    global _last_meter
    provider = provider if provider is not None else metrics.get_meter_provider()
    if isinstance(provider, ProxyMeterProvider | NoOpMeterProvider):
        return None
    last_provider, meter = _last_meter
    if last_provider is not provider or meter is None:
        meter = provider.get_meter(SCOPE, __version__, schema_url=SCHEMA_URL)
        _last_meter = (provider, meter)
    return meter


__all__ = ["meter_of", "tracer_of"]
