"""Telemetry details on the in-memory broker (the adapter suite checks spans on every adapter).

Spans and metrics are recorded by the SDK's in-memory exporter and reader, installed as the
global providers for one test (reliable_sub.testing.otel).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics._internal import instrument as sdk_instrument
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.trace import SpanKind

from reliable_sub import (
    LeasePolicy,
    ManualClock,
    Message,
    Outcome,
    RetryPolicy,
    TelemetryPolicy,
)
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.telemetry.producer import send_span
from reliable_sub.testing.otel import Recorded, recording_telemetry
from reliable_sub.testing.timing import drive_until
from tests.memory_world import serving, setup

WITHIN = 60.0
SPAN = "process billing"


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    with recording_telemetry() as recorded:
        yield recorded


async def run_until(clock: ManualClock, sub, predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    task = await serving(sub, clock)
    try:
        await drive_until(clock, predicate, WITHIN, what=what)
    finally:
        await sub.shutdown(timeout=1)
        await task


@pytest.mark.parametrize("value", [
    "00-zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz-yyyyyyyyyyyyyyyy-01",  # not hex
    "00-00000000000000000000000000000000-0000000000000000-01",  # all-zero ids: invalid
    "garbage", "", "00-" + "a" * 10_000, "ʘ‿ʘ\n\x00",
    "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra-" + "x" * 20_000,
])
async def test_a_malformed_or_hostile_traceparent_is_ignored(recorded: Recorded,
                                                             value: str) -> None:
    clock, broker, sub = setup()
    handled: list[bytes] = []

    @sub.handler("billing")
    async def charge(message: Message) -> None:
        handled.append(message.data)

    broker.publish_sync("orders", b"x", {"traceparent": value, "tracestate": value,
                                         "baggage": value})
    await run_until(clock, sub, lambda: sub.stats[Outcome.ACKED] == 1, "the message")
    [span] = recorded.spans(SPAN)
    assert handled == [b"x"]
    assert span.attributes["reliable_sub.outcome"] == "acked"
    assert all(link.context.is_valid for link in span.links)


async def test_child_of_the_producer_when_configured(recorded: Recorded) -> None:
    clock, broker, sub = setup(telemetry=TelemetryPolicy(producer_as_parent=True))
    sub.handler("billing")(lambda message: None)
    broker.publish_sync("orders", b"x")
    await run_until(clock, sub, lambda: sub.stats[Outcome.ACKED] == 1, "the message")
    [send] = recorded.spans("send orders")
    [span] = recorded.spans(SPAN)
    assert span.parent is not None and span.parent.span_id == send.context.span_id
    assert span.context.trace_id == send.context.trace_id, "one trace, publish to processing"
    assert not span.links


@pytest.mark.parametrize(("mode", "expected"), [
    ("raw", "order-9"),
    ("hashed", hashlib.sha256(b"order-9").hexdigest()[:16]),
    ("off", None),
])
async def test_the_idempotency_key_attribute(recorded: Recorded, mode: str,
                                             expected: str | None) -> None:
    clock, broker, sub = setup(telemetry=TelemetryPolicy(idempotency_key=mode))
    sub.handler("billing")(lambda message: None)
    broker.publish_sync("orders", b"x", {"idempotency-key": "order-9"})
    await run_until(clock, sub, lambda: sub.stats[Outcome.ACKED] == 1, "the message")
    [span] = recorded.spans(SPAN)
    assert span.attributes.get("reliable_sub.idempotency_key") == expected


def test_bad_telemetry_policies_name_the_field() -> None:
    from reliable_sub import ConfigurationError

    with pytest.raises(ConfigurationError, match="idempotency_key"):
        TelemetryPolicy(idempotency_key="plain")
    with pytest.raises(ConfigurationError, match="producer_as_parent"):
        TelemetryPolicy(producer_as_parent="yes")  # type: ignore[arg-type]


async def test_without_an_sdk_nothing_is_recorded_or_injected() -> None:
    clock, broker, sub = setup()
    seen: list[dict[str, str]] = []
    current: list[bool] = []

    @sub.handler("billing")
    async def charge(message: Message) -> None:
        seen.append(dict(message.attributes))
        current.append(trace.get_current_span().get_span_context().is_valid)

    broker.publish_sync("orders", b"x", {"k": "v"})
    task = await serving(sub, clock)
    try:
        assert sub._runtime is not None and sub._runtime.telemetry is None, \
            "no SDK: the delivery path has no telemetry stage at all"
        await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 1, WITHIN)
    finally:
        await sub.shutdown(timeout=1)
        await task
    assert seen == [{"k": "v"}], "no traceparent injected without an SDK"
    assert current == [False]


async def test_handlers_run_inside_their_attempts_span(recorded: Recorded) -> None:
    clock, broker, sub = setup()
    broker.ensure_subscription_sync("orders", "audit")
    tracer = recorded.tracer_provider.get_tracer("the-app")
    inside: dict[str, int] = {}

    @sub.handler("billing")
    async def charge(message: Message) -> None:
        inside["async"] = trace.get_current_span().get_span_context().span_id
        with tracer.start_as_current_span("charge the card"):
            pass

    @sub.handler("audit")
    def audit(message: Message) -> None:  # a sync handler, on a worker thread
        inside["sync"] = trace.get_current_span().get_span_context().span_id

    broker.publish_sync("orders", b"x")
    await run_until(clock, sub, lambda: sub.stats[Outcome.ACKED] == 2, "both handlers")
    [billing] = recorded.spans(SPAN)
    [audit_span] = recorded.spans("process audit")
    [card] = recorded.spans("charge the card")
    assert inside == {"async": billing.context.span_id, "sync": audit_span.context.span_id}
    assert card.parent is not None and card.parent.span_id == billing.context.span_id


async def test_in_process_retries_are_events_of_one_attempt(recorded: Recorded) -> None:
    clock, broker, sub = setup(retry=RetryPolicy(min_backoff=1, max_backoff=2,
                                                 in_process_attempts=3, in_process_wait=0.1))
    calls: list[int] = []

    @sub.handler("billing")
    async def charge(message: Message) -> None:
        calls.append(1)
        if len(calls) < 3:
            raise TimeoutError("the card network is slow")

    broker.publish_sync("orders", b"x")
    await run_until(clock, sub, lambda: sub.stats[Outcome.ACKED] == 1, "the message")
    [span] = recorded.spans(SPAN)
    retries = [e for e in span.events if e.name == "reliable_sub.retry"]
    assert [e.attributes["reliable_sub.retry.attempt"] for e in retries] == [1, 2]
    assert {e.attributes["exception.type"] for e in retries} == {"TimeoutError"}
    assert span.attributes["reliable_sub.outcome"] == "acked"


async def test_lease_extensions_are_events_and_metrics(recorded: Recorded) -> None:
    clock, broker, sub = setup(lease=LeasePolicy(min_extension=10, max_extension=60))
    release: list[bool] = []

    @sub.handler("billing")
    async def slow(message: Message) -> None:
        while not release:
            await clock.sleep(5)

    broker.publish_sync("orders", b"x")
    task = await serving(sub, clock)
    try:
        lease = sub.lease_manager("billing")
        await drive_until(clock, lambda: lease.stats.extend_calls >= 3, WITHIN,
                          what="three extensions")
        inflight = recorded.sum("reliable_sub.inflight.messages")
        release.append(True)
        await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 1, WITHIN)
    finally:
        await sub.shutdown(timeout=1)
        await task
    [span] = recorded.spans(SPAN)
    extensions = [e for e in span.events if e.name == "reliable_sub.lease.extended"]
    assert len(extensions) >= 3
    assert all(e.attributes["reliable_sub.lease.extension"] >= 10 for e in extensions)
    assert recorded.sum("reliable_sub.lease.extensions") == len(extensions)
    [deadline] = recorded.points("reliable_sub.lease.deadline")
    assert deadline.value >= 10
    assert inflight == 1, "one message in flight while its handler ran"
    assert recorded.sum("reliable_sub.inflight.messages") == 0, "none after it settled"


async def test_the_lease_deadline_has_a_point_before_any_extension(recorded: Recorded) -> None:
    """#28: quick handlers are never extended; the dashboard's deadline line (and the p99 alert)
    still needs the deadline their deliveries get."""
    clock, broker, sub = setup(lease=LeasePolicy(min_extension=10, max_extension=60))
    sub.handler("billing")(lambda message: None)
    broker.publish_sync("orders", b"x")
    task = await serving(sub, clock)
    try:
        await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 1, WITHIN)
        lease = sub.lease_manager("billing")
        assert lease.stats.extend_calls == 0
        [deadline] = recorded.points("reliable_sub.lease.deadline")
        assert deadline.value == lease.extension() == 10
        assert deadline.attributes["messaging.consumer.group.name"] == "billing"
    finally:
        await sub.shutdown(timeout=1)
        await task


async def test_a_stopped_delivery_ends_its_span_as_stopped(recorded: Recorded) -> None:
    clock, broker, sub = setup(sync_workers=1)
    started: list[bytes] = []

    @sub.handler("billing")
    def one_at_a_time(message: Message) -> None:
        started.append(message.data)

    for n in range(3):
        broker.publish_sync("orders", str(n).encode())
    task = await serving(sub, clock)
    await sub.shutdown(timeout=1)
    await task
    spans = recorded.spans(SPAN)
    assert len(spans) == 3, "every received delivery's span ends, whatever its outcome"
    by_outcome = {s.attributes["reliable_sub.outcome"] for s in spans}
    assert by_outcome <= {"acked", "stopped"}
    assert all(s.kind is SpanKind.CONSUMER and s.end_time is not None for s in spans)


async def test_metric_attributes_hold_no_message_ids(recorded: Recorded) -> None:
    clock, broker, sub = setup()
    sub.handler("billing")(lambda message: None)
    for n in range(5):
        broker.publish_sync("orders", str(n).encode())
    await run_until(clock, sub, lambda: sub.stats[Outcome.ACKED] == 5, "the messages")
    points = recorded.points("messaging.client.consumed.messages")
    assert [dict(p.attributes) for p in points] == [{
        "messaging.system": "memory", "messaging.operation.name": "process",
        "messaging.destination.name": "orders",
        "messaging.destination.subscription.name": "billing",
        "messaging.consumer.group.name": "billing",  # on every system: dashboards filter by it
        "reliable_sub.outcome": "acked",
    }]
    assert points[0].value == 5


def test_a_publish_without_a_subscriber_is_a_producer_span(recorded: Recorded) -> None:
    broker = MemoryAdapter()
    broker.ensure_subscription_sync("orders", "billing")
    broker.publish_sync("orders", b"x", {"k": "v"})
    [send] = recorded.spans("send orders")
    assert send.kind is SpanKind.PRODUCER
    assert send.attributes["messaging.operation.type"] == "send"
    assert send.attributes["messaging.system"] == "memory"


def test_the_tracing_example_prints_one_trace_from_the_order_to_the_success() -> None:
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, "examples/tracing.py"], capture_output=True, text=True, timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK: one trace" in done.stdout
    tree = done.stdout.splitlines()
    assert sum("process shipping" in line for line in tree) == 3
    assert any("send orders" in line and "outbox row 1" in line for line in tree)
    assert any("outcome acked" in line for line in tree)


class BrokenProcessor(SpanProcessor):
    """A span processor that raises on every span: user code gone wrong."""

    def on_start(self, span, parent_context=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("span processor broke on start")

    def on_end(self, span):  # type: ignore[no-untyped-def]
        raise RuntimeError("span processor broke on end")


async def test_a_broken_tracer_or_meter_fails_no_delivery_and_no_publish(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BrokenProcessor())
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])

    def broken_record(*args: object, **kwargs: object) -> None:
        raise RuntimeError("histogram broke")

    monkeypatch.setattr(sdk_instrument._Histogram, "record", broken_record)
    clock, broker, sub = setup(tracer_provider=tracer_provider, meter_provider=meter_provider,
                               retry=RetryPolicy(min_backoff=1, max_backoff=1))
    calls: list[int] = []

    @sub.handler("billing")
    async def charge(message: Message) -> None:
        calls.append(message.delivery_attempt)
        if len(calls) == 1:
            raise ConnectionError("first attempt fails")

    with send_span("memory", "orders", {"a": "1"}, tracer=tracer_provider.get_tracer("t")) as sent:
        assert sent is not None and sent["a"] == "1", "the publish goes on without its span"
        broker.publish_sync("orders", b"x", sent)
    await run_until(clock, sub, lambda: sub.stats[Outcome.ACKED] == 1, "the message")
    assert calls == [1, 2]
    assert sub.stats.outcomes == {Outcome.RETRY: 1, Outcome.ACKED: 1}
    warnings = [r for r in caplog.records
                if r.name == "reliable_sub.telemetry" and r.levelname == "WARNING"]
    assert warnings, "the failing telemetry is logged"
    assert any("span processor broke" in str(r.exc_info[1]) or "histogram broke" in
               str(r.exc_info[1]) for r in warnings if r.exc_info)


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ failed")

    def __repr__(self) -> str:
        raise RuntimeError("__repr__ failed")


async def test_an_error_that_cannot_be_printed_still_ends_its_span_and_every_log_line(
    recorded: Recorded, caplog: pytest.LogCaptureFixture
) -> None:
    """#24: the SDK's record_exception calls str(error); when that raises, the span used to
    be left unended (never exported), and log lines that formatted the error were lost."""
    from reliable_sub import DeadLetterPolicy

    clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", 2),
                               retry=RetryPolicy(in_process_attempts=2, min_backoff=1,
                                                 max_backoff=2, retry_on=(_Unprintable,)))
    broker.ensure_subscription_sync("orders-dlq", "dead")

    @sub.handler("billing")
    async def charge(message: Message) -> None:
        raise _Unprintable()

    broker.publish_sync("orders", b"x")
    await run_until(clock, sub, lambda: sub.stats[Outcome.DEAD_LETTERED] == 1,
                    "the dead letter")
    spans = recorded.spans(SPAN)
    assert [s.attributes["reliable_sub.outcome"] for s in spans] == ["retried",
                                                                     "dead_lettered"]
    for span in spans:
        [exception] = [e for e in span.events if e.name == "exception"]
        assert exception.attributes["exception.message"].startswith("<unprintable _Unprintable")
        assert "_Unprintable" in exception.attributes["exception.stacktrace"]
    retries = [e for s in spans for e in s.events if e.name == "reliable_sub.retry"]
    assert retries and retries[0].attributes["exception.message"].startswith("<unprintable")
    for record in caplog.records:
        record.getMessage()  # raised for the lines that formatted the error, before
    assert any("dead-lettered" in r.getMessage() for r in caplog.records)


async def test_dead_letters_are_counted_by_reason(recorded: Recorded) -> None:
    """#26: a dashboard tells a rejected message from one whose attempts were used up."""
    from reliable_sub import DeadLetterPolicy, Reject

    clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", 2))
    broker.ensure_subscription_sync("orders-dlq", "dead")

    @sub.handler("billing")
    async def charge(message: Message) -> None:
        if message.data == b"reject":
            raise Reject("no such customer")
        raise ConnectionError("down")

    for data in (b"reject", b"exhaust", b"reject"):
        broker.publish_sync("orders", data)
    await run_until(clock, sub, lambda: sub.stats[Outcome.DEAD_LETTERED] == 3, "three letters")
    reason = "reliable_sub.dead_letter.reason"
    by_reason = {p.attributes[reason]: p.value
                 for p in recorded.points("reliable_sub.dead_lettered")}
    assert by_reason == {"rejected": 2, "max-delivery-attempts": 1}


async def test_acked_messages_are_counted_by_the_attempt_that_succeeded(
        recorded: Recorded) -> None:
    """#27: a counter by attempt (tallied in process), not a histogram record per message."""
    clock, broker, sub = setup(retry=RetryPolicy(min_backoff=1, max_backoff=1))
    fail_until: dict[bytes, int] = {b"first": 1, b"third": 3, b"twelfth": 12}

    @sub.handler("billing")
    async def charge(message: Message) -> None:
        if message.delivery_attempt < fail_until[message.data]:
            raise ConnectionError("down")

    for data in fail_until:
        broker.publish_sync("orders", data)
    await run_until(clock, sub, lambda: sub.stats[Outcome.ACKED] == 3, "three acks")
    by_attempt = {p.attributes["reliable_sub.delivery.attempt"]: p.value
                  for p in recorded.points("reliable_sub.delivery.attempts")}
    assert by_attempt == {"1": 1, "3": 1, ">10": 1}


async def test_failures_are_counted_by_error_type_with_a_bounded_number_of_types(
        recorded: Recorded) -> None:
    """#28: failures by error.type on the consumed counter and the processing time, at most
    MAX_ERROR_TYPES names per route, then _OTHER."""
    from reliable_sub import DeadLetterPolicy
    from reliable_sub.telemetry.instruments import MAX_ERROR_TYPES

    clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", 1))
    kinds = {f"m{n}": type(f"Failure{n}", (Exception,), {}) for n in range(MAX_ERROR_TYPES + 5)}

    @sub.handler("billing")
    async def charge(message: Message) -> None:
        raise kinds[message.data.decode()]("no")

    for data in kinds:
        broker.publish_sync("orders", data.encode())
    await run_until(clock, sub, lambda: sub.stats[Outcome.DEAD_LETTERED] == len(kinds),
                    "every message dead-lettered")
    counted = {p.attributes["error.type"]: p.value
               for p in recorded.points("messaging.client.consumed.messages")
               if p.attributes["reliable_sub.outcome"] == "dead_lettered"}
    assert counted.pop("_OTHER") == 5
    assert len(counted) == MAX_ERROR_TYPES and set(counted.values()) == {1}
    assert all(name.endswith(tuple(kind.__qualname__ for kind in kinds.values()))
               for name in counted)
    timed = {p.attributes.get("error.type") for p in recorded.points("messaging.process.duration")}
    assert timed == {*counted, "_OTHER"}
