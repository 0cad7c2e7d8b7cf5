"""Redis entries in another producer's layout (#44 items 11 and 12), on the real Redis.

An entry the adapter cannot read (FastStream's single ``__data__`` field, a redis-cli entry with
a ``payload`` field, a ``data`` field beside attributes that are not JSON) is dead-lettered
``unreadable`` with every field of it in the copy: before, the copy held ``data=b''`` and no
attributes, and the original was acked, so its body, headers and correlation id were gone, and a
replay published an empty message. Fields beside ``data`` (a ``correlation_id``, a
``content-type``) were dropped without a word; they are attributes now, and a dead letter's
replay writes them back as fields. Each case goes through a Subscriber, its dead-letter queue and
a replay, and checks the entry the replay wrote.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from reliable_sub import DeadLetterPolicy, Message, Outcome, Reject
from reliable_sub.dead_letters import DeadLetter, DeadLetterQueue
from reliable_sub.testing.harness import Harness, redis_harness

pytestmark = pytest.mark.asyncio

WITHIN = 30.0  # seconds a Subscriber may take to dead-letter one entry (a loaded machine)
Fields = dict[bytes, bytes]


async def faststream_entry(adapter: Any, topic: str) -> None:
    """What FastStream's RedisBroker writes to a stream: one ``__data__`` field holding its own
    binary envelope (body, correlation id, headers)."""
    from faststream.redis import RedisBroker

    from reliable_sub.testing.services import redis_url

    broker = RedisBroker(redis_url())
    await broker.connect()
    try:
        await broker.publish({"order": 7}, stream=topic, correlation_id="corr-7",
                             headers={"tenant": "t-1"})
    finally:
        await broker.stop()


def raw_entry(fields: Fields) -> Callable[[Any, str], Awaitable[None]]:
    async def write(adapter: Any, topic: str) -> None:
        await adapter.client.xadd(topic, fields)
    return write


@dataclass(frozen=True)
class Foreign:
    write: Callable[[Any, str], Awaitable[None]]
    # the dead letter's data and (restored) attributes, from the entry's fields
    data: Callable[[Fields], bytes]
    attributes: Callable[[Fields], dict[str, str]]


def json_of(fields: Fields) -> bytes:
    return json.dumps({k.decode("utf-8", "surrogateescape"): v.decode("utf-8", "surrogateescape")
                       for k, v in fields.items()}, separators=(",", ":")).encode()


CASES = {
    "FastStream's __data__": Foreign(
        faststream_entry, lambda f: f[b"__data__"], lambda f: {"redis-data-field": "__data__"}),
    "redis-cli, one payload field": Foreign(
        raw_entry({b"payload": b'{"order": 8}'}), lambda f: b'{"order": 8}',
        lambda f: {"redis-data-field": "payload"}),
    "redis-cli, payload and correlation_id": Foreign(
        raw_entry({b"payload": b'{"order": 9}', b"correlation_id": b"corr-9"}), json_of,
        lambda f: {"redis-entry": "json"}),
    "a data field beside attributes that are not JSON": Foreign(
        raw_entry({b"data": b"order-10", b"attributes": b"\xff\xfe"}), json_of,
        lambda f: {"redis-entry": "json"}),
}


async def dead_letter_one(harness: Harness, adapter: Any, topic: str, subscription: str,
                          *, fail: bool = False) -> tuple[DeadLetter, list[Message], str]:
    """Run a Subscriber until the one entry on ``topic`` is dead-lettered (its handler rejects
    every message when ``fail``); returns the dead letter, what the handler saw and the
    dead-letter subscription."""
    dlq_topic, dlq_subscription = await harness.topic_and_subscription(start="0")
    handled: list[Message] = []
    subscriber = harness.subscriber(adapter, dead_letter=DeadLetterPolicy(dlq_topic, 2))

    @subscriber.handler(subscription)
    async def handle(message: Message) -> None:
        handled.append(message)
        if fail:
            raise Reject("refused")

    async with harness.serving(subscriber):
        await harness.wait_until(lambda: subscriber.stats[Outcome.DEAD_LETTERED] == 1, WITHIN,
                                 "the entry dead-lettered")
    [letter] = await DeadLetterQueue(adapter, dlq_subscription, wait=0.3).peek()
    return letter, handled, dlq_subscription


async def replayed_fields(adapter: Any, topic: str, dlq_subscription: str,
                          letter: DeadLetter) -> Fields:
    report = await DeadLetterQueue(adapter, dlq_subscription, wait=0.3).replay([letter.id])
    assert report.replayed == [letter.id], report
    [(_, fields)] = await adapter.client.xrevrange(topic, count=1)
    return dict(fields)


@pytest.mark.parametrize("case", sorted(CASES))
async def test_an_unreadable_entry_is_dead_lettered_whole_and_replayed_as_it_was(
    case: str,
) -> None:
    foreign = CASES[case]
    harness = redis_harness()
    try:
        adapter: Any = await harness.adapter()
        topic, subscription = await harness.topic_and_subscription()
        await foreign.write(adapter, topic)
        [(_, written)] = await adapter.client.xrange(topic)
        letter, handled, dlq_subscription = await dead_letter_one(
            harness, adapter, topic, subscription)
        assert handled == [] and letter.reason == "unreadable"
        assert letter.data == foreign.data(written), "the copy lost the entry's data"
        assert letter.attributes == foreign.attributes(written)

        again = await replayed_fields(adapter, topic, dlq_subscription, letter)
        assert {k: v for k, v in again.items() if k in written} == written, (
            "the replay did not write the entry's fields back")
        # beside them, only the replay's own attributes (when the entry had none of its own)
        assert set(again) - set(written) <= {b"attributes"}
        if b"attributes" not in written:
            assert json.loads(again[b"attributes"])["replayed-from"] == letter.id
    finally:
        await harness.close()


async def test_faststream_can_read_its_replayed_entry() -> None:
    from faststream.redis.parser.binary import BinaryMessageFormatV1

    harness = redis_harness()
    try:
        adapter: Any = await harness.adapter()
        topic, subscription = await harness.topic_and_subscription()
        await faststream_entry(adapter, topic)
        letter, _, dlq_subscription = await dead_letter_one(harness, adapter, topic,
                                                            subscription)
        again = await replayed_fields(adapter, topic, dlq_subscription, letter)
        body, headers = BinaryMessageFormatV1.parse(again[b"__data__"])
        assert json.loads(body) == {"order": 7}
        assert (headers["correlation_id"], headers["tenant"]) == ("corr-7", "t-1")
    finally:
        await harness.close()


async def test_fields_beside_data_are_attributes_and_a_replay_writes_them_as_fields() -> None:
    harness = redis_harness()
    try:
        adapter: Any = await harness.adapter()
        topic, subscription = await harness.topic_and_subscription()
        fields = {b"data": b"order-11", b"attributes": b'{"shop":"s-1"}',
                  b"correlation_id": b"corr-11", b"content-type": b"text/plain"}
        await adapter.client.xadd(topic, fields)
        letter, handled, dlq_subscription = await dead_letter_one(
            harness, adapter, topic, subscription, fail=True)
        expected = {"shop": "s-1", "correlation_id": "corr-11", "content-type": "text/plain",
                    "redis-fields": '["correlation_id","content-type"]'}
        assert [m.attributes for m in handled] == [expected], "the handler lost the fields"
        assert (letter.data, letter.attributes, letter.reason) == (b"order-11", expected,
                                                                   "rejected")
        again = await replayed_fields(adapter, topic, dlq_subscription, letter)
        assert (again[b"data"], again[b"correlation_id"], again[b"content-type"]) == (
            b"order-11", b"corr-11", b"text/plain")
        replay_attributes = json.loads(again[b"attributes"])
        assert replay_attributes["shop"] == "s-1"
        assert {"correlation_id", "content-type", "redis-fields"}.isdisjoint(replay_attributes)
    finally:
        await harness.close()


@pytest.mark.parametrize("fields", [
    {b"data": b"x", b"attributes": b'{"k":"v"}', b"k": b"w"},
    {b"data": b"x", b"redis-fields": b"[]"},
])
async def test_a_field_named_like_an_attribute_makes_the_entry_unreadable_not_lost(
    fields: Fields,
) -> None:
    """A field and an attribute of one name (or a field named like the adapter's own
    ``redis-fields``) cannot both be attributes: rather than drop one, the entry is
    dead-lettered whole."""
    harness = redis_harness()
    try:
        adapter: Any = await harness.adapter()
        topic, subscription = await harness.topic_and_subscription()
        await adapter.client.xadd(topic, fields)
        letter, handled, _ = await dead_letter_one(harness, adapter, topic, subscription)
        assert handled == [] and letter.reason == "unreadable"
        assert (letter.data, letter.attributes) == (json_of(fields), {"redis-entry": "json"})
    finally:
        await harness.close()


async def test_publishing_with_layout_attributes_writes_that_layout() -> None:
    """What a replay relies on, through ``publish`` itself: the layout attributes say which
    attributes are fields, and which field the data is; one that cannot be followed (here, data
    that is not a JSON object of the fields) is an ordinary attribute."""
    harness = redis_harness()
    try:
        adapter: Any = await harness.adapter()
        topic, _ = await harness.topic_and_subscription()
        await adapter.publish(topic, b"body", {"redis-fields": '["cid"]', "cid": "c-1",
                                               "k": "v"})
        await adapter.publish(topic, b"body", {"redis-data-field": "payload"})
        await adapter.publish(topic, b'{"a":"1","b":"2"}', {"redis-entry": "json"})
        await adapter.publish(topic, b"not json", {"redis-entry": "json"})
        entries = [dict(fields) for _, fields in await adapter.client.xrange(topic)]
        assert entries == [
            {b"data": b"body", b"cid": b"c-1", b"attributes": b'{"k":"v"}'},
            {b"payload": b"body"},
            {b"a": b"1", b"b": b"2"},
            {b"data": b"not json", b"attributes": b'{"redis-entry":"json"}'},
        ]
    finally:
        await harness.close()
