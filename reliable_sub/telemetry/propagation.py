"""Trace context carried in message attributes, through the configured propagator.

:func:`inject` writes the current (or a given) context into an attributes dict, as the global
propagator does (W3C ``traceparent``/``tracestate`` and ``baggage`` by default). :func:`extract`
reads one back from a message's attributes and never raises: a malformed, oversized or hostile
value is ignored and the message simply has no producer context.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, MutableMapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanContext

from .guard import report

logger = logging.getLogger(__name__)

# Longest attribute value handed to the propagator: W3C trace context is 55 characters, and
# tracestate and baggage are bounded at a few kilobytes; anything longer is not context.
MAX_CARRIER_VALUE = 8192


def inject(attributes: MutableMapping[str, str], context: Context | None = None) -> None:
    """Write ``context`` (default: the current one) into ``attributes``."""
    propagate.inject(attributes, context=context)


def extract(attributes: Mapping[str, str]) -> Context | None:
    """The context a producer injected into ``attributes``, or None (none, or unreadable)."""
    fields = propagate.get_global_textmap().fields
    carrier = {}
    for name in fields:
        value = attributes.get(name)
        if isinstance(value, str) and len(value) <= MAX_CARRIER_VALUE:
            carrier[name] = value
    if not carrier:
        return None
    try:
        return propagate.extract(carrier)
    except Exception:  # a hostile value must never fail a delivery
        logger.debug("ignoring unreadable trace context %r", carrier, exc_info=True)
        return None


def context_as_json() -> str | None:
    """The current context as a JSON object of carrier fields (what ``Outbox.add`` keeps with
    a row), or None when there is none to keep. Never raises."""
    carrier: dict[str, str] = {}
    try:
        inject(carrier)
    except Exception:
        report("inject")
        return None
    return json.dumps(carrier) if carrier else None


def extract_json(text: str | None) -> Context | None:
    """The context :func:`context_as_json` kept, or None (none, or not readable). Never
    raises: a row whose column was damaged still publishes, without its trace."""
    if not text:
        return None
    try:
        carrier = json.loads(text)
    except ValueError:
        logger.debug("ignoring unreadable trace context %r", text[:200])
        return None
    if not isinstance(carrier, dict):
        return None
    return extract(carrier)


def producer_span_context(context: Context | None) -> SpanContext | None:
    """The span context ``context`` carries, if it names a valid span."""
    if context is None:
        return None
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


__all__ = ["MAX_CARRIER_VALUE", "context_as_json", "extract", "extract_json", "inject",
           "producer_span_context"]
