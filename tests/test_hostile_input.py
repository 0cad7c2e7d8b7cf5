"""Hostile input (#13): what publishers and handlers can throw at a consumer, and what happens.

Every case publishes a well-formed canary beside the hostile message and checks that it is
handled (the consumer stays healthy, other messages keep flowing), and checks the hostile
message's outcome exactly: acked, retried, dead-lettered with an error naming the problem, or
refused at publish with a named exception.

Payloads, attributes and idempotency keys run on all six adapters: the in-memory broker (on a
ManualClock), Redis Streams (real Redis), the Pub/Sub emulator, NATS JetStream (a private nats-
server), RabbitMQ (the shared broker), SQS (a private ElasticMQ) and Kafka (a private KRaft node).
Each adapter gets one running Subscriber for the whole module (a ``world``): the hostile messages
of one test after another go through the same consumer, which must still be healthy after all of
them. Its dead-letter policy allows 2 handler failures, so a poison message is ``retried`` once,
then ``dead_lettered``. Records that only another Kafka producer writes (foreign headers, binary
keys, tombstones) are in ``tests/test_kafka.py``.

Handler behaviour (never returns, raises ``KeyboardInterrupt``/``SystemExit``/``CancelledError``,
blocks the loop) is in ``tests/test_hostile_handlers.py``, on the in-memory broker, where a
ManualClock moves the time (here a world on a real broker would keep the clock from jumping).

Already covered elsewhere, and not repeated here:

* a Redis entry from another producer whose attributes hold non-string values (or are not JSON):
  dead-lettered with ``MalformedMessageError``, its batch handled --
  ``tests/test_redis_streams.py::test_an_unreadable_entry_is_dead_lettered_and_its_batch_handled``;
* entries written past ``publish`` whose parse raises what nobody foresaw (attributes nested
  100,000 deep, on Redis, fresh and reclaimed, and on NATS), and odd entries that are still
  messages (a far-future Redis entry id, a wrapped delivery counter), each between two valid
  ones in one batch -- ``tests/test_hostile_entries.py``;
* many more malformed ``traceparent``/``tracestate``/``baggage`` values (up to 20 KB), on memory --
  ``tests/test_telemetry.py::test_a_malformed_or_hostile_traceparent_is_ignored``;
* a *sync* handler that never returns: given back at ``max_lease_duration``, its claim kept while
  the thread runs, dead-lettered with ``HandlerTimeoutError`` once each period counted as a
  failure -- ``reliable_sub/testing/adapter_suite/failures.py::
  test_a_hung_sync_handler_starves_nothing_and_is_dead_lettered_in_the_end`` (memory and Redis),
  and ``tests/test_subscriber.py::
  test_past_max_lease_a_sync_handler_keeps_its_claim_and_is_not_run_twice``;
* ``KeyboardInterrupt``, ``SystemExit``, ``CancelledError`` and a custom ``BaseException`` raised
  once, sync and async, before and after an await: retried, then acked --
  ``reliable_sub/testing/adapter_suite/hostile_handlers.py::
  test_anything_a_handler_raises_is_a_failed_attempt`` (memory and Redis);
* an async handler calling ``time.sleep``: the loop-lag watchdog's WARNING names it --
  ``reliable_sub/testing/adapter_suite/failures.py::
  test_an_async_handler_blocking_the_loop_is_named_in_a_warning``.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracerProvider

from reliable_sub import (
    DeadLetterPolicy,
    InvalidMessageError,
    Message,
    Outcome,
    Subscriber,
)
from reliable_sub.outcome import DeliveryEvent
from reliable_sub.ports import Adapter
from reliable_sub.testing.harness import (
    Harness,
    memory_harness,
    nats_harness,
    pubsub_harness,
    rabbitmq_harness,
    redis_harness,
)
from reliable_sub.testing.harness_kafka import kafka_harness
from reliable_sub.testing.services import missing_service, rabbitmq_url

# One event loop for the module: the worlds (a running Subscriber per adapter) outlive a test.
pytestmark = pytest.mark.asyncio(loop_scope="module")

ADAPTERS = ["memory", "redis", "pubsub", "nats", "rabbitmq", "sqs", "kafka"]
# Handler failures after which the worlds dead-letter a message: retried once, then dead.
MAX_ATTEMPTS = 2
# How long a world may take to settle a message: clock seconds (virtual on memory).
WITHIN = {"memory": 300.0, "redis": 20.0, "pubsub": 30.0, "nats": 20.0, "rabbitmq": 20.0,
          "sqs": 20.0, "kafka": 20.0}

MIB = 1024 * 1024
# "10 MB": 10 MiB on memory and Redis. Pub/Sub's limit is 10,000,000 bytes per publish request
# (data, attributes and the topic name together); google-cloud-pubsub refuses a larger one
# before sending (the emulator would take even 10 MiB + 1 through the raw API: it does not
# enforce the limit). 1 KB below it leaves room for the topic name and the request's framing.
TEN_MB = 10 * MIB
PUBSUB_REQUEST_LIMIT = 10_000_000
PUBSUB_LARGEST_DATA = PUBSUB_REQUEST_LIMIT - 1000
# Pub/Sub's attribute limits (the emulator does not enforce them; the adapter does, at publish).
# A NATS server's default max_payload (data and headers together), which the test server keeps.
NATS_MAX_PAYLOAD = MIB
# librdkafka's default message.max.bytes (a record with its key and headers; Kafka's brokers take
# 1 MiB and a little more per batch by default).
KAFKA_MAX_MESSAGE = 1_000_000
PUBSUB_KEY_BYTES = 256
PUBSUB_VALUE_BYTES = 1024


def _no_behaviour(message: Message) -> None:
    return None


@dataclass
class World:
    """One adapter with a Subscriber running on it for the whole module.

    The handler of ``subscription`` records each message and then calls ``behaviour`` (a test
    sets it to raise for its hostile message); the handler of the dead-letter subscription
    records each copy by its ``original-message-id``.
    """

    name: str
    harness: Harness
    adapter: Adapter
    topic: str
    subscription: str
    dlq_subscription: str
    spans: InMemorySpanExporter
    subscriber: Subscriber | None = None
    behaviour: Callable[[Message], None] = _no_behaviour
    handled: list[Message] = field(default_factory=list)
    outcomes: dict[tuple[str, str], list[Outcome]] = field(
        default_factory=lambda: defaultdict(list))
    events: dict[tuple[str, str], list[DeliveryEvent]] = field(
        default_factory=lambda: defaultdict(list))
    dead: dict[str, Message] = field(default_factory=dict)

    @property
    def within(self) -> float:
        return WITHIN[self.name]

    def on_event(self, event: DeliveryEvent) -> None:
        key = (event.message.subscription, event.message.id)
        self.outcomes[key].append(event.outcome)
        self.events[key].append(event)

    def outcomes_of(self, message_id: str) -> list[Outcome]:
        return self.outcomes.get((self.subscription, message_id), [])

    def error_of(self, message_id: str) -> BaseException | None:
        """What the handler raised on the last failed delivery of ``message_id``."""
        errors = [e.error for e in self.events.get((self.subscription, message_id), [])
                  if e.error is not None]
        return errors[-1] if errors else None

    def seen(self, message_id: str) -> list[Message]:
        """Every delivery of ``message_id`` the handler was called with."""
        return [m for m in self.handled if m.id == message_id]

    async def publish(self, data: bytes, attributes: dict[str, Any] | None = None,
                      ordering_key: str | None = None) -> str:
        return await self.adapter.publish(self.topic, data, attributes, ordering_key)

    async def publish_canary(self) -> str:
        return await self.publish(f"canary-{uuid.uuid4().hex}".encode())

    async def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        await self.harness.wait_until(predicate, self.within, what)

    async def settled(self, expected: dict[str, list[Outcome]]) -> None:
        """Wait until each message id has exactly its expected outcomes (fail on more)."""
        await self.wait_for(
            lambda: all(len(self.outcomes_of(i)) >= len(o) for i, o in expected.items()),
            f"outcomes {expected}")
        got = {i: self.outcomes_of(i) for i in expected}
        assert got == expected
        assert self.subscriber is not None and self.subscriber.healthy()

    async def dead_letter_of(self, message_id: str) -> Message:
        await self.wait_for(lambda: message_id in self.dead, "the dead-letter copy")
        return self.dead[message_id]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=ADAPTERS)
async def running(request: pytest.FixtureRequest) -> AsyncIterator[World]:
    harness = _harness(request.param, request)
    adapter = await harness.adapter()
    try:
        topic, subscription = await harness.topic_and_subscription()
        dlq_topic, dlq_subscription = await harness.topic_and_subscription()
        spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()  # this Subscriber's own
        tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
        world = World(request.param, harness, adapter, topic, subscription, dlq_subscription,
                      spans)
        subscriber = harness.subscriber(
            adapter, dedup=harness.dedup_store(), on_event=world.on_event,
            dead_letter=DeadLetterPolicy(dlq_topic, max_delivery_attempts=MAX_ATTEMPTS),
            tracer_provider=tracer_provider,
        )
        world.subscriber = subscriber
        # publishing stays untraced: the attributes published are exactly the test's (a send
        # span would inject its own traceparent over a malformed one)
        adapter.instrument_publishes(tracer_provider=NoOpTracerProvider())

        @subscriber.handler(subscription)
        async def handle(message: Message) -> None:
            world.handled.append(message)
            world.behaviour(message)

        @subscriber.handler(dlq_subscription)
        async def dead_letters(message: Message) -> None:
            world.dead[message.attributes["original-message-id"]] = message

        async with harness.serving(subscriber):
            yield world
        tracer_provider.shutdown()
    finally:
        await harness.close()


def _harness(name: str, request: pytest.FixtureRequest) -> Harness:
    if name == "memory":
        return memory_harness()
    if name == "redis":
        return redis_harness()  # skips without Redis (fails under CI=true)
    if name == "nats":
        if importlib.util.find_spec("nats") is None:
            missing_service('the NATS tests need pip install "reliable-sub[nats]"')
        return nats_harness(request.getfixturevalue("nats_server").url)
    if name == "rabbitmq":
        return rabbitmq_harness(rabbitmq_url())  # fails under CI=true without RabbitMQ
    if name == "kafka":
        if importlib.util.find_spec("confluent_kafka") is None:
            missing_service('the Kafka tests need pip install "reliable-sub[kafka]"')
        return kafka_harness(request.getfixturevalue("kafka_broker").bootstrap)
    if name == "sqs":
        if importlib.util.find_spec("aiobotocore") is None:
            missing_service('the SQS tests need pip install "reliable-sub[sqs]"')
        from reliable_sub.testing.sqs_harness import sqs_harness

        return sqs_harness(request.getfixturevalue("sqs_server").client_options)
    if importlib.util.find_spec("google.cloud.pubsub_v1") is None:
        missing_service('the Pub/Sub tests need pip install "reliable-sub[pubsub]"')
    return pubsub_harness()  # starts the emulator; skips without it (fails under CI=true)


@pytest.fixture
def world(running: World) -> Iterator[World]:
    running.behaviour = _no_behaviour
    yield running
    running.behaviour = _no_behaviour


async def publish_beside_canary(
    world: World, data: bytes, attributes: dict[str, Any] | None = None,
    ordering_key: str | None = None,
) -> tuple[str | BaseException, str]:
    """Publish the hostile message and a canary concurrently (so that, on Pub/Sub, they could
    share the client's batch); returns the hostile's id or error, and the canary's id."""
    hostile, canary = await asyncio.gather(
        world.publish(data, attributes, ordering_key), world.publish_canary(),
        return_exceptions=True)
    assert isinstance(canary, str), f"the canary's publish failed: {canary!r}"
    return hostile, canary


# -- payloads ------------------------------------------------------------------------------------


async def test_an_empty_payload(world: World) -> None:
    """Memory and Redis deliver it (data b""); Pub/Sub refuses a message with neither data nor
    attributes, so the adapter refuses it at publish, alone: before, the service's refusal
    failed every message of the client's batch, the canary too."""
    hostile, canary = await publish_beside_canary(world, b"")
    if world.name == "pubsub":
        assert isinstance(hostile, InvalidMessageError), hostile
        assert "neither data nor attributes" in str(hostile)
        await world.settled({canary: [Outcome.ACKED]})
        return
    assert isinstance(hostile, str), hostile
    await world.settled({hostile: [Outcome.ACKED], canary: [Outcome.ACKED]})
    [message] = world.seen(hostile)
    assert (message.data, message.attributes) == (b"", {})


async def test_an_empty_payload_with_an_attribute_is_delivered(world: World) -> None:
    hostile, canary = await publish_beside_canary(world, b"", {"kind": "ping"})
    assert isinstance(hostile, str), hostile
    await world.settled({hostile: [Outcome.ACKED], canary: [Outcome.ACKED]})
    [message] = world.seen(hostile)
    assert (message.data, message.attributes) == (b"", {"kind": "ping"})


async def test_a_10_mb_payload(world: World) -> None:
    """10 MiB is delivered whole by memory and Redis; Pub/Sub refuses it at publish (over its
    10,000,000-byte request limit) and delivers the largest it takes; NATS refuses it before
    sending (over the server's max_payload, 1 MiB by default) and delivers the
    largest it takes (1 KB below it, for the headers); Kafka's producer too (over its
    message.max.bytes, 1,000,000 by default). Receiving that one needs
    a channel without gRPC's 4 MiB receive limit: before, every pull failed while it waited."""
    payload = bytes(range(256)) * (TEN_MB // 256)
    if world.name == "pubsub":
        with pytest.raises(InvalidMessageError, match="over Pub/Sub's limit of 10 MB"):
            await world.publish(payload)
        payload = payload[:PUBSUB_LARGEST_DATA]
    if world.name == "nats":
        with pytest.raises(InvalidMessageError, match="over the NATS server's max_payload"):
            await world.publish(payload)
        payload = payload[:NATS_MAX_PAYLOAD - 1000]  # room for the headers
    if world.name == "kafka":
        with pytest.raises(InvalidMessageError, match=r"larger than the producer's message\.max"):
            await world.publish(payload)
        payload = payload[:KAFKA_MAX_MESSAGE - 1000]  # room for the record's framing
    elif world.name == "sqs":  # 1 MiB a message, body (base64 for binary data) and attributes
        from reliable_sub.adapters._sqs_messages import largest_binary_payload

        with pytest.raises(InvalidMessageError, match="over the limit of 1,048,576 bytes"):
            await world.publish(payload)
        payload = payload[:largest_binary_payload()]
    hostile, canary = await publish_beside_canary(world, payload)
    assert isinstance(hostile, str), hostile
    await world.settled({hostile: [Outcome.ACKED], canary: [Outcome.ACKED]})
    [message] = world.seen(hostile)
    assert len(message.data) == len(payload)
    assert hashlib.sha256(message.data).digest() == hashlib.sha256(payload).digest()


async def test_a_non_utf8_payload_is_delivered_as_is_and_a_decode_error_dead_letters_it(
    world: World,
) -> None:
    """The bytes reach the handler untouched. A handler that decodes them fails like with any
    error: retried, then dead-lettered, the copy carrying the same bytes and the decode error."""
    payload = b"\xff\xfe\x00\x80 not UTF-8 " + uuid.uuid4().bytes

    def decode(message: Message) -> None:
        if message.data == payload:
            message.data.decode("utf-8")

    world.behaviour = decode
    hostile, canary = await publish_beside_canary(world, payload)
    assert isinstance(hostile, str), hostile
    await world.settled({hostile: [Outcome.RETRY, Outcome.DEAD_LETTERED],
                         canary: [Outcome.ACKED]})
    assert [m.data for m in world.seen(hostile)] == [payload, payload]
    dead = await world.dead_letter_of(hostile)
    assert dead.data == payload
    assert dead.attributes["error-type"] == "builtins.UnicodeDecodeError"
    assert "can't decode byte 0xff in position 0" in dead.attributes["error-message"]


# -- attributes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("attributes", [
    {"amount": 10}, {"flag": None}, {"raw": b"bytes"}, {"list": ["a"]}, {1: "int name"},
    {"ok": "fine", "nested": {"a": "b"}},
], ids=["int", "None", "bytes", "list", "int-name", "dict"])
async def test_attributes_that_are_not_strings_are_refused_at_publish(
    world: World, attributes: dict[Any, Any]
) -> None:
    """Every adapter refuses them with a TypeError naming the attribute; nothing is sent."""
    before = len(world.handled)
    with pytest.raises(TypeError, match="attributes must map str to str"):
        await world.publish(b"typed", attributes)
    with pytest.raises(TypeError, match="attributes must map str to str"):
        await asyncio.to_thread(world.adapter.publish_sync, world.topic, b"typed", attributes)
    canary = await world.publish_canary()
    await world.settled({canary: [Outcome.ACKED]})
    assert [m for m in world.handled[before:] if m.data == b"typed"] == [], "it was sent"


# Names that are legal everywhere but odd: empty, blank, control characters, non-ASCII, separators
# of the adapters' own formats, the longest Pub/Sub allows, the arguments of google-cloud-pubsub's
# publish() (which took attributes as keyword arguments: `timeout` was dropped from the message,
# `retry` crashed, the others were a TypeError), the fields of a Redis stream entry.
ODD_ATTRIBUTES = {
    "": "empty name", " ": "blank", "a b": "space", "line\nbreak": "newline", "tab\there": "tab",
    "nul\x00name": "nul\x00value", "ключ": "значение", "🙂": "emoji", "=": "=", "a:b": ":",
    "*": "*", "{tag}": "{}", '"quoted"': "'", "k" * PUBSUB_KEY_BYTES: "longest name",
    "longest value": "v" * PUBSUB_VALUE_BYTES,
    "self": "me", "topic": "not the topic", "data": "not the data", "timeout": "30",
    "retry": "3", "ordering_key": "not the key", "ordering-key": "not the key either",
    "attributes": "not the attributes",
}


async def test_odd_attribute_names_reach_the_handler_unchanged(world: World) -> None:
    hostile, canary = await publish_beside_canary(world, b"odd", ODD_ATTRIBUTES)
    assert isinstance(hostile, str), hostile
    await world.settled({hostile: [Outcome.ACKED], canary: [Outcome.ACKED]})
    [message] = world.seen(hostile)
    assert message.attributes == ODD_ATTRIBUTES
    assert message.ordering_key is None, "an attribute never becomes the ordering key"


# Within every adapter's own limits, beyond Pub/Sub's: memory and Redis deliver them; Pub/Sub's
# service would refuse the whole publish request (every message of the batch), so the adapter
# refuses the one message at publish.
BEYOND_PUBSUB: dict[str, tuple[dict[str, str], str | None, str]] = {
    "name of 257 bytes": ({"k" * (PUBSUB_KEY_BYTES + 1): "v"}, None,
                          "is 257 bytes of UTF-8, Pub/Sub allows at most 256"),
    "value of 1025 bytes": ({"k": "é" * 512 + "v"}, None,
                            "is 1025 bytes of UTF-8, Pub/Sub allows at most 1024"),
    "101 attributes": ({f"k{i}": "v" for i in range(101)}, None,
                       "101 attributes, Pub/Sub allows at most 100"),
    "lone surrogate": ({"k": "\ud800"}, None, "is not valid Unicode text"),
    "publish() argument name with an ordering key": ({"data": "x"}, "key-1",
                                                     "cannot be published with an ordering key"),
}


@pytest.mark.parametrize("case", sorted(BEYOND_PUBSUB))
async def test_attributes_beyond_pubsubs_limits(world: World, case: str) -> None:
    attributes, ordering_key, refusal = BEYOND_PUBSUB[case]
    hostile, canary = await publish_beside_canary(world, b"big attributes", attributes,
                                                  ordering_key)
    if world.name == "pubsub":
        assert isinstance(hostile, InvalidMessageError), hostile
        assert refusal in str(hostile)
        await world.settled({canary: [Outcome.ACKED]})
        return
    assert isinstance(hostile, str), hostile
    await world.settled({hostile: [Outcome.ACKED], canary: [Outcome.ACKED]})
    [message] = world.seen(hostile)
    assert message.attributes == attributes


# The dead-letter copy's own attribute names, plus a publisher's name for their renamed form.
OURS = {
    "original-message-id": "publisher's id", "original-subscription": "publisher's sub",
    "delivery-attempts": "99", "handler-failures": "-1", "error-type": "none",
    "error-message": "publisher's text", "publisher-delivery-attempts": "also the publisher's",
    "dead-letter-reason": "the publisher's reason",
}


async def test_attributes_named_like_ours_reach_the_handler_unchanged(world: World) -> None:
    """They mean nothing on the way in: the attempt is the broker's count, not the attribute."""
    hostile, canary = await publish_beside_canary(world, b"ours", OURS)
    assert isinstance(hostile, str), hostile
    await world.settled({hostile: [Outcome.ACKED], canary: [Outcome.ACKED]})
    [message] = world.seen(hostile)
    assert message.attributes == OURS
    assert message.delivery_attempt == 1


async def test_attributes_named_like_ours_are_kept_renamed_in_a_dead_letter(
    world: World,
) -> None:
    """The copy's own attributes say where it came from and why; the publisher's of those
    names are kept as ``publisher-<name>``, and its ``publisher-<name>`` as
    ``publisher-publisher-<name>`` (before, one of the two was lost; and until the dead-letter
    tools needed to undo the renaming, ``<name>`` took ``publisher-publisher-<name>`` when the
    publisher had ``publisher-<name>``). The error message, long and
    not ASCII, is cut to 1000 bytes of UTF-8 (before, 1000 characters: over Pub/Sub's 1024-byte
    limit, so that dead letter could never be published)."""
    error_text = "ошибка разбора заказа; " * 100

    def fail(message: Message) -> None:
        if message.data == b"ours, failing":
            raise ValueError(error_text)

    world.behaviour = fail
    hostile, canary = await publish_beside_canary(world, b"ours, failing", OURS)
    assert isinstance(hostile, str), hostile
    await world.settled({hostile: [Outcome.RETRY, Outcome.DEAD_LETTERED],
                         canary: [Outcome.ACKED]})
    dead = await world.dead_letter_of(hostile)
    attributes = dict(dead.attributes)
    cut = attributes.pop("error-message")
    assert attributes == {
        "original-message-id": hostile, "original-subscription": world.subscription,
        "delivery-attempts": "2", "handler-failures": "2", "error-type": "builtins.ValueError",
        "dead-letter-reason": "max-delivery-attempts",
        "publisher-original-message-id": "publisher's id",
        "publisher-original-subscription": "publisher's sub",
        "publisher-delivery-attempts": "99",
        "publisher-publisher-delivery-attempts": "also the publisher's",
        "publisher-handler-failures": "-1", "publisher-error-type": "none",
        "publisher-error-message": "publisher's text",
        "publisher-dead-letter-reason": "the publisher's reason",
    }
    assert 990 < len(cut.encode()) <= 1000 and error_text.startswith(cut)


async def test_a_malformed_traceparent_is_ignored(world: World) -> None:
    """The delivery gets its span, without a link to (or a parent in) the bogus context."""
    values = [
        "00-zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz-yyyyyyyyyyyyyyyy-01",  # not hex
        "00-00000000000000000000000000000000-0000000000000000-01",  # all-zero ids: invalid
        "ʘ‿ʘ\n\x00 garbage",
        "00-" + "a" * 1000,
    ]
    ids = [await world.publish(b"traced", {"traceparent": v, "tracestate": v, "baggage": v})
           for v in values]
    canary = await world.publish_canary()
    await world.settled({**{i: [Outcome.ACKED] for i in ids}, canary: [Outcome.ACKED]})
    for message_id in ids:
        [span] = spans_of(world, message_id)
        assert span.attributes is not None
        assert span.attributes["reliable_sub.outcome"] == "acked"
        assert span.parent is None
        assert not span.links


def spans_of(world: World, message_id: str) -> list[ReadableSpan]:
    return [span for span in world.spans.get_finished_spans()
            if span.name == f"process {world.subscription}" and span.attributes is not None
            and span.attributes.get("messaging.message.id") == message_id]


# -- idempotency keys ----------------------------------------------------------------------------

# Each key (made unique per run) is published twice: the first is handled, the second is a
# duplicate; its "sibling" (a key that a careless encoding could confuse with it) is handled too.
KEYS: dict[str, tuple[str, str]] = {
    "10 KB": ("k" * 10_240, "k" * 10_239 + "j"),
    "colon": ("order:42:pay", "order:42"),
    "star": ("*", "order-*"),
    "newline": ("line\nbreak\r\n", "line\nbreak"),
    "unicode": ("заказ-🙂-e\u0301", "заказ-🙂-é"),  # NFD and NFC: different keys
    "lone surrogate": ("order-\ud800", "order-\ufffd"),
    "nul": ("order\x00", "order"),
}


@pytest.mark.parametrize("kind", sorted(KEYS))
async def test_an_odd_idempotency_key_deduplicates_and_is_never_confused(
    world: World, kind: str
) -> None:
    run = uuid.uuid4().hex[:8]
    key, sibling = (f"{k}{run}" if kind != "10 KB" else run + k for k in KEYS[kind])
    if world.name == "pubsub" and kind in ("10 KB", "lone surrogate"):
        with pytest.raises(InvalidMessageError, match="of attribute 'idempotency-key'"):
            await world.publish(b"keyed", {"idempotency-key": key})
        if kind == "lone surrogate":
            return
        # the longest key Pub/Sub carries, and one that differs in its last character only
        longest = run + "k" * (PUBSUB_VALUE_BYTES - len(run) - 1)
        key, sibling = longest + "a", longest + "b"
    first = await world.publish(b"keyed", {"idempotency-key": key})
    await world.settled({first: [Outcome.ACKED]})
    again, other, canary = (
        await world.publish(b"keyed", {"idempotency-key": key}),
        await world.publish(b"keyed", {"idempotency-key": sibling}),
        await world.publish_canary(),
    )
    await world.settled({first: [Outcome.ACKED], again: [Outcome.DUPLICATE],
                         other: [Outcome.ACKED], canary: [Outcome.ACKED]})
    assert [m.idempotency_key for m in world.seen(first)] == [key]
    assert world.seen(again) == [], "the duplicate reached the handler"
    assert [m.idempotency_key for m in world.seen(other)] == [sibling]
    for message_id in (first, again, other):  # telemetry hashes the key: it must cope too
        assert len(spans_of(world, message_id)) == 1


async def test_an_empty_idempotency_key_counts_as_none(world: World) -> None:
    """The message id is the key then: two messages with empty keys are both handled."""
    first, second = (await world.publish(b"unkeyed", {"idempotency-key": ""}),
                     await world.publish(b"unkeyed", {"idempotency-key": ""}))
    canary = await world.publish_canary()
    await world.settled({first: [Outcome.ACKED], second: [Outcome.ACKED],
                         canary: [Outcome.ACKED]})
    assert [m.idempotency_key for m in world.seen(first) + world.seen(second)] == [first, second]
