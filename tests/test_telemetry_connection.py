"""Delivery spans say which server and which client (#28): ``server.address``, ``server.port``
and ``messaging.client.id`` where the adapter knows them (Redis, NATS), nothing where it does
not (the in-memory broker), and a broken answer costs no delivery."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from reliable_sub import Outcome, Subscriber
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.adapters.nats_jetstream import NatsJetStreamAdapter
from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
from reliable_sub.testing.otel import Recorded, recording_telemetry
from reliable_sub.testing.services import redis_url
from tests.memory_world import serve_until
from tests.nats_processes import NatsServer

WITHIN = 30.0
CONNECTION = ("server.address", "server.port", "messaging.client.id")


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    with recording_telemetry() as recorded:
        yield recorded


async def one_delivery(adapter: Any, topic: str, subscription: str) -> None:
    sub = Subscriber(adapter, receive_timeout=0.2)
    sub.handler(subscription)(lambda message: None)
    await adapter.publish(topic, b"x")
    await serve_until(sub, lambda: sub.stats[Outcome.ACKED] == 1, "the delivery", WITHIN)


def connection_of(recorded: Recorded, subscription: str) -> dict[str, Any]:
    [span] = recorded.spans(f"process {subscription}")
    return {name: span.attributes[name] for name in CONNECTION if name in span.attributes}


async def test_redis_spans_name_the_server_and_the_consumer(recorded: Recorded) -> None:
    url = redis_url()
    prefix = f"conn-{uuid.uuid4().hex[:8]}"
    adapter = RedisStreamsAdapter(url, consumer="shipping-7", key_prefix=prefix)
    topic, subscription = f"{prefix}-orders", f"{prefix}-billing"
    await adapter.ensure_subscription(topic, subscription, ack_deadline=30, start="0")
    try:
        await one_delivery(adapter, topic, subscription)
    finally:
        await adapter.client.delete(topic)
        await adapter.close()
    server = urlsplit(url)
    assert connection_of(recorded, subscription) == {
        "server.address": server.hostname, "server.port": server.port or 6379,
        "messaging.client.id": "shipping-7"}


async def test_nats_spans_name_the_server_and_the_connection(
        recorded: Recorded, nats_server: NatsServer) -> None:
    prefix = f"conn{uuid.uuid4().hex[:8]}"
    adapter = NatsJetStreamAdapter(nats_server.url, prefix=prefix, name="shipping-7")
    topic, subscription = f"{prefix}-orders", f"{prefix}-billing"
    await adapter.ensure_subscription(topic, subscription, ack_deadline=30)
    try:
        await one_delivery(adapter, topic, subscription)
    finally:
        await adapter.close()
    server = urlsplit(nats_server.url)
    assert connection_of(recorded, subscription) == {
        "server.address": server.hostname, "server.port": server.port,
        "messaging.client.id": "shipping-7"}


async def test_an_adapter_that_cannot_tell_or_answers_badly_costs_no_delivery(
        recorded: Recorded) -> None:
    plain = MemoryAdapter()
    plain.ensure_subscription_sync("orders", "billing")
    await one_delivery(plain, "orders", "billing")
    assert connection_of(recorded, "billing") == {}

    class Broken(MemoryAdapter):
        def connection_attributes(self) -> dict[str, Any]:
            raise RuntimeError("no idea")

    class Odd(MemoryAdapter):
        def connection_attributes(self) -> dict[str, Any]:
            return {"server.address": "broker-1", "server.port": True, "extra": [1]}

    for kind, subscription in ((Broken, "audit"), (Odd, "ledger")):
        adapter = kind()
        adapter.ensure_subscription_sync("orders", subscription)
        await one_delivery(adapter, "orders", subscription)
    assert connection_of(recorded, "audit") == {}
    assert connection_of(recorded, "ledger") == {"server.address": "broker-1"}



@pytest.mark.parametrize(("emulator", "expected"), [
    ("localhost:8681", {"server.address": "localhost", "server.port": 8681}),
    ("[::1]:8085", {"server.address": "::1", "server.port": 8085}),
    (None, {"server.address": "pubsub.googleapis.com", "server.port": 443}),
])
def test_pubsub_names_the_endpoint_its_clients_use(
        monkeypatch: pytest.MonkeyPatch, emulator: str | None, expected: dict[str, Any]) -> None:
    from reliable_sub.adapters.pubsub import PubSubAdapter

    if emulator is None:
        monkeypatch.delenv("PUBSUB_EMULATOR_HOST", raising=False)
    else:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", emulator)
    assert PubSubAdapter("project-x").connection_attributes() == expected
