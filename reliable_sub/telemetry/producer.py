"""The producer side: a span ``send {topic}`` (kind PRODUCER) per published message, whose
context is injected into the message's attributes so the consumer's span can link to it.

Our adapters publish through :class:`~.publishing.PublishTelemetry`, which opens
:func:`send_span` on the providers bound to the adapter (else the global ones); an adapter of
your own may call :func:`send_span` directly. The outbox relay opens its rows' spans
itself (:class:`SendSpans`, on its own tracer, each the child of the context its row captured in
the business transaction) and publishes under them; an adapter's ``send_span`` inside one of
those opens no second span. ``publish_many`` creates no spans of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from ..ports import Outgoing
from . import semconv as sc
from .guard import record_error, report
from .instruments import error_type
from .propagation import inject
from .providers import tracer_of

# Set in the context a send span is current in: a publish under it is that span's publish.
_SENDING = otel_context.create_key("reliable_sub.sending")


@contextmanager
def send_span(
    system: str,
    topic: str,
    attributes: dict[str, str] | None,
    *,
    tracer: Tracer | None = None,
    parent: Context | None = None,
    span_attributes: dict[str, Any] | None = None,
) -> Iterator[dict[str, str] | None]:
    """Around one publish: yields the attributes to publish, with the span's context injected
    (a copy; ``attributes`` is not changed). No SDK configured, or inside a send span already:
    yields ``attributes`` as they are, at no further cost.

    ``tracer`` defaults to one from the global provider; ``parent`` to the current context.
    """
    if otel_context.get_value(_SENDING):
        yield attributes
        return
    tracer = tracer if tracer is not None else tracer_of(None)
    if tracer is None:
        yield attributes
        return
    try:
        span = _start(tracer, system, topic, parent, span_attributes)
        token = otel_context.attach(_sending_in(span, parent))
    except Exception:
        report("send_span")
        yield attributes
        return
    try:
        carried = dict(attributes or {})
        try:
            inject(carried)
        except Exception:
            report("send_span")
        yield carried
    except BaseException as error:
        _failed(span, error)
        raise
    finally:
        otel_context.detach(token)
        _end(span)


class SendSpans:
    """The send spans of a batch of messages (the outbox relay's round).

    Args:
        tracer: where the spans go.
        system: the broker's ``messaging.system``.
        messages: what will be published.
        parents: each message's parent context (None: a root span).
        span_attributes: each message's extra span attributes.

    :attr:`messages` are the messages with each span's context injected, and :attr:`contexts`
    the contexts to publish each under (its span current); :meth:`end` ends the spans with the
    outcome of each publish.
    """

    def __init__(self, tracer: Tracer, system: str, messages: Sequence[Outgoing],
                 parents: Sequence[Context | None],
                 span_attributes: Sequence[dict[str, Any]]) -> None:
        self.spans = [_start(tracer, system, message.topic, parent or Context(), extra)
                      for message, parent, extra in zip(messages, parents, span_attributes,
                                                        strict=True)]
        self.contexts = [_sending_in(span, parent or Context())
                         for span, parent in zip(self.spans, parents, strict=True)]
        self.messages: list[Outgoing] = []
        for message, context in zip(messages, self.contexts, strict=True):
            carried = dict(message.attributes or {})
            inject(carried, context)
            self.messages.append(message._replace(attributes=carried))

    def end(self, outcomes: Sequence[BaseException | object | None]) -> None:
        """End each span: ``None`` published, an exception failed, anything else not sent."""
        for span, outcome in zip(self.spans, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                _failed(span, outcome)
            elif outcome is not None and span.is_recording():
                span.set_attribute(sc.OUTCOME, "not_sent")
            _end(span)


def _start(tracer: Tracer, system: str, topic: str, parent: Context | None,
           extra: dict[str, Any] | None) -> Span:
    attributes: dict[str, Any] = {
        sc.MESSAGING_SYSTEM: system, sc.OPERATION_TYPE: sc.SEND, sc.OPERATION_NAME: sc.SEND,
        sc.DESTINATION_NAME: topic,
    }
    if extra:
        attributes.update(extra)
    return tracer.start_span(f"{sc.SEND} {topic}", context=parent, kind=SpanKind.PRODUCER,
                             attributes=attributes)


def _sending_in(span: Span, base: Context | None) -> Context:
    """``base`` (default: the current context, with its baggage) with ``span`` current and the
    mark that a send span is open."""
    return otel_context.set_value(_SENDING, True, trace.set_span_in_context(span, base))


def _failed(span: Span, error: BaseException) -> None:
    try:
        if span.is_recording():
            span.set_attribute(sc.ERROR_TYPE, error_type(error))
            record_error(span, error, error_type(error))
            span.set_status(Status(StatusCode.ERROR, error_type(error)))
    except Exception:
        report("send span's error")


def _end(span: Span) -> None:
    try:
        span.end()
    except Exception:
        report("send span's end")


__all__ = ["SendSpans", "send_span"]
