"""Hostile entries (#24.10): what another producer can write straight to the broker, past our
``publish``, and what it does to the batch it arrives in.

Reading one entry must never fail its neighbours: whatever an entry's parse raises, that entry
is dead-lettered as malformed (``MalformedMessageError``, the parse error as its reason) and the
rest of its batch is handled. Before, an error nobody foresaw (``json.loads`` raising
RecursionError on deeply nested attributes) escaped the adapter's ``receive``: on Redis the bad
entry and its valid neighbours stayed pending for good (the reclaim met the same batch every
time); on NATS the batch was redelivered for ever. Deeply nested attributes and ordering keys
are now refused before ``json.loads`` sees them: its recursion ran at the interpreter's limit,
where a finalizer the garbage collector ran meanwhile failed too (a loaded run saw pytest's
unraisable-exception hook fail that way).

Each case writes a valid entry, the hostile one and another valid one, before the Subscriber
starts, so that all three come in one batch (the test checks it), on the real Redis and on a
private nats-server. Entries that are odd but still messages (a far-future entry id, a delivery
counter that wrapped around) are handled as messages.

Entries with attributes that are not a JSON object of strings are in
``tests/test_redis_streams.py::test_an_unreadable_entry_is_dead_lettered_and_its_batch_handled``
and ``tests/test_nats_jetstream.py``; what a publisher can send through ``publish`` is in
``tests/test_hostile_input.py``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from reliable_sub import DeadLetterPolicy, Message, Outcome
from reliable_sub.entries import describe, read_each
from reliable_sub.message import Delivery
from reliable_sub.testing.harness import Harness, nats_harness, redis_harness
from reliable_sub.testing.services import missing_service
from tests.redis_processes import poll_until

# Seconds a Subscriber may take to settle the three entries (real time, a loaded machine).
WITHIN = 30.0
# Deeper than any recursion limit: json.loads raises RecursionError on it. A NATS server takes
# at most 64 KiB of headers per message.
DEEP = 100_000
NATS_DEEP = 60_000
# The largest delivery count Redis keeps; one more delivery wraps it around to -2**63.
REDIS_MAX_COUNT = 2**63 - 1


@dataclass(frozen=True)
class Hostile:
    """One hostile entry: how it is written, and what becomes of it.

    ``write(adapter, topic)`` writes the entry past ``publish`` and returns its message id.
    ``problem`` is what its dead letter's ``error-message`` holds; None when the entry is still a
    message and is handled. With ``reclaimed`` a consumer that then dies reads the batch first,
    so the Subscriber gets it from Redis's reclaim; ``tamper(adapter, topic, subscription, id)``
    runs after that read.
    """

    broker: str
    write: Callable[[Any, str], Awaitable[str]]
    problem: str | None
    reclaimed: bool = False
    tamper: Callable[[Any, str, str, str], Awaitable[None]] | None = None


def redis_entry(fields: dict[Any, bytes], entry_id: str = "*") -> Callable[[Any, str],
                                                                          Awaitable[str]]:
    async def write(adapter: Any, topic: str) -> str:
        written = await adapter.client.xadd(topic, fields, id=entry_id)
        return written.decode() if isinstance(written, bytes) else str(written)
    return write


def nats_message(header: str, value: str) -> Callable[[Any, str], Awaitable[str]]:
    """A message published with raw nats-py, as another service would, with ``header`` (the
    name of one of the adapter's header constants) set to ``value``."""
    async def write(adapter: Any, topic: str) -> str:
        from reliable_sub.adapters import nats_jetstream

        js = await adapter._js()
        headers = {getattr(nats_jetstream, header): value}
        return str((await js.publish(topic, b"hostile", headers=headers)).seq)
    return write


async def wrap_the_counter(adapter: Any, topic: str, subscription: str, entry_id: str) -> None:
    """Set the entry's delivery counter to Redis's largest (XCLAIM RETRYCOUNT, as an operator's
    tool may): the reclaim's XCLAIM then wraps it around to -2**63."""
    await adapter.client.xclaim(topic, subscription, "gone-consumer", 0, [entry_id],
                                retrycount=REDIS_MAX_COUNT, justid=True)


DEEP_LIST = redis_entry({"data": b"hostile", "attributes": b"[" * DEEP})
CASES = {
    "redis: attributes nested 100,000 deep": Hostile("redis", DEEP_LIST, "nested"),
    "redis: attributes nested 100,000 deep, reclaimed": Hostile(
        "redis", DEEP_LIST, "nested", reclaimed=True),
    "redis: an attributes object nested 100,000 deep": Hostile(
        "redis", redis_entry({"data": b"hostile", "attributes": b'{"a":' * DEEP}),
        "nested"),
    "redis: no data field, a non-UTF-8 field name": Hostile(
        "redis", redis_entry({b"\xff\xfe": b"hostile"}), "no data field"),
    "redis: a non-UTF-8 field name beside data": Hostile(
        "redis", redis_entry({"data": b"hostile", b"\xff\xfe": b"x"}), None),
    "redis: an entry id past the year 9999": Hostile(
        "redis", redis_entry({"data": b"hostile"}, "18446744073709551614-0"), None),
    "redis: a delivery counter that wraps around": Hostile(
        "redis", redis_entry({"data": b"hostile"}), None, reclaimed=True,
        tamper=wrap_the_counter),
    "nats: attributes header nested 60,000 deep": Hostile(
        "nats", nats_message("ATTRIBUTES_HEADER", "[" * NATS_DEEP), "nested"),
    "nats: ordering-key header nested 60,000 deep": Hostile(
        "nats", nats_message("ORDERING_KEY_HEADER", "[" * NATS_DEEP), "not a JSON string"),
}


def _harness(broker: str, request: pytest.FixtureRequest) -> Harness:
    if broker == "redis":
        return redis_harness()  # skips without Redis (fails under CI=true)
    if importlib.util.find_spec("nats") is None:
        missing_service('the NATS tests need pip install "reliable-sub[nats]"')
    return nats_harness(request.getfixturevalue("nats_server").url)


@pytest.mark.asyncio
@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_hostile_entry_never_fails_its_batch(
    case: str, request: pytest.FixtureRequest
) -> None:
    hostile = CASES[case]
    harness = _harness(hostile.broker, request)
    try:
        adapter: Any = await harness.adapter()
        topic, subscription = await harness.topic_and_subscription()
        dlq_topic, dlq_subscription = await harness.topic_and_subscription()
        before = await adapter.publish(topic, b"before")
        bad = await hostile.write(adapter, topic)
        after = await adapter.publish(topic, b"after")
        if hostile.reclaimed:  # a consumer reads the batch and dies
            await adapter.client.xreadgroup(subscription, "gone-consumer", {topic: ">"})
            if hostile.tamper is not None:
                await hostile.tamper(adapter, topic, subscription, bad)
                # one idle time for the three again (the tamper's XCLAIM restarted the hostile
                # one's), so the reclaim takes them together however long these calls took
                await adapter.client.xclaim(topic, subscription, "gone-consumer", 0,
                                            [before, bad, after], idle=0, justid=True)

        batches: list[list[str]] = []
        receive = adapter.receive

        async def recorded(name: str, max_messages: int, timeout: float) -> list[Delivery]:
            got = await receive(name, max_messages, timeout)
            if name == subscription and got:
                batches.append([d.message.id for d in got])
            return got

        adapter.receive = recorded
        handled: dict[str, list[Message]] = {}
        dead: dict[str, Message] = {}
        outcomes: dict[str, list[Outcome]] = {}

        def on_outcome(message: Message, outcome: Outcome) -> None:
            if message.subscription == subscription:
                outcomes.setdefault(message.id, []).append(outcome)

        subscriber = harness.subscriber(
            adapter, dead_letter=DeadLetterPolicy(dlq_topic, max_delivery_attempts=2),
            on_outcome=on_outcome)

        @subscriber.handler(subscription)
        async def handle(message: Message) -> None:
            handled.setdefault(message.id, []).append(message)

        @subscriber.handler(dlq_subscription)
        async def dead_letters(message: Message) -> None:
            dead[message.attributes["original-message-id"]] = message

        expected = {before: [Outcome.ACKED], after: [Outcome.ACKED],
                    bad: [Outcome.DEAD_LETTERED] if hostile.problem else [Outcome.ACKED]}
        async with harness.serving(subscriber):
            await harness.wait_until(
                lambda: len(outcomes) == 3 and (hostile.problem is None or bad in dead),
                WITHIN, "the batch settled")
            assert subscriber.healthy()

            async def nothing_left() -> bool:
                stats = await adapter.subscription_stats(subscription)
                return (stats.backlog, stats.in_flight) == (0, 0)

            await poll_until(nothing_left, "nothing pending", WITHIN)

        assert batches[0] == [before, bad, after], "the three did not come in one batch"
        assert outcomes == expected
        handled_ids = [before, after] if hostile.problem else [before, bad, after]
        assert {i: len(m) for i, m in handled.items()} == {i: 1 for i in handled_ids}
        if hostile.problem is None:
            assert subscriber.stats.malformed == 0 and not dead
            return
        assert subscriber.stats.malformed == 1
        letter = dead[bad]
        assert letter.attributes["error-type"] == "reliable_sub.errors.MalformedMessageError"
        assert hostile.problem in letter.attributes["error-message"]
        if hostile.broker == "nats":
            assert letter.data == b"hostile"
        elif "no data field" in hostile.problem:  # its one field is the data (#44 item 11)
            assert letter.data == b"hostile"
            assert letter.attributes["publisher-redis-data-field"] == "\udcff\udcfe"
        else:  # every field of it, as a JSON object
            assert json.loads(letter.data)["data"] == "hostile"
            assert letter.attributes["publisher-redis-entry"] == "json"
    finally:
        await harness.close()


# -- the guard itself ----------------------------------------------------------------------------


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def delivery(entry: str, malformed: str | None = None) -> Delivery:
    return Delivery(Message(id=entry, data=entry.encode()), f"ack-{entry}", malformed=malformed)


def test_whatever_reading_an_entry_raises_marks_that_entry_only() -> None:
    raised: dict[str, Exception] = {
        "lookup": LookupError("unforeseen"),
        "recursion": RecursionError("maximum recursion depth exceeded"),
        "unprintable": Unprintable(),
        "long": ValueError("x" * 10_000),
    }

    def read(entry: str) -> Delivery:
        if entry in raised:
            raise raised[entry]
        return delivery(entry)

    got = read_each(["ok-1", *raised, "ok-2"], read, delivery)
    assert [d.message.id for d in got] == ["ok-1", *raised, "ok-2"]
    problems = {d.message.id: d.malformed for d in got}
    assert problems["ok-1"] is None and problems["ok-2"] is None
    assert problems["lookup"] == "LookupError: unforeseen"
    assert problems["recursion"] == "RecursionError: maximum recursion depth exceeded"
    assert problems["unprintable"] == (
        "Unprintable: <unprintable Unprintable: str() raised RuntimeError>")
    assert problems["long"] is not None and len(problems["long"]) == 300
    assert problems["long"].startswith("ValueError: xxx") and problems["long"].endswith("...")


def test_an_entry_that_cannot_even_be_marked_is_left_out_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def unreadable(entry: str, problem: str) -> Delivery:
        raise KeyError("no id either")

    def read(entry: str) -> Delivery:
        if entry == "bad":
            raise ValueError("bad entry")
        return delivery(entry)

    with caplog.at_level(logging.ERROR, logger="reliable_sub.entries"):
        got = read_each(["ok-1", "bad", "ok-2"], read, unreadable)
    assert [d.message.id for d in got] == ["ok-1", "ok-2"]
    [record] = caplog.records
    assert "ValueError: bad entry" in record.getMessage()
    assert "stays at the broker" in record.getMessage()


def test_a_keyboard_interrupt_is_not_swallowed() -> None:
    def read(entry: str) -> Delivery:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        read_each(["x"], read, delivery)


def test_describe_names_the_type_when_there_is_no_text() -> None:
    assert describe(RecursionError()) == "RecursionError"
