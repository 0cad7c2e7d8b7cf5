"""A failing batch is bisected (#44, item 13): only the messages that fail alone take the failure.

A batch handler that raises when its batch holds one poison message fails the whole batch; its
innocent neighbours must not go to the dead-letter queue with the poison. On the in-memory broker
with a ManualClock, and once on a real Redis, counting effects outside the consumer."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from typing import Any

import pytest

from reliable_sub import (
    BatchResult,
    DeadLetterPolicy,
    MemoryDedupStore,
    Message,
    Outcome,
    Reject,
    RetryPolicy,
    Subscriber,
)
from reliable_sub.dead_letters import DeadLetter
from reliable_sub.testing.services import redis_url
from reliable_sub.testing.timing import drive_until
from tests.memory_world import serve_until, serving, setup

MESSAGES = 200
# Where the poison ones are: alone in a batch, two in one half of a batch, and (0-19: 3 and 15)
# one in each half, so a first split finds no clean half.
POISON_AT = (3, 15, 40, 41, 77, 130, 160, 199)
MAX_BATCH = 20


def payloads() -> list[bytes]:
    return [(b"poison-%d" if i in POISON_AT else b"ok-%d") % i for i in range(MESSAGES)]


def settled(sub: Subscriber, count: int) -> Any:
    return lambda: sum(sub.stats[o] for o in (Outcome.ACKED, Outcome.DEAD_LETTERED)) >= count


@pytest.mark.parametrize("dedup", [True, False], ids=["dedup store", "no store"])
async def test_a_poison_message_takes_no_innocent_neighbour_to_the_dead_letter_queue(
    dedup: bool,
) -> None:
    clock, broker, _ = setup()
    sub = Subscriber(broker, clock=clock, dedup=MemoryDedupStore(clock=clock) if dedup else None,
                     retry=RetryPolicy(min_backoff=1, max_backoff=2),
                     dead_letter=DeadLetterPolicy("orders-dlq", max_delivery_attempts=3),
                     rng=random.Random(44))
    broker.ensure_subscription_sync("orders-dlq", "dlq")
    effects: Counter[bytes] = Counter()

    @sub.handler("billing", batch=True, max_batch=MAX_BATCH)
    async def handle(messages: list[Message]) -> None:
        if any(m.data.startswith(b"poison") for m in messages):
            raise ValueError("a poison message in the batch")
        effects.update(m.data for m in messages)  # all or nothing, as one bulk write

    for data in payloads():
        broker.publish_sync("orders", data)
    await serve_until(sub, settled(sub, MESSAGES), "every message settled", 600, clock)
    letters = [DeadLetter.of(d) for d in await broker.receive("dlq", 2 * MESSAGES, 0)]
    innocent = [data for data in payloads() if not data.startswith(b"poison")]
    dead_innocent = [letter.data for letter in letters if not letter.data.startswith(b"poison")]
    assert dead_innocent == [], f"{len(dead_innocent)} innocent messages dead-lettered"
    assert sorted(letter.data for letter in letters) == sorted(
        b"poison-%d" % i for i in POISON_AT)
    assert {(letter.reason, letter.handler_failures) for letter in letters} == {
        ("max-delivery-attempts", 3)}
    assert effects == Counter(innocent)  # every innocent effect, once
    assert (sub.stats[Outcome.ACKED], sub.stats[Outcome.DEAD_LETTERED]) == (
        len(innocent), len(POISON_AT))
    assert not await broker.receive("billing", 10, 0)  # nothing left behind


async def test_a_dependency_that_is_down_costs_a_failed_batch_three_calls_not_one_a_message(
) -> None:
    """Every call fails: the batch and its two halves are called (no half succeeded, so the
    failure looks like the dependency's), and each message counts one failure; only at the
    attempt that would dead-letter it is a message called alone."""
    clock, broker, sub = setup(retry=RetryPolicy(min_backoff=1, max_backoff=1),  # no jitter
                               dead_letter=DeadLetterPolicy("orders-dlq", 3))
    calls: list[tuple[int, int]] = []  # (delivery attempt, batch size)

    @sub.handler("billing", batch=True, max_batch=MAX_BATCH)
    async def handle(messages: list[Message]) -> None:
        calls.append((messages[0].delivery_attempt, len(messages)))
        raise ConnectionError("the warehouse is down")

    for i in range(MAX_BATCH):
        broker.publish_sync("orders", b"m%d" % i)
    await serve_until(sub, settled(sub, MAX_BATCH), "twenty dead letters", 600, clock)
    by_attempt = {n: [size for attempt, size in calls if attempt == n] for n in (1, 2, 3)}
    assert by_attempt[1] == by_attempt[2] == [20, 10, 10]
    assert by_attempt[3].count(1) == 20 and len(by_attempt[3]) == 2 * 20 - 1  # bisected alone
    assert len(calls) == len(by_attempt[1]) + len(by_attempt[2]) + len(by_attempt[3])
    assert (sub.stats[Outcome.RETRY], sub.stats[Outcome.DEAD_LETTERED]) == (40, 20)


async def test_the_halves_report_partial_failures_as_any_call() -> None:
    """A call of a half returns a BatchResult: those it names fail alone, as from any call."""
    clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", 5))
    broker.ensure_subscription_sync("orders-dlq", "dlq")
    calls: list[list[bytes]] = []

    @sub.handler("billing", batch=True)
    async def handle(messages: list[Message]) -> BatchResult:
        calls.append([m.data for m in messages])
        if any(m.data == b"poison" for m in messages):
            raise Reject("poison")  # a permanent failure: confirmed alone before the letter
        return BatchResult(failed={m.id: Reject("no such sku") for m in messages
                                   if m.data == b"gone"})

    for data in (b"a", b"gone", b"b", b"poison"):
        broker.publish_sync("orders", data)
    await serve_until(sub, settled(sub, 4), "four settled", 60, clock)
    assert calls == [[b"a", b"gone", b"b", b"poison"], [b"a", b"gone"], [b"b", b"poison"],
                     [b"b"], [b"poison"]]
    letters = sorted(DeadLetter.of(d).data for d in await broker.receive("dlq", 10, 0))
    assert letters == [b"gone", b"poison"]
    assert (sub.stats[Outcome.ACKED], sub.stats["rejected"], sub.stats[Outcome.RETRY]) == (
        2, 2, 0)


async def test_a_stop_while_a_batch_is_bisected_gives_back_what_was_not_called() -> None:
    clock, broker, _ = setup()
    sub = Subscriber(broker, clock=clock, dedup=MemoryDedupStore(clock=clock),
                     retry=RetryPolicy(min_backoff=1, max_backoff=2))
    calls: list[list[bytes]] = []
    stopping: list[asyncio.Future[None]] = []

    @sub.handler("billing", batch=True)
    async def handle(messages: list[Message]) -> None:
        calls.append([m.data for m in messages])
        if len(calls) == 2:  # the first half: a stop begins while it runs
            stopping.append(asyncio.ensure_future(sub.shutdown(timeout=30)))
            assert sub._runtime is not None
            for _ in range(1000):  # (loop turns, not time: the stop's first steps)
                if not sub._runtime.state.accepting:
                    break
                await asyncio.sleep(0)
            assert not sub._runtime.state.accepting
        if any(m.data == b"poison" for m in messages):
            raise ValueError("poison")

    for data in (b"a", b"b", b"c", b"poison"):
        broker.publish_sync("orders", data)
    task = await serving(sub, clock)
    await drive_until(clock, lambda: bool(stopping) and stopping[0].done(), 60, what="stopped")
    await task
    assert calls == [[b"a", b"b", b"c", b"poison"], [b"a", b"b"]]  # no call after the stop
    assert (sub.stats[Outcome.ACKED], sub.stats[Outcome.STOPPED]) == (2, 2)
    assert sub.stats[Outcome.RETRY] == 0  # given back, not failed: no attempt counted
    back = await broker.receive("billing", 10, 0)
    assert sorted(d.message.data for d in back) == [b"c", b"poison"]


# -- on a real broker ---------------------------------------------------------------------------


async def test_on_redis_streams_only_the_poison_messages_are_dead_lettered() -> None:
    """RedisStreamsAdapter and RedisDedupStore on the local Redis; the handler's effects are
    counted in Redis, and the dead letters read from their stream, outside the consumer."""
    import redis.asyncio as aioredis

    from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
    from reliable_sub.dedup import RedisDedupStore

    url = redis_url()
    run = f"bisect-{uuid.uuid4().hex[:10]}"
    topic, dlq, subscription = f"{run}-orders", f"{run}-dlq", f"{run}-sub"
    adapter = RedisStreamsAdapter(url, key_prefix=run)
    client = aioredis.Redis.from_url(url)
    try:
        await adapter.ensure_subscription(topic, subscription, ack_deadline=5, start="0")
        await adapter.ensure_subscription(dlq, f"{run}-dlq-sub", start="0")
        sub = Subscriber(adapter, dedup=RedisDedupStore(url, prefix=run),
                         retry=RetryPolicy(min_backoff=0.05, max_backoff=0.2),
                         dead_letter=DeadLetterPolicy(dlq, max_delivery_attempts=3),
                         receive_batch=50, receive_timeout=0.5)
        effects = f"{run}:effects"

        @sub.handler(subscription, batch=True, max_batch=MAX_BATCH)
        async def handle(messages: list[Message]) -> None:
            if any(m.data.startswith(b"poison") for m in messages):
                raise ValueError("a poison message in the batch")
            async with client.pipeline(transaction=True) as pipe:
                for message in messages:
                    pipe.hincrby(effects, message.data, 1)
                await pipe.execute()

        for data in payloads():
            await adapter.publish(topic, data)
        await serve_until(sub, settled(sub, MESSAGES), "every message settled", 120)
        counted = {key: int(value) for key, value in (await client.hgetall(effects)).items()}
        letters = [fields[b"data"] for _, fields in await client.xrange(dlq)]
        innocent = [data for data in payloads() if not data.startswith(b"poison")]
        dead_innocent = [data for data in letters if not data.startswith(b"poison")]
        assert dead_innocent == [], f"{len(dead_innocent)} innocent messages dead-lettered"
        assert sorted(letters) == sorted(b"poison-%d" % i for i in POISON_AT)
        assert counted == dict.fromkeys(innocent, 1)  # every innocent effect, once
        assert (sub.stats[Outcome.ACKED], sub.stats[Outcome.DEAD_LETTERED]) == (
        len(innocent), len(POISON_AT))
    finally:
        keys = [key async for key in client.scan_iter(match=f"*{run}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
        await adapter.close()

