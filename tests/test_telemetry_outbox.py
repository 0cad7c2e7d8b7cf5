"""Telemetry through the outbox: one trace from the business transaction to the consumer.

``Outbox.add`` keeps the writer's context in the row; the relay's send span is its child; the
consumer's span links to (or, configured so, is the child of) the send span. On the in-memory
broker the relay publishes each row under its span through ``publish`` (which must then open no
span of its own); on Redis Streams through ``publish_many``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from opentelemetry import propagate
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.trace import StatusCode

from reliable_sub import Message, Outcome, Subscriber, TelemetryPolicy
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.outbox import Outbox, OutboxRelay
from reliable_sub.ports import Adapter
from reliable_sub.testing.otel import Recorded, recording_telemetry
from reliable_sub.testing.services import redis_url
from tests.memory_world import serve_until
from tests.outbox_support import fresh_outbox
from tests.redis_processes import poll_until


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    with recording_telemetry() as recorded:
        yield recorded


@pytest.fixture(params=["memory", "redis"])
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Adapter, str, str]]:
    run = uuid.uuid4().hex[:8]
    topic, subscription = f"orders-{run}", f"shipping-{run}"
    if request.param == "memory":
        adapter: Adapter = MemoryAdapter()
    else:
        from reliable_sub.adapters.redis_streams import RedisStreamsAdapter

        adapter = RedisStreamsAdapter(redis_url(), key_prefix=f"otel-{run}")
    await adapter.ensure_subscription(topic, subscription)
    yield adapter, topic, subscription
    if request.param == "redis":
        await adapter.client.delete(topic)  # type: ignore[attr-defined]
    await adapter.close()


async def test_one_trace_from_the_business_transaction_to_the_consumer(
    recorded: Recorded, broker: tuple[Adapter, str, str],
) -> None:
    adapter, topic, subscription = broker
    async with fresh_outbox("postgresql") as box:
        service = recorded.tracer_provider.get_tracer("order-service")
        with service.start_as_current_span("place order") as business:
            async with box.engine.begin() as connection:
                await box.add(connection, topic, {"order": 1}, ordering_key="order-1")
        relay = OutboxRelay(box, adapter)
        assert await relay.relay_once() == 1
        sub = Subscriber(adapter, telemetry=TelemetryPolicy(producer_as_parent=True),
                         receive_timeout=0.2)
        handled: list[int] = []

        @sub.handler(subscription)
        async def ship(message: Message) -> None:
            handled.append(json.loads(message.data)["order"])

        await serve_until(sub, lambda: sub.stats[Outcome.ACKED] == 1, "the order")
    [send] = recorded.spans(f"send {topic}")
    [process] = recorded.spans(f"process {subscription}")
    trace_id = business.get_span_context().trace_id
    assert send.context.trace_id == trace_id == process.context.trace_id, "one trace"
    assert send.parent is not None and send.parent.span_id == business.get_span_context().span_id
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert send.attributes["reliable_sub.outbox.row_id"] >= 1
    assert send.attributes["messaging.system"] == adapter.capabilities.messaging_system
    assert handled == [1]


async def test_a_row_written_outside_any_span_starts_its_own_trace(recorded: Recorded) -> None:
    async with fresh_outbox("sqlite") as box:
        broker = MemoryAdapter()
        broker.ensure_subscription_sync("orders", "shipping")
        async with box.engine.begin() as connection:
            await box.add(connection, "orders", b"x")
        assert await OutboxRelay(box, broker).relay_once() == 1
    [send] = recorded.spans("send orders")
    assert send.parent is None
    [delivery] = await broker.receive("shipping", 10, 0)
    assert delivery.message.attributes["traceparent"].split("-")[2] == \
        f"{send.context.span_id:016x}", "the consumer links to the relay's send span"


async def test_a_failed_publish_is_an_error_span_and_the_gauges_show_the_backlog(
    recorded: Recorded,
) -> None:
    class Refusing(MemoryAdapter):
        async def publish(self, topic, data, attributes=None, ordering_key=None):  # type: ignore[no-untyped-def]
            if ordering_key == "bad":
                raise ConnectionError("broker refused")
            return await super().publish(topic, data, attributes, ordering_key)

    async with fresh_outbox("postgresql") as box:
        broker = Refusing()
        broker.ensure_topic_sync("orders")
        for key in ("bad", "good"):
            async with box.engine.begin() as connection:
                await box.add(connection, "orders", b"x", ordering_key=key)
        relay = OutboxRelay(box, broker, metrics_interval=0.05, poll_interval=60)
        async with relay:
            await poll_until(lambda: recorded.sum("reliable_sub.outbox.published") == 1,
                             "the good row published")
            await poll_until(lambda: recorded.sum("reliable_sub.outbox.backlog") == 1,
                             "the gauge to show the refused row pending")
        oldest = recorded.sum("reliable_sub.outbox.oldest_age")
    failed = [s for s in recorded.spans("send orders")
              if s.status.status_code is StatusCode.ERROR]
    [span] = failed
    assert span.attributes["error.type"] == "ConnectionError"
    assert oldest >= 0


async def add_within_a_span(recorded: Recorded, box: Outbox) -> MemoryAdapter:
    """Write one row to ``orders`` inside a span; the broker it will be relayed to."""
    broker = MemoryAdapter()
    broker.ensure_subscription_sync("orders", "shipping")
    with recorded.tracer_provider.get_tracer("t").start_as_current_span("writer"):
        async with box.engine.begin() as connection:
            await box.add(connection, "orders", b"x")
    return broker


@pytest.mark.parametrize("damaged", ["not json", "[1, 2]", '{"traceparent": 5}', '"x"'])
async def test_a_damaged_trace_context_column_still_publishes_its_row(
    recorded: Recorded, damaged: str,
) -> None:
    async with fresh_outbox("sqlite") as box:
        broker = await add_within_a_span(recorded, box)
        async with box.engine.begin() as connection:
            await connection.execute(box.table.update().values(trace_context=damaged))
        assert await OutboxRelay(box, broker).relay_once() == 1
    [send] = recorded.spans("send orders")
    assert send.parent is None, "a root span: the writer's context could not be read"
    assert send.attributes["reliable_sub.outbox.row_id"] == 1, "the relay's own span"
    assert len(await broker.receive("shipping", 10, 0)) == 1


async def test_a_broken_span_processor_does_not_stop_the_relay(recorded: Recorded) -> None:
    class Broken(SpanProcessor):
        def on_start(self, span, parent_context=None):  # type: ignore[no-untyped-def]
            raise RuntimeError("span processor broke")

    recorded.tracer_provider.add_span_processor(Broken())
    async with fresh_outbox("sqlite") as box:
        broker = MemoryAdapter()
        broker.ensure_subscription_sync("orders", "shipping")
        async with box.engine.begin() as connection:
            await box.add(connection, "orders", b"x")
        relay = OutboxRelay(box, broker)
        assert await relay.relay_once() == 1
        assert (await relay.backlog()).pending == 0
    assert len(await broker.receive("shipping", 10, 0)) == 1


class BrokenPropagator(TextMapPropagator):
    """A propagator that raises on every call: user code gone wrong."""

    def inject(self, carrier, context=None, setter=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("propagator broke")

    def extract(self, carrier, context=None, getter=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("propagator broke")

    @property
    def fields(self) -> set[str]:
        return {"traceparent"}


async def test_a_broken_propagator_fails_no_write_and_no_publish(recorded: Recorded) -> None:
    previous = propagate.get_global_textmap()
    propagate.set_global_textmap(BrokenPropagator())
    try:
        async with fresh_outbox("sqlite") as box:
            broker = await add_within_a_span(recorded, box)
            assert await OutboxRelay(box, broker).relay_once() == 1
            broker.publish_sync("orders", b"y", {"traceparent": "00-x"})
    finally:
        propagate.set_global_textmap(previous)
    assert [d.message.data for d in await broker.receive("shipping", 10, 0)] == [b"x", b"y"]
