"""Spans decided once the outcome is known (``TelemetryPolicy.trace_first_attempts`` below 1).

Most deliveries succeed on their first attempt and nobody opens their spans; the SDK's work for
each of them (starting and ending a span with a dozen attributes) costs more than the rest of
the delivery path. With a ratio below 1, a first attempt that the ratio leaves out starts no
span: it gets a :class:`DeferredSpan`, which only notes when the delivery was received and the
events that happen to it. When it settles:

* acked: nothing is recorded (the ratio's share of first attempts is traced in full instead);
* any other outcome (retried, dead-lettered, a duplicate, deferred, given back at a stop, an
  ack the broker refused): its span is made then, starting at the reception, with its events at
  the times they happened, exactly as a span made at the start would have ended.

What such an after-the-fact span cannot have is the handler's own child spans: while the
handler ran, its current span was a valid but unsampled one (its own ids), so the SDK's default
``ParentBased`` sampler recorded none of them and none of them became a stray root trace.
Redeliveries (attempt 2 and later) are always traced in full, children included.
"""

from __future__ import annotations

import time
from random import Random
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

_Event = tuple[str, dict[str, Any], int]


class DeferredSpan:
    """A first attempt's span not started: when it was received, and its events so far.

    It answers the calls the telemetry stage makes on a span before it ends
    (``is_recording``, ``add_event``), so events are kept in case the span is made.
    """

    __slots__ = ("events", "handler", "start")

    def __init__(self, handler: str) -> None:
        self.start = time.time_ns()
        self.handler = handler
        self.events: list[_Event] | None = None

    def is_recording(self) -> bool:
        return True  # its events are kept: the outcome may still ask for the span

    def add_event(self, name: str, attributes: dict[str, Any]) -> None:
        if self.events is None:
            self.events = []
        self.events.append((name, attributes, time.time_ns()))


def unsampled_context(rng: Random) -> Context:
    """A context whose current span is valid and not sampled, with ids of its own: what a
    handler of a deferred delivery runs in (its child spans are not recorded)."""
    span_context = SpanContext(trace_id=rng.getrandbits(128) or 1,
                               span_id=rng.getrandbits(64) or 1,
                               is_remote=False, trace_flags=TraceFlags(TraceFlags.DEFAULT))
    return trace.set_span_in_context(NonRecordingSpan(span_context), Context())


__all__ = ["DeferredSpan", "unsampled_context"]
