"""The publish side (#28): ``messaging.client.sent.messages`` and
``messaging.client.operation.duration`` for every publish an adapter makes (the user's own, the
dead-letter publish, the outbox relay's), on the providers a Subscriber or relay was given
rather than only the global ones; send spans name the server and the client."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from reliable_sub import ConfigurationError, DeadLetterPolicy, Outcome, Subscriber
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.adapters.nats_jetstream import NatsJetStreamAdapter
from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
from reliable_sub.clock import SystemClock
from reliable_sub.outbox import OutboxRelay
from reliable_sub.ports import Outgoing
from reliable_sub.testing.otel import Recorded, recording_telemetry
from reliable_sub.testing.services import redis_url
from reliable_sub.testing.timing import drive_until
from tests.memory_world import serve_until, setup
from tests.nats_processes import NatsServer
from tests.outbox_support import fresh_outbox

SENT = "messaging.client.sent.messages"
DURATION = "messaging.client.operation.duration"
DESTINATION = "messaging.destination.name"
WITHIN = 30.0


@pytest.fixture
def given() -> Iterator[Recorded]:
    """Providers given to a Subscriber or relay; the global ones stay the API's no-ops."""
    with recording_telemetry(install=False) as recorded:
        yield recorded


def sent(recorded: Recorded) -> dict[tuple[str, str | None], float]:
    """messaging.client.sent.messages by destination and error.type."""
    return {(p.attributes[DESTINATION], p.attributes.get("error.type")): p.value
            for p in recorded.points(SENT)}


def timed(recorded: Recorded) -> dict[tuple[str | None, str | None], int]:
    """How many publish operations messaging.client.operation.duration timed, by destination
    and error.type."""
    return {(p.attributes.get(DESTINATION), p.attributes.get("error.type")): p.count
            for p in recorded.points(DURATION)}


def test_a_subscribers_providers_record_the_publishes_made_through_its_adapter(
        given: Recorded) -> None:
    broker = MemoryAdapter()
    broker.ensure_subscription_sync("orders", "billing")
    Subscriber(broker, tracer_provider=given.tracer_provider,
               meter_provider=given.meter_provider)

    broker.publish_sync("orders", b"1")
    broker.publish_sync("orders", b"2")
    with pytest.raises(LookupError):
        broker.publish_sync("no-such-topic", b"3")

    assert sent(given) == {("orders", None): 2,
                           ("no-such-topic", "reliable_sub.errors.UnknownTopicError"): 1}
    assert timed(given) == {("orders", None): 2,
                            ("no-such-topic", "reliable_sub.errors.UnknownTopicError"): 1}
    [point] = [p for p in given.points(DURATION) if p.attributes[DESTINATION] == "orders"]
    assert dict(point.attributes) == {
        "messaging.system": "memory", "messaging.operation.name": "send",
        "messaging.operation.type": "send", DESTINATION: "orders"}
    assert [span.name for span in given.spans()] == ["send orders", "send orders",
                                                     "send no-such-topic"]


async def test_the_dead_letter_publish_is_counted_on_the_subscribers_meter(
        given: Recorded) -> None:
    clock, broker, sub = setup(meter_provider=given.meter_provider,
                               dead_letter=DeadLetterPolicy("orders-dlq", 1))

    @sub.handler("billing")
    def charge(message: Any) -> None:
        raise ValueError("cannot parse")

    broker.publish_sync("orders", b"poison")
    await serve_until(sub, lambda: sub.stats[Outcome.DEAD_LETTERED] == 1, "the dead letter",
                      clock=clock)
    assert sent(given) == {("orders", None): 1, ("orders-dlq", None): 1}


def test_no_provider_anywhere_records_nothing_and_a_bad_one_is_refused() -> None:
    with recording_telemetry(install=False) as elsewhere:
        broker = MemoryAdapter()
        broker.ensure_topic_sync("orders")
        broker.publish_sync("orders", b"1")
        assert elsewhere.points(SENT) == [] and elsewhere.spans() == []
    with pytest.raises(ConfigurationError, match=r"instrument_publishes\(meter_provider=\)"):
        broker.instrument_publishes(meter_provider="prometheus")  # type: ignore[arg-type]


def test_binding_other_providers_to_one_adapter_warns(
        given: Recorded, caplog: pytest.LogCaptureFixture) -> None:
    broker = MemoryAdapter()
    Subscriber(broker, meter_provider=given.meter_provider)
    with recording_telemetry(install=False) as other, caplog.at_level(logging.WARNING):
        Subscriber(broker, meter_provider=given.meter_provider)
        assert caplog.records == [], "the same provider again is no change"
        Subscriber(broker, meter_provider=other.meter_provider)
    [record] = caplog.records
    assert "meter_provider" in record.getMessage()


async def test_redis_publish_many_counts_each_message_and_times_the_batch_once(
        given: Recorded) -> None:
    prefix = f"pubm-{uuid.uuid4().hex[:8]}"
    adapter = RedisStreamsAdapter(redis_url(), consumer="relay-1", key_prefix=prefix)
    adapter.instrument_publishes(given.tracer_provider, given.meter_provider)
    topic = f"{prefix}-orders"
    try:
        results = await adapter.publish_many([
            Outgoing(topic, b"1", None, None), Outgoing(topic, "not bytes", None, None),  # type: ignore[arg-type]
            Outgoing(topic, b"3", None, None)])
        await adapter.publish(topic, b"4")
    finally:
        await adapter.client.delete(topic)
        await adapter.close()
    assert [isinstance(r, Exception) for r in results] == [False, True, False]
    kind = f"{type(results[1]).__module__}.{type(results[1]).__qualname__}".removeprefix(
        "builtins.")
    assert sent(given) == {(topic, None): 3, (topic, kind): 1}
    assert timed(given) == {(topic, kind): 1, (topic, None): 1}, "a batch is one operation"
    [span] = given.spans(f"send {topic}")  # publish_many makes none: its caller does
    server = urlsplit(redis_url())
    assert {k: span.attributes[k] for k in ("server.address", "server.port",
                                           "messaging.client.id")} == {
        "server.address": server.hostname, "server.port": server.port or 6379,
        "messaging.client.id": "relay-1"}


async def test_nats_publish_many_counts_a_refused_message_by_its_error(
        given: Recorded, nats_server: NatsServer) -> None:
    prefix = f"pubm{uuid.uuid4().hex[:8]}"
    adapter = NatsJetStreamAdapter(nats_server.url, prefix=prefix)
    adapter.instrument_publishes(meter_provider=given.meter_provider)
    topic = f"{prefix}-orders"
    await adapter.ensure_topic(topic)
    try:
        results = await adapter.publish_many([
            Outgoing(topic, b"1", None, None), Outgoing(f"{prefix}-nowhere", b"2", None, None)])
    finally:
        await adapter.close()
    assert [isinstance(r, Exception) for r in results] == [False, True]
    assert sent(given) == {(topic, None): 1,
                           (f"{prefix}-nowhere", "reliable_sub.errors.UnknownTopicError"): 1}
    assert timed(given) == {(None, "reliable_sub.errors.UnknownTopicError"): 1}, (
        "two destinations: the operation names none")


async def test_the_relays_providers_count_its_publishes(given: Recorded) -> None:
    broker = MemoryAdapter()
    broker.ensure_topic_sync("orders")
    async with fresh_outbox("sqlite") as box:
        async with box.engine.begin() as connection:
            for n in range(3):
                await box.add(connection, "orders", b"%d" % n)
        relay = OutboxRelay(box, broker, meter_provider=given.meter_provider,
                            tracer_provider=given.tracer_provider, poll_interval=0.05)
        async with relay:
            await drive_until(SystemClock(), lambda: relay.published == 3, WITHIN,
                              what="the three rows published")
    assert sent(given) == {("orders", None): 3}
    assert len(given.spans("send orders")) == 3, "one span per row, the relay's"
