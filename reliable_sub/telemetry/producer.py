"""The producer side: a span ``send {topic}`` (kind PRODUCER) per published message, whose
context is injected into the message's attributes so the consumer's span can link to it.

Adapters call :func:`send_span` in ``publish`` and ``publish_sync`` (on the global tracer
provider: publishing has no Subscriber to configure it); the outbox relay calls it with its own
tracer and the context each row captured in its business transaction. ``publish_many`` creates no
spans of its own: its caller (the relay) does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from . import semconv as sc
from .consumer import error_type
from .propagation import inject
from .providers import tracer_of


@contextmanager
def send_span(
    system: str,
    topic: str,
    attributes: dict[str, str] | None,
    *,
    tracer: Tracer | None = None,
    parent: Context | None = None,
    span_attributes: dict[str, object] | None = None,
) -> Iterator[dict[str, str] | None]:
    """Around one publish: yields the attributes to publish, with the span's context injected
    (a copy; ``attributes`` is not changed). No SDK configured: yields ``attributes`` as they
    are, and costs nothing more.

    ``tracer`` defaults to one from the global provider; ``parent`` to the current context.
    """
    tracer = tracer if tracer is not None else tracer_of(None)
    if tracer is None:
        yield attributes
        return
    values: dict[str, object] = {
        sc.MESSAGING_SYSTEM: system, sc.OPERATION_TYPE: sc.SEND, sc.OPERATION_NAME: sc.SEND,
        sc.DESTINATION_NAME: topic,
    }
    if span_attributes:
        values.update(span_attributes)
    with tracer.start_as_current_span(
        f"{sc.SEND} {topic}", context=parent, kind=SpanKind.PRODUCER,
        attributes=values,  # type: ignore[arg-type]
        record_exception=False, set_status_on_exception=False,
    ) as span:
        carried = dict(attributes or {})
        inject(carried)
        try:
            yield carried
        except BaseException as error:
            if span.is_recording():
                span.set_attribute(sc.ERROR_TYPE, error_type(error))
                span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, error_type(error)))
            raise


__all__ = ["send_span"]
