"""One message's trace, printed as a tree: from the business transaction to the attempt that worked.

* ``place order`` writes the order's event into the outbox (SQLite here) inside a span of the
  order service; the outbox keeps that span's context with the row.
* The relay publishes the row: its ``send orders`` span is the child of ``place order``.
* The ``shipping`` consumer fails twice (the carrier's API is down) and then succeeds: three
  ``process shipping`` spans, one per delivery attempt, outcomes ``retried``, ``retried``,
  ``acked``, each with its events (the dedup verdict, the exception).

Spans go to :class:`TreeConsoleExporter`, a console exporter that prints each trace as a tree
when the provider shuts down. The consumer is configured as the producer's *child*
(``TelemetryPolicy(producer_as_parent=True)``) so the whole story is one trace; by default a
consumer span *links* to the producer's instead.

Run it with ``python examples/tracing.py``. Needs ``pip install "reliable-sub[sql,otel]"``.
Exits with status 1 if the trace is not the one described above.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import defaultdict
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from reliable_sub import (
    MemoryDedupStore,
    Message,
    Outcome,
    RetryPolicy,
    Subscriber,
    SystemClock,
    TelemetryPolicy,
)
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.outbox import Outbox, OutboxRelay
from reliable_sub.testing.timing import drive_until

WAIT_LIMIT = 10.0
# The attributes shown on a span's line, with their labels.
SHOWN_ATTRIBUTES = {"reliable_sub.delivery_attempt": "attempt", "reliable_sub.outcome": "outcome",
                    "error.type": "error", "reliable_sub.outbox.row_id": "outbox row"}


class TreeConsoleExporter(SpanExporter):
    """Collects finished spans and prints them as one tree per trace at shutdown."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        print(render(self.spans))


def render(spans: Sequence[ReadableSpan]) -> str:
    children: dict[int | None, list[ReadableSpan]] = defaultdict(list)
    for span in sorted(spans, key=lambda s: s.start_time or 0):
        children[span.parent.span_id if span.parent else None].append(span)
    lines: list[str] = []

    def walk(span: ReadableSpan, prefix: str, last: bool) -> None:
        branch = "" if not prefix and not lines else ("└── " if last else "├── ")
        duration = ((span.end_time or 0) - (span.start_time or 0)) / 1e6
        details = [span.kind.name]
        details += [f"{label} {span.attributes[name]}" for name, label in SHOWN_ATTRIBUTES.items()
                    if span.attributes and name in span.attributes]
        if span.status.status_code.name == "ERROR":
            details.append("ERROR")
        lines.append(f"{prefix}{branch}{span.name}  [{', '.join(details)}]  {duration:.1f} ms")
        inner = prefix + ("    " if last else "│   ") if branch else prefix
        for event in span.events:
            attributes = {k: v for k, v in (event.attributes or {}).items()
                          if k != "exception.stacktrace"}
            lines.append(f"{inner}  · {event.name} {json.dumps(attributes)}")
        kids = children.get(span.context.span_id, [])
        for index, child in enumerate(kids):
            walk(child, inner, index == len(kids) - 1)

    for root in children[None]:
        lines.append(f"trace {root.context.trace_id:032x}")
        walk(root, "", True)
    return "\n".join(lines)


async def main() -> int:
    exporter = TreeConsoleExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    service = trace.get_tracer("order-service")

    outbox = Outbox("sqlite://")
    await outbox.create_schema()
    with service.start_as_current_span("place order"):
        async with outbox.engine.begin() as connection:  # the order and its event, together
            await outbox.add(connection, "orders", {"order": 42}, ordering_key="order-42")

    broker = MemoryAdapter()
    broker.ensure_subscription_sync("orders", "shipping")
    assert await OutboxRelay(outbox, broker).relay_once() == 1
    await outbox.close()

    sub = Subscriber(broker, dedup=MemoryDedupStore(),
                     retry=RetryPolicy(min_backoff=0.05, max_backoff=0.1),
                     telemetry=TelemetryPolicy(producer_as_parent=True))
    attempts: list[int] = []

    @sub.handler("shipping")
    async def ship(message: Message) -> None:
        attempts.append(message.delivery_attempt)
        if len(attempts) < 3:
            raise ConnectionError("the carrier's API is down")

    serving = asyncio.ensure_future(sub.serve())
    try:
        await drive_until(SystemClock(), lambda: sub.stats[Outcome.ACKED] == 1, WAIT_LIMIT,
                          what="the third attempt")
    finally:
        await sub.shutdown(timeout=5)
        await serving
    provider.shutdown()  # prints the tree

    spans = exporter.spans
    process = [s for s in spans if s.name == "process shipping"]
    send = [s for s in spans if s.name == "send orders"]
    ok = (len({s.context.trace_id for s in spans}) == 1 and len(send) == 1
          and [s.attributes["reliable_sub.outcome"] for s in process]  # type: ignore[index]
          == ["retried", "retried", "acked"]
          and all(s.parent is not None and s.parent.span_id == send[0].context.span_id
                  for s in process))
    print("OK: one trace, from the order to the attempt that worked" if ok
          else "FAILED: see the tree above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
