"""PubSubAdapter specifics on the official emulator (the contract itself is in conformance/).

Every test makes its own topic and subscription names, so tests share nothing but the emulator.
Whether acks took effect is checked without waiting for the 10 s minimum ack deadline: a nack(0)
(modifyAckDeadline 0) of an acked message is a no-op on the emulator, while an un-acked one comes
back at once; so "nack(0) everything, then a short receive is empty" fails if any ack was lost.

The emulator restart test resets the emulator for the whole process: it is the LAST test of this
file and must stay so (other modules create their own names and keep no emulator state).
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

if os.environ.get("CI", "").lower() != "true" and any(
    importlib.util.find_spec(name) is None
    for name in ("google", "google.cloud", "google.cloud.pubsub_v1")  # parents first
):
    pytest.skip('the Pub/Sub tests need pip install "reliable-sub[pubsub]"',
                allow_module_level=True)

import grpc
from google.api_core import exceptions as google_errors
from google.cloud import pubsub_v1
from google.pubsub_v1.services.subscriber import SubscriberAsyncClient
from google.pubsub_v1.services.subscriber.transports import SubscriberGrpcAsyncIOTransport

from reliable_sub import (
    ConfigurationError,
    DeadLetterPolicy,
    Delivery,
    Message,
    Outcome,
    RetryPolicy,
    Subscriber,
    UnknownSubscriptionError,
    UnknownTopicError,
)
from reliable_sub.adapters.pubsub import PubSubAdapter
from reliable_sub.testing import services
from reliable_sub.testing.services import emulator_host

PROJECT = "reliable-sub-tests"
# A receive that should find something waits at most this long (the emulator answers at once).
WITHIN = 5.0
# A receive that should find nothing waits this long: a nacked message comes back well within it.
QUIET = 2.0
# Real-time waits poll at this interval until their deadline.
POLL = 0.01
# The service's limit of ack ids in one acknowledge / modifyAckDeadline request (the emulator
# has none, so requests are checked on the client side).
SERVICE_ACK_IDS_LIMIT = 2500


def unique(kind: str) -> str:
    return f"ps-{kind}-{uuid.uuid4().hex[:12]}"


async def poll_until(check: Callable[[], bool], what: str, within: float = 10.0) -> None:
    give_up = time.monotonic() + within
    while not check():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(POLL)  # polling with a deadline, not synchronisation


@pytest.fixture
async def make_adapter() -> AsyncIterator[Callable[..., PubSubAdapter]]:
    """PubSubAdapters on the emulator (each a separate consumer process, as far as its own
    delivery counts go); all closed at the end."""
    emulator_host()
    made: list[PubSubAdapter] = []

    def make(**kwargs: Any) -> PubSubAdapter:
        adapter = PubSubAdapter(PROJECT, **kwargs)
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        await adapter.close()


@pytest.fixture
def admin() -> Iterator[pubsub_v1.SubscriberClient]:
    """A plain Google client, to read back what the adapter created."""
    emulator_host()
    client = pubsub_v1.SubscriberClient()
    yield client
    client.close()


def sub_path(subscription: str) -> str:
    return f"projects/{PROJECT}/subscriptions/{subscription}"


def topic_path(topic: str) -> str:
    return f"projects/{PROJECT}/topics/{topic}"


def topic_exists(topic: str) -> bool:
    publisher = pubsub_v1.PublisherClient()
    try:
        publisher.get_topic(topic=topic_path(topic))
    except google_errors.NotFound:
        return False
    finally:
        publisher.stop()
    return True


def subscription_exists(admin: pubsub_v1.SubscriberClient, subscription: str) -> bool:
    try:
        admin.get_subscription(subscription=sub_path(subscription))
    except google_errors.NotFound:
        return False
    return True


async def receive_one(adapter: PubSubAdapter, subscription: str) -> Delivery:
    deliveries = await adapter.receive(subscription, 10, WITHIN)
    assert len(deliveries) == 1, deliveries
    return deliveries[0]


async def receive_all(adapter: PubSubAdapter, subscription: str, count: int,
                      max_messages: int = 1000) -> list[Delivery]:
    got: list[Delivery] = []
    give_up = time.monotonic() + 20.0
    while len(got) < count:
        batch = await adapter.receive(subscription, max_messages, WITHIN)
        assert batch or time.monotonic() < give_up, f"only {len(got)} of {count} arrived"
        got.extend(batch)
    assert len(got) == count, f"{len(got)} deliveries, expected {count}"
    return got


async def still_deliverable(
    adapter: PubSubAdapter, subscription: str, deliveries: list[Delivery]
) -> list[Delivery]:
    """nack(0) ``deliveries`` and return what comes back: the ones whose ack did not take."""
    await adapter.nack(deliveries, 0)
    return await adapter.receive(subscription, 1000, QUIET)


def bogus_delivery(subscription: str) -> Delivery:
    return Delivery(Message(id="bogus", data=b"", subscription=subscription), "bogus")


# -- ensure_subscription ---------------------------------------------------------------------


async def test_ensure_subscription_is_idempotent_and_keeps_the_first_settings(
    make_adapter, admin
) -> None:
    adapter = make_adapter()
    topic, sub = unique("topic"), unique("sub")
    await adapter.ensure_subscription(topic, sub, ack_deadline=20)
    message_id = await adapter.publish(topic, b"kept")

    # again, with other settings: an existing subscription is left as it is
    await adapter.ensure_subscription(topic, sub, ack_deadline=30, ordering=True)
    adapter.ensure_subscription_sync(topic, sub, ack_deadline=40, exactly_once=True)

    found = admin.get_subscription(subscription=sub_path(sub))
    assert found.topic == topic_path(topic)
    assert found.ack_deadline_seconds == 20
    assert not found.enable_message_ordering
    assert not found.enable_exactly_once_delivery
    assert await adapter.subscription_ack_deadline(sub) == 20.0
    assert await make_adapter().subscription_ack_deadline(sub) == 20.0, "read from the server"
    delivery = await receive_one(adapter, sub)
    assert delivery.message.id == message_id, "the message published in between was kept"
    assert await adapter.ack([delivery]) == []


@pytest.mark.parametrize("ack_deadline", [10, 10.5, 600])
async def test_ack_deadlines_at_the_limits_are_accepted(make_adapter, admin, ack_deadline) -> None:
    adapter = make_adapter()
    sub = unique("sub")
    await adapter.ensure_subscription(unique("topic"), sub, ack_deadline=ack_deadline)
    found = admin.get_subscription(subscription=sub_path(sub))
    assert found.ack_deadline_seconds == math.ceil(ack_deadline)
    assert await adapter.subscription_ack_deadline(sub) == math.ceil(ack_deadline)


async def test_ensure_subscription_refuses_bad_options_and_creates_nothing(
    make_adapter, admin
) -> None:
    adapter = make_adapter()
    topic, sub, dlq = unique("topic"), unique("sub"), unique("dlq")
    for bad in (0, 9.9, 600.5, -10, math.nan, math.inf):
        with pytest.raises(ConfigurationError, match=r"ack_deadline must be in \[10, 600\]"):
            await adapter.ensure_subscription(topic, sub, ack_deadline=bad)
    with pytest.raises(ConfigurationError, match="unknown options") as refused:
        await adapter.ensure_subscription(topic, sub, ack_deadlin=20, start="0")
    assert "ack_deadlin" in str(refused.value) and "start" in str(refused.value)
    with pytest.raises(ConfigurationError, match=r"unknown options.*max_messages"):
        adapter.ensure_subscription_sync(topic, sub, max_messages=5)
    for attempts in (1, 4, 101, 1000):  # DeadLetterPolicy allows 1..1000; Pub/Sub only 5..100
        with pytest.raises(ConfigurationError, match=rf"\[5, 100\], got {attempts}"):
            await adapter.ensure_subscription(
                topic, sub, dead_letter=DeadLetterPolicy(dlq, max_delivery_attempts=attempts)
            )

    assert not subscription_exists(admin, sub)
    assert not topic_exists(topic)
    assert not topic_exists(dlq), "a refused dead-letter policy must not create its topic"


async def test_native_policies_appear_on_the_subscription(make_adapter, admin) -> None:
    adapter = make_adapter()
    topic, dlq = unique("topic"), unique("dlq")
    plain, policed, clamped, eod, ordered = (unique(k) for k in
                                             ("plain", "pol", "clamp", "eod", "ord"))
    await adapter.ensure_subscription(topic, plain)
    await adapter.ensure_subscription(
        topic, policed,
        dead_letter=DeadLetterPolicy(dlq, max_delivery_attempts=5),
        retry=RetryPolicy(min_backoff=1.5, max_backoff=30),
    )
    await adapter.ensure_subscription(
        topic, clamped,
        dead_letter=DeadLetterPolicy(dlq, max_delivery_attempts=100),
        retry=RetryPolicy(min_backoff=700, max_backoff=900),
    )
    await adapter.ensure_subscription(topic, eod, exactly_once=True)
    await adapter.ensure_subscription(topic, ordered, ordering=True)

    found = admin.get_subscription(subscription=sub_path(plain))
    assert not found.dead_letter_policy.dead_letter_topic
    assert "retry_policy" not in found, "no native retry policy unless asked for"
    assert not found.enable_exactly_once_delivery and not found.enable_message_ordering

    found = admin.get_subscription(subscription=sub_path(policed))
    assert found.dead_letter_policy.dead_letter_topic == topic_path(dlq)
    assert found.dead_letter_policy.max_delivery_attempts == 5
    assert found.retry_policy.minimum_backoff == timedelta(seconds=1.5)
    assert found.retry_policy.maximum_backoff == timedelta(seconds=30)
    assert topic_exists(dlq), "the dead-letter topic is created with the policy"

    found = admin.get_subscription(subscription=sub_path(clamped))
    assert found.dead_letter_policy.max_delivery_attempts == 100
    assert found.retry_policy.minimum_backoff == timedelta(seconds=600), "Pub/Sub's maximum"
    assert found.retry_policy.maximum_backoff == timedelta(seconds=600)

    found = admin.get_subscription(subscription=sub_path(eod))
    assert found.enable_exactly_once_delivery and not found.enable_message_ordering
    found = admin.get_subscription(subscription=sub_path(ordered))
    assert found.enable_message_ordering and not found.enable_exactly_once_delivery


# -- delivery_attempt ------------------------------------------------------------------------


async def test_delivery_attempt_is_counted_per_process_without_a_dead_letter_policy(
    make_adapter,
) -> None:
    first, other = make_adapter(), make_adapter()
    topic, sub = unique("topic"), unique("sub")
    await first.ensure_subscription(topic, sub)
    message_id = await first.publish(topic, b"again and again")

    for expected in (1, 2, 3):
        delivery = await receive_one(first, sub)
        assert (delivery.message.id, delivery.message.delivery_attempt) == (message_id, expected)
        await first.nack([delivery], 0)
    # documented: the count lives in one process; another consumer starts again from 1
    delivery = await receive_one(other, sub)
    assert delivery.message.delivery_attempt == 1
    await other.nack([delivery], 0)
    delivery = await receive_one(first, sub)
    assert delivery.message.delivery_attempt == 4
    assert await first.ack([delivery]) == []


async def test_delivery_attempt_is_the_servers_count_with_a_native_dead_letter_policy(
    make_adapter,
) -> None:
    first, other = make_adapter(), make_adapter()
    topic, sub, dlq, dlq_sub = unique("topic"), unique("sub"), unique("dlq"), unique("dlqsub")
    await first.ensure_subscription(dlq, dlq_sub)
    await first.ensure_subscription(
        topic, sub, dead_letter=DeadLetterPolicy(dlq, max_delivery_attempts=5)
    )
    message_id = await first.publish(topic, b"poison", {"k": "v"})

    # alternate consumers: per-process counts would say 1, 1, 2, 2, 3
    for attempt, consumer in zip((1, 2, 3, 4, 5), (first, other, first, other, first),
                                 strict=True):
        delivery = await receive_one(consumer, sub)
        assert delivery.message.id == message_id
        assert delivery.message.delivery_attempt == attempt
        await consumer.nack([delivery], 0)

    # after the 5th attempt the emulator forwards it, as the native policy says (it does so
    # when the message is next due for delivery, i.e. on the next pull of the subscription)
    assert await first.receive(sub, 10, QUIET) == [], "forwarded, not redelivered"
    forwarded = await receive_one(first, dlq_sub)
    assert forwarded.message.data == b"poison"
    assert forwarded.message.attributes["k"] == "v"
    assert forwarded.message.attributes["CloudPubSubDeadLetterSourceDeliveryCount"] == "5"
    assert await first.ack([forwarded]) == []


async def test_delivery_attempt_starts_at_1_on_each_subscription_of_a_topic(
    make_adapter,
) -> None:
    adapter = make_adapter()
    topic, sub_a, sub_b = unique("topic"), unique("suba"), unique("subb")
    await adapter.ensure_subscription(topic, sub_a)
    await adapter.ensure_subscription(topic, sub_b)
    await adapter.publish(topic, b"fan-out")
    on_a = await receive_one(adapter, sub_a)
    on_b = await receive_one(adapter, sub_b)
    try:
        assert on_a.message.id == on_b.message.id  # Pub/Sub: one id per topic message
        assert on_a.message.delivery_attempt == 1
        assert on_b.message.delivery_attempt == 1, "its first delivery on this subscription"
    finally:
        await adapter.ack([on_a, on_b])


async def test_a_message_whose_reading_raises_is_delivered_malformed_beside_the_others(
    make_adapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever reading one received message raises, that message alone is delivered marked
    malformed (the Subscriber dead-letters it) and the others of its pull come as usual (#24.10).
    The service checks what it sends, so the error is injected here: before, it escaped
    ``receive`` and every message of the pull came back after the ack deadline, again and
    again."""
    adapter = make_adapter()
    topic, sub = unique("topic"), unique("sub")
    await adapter.ensure_subscription(topic, sub)
    before, bad, after = [await adapter.publish(topic, data)
                          for data in (b"before", b"bad", b"after")]
    count_attempt = adapter._count_attempt

    def unforeseen(path: str, message_id: str) -> int:
        if message_id == bad:
            raise LookupError("unforeseen")
        return count_attempt(path, message_id)

    monkeypatch.setattr(adapter, "_count_attempt", unforeseen)
    got = {d.message.id: d for d in await receive_all(adapter, sub, 3)}
    assert (got[bad].malformed, got[bad].message.data) == ("LookupError: unforeseen", b"bad")
    assert (got[before].malformed, got[after].malformed) == (None, None)
    assert await adapter.ack(list(got.values())) == []
    assert await still_deliverable(adapter, sub, list(got.values())) == []


# -- exactly-once ----------------------------------------------------------------------------


async def test_exactly_once_refuses_the_ack_of_a_stale_ack_id(make_adapter) -> None:
    """The emulator implements exactly-once ack confirmation: an ack id made stale by a
    redelivery is rejected (INVALID_ARGUMENT, ErrorInfo reason EXACTLY_ONCE_ACKID_FAILURE,
    PERMANENT_FAILURE_INVALID_ACK_ID), and the adapter reports it as refused."""
    adapter = make_adapter()
    topic, sub = unique("topic"), unique("sub")
    await adapter.ensure_subscription(topic, sub, exactly_once=True)
    await adapter.publish(topic, b"one")
    await adapter.publish(topic, b"two")
    one, two = sorted(await receive_all(adapter, sub, 2), key=lambda d: d.message.data)

    assert await adapter.ack([one]) == []
    await adapter.nack([two], 0)
    again = await receive_one(adapter, sub)
    assert again.message.id == two.message.id and again.ack_id != two.ack_id

    assert await adapter.ack([two]) == [two], "the old delivery's ack id is stale"
    assert await adapter.extend([two], 10) == [two], "and cannot be extended either"
    assert await adapter.ack([one]) == [one], "an ack id acked before is no longer valid"
    assert await adapter.extend([again], 10) == []
    assert await adapter.ack([again]) == [], "the current delivery acks fine"
    assert await still_deliverable(adapter, sub, [one, two, again]) == []


async def test_without_exactly_once_a_stale_ack_is_accepted_but_does_not_ack(
    make_adapter,
) -> None:
    """capabilities.refuses_stale_acks is False: outside exactly-once nothing is refused.
    What the emulator does with such an ack: accepts it and ignores it."""
    adapter = make_adapter()
    assert not adapter.capabilities.refuses_stale_acks
    topic, sub = unique("topic"), unique("sub")
    await adapter.ensure_subscription(topic, sub)
    await adapter.publish(topic, b"x")
    old = await receive_one(adapter, sub)
    await adapter.nack([old], 0)
    current = await receive_one(adapter, sub)

    assert await adapter.ack([old]) == []
    [back] = await still_deliverable(adapter, sub, [current])
    assert back.message.id == old.message.id, "the stale ack did not ack the message"
    assert await adapter.ack([back]) == []


async def test_exactly_once_ack_batch_with_a_stale_id_refuses_only_the_stale_one(
    make_adapter,
) -> None:
    adapter = make_adapter()
    topic, sub = unique("topic"), unique("sub")
    await adapter.ensure_subscription(topic, sub, exactly_once=True)
    await adapter.publish(topic, b"redelivered")
    old = await receive_one(adapter, sub)
    await adapter.nack([old], 0)
    again = await receive_one(adapter, sub)
    await adapter.publish(topic, b"fresh")
    fresh = await receive_one(adapter, sub)

    refused = await adapter.ack([old, fresh])
    await adapter.ack([again])
    assert refused == [old], [d.message.data for d in refused]


# -- publishing ------------------------------------------------------------------------------


async def test_publish_round_trips_data_attributes_and_ordering_key(make_adapter) -> None:
    adapter = make_adapter()
    topic, sub = unique("topic"), unique("sub")
    await adapter.ensure_subscription(topic, sub, ordering=True)
    attributes = {"k": "v", "ünïcode": "välue ✓", "empty": ""}
    published = [
        await adapter.publish(topic, b"\x00\xffbinary", attributes, ordering_key="key-1"),
        await adapter.publish(topic, bytearray(b"second"), ordering_key="key-1"),
        await asyncio.to_thread(adapter.publish_sync, topic, b"third", {"n": "3"}, "key-1"),
        await adapter.publish(topic, memoryview(b"no key")),
        adapter.publish_sync(topic, b"no key sync"),
    ]
    assert all(isinstance(i, str) and i for i in published)
    assert len(set(published)) == 5

    got: dict[str, Message] = {}
    order: list[bytes] = []
    give_up = time.monotonic() + 20
    while len(got) < 5:  # ack as we go: ordered keys may be released one batch at a time
        batch = await adapter.receive(sub, 10, WITHIN)
        assert batch or time.monotonic() < give_up, f"only {len(got)} of 5 arrived"
        for delivery in batch:
            got[delivery.message.id] = delivery.message
            if delivery.message.ordering_key:
                order.append(delivery.message.data)
        assert await adapter.ack(batch) == []
    assert set(got) == set(published), "publish and publish_sync return the message ids"

    first, second, third, plain, plain_sync = (got[i] for i in published)
    assert (first.data, first.attributes, first.ordering_key) == (
        b"\x00\xffbinary", attributes, "key-1")
    assert (second.data, second.attributes, second.ordering_key) == (b"second", {}, "key-1")
    assert (third.data, third.attributes, third.ordering_key) == (b"third", {"n": "3"}, "key-1")
    assert (plain.data, plain.ordering_key) == (b"no key", None)
    assert (plain_sync.data, plain_sync.ordering_key) == (b"no key sync", None)
    assert order == [b"\x00\xffbinary", b"second", b"third"]
    assert all(m.publish_time is not None and m.publish_time.year >= 2024 for m in got.values())
    assert {m.subscription for m in got.values()} == {sub}


async def test_publish_refuses_bad_data_and_attributes(make_adapter) -> None:
    adapter = make_adapter()
    topic, sub = unique("topic"), unique("sub")
    await adapter.ensure_subscription(topic, sub)
    for data in ("text", None, object(), {"at": float("nan")}):
        with pytest.raises(TypeError, match="data must be bytes"):
            await adapter.publish(topic, data)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="data must be bytes"):
            adapter.publish_sync(topic, data)  # type: ignore[arg-type]
    for attributes in ({"k": 1}, {1: "v"}, {"k": None}, {"k": b"bytes"}):
        with pytest.raises(TypeError, match="attributes must map str to str"):
            await adapter.publish(topic, b"x", attributes)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="attributes must map str to str"):
            adapter.publish_sync(topic, b"x", attributes, "key")  # type: ignore[arg-type]
    assert await adapter.receive(sub, 10, QUIET) == [], "nothing was published"


async def test_missing_topics_and_subscriptions_raise_named_errors(make_adapter) -> None:
    adapter = make_adapter()
    topic = unique("topic")
    missing = f"topic '{topic}' does not exist on Pub/Sub"
    with pytest.raises(UnknownTopicError, match=missing):
        await adapter.publish(topic, b"x")
    with pytest.raises(UnknownTopicError, match=missing):
        adapter.publish_sync(topic, b"x")
    # with an ordering key the failed publish pauses the key; the adapter resumes it so that a
    # retry is not refused as "paused" (it meets the real error again, or succeeds)
    with pytest.raises(UnknownTopicError):
        await adapter.publish(topic, b"x", ordering_key="k")
    with pytest.raises(UnknownTopicError):
        adapter.publish_sync(topic, b"x", ordering_key="k")
    assert await adapter.topic_exists(topic) is False
    nowhere = unique("sub")
    with pytest.raises(UnknownSubscriptionError, match=f"subscription '{nowhere}' does not"):
        await adapter.receive(nowhere, 10, QUIET)
    with pytest.raises(UnknownSubscriptionError, match=f"subscription '{nowhere}' does not"):
        await adapter.subscription_ack_deadline(nowhere)

    sub = unique("sub")
    await adapter.ensure_subscription(topic, sub, ordering=True)
    assert await adapter.topic_exists(topic) is True
    other = unique("topic")
    with pytest.raises(ConfigurationError, match=f"subscription '{sub}' already exists on topic"):
        await adapter.ensure_subscription(other, sub)
    message_id = await adapter.publish(topic, b"after", ordering_key="k")
    delivery = await receive_one(adapter, sub)
    assert (delivery.message.id, delivery.message.ordering_key) == (message_id, "k")
    assert await adapter.ack([delivery]) == []


# -- ack / modack batching -------------------------------------------------------------------


class RecordingSubscriberClient:
    """The real asyncio GAPIC client, recording the ack ids of each ack and modack request."""

    def __init__(self, inner: SubscriberAsyncClient) -> None:
        self.inner = inner
        self.acks: list[list[str]] = []  # requests made
        self.acked: list[str] = []  # ack ids of the requests that succeeded
        self.modacks: list[tuple[int, list[str]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def acknowledge(self, *, ack_ids: list[str], **kwargs: Any) -> None:
        self.acks.append(list(ack_ids))
        await self.inner.acknowledge(ack_ids=ack_ids, **kwargs)
        self.acked.extend(ack_ids)

    async def modify_ack_deadline(
        self, *, ack_ids: list[str], ack_deadline_seconds: int, **kwargs: Any
    ) -> None:
        self.modacks.append((ack_deadline_seconds, list(ack_ids)))
        await self.inner.modify_ack_deadline(
            ack_ids=ack_ids, ack_deadline_seconds=ack_deadline_seconds, **kwargs
        )


def recording_client() -> RecordingSubscriberClient:
    channel = grpc.aio.insecure_channel(emulator_host())
    return RecordingSubscriberClient(
        SubscriberAsyncClient(transport=SubscriberGrpcAsyncIOTransport(channel=channel))
    )


async def test_ack_and_modack_of_3000_deliveries_are_split_into_allowed_requests(
    make_adapter,
) -> None:
    """The emulator takes any number of ack ids per request; the service takes 2,500."""
    client = recording_client()
    adapter = make_adapter(subscriber_client=client)
    topic, sub = unique("topic"), unique("sub")
    count = 3000
    await adapter.ensure_subscription(topic, sub, ack_deadline=60)
    await asyncio.gather(*(adapter.publish(topic, b"%d" % i) for i in range(count)))
    deliveries = await receive_all(adapter, sub, count)
    assert len({d.message.id for d in deliveries}) == count
    ack_ids = sorted(d.ack_id for d in deliveries)

    assert await adapter.extend(deliveries, 60) == []
    assert all(len(ids) <= SERVICE_ACK_IDS_LIMIT for _, ids in client.modacks)
    assert {s for s, _ in client.modacks} == {60}
    assert sorted(i for _, ids in client.modacks for i in ids) == ack_ids
    assert len(client.modacks) == 2

    assert await adapter.ack(deliveries) == []
    assert [len(ids) for ids in client.acks] == [SERVICE_ACK_IDS_LIMIT,
                                                 count - SERVICE_ACK_IDS_LIMIT]
    assert sorted(i for ids in client.acks for i in ids) == ack_ids

    client.modacks.clear()
    assert await still_deliverable(adapter, sub, deliveries) == [], "every ack took effect"
    assert [(s, len(ids)) for s, ids in client.modacks] == [(0, 2500), (0, 500)]


@pytest.mark.parametrize("exactly_once", [False, True], ids=["plain", "exactly-once"])
async def test_an_invalid_ack_id_in_a_batch_is_refused_alone(make_adapter, exactly_once) -> None:
    """The emulator rejects a whole request that holds a malformed ack id (nothing in it is
    acked); the adapter retries the ids one by one and refuses only the bad one."""
    client = recording_client()
    adapter = make_adapter(subscriber_client=client)
    topic, sub = unique("topic"), unique("sub")
    await adapter.ensure_subscription(topic, sub, ack_deadline=60, exactly_once=exactly_once)
    for i in range(3):
        await adapter.publish(topic, b"%d" % i)
    deliveries = await receive_all(adapter, sub, 3)
    bogus = bogus_delivery(sub)

    refused = await adapter.ack([deliveries[0], bogus, *deliveries[1:]])

    assert refused == [bogus]
    assert len(client.acks[0]) == 4, "one request first, not one per ack id"
    assert await still_deliverable(adapter, sub, deliveries) == [], "the valid ones were acked"


# -- packaging -------------------------------------------------------------------------------


def test_importing_without_google_cloud_pubsub_names_the_extra() -> None:
    script = (
        "import sys; sys.modules['google.cloud.pubsub_v1'] = None\n"
        "try:\n"
        "    import reliable_sub.adapters.pubsub\n"
        "except ImportError as error:\n"
        "    print(type(error).__name__, error)\n"
        "else:\n"
        "    print('imported without google.cloud.pubsub_v1')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("MissingExtraError "), result.stdout + result.stderr
    assert 'pip install "reliable-sub[pubsub]"' in result.stdout, result.stdout + result.stderr


# -- emulator restart: keep this LAST in the file (it resets the emulator for everyone) -------


async def retrying_unavailable(call: Callable[[], Awaitable[Any]], what: str) -> Any:
    """``call()``, retried while the restarted emulator does not answer yet."""
    give_up = time.monotonic() + 30.0
    while True:
        try:
            return await call()
        except google_errors.ServiceUnavailable:
            if time.monotonic() > give_up:
                raise AssertionError(f"the emulator did not come back for {what}") from None
            await asyncio.sleep(0.1)  # a client's retry backoff


async def test_a_running_subscriber_survives_an_emulator_restart(make_adapter) -> None:
    host = emulator_host()
    client = recording_client()
    adapter = make_adapter(subscriber_client=client)
    topic, sub = unique("topic"), unique("sub")
    await adapter.ensure_subscription(topic, sub)
    subscriber = Subscriber(adapter, receive_timeout=1.0)
    handled: Counter[bytes] = Counter()

    @subscriber.handler(sub)
    async def handle(message: Message) -> None:
        handled[message.data] += 1

    task = asyncio.create_task(subscriber.serve(), name="subscriber")
    try:
        await poll_until(lambda: subscriber.running or task.done(), "the Subscriber to start")
        await adapter.publish(topic, b"before")
        await poll_until(lambda: handled[b"before"] == 1, "the message before the restart")
        # its ack is sent after the handler returns: let it land before the emulator goes
        await poll_until(lambda: len(client.acked) == 1, "the ack before the restart")

        # in a thread: the Subscriber keeps running in this loop while the emulator is down
        await asyncio.to_thread(services.restart_emulator)
        assert emulator_host() == host, "same port: later tests still find it"
        await poll_until(lambda: subscriber.stats.receive_errors > 0, "a failed receive", 20)
        assert subscriber.running and not task.done()

        # all emulator state is gone: recreate it as a deployment would, then publish
        await retrying_unavailable(lambda: adapter.ensure_subscription(topic, sub), "ensure")
        after = [f"after-{i}".encode() for i in range(5)]
        for data in after:
            await retrying_unavailable(lambda data=data: adapter.publish(topic, data), "publish")
        # the receive loop backs off up to 10 s (jittered) between failed calls
        await poll_until(lambda: all(handled[d] for d in after), "the messages after", 25)
        await poll_until(lambda: subscriber.stats[Outcome.ACKED] == 6, "every ack", 10)
        assert subscriber.running, "the Subscriber survived the restart"
    finally:
        await subscriber.shutdown(timeout=5)
        await asyncio.wait_for(task, timeout=15)  # re-raises what serve() failed with

    assert not subscriber.running
    stats = subscriber.stats
    assert stats.receive_errors > 0, "it saw the outage"
    assert handled == Counter({b"before": 1, **{d: 1 for d in after}})
    assert (stats.handler_errors, stats.ack_errors, stats.acks_refused) == (0, 0, 0)


async def test_a_deferred_message_is_not_overtaken_by_later_ones_of_its_key(
    make_adapter,
) -> None:
    """A crashed consumer's claim defers step-1; step-2 and step-3 must wait for it (#8.5)."""
    from reliable_sub import Claimed, DedupKey, MemoryDedupStore

    adapter = make_adapter()
    topic, sub = unique("topic"), unique("sub")
    await adapter.ensure_subscription(topic, sub, ordering=True)
    store, dead_peer = MemoryDedupStore(), MemoryDedupStore(owner="crashed")
    dead_peer._records, dead_peer._lock = store._records, store._lock
    lapse = 2.0
    held = await dead_peer.claim(DedupKey(adapter.dedup_namespace(sub), "step-1"), lapse)
    assert isinstance(held, Claimed)
    for step in (1, 2, 3):
        await adapter.publish(topic, f"step-{step}".encode(), {"idempotency-key": f"step-{step}"},
                              ordering_key="order-9")
    seen: list[bytes] = []
    subscriber = Subscriber(adapter, dedup=store, receive_timeout=1.0,
                            retry=RetryPolicy(min_backoff=0.5, max_backoff=1.0))

    @subscriber.handler(sub)
    async def handle(message: Message) -> None:
        seen.append(message.data)

    task = asyncio.ensure_future(subscriber.serve())
    try:
        await poll_until(lambda: subscriber.stats[Outcome.ACKED] == 3, "three acks",
                         within=10 * WITHIN)
    finally:
        await subscriber.shutdown(timeout=2)
        await task
    assert subscriber.stats[Outcome.DEFERRED] >= 1, "step-1 was deferred behind the dead claim"
    assert subscriber.stats[Outcome.REQUEUED] >= 2, "step-2 and step-3 came in the same pull"
    assert seen == [b"step-1", b"step-2", b"step-3"]


def test_short_and_full_subscription_names_share_a_dedup_namespace() -> None:
    adapter = PubSubAdapter("my-project", publisher_client=object(),  # type: ignore[arg-type]
                            admin_client=object())  # type: ignore[arg-type]
    full = "projects/my-project/subscriptions/billing"
    assert adapter.dedup_namespace("billing") == adapter.dedup_namespace(full)
    assert adapter.dedup_namespace("billing") != adapter.dedup_namespace("billing-2")
