"""RedisStreamsAdapter specifics on a real Redis (the contract itself is in conformance/)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timezone

import pytest

from reliable_sub import ConfigurationError, UnknownSubscriptionError
from reliable_sub._redis_clients import URL_SCHEMES
from reliable_sub.adapters.redis_streams import NACKED_CONSUMER, RedisStreamsAdapter
from reliable_sub.replay import seek
from reliable_sub.testing.services import redis_url

DEADLINE = 0.5


@pytest.fixture
async def names() -> AsyncIterator[tuple[str, str, str]]:
    url = redis_url()
    run = uuid.uuid4().hex[:10]
    yield url, f"rs-{run}-topic", f"rs-{run}"
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    keys = [key async for key in client.scan_iter(match=f"*rs-{run}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def make(url: str, prefix: str, consumer: str, topic: str) -> RedisStreamsAdapter:
    adapter = RedisStreamsAdapter(url, consumer=consumer, key_prefix=prefix)
    await adapter.ensure_subscription(topic, f"{prefix}-sub", ack_deadline=DEADLINE, start="0")
    return adapter


@pytest.mark.parametrize(("url", "what"), [
    ("http://127.0.0.1:6379", "scheme 'http://'"),
    ("nats://127.0.0.1:4222", "scheme 'nats://'"),
    ("REDIS://127.0.0.1:6379", "scheme 'REDIS://'"),
    ("redis://127.0.0.1:port/0", "Port could not be cast"),
])
def test_a_url_it_cannot_use_is_a_configuration_error_naming_every_scheme(
    url: str, what: str,
) -> None:
    """Not redis-py's raw ValueError, whose list of schemes leaves out redis+cluster://."""
    with pytest.raises(ConfigurationError) as refused:
        RedisStreamsAdapter(url)
    message = str(refused.value)
    assert "RedisStreamsAdapter" in message and what in message
    if "scheme" in what:
        assert all(scheme in message for scheme in URL_SCHEMES), message


async def test_entry_layout_is_documented_fields(names) -> None:
    url, topic, prefix = names
    adapter = await make(url, prefix, "c1", topic)
    entry_id = await adapter.publish(topic, b"\x00payload", {"k": "v"}, ordering_key="o")
    [(got_id, fields)] = await adapter.client.xrange(topic)
    assert got_id.decode() == entry_id
    assert fields == {b"data": b"\x00payload", b"attributes": b'{"k":"v"}',
                      b"ordering-key": b"o"}
    [delivery] = await adapter.receive(f"{prefix}-sub", 10, 1)
    message = delivery.message
    assert (message.data, message.attributes, message.ordering_key) == (b"\x00payload",
                                                                        {"k": "v"}, "o")
    assert message.publish_time is not None and message.publish_time.year >= 2024
    await adapter.close()


async def test_publish_many_is_one_round_trip_and_refuses_per_message(names) -> None:
    from reliable_sub.ports import BatchPublisher, Outgoing

    url, topic, prefix = names
    adapter = await make(url, prefix, "c1", topic)
    assert isinstance(adapter, BatchPublisher)
    not_a_stream = f"{prefix}-a-string"
    await adapter.client.set(not_a_stream, "x")
    sent = []
    connection = await adapter.client.connection_pool.get_connection()
    original = connection.send_packed_command

    async def counting(command, check_health=True):
        sent.append(command)
        return await original(command, check_health)

    connection.send_packed_command = counting
    await adapter.client.connection_pool.release(connection)
    results = await adapter.publish_many([
        Outgoing(topic, b"one", {"n": "1"}, "k"),
        Outgoing(not_a_stream, b"refused"),
        Outgoing(topic, b"two", None, "k"),
        Outgoing(topic, b"bad attributes", {"n": 1}),  # type: ignore[dict-item]
    ])
    assert len(sent) == 1, "one pipelined write for the whole batch"
    first, wrong_type, second, bad = results
    assert isinstance(first, str) and isinstance(second, str) and first < second
    assert "WRONGTYPE" in str(wrong_type)
    assert isinstance(bad, TypeError | ValueError)
    entries = await adapter.client.xrange(topic)
    assert [fields[b"data"] for _, fields in entries] == [b"one", b"two"]
    await adapter.close()


async def test_extending_leaves_the_delivery_counter_alone(names) -> None:
    """XCLAIM ... JUSTID must not count as a delivery (fakeredis gets this wrong)."""
    url, topic, prefix = names
    adapter = await make(url, prefix, "c1", topic)
    await adapter.publish(topic, b"x")
    [delivery] = await adapter.receive(f"{prefix}-sub", 10, 1)
    for _ in range(5):
        assert await adapter.extend([delivery], DEADLINE) == []
    [pending] = await adapter.client.xpending_range(topic, f"{prefix}-sub", "-", "+", 10)
    assert pending["times_delivered"] == 1
    assert pending["consumer"] == b"c1"
    assert await adapter.ack([delivery]) == []
    await adapter.close()


async def test_a_stalled_consumer_cannot_snatch_back_a_reclaimed_entry(names) -> None:
    url, topic, prefix = names
    stalled = await make(url, prefix, "stalled", topic)
    live = await make(url, prefix, "live", topic)
    sub = f"{prefix}-sub"
    await stalled.publish(topic, b"job")
    [old] = await stalled.receive(sub, 10, 1)
    [new] = await live.receive(sub, 10, 3 * DEADLINE)  # reclaimed once idle past the deadline
    assert new.message.delivery_attempt == 2

    assert await stalled.extend([old], DEADLINE) == [old]
    assert await stalled.ack([old]) == [old]
    [pending] = await live.client.xpending_range(topic, sub, "-", "+", 10)
    assert pending["consumer"] == b"live", "the stalled consumer took the entry back"
    assert await live.ack([new]) == []
    await stalled.close()
    await live.close()


async def test_one_ack_call_acks_exactly_what_is_still_ours_among_many_pending(names) -> None:
    """The ack script asks XPENDING once for the call's id range (at most as many entries as
    the call acks): entries it does not list -- more of ours pending in the range, one taken by
    another consumer, one redelivered to us (its old ack id stale) -- are still judged one by
    one, whatever order the call lists them in."""
    url, topic, prefix = names
    adapter = await make(url, prefix, "c1", topic)
    sub = f"{prefix}-sub"
    for number in range(30):
        await adapter.publish(topic, str(number).encode())
    deliveries = await adapter.receive(sub, 30, 1)
    assert len(deliveries) == 30
    client, ids = adapter.client, [d.message.id for d in deliveries]
    # another consumer takes #4; #10 is claimed again by c1 itself (delivery count 2)
    await client.xclaim(topic, sub, "thief", 0, [ids[4]], justid=True)
    await client.execute_command("XCLAIM", topic, sub, "c1", 0, ids[10])
    chosen = [deliveries[i] for i in (27, 4, 1, 10, 16, 7, 22)]  # out of order, spread out
    refused = await adapter.ack(chosen)
    assert [d.message.id for d in refused] == [ids[4], ids[10]]
    left = {entry["message_id"].decode(): (entry["consumer"], entry["times_delivered"])
            for entry in await client.xpending_range(topic, sub, "-", "+", 100)}
    acked = {ids[i] for i in (27, 1, 16, 7, 22)}
    assert set(left) == set(ids) - acked
    assert left[ids[4]] == (b"thief", 1) and left[ids[10]] == (b"c1", 2)
    await adapter.close()


async def test_nack_parks_the_entry_and_delays_it_without_a_copy(names) -> None:
    url, topic, prefix = names
    adapter = await make(url, prefix, "c1", topic)
    sub = f"{prefix}-sub"
    await adapter.publish(topic, b"x")
    [delivery] = await adapter.receive(sub, 10, 1)
    await adapter.nack([delivery], 0.4)
    [pending] = await adapter.client.xpending_range(topic, sub, "-", "+", 10)
    assert pending["consumer"] == NACKED_CONSUMER.encode()
    assert await adapter.client.xlen(topic) == 1, "nack must not add a copy"
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await adapter.receive(sub, 10, 0.2) == []
    [again] = await adapter.receive(sub, 10, 2)
    assert loop.time() - start >= 0.35
    assert again.message.delivery_attempt == 2
    await adapter.ack([again])
    await adapter.close()


async def test_entries_trimmed_while_pending_are_dropped_and_counted(names) -> None:
    url, topic, prefix = names
    adapter = await make(url, prefix, "c1", topic)
    sub = f"{prefix}-sub"
    for i in range(3):
        await adapter.publish(topic, f"{i}".encode())
    deliveries = await adapter.receive(sub, 10, 1)
    assert len(deliveries) == 3
    await adapter.client.xdel(topic, deliveries[0].message.id)
    await adapter.nack(deliveries, 0)
    again = await adapter.receive(sub, 10, 2)
    assert sorted(d.message.data for d in again) == [b"1", b"2"]
    assert adapter.stats["gone"] == 1
    await adapter.ack(again)
    summary = await adapter.client.xpending(topic, sub)
    assert summary["pending"] == 0, "the trimmed entry must not stay pending forever"
    await adapter.close()


async def test_a_lost_group_is_recreated(names) -> None:
    url, topic, prefix = names
    adapter = await make(url, prefix, "c1", topic)
    sub = f"{prefix}-sub"
    await adapter.client.delete(topic)  # as after a restart without persistence
    assert await adapter.receive(sub, 10, 0.1) == []
    await adapter.publish(topic, b"after")
    [delivery] = await adapter.receive(sub, 10, 1)
    assert delivery.message.data == b"after"
    await adapter.close()


async def test_settings_are_shared_and_errors_are_clear(names) -> None:
    url, topic, prefix = names
    first = await make(url, prefix, "c1", topic)
    other = RedisStreamsAdapter(url, consumer="c2", key_prefix=prefix)
    assert await other.subscription_ack_deadline(f"{prefix}-sub") == DEADLINE
    with pytest.raises(UnknownSubscriptionError, match="'nope' does not exist"):
        await other.receive("nope", 1, 0)
    with pytest.raises(ConfigurationError, match="start must be"):
        await other.ensure_subscription(topic, "x", start="1-0")
    with pytest.raises(ConfigurationError, match="unknown options"):
        await other.ensure_subscription(topic, "x", ordering=True)
    with pytest.raises(TypeError, match="data must be bytes"):
        await other.publish(topic, "text")  # type: ignore[arg-type]
    settings = json.loads(await first.client.hget(f"{prefix}:subscriptions", f"{prefix}-sub"))
    assert settings == {"topic": topic, "ack_deadline": DEADLINE, "start": "0"}
    await first.close()
    await other.close()


@pytest.mark.parametrize("on_a_cluster", [False, True], ids=["redis", "cluster"])
@pytest.mark.parametrize("blocking", [False, True], ids=["async", "sync"])
async def test_a_group_created_at_dollar_on_a_stream_with_entries_says_what_it_skips(
    names, caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest, blocking: bool,
    on_a_cluster: bool,
) -> None:
    """#24.18: a new user's first trial handled 0 of 5 messages, published before the group
    existed. start="$" stays the default (a subscription gets what is published after it, as
    on Pub/Sub, redis-py and FastStream), but creating a group at "$" on a stream that holds
    entries says, at WARNING, how many it skips and how to start at "0"; an existing group, an
    empty stream and start="0" say nothing."""
    url, topic, prefix = names
    if on_a_cluster:  # the group is created, then the stream counted, one after the other
        url = request.getfixturevalue("redis_cluster").url
    adapter = RedisStreamsAdapter(url, consumer="c1", key_prefix=prefix)
    for n in range(5):
        await adapter.publish(topic, f"early-{n}".encode())

    async def ensure(stream: str, group: str, **options: str) -> None:
        if blocking:
            adapter.ensure_subscription_sync(stream, group, ack_deadline=DEADLINE, **options)
        else:
            await adapter.ensure_subscription(stream, group, ack_deadline=DEADLINE, **options)

    late, everything = f"{prefix}-late", f"{prefix}-all"
    with caplog.at_level("WARNING", logger="reliable_sub.adapters.redis_streams"):
        await ensure(topic, late)
        await ensure(topic, late)  # it exists: nothing new to say
        await ensure(topic, everything, start="0")
        await ensure(f"{topic}-empty", f"{prefix}-new")
    [record] = [r for r in caplog.records if r.name == "reliable_sub.adapters.redis_streams"]
    assert record.levelname == "WARNING"
    text = record.getMessage()
    assert f"the 5 entries stream {topic!r} holds" in text
    assert f"ensure_subscription({topic!r}, {late!r}, start=\"0\")" in text
    assert f"seek(broker, {late!r}, to=datetime(1970, 1, 1, tzinfo=timezone.utc))" in text
    # and it is true: the group at "$" delivers none of them, the one at "0" all five, and
    # the seek it advises brings them to the group at "$"
    assert await adapter.receive(late, 10, 0.1) == []
    assert len(await adapter.receive(everything, 10, 1)) == 5
    await seek(adapter, late, to=datetime(1970, 1, 1, tzinfo=timezone.utc))
    assert len(await adapter.receive(late, 10, 1)) == 5
    await adapter.close()


async def test_publish_sync_and_max_len(names) -> None:
    url, topic, prefix = names
    adapter = RedisStreamsAdapter(url, consumer="c1", key_prefix=prefix, max_len=10)
    adapter.ensure_subscription_sync(topic, f"{prefix}-sub", ack_deadline=DEADLINE)
    ids = [adapter.publish_sync(topic, f"{i}".encode()) for i in range(500)]
    assert len(set(ids)) == 500
    assert await adapter.client.xlen(topic) < 500
    await adapter.close()


def test_importing_without_redis_names_the_extra() -> None:
    script = (
        "import sys; sys.modules['redis'] = None\n"
        "try:\n"
        "    import reliable_sub.adapters.redis_streams\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60)
    assert 'pip install "reliable-sub[redis]"' in result.stdout, result.stdout + result.stderr


async def test_completions_ride_with_the_ack_when_store_and_stream_share_redis(names) -> None:
    from reliable_sub import Completed, Message, Outcome, Subscriber
    from reliable_sub.clock import SystemClock
    from reliable_sub.dedup import DedupKey, RedisDedupStore
    from reliable_sub.testing.timing import drive_until

    url, topic, prefix = names

    class CountingAdapter(RedisStreamsAdapter):
        calls: dict[str, int] = {"ack": 0, "ack_with_completions": 0}

        async def ack(self, deliveries):
            self.calls["ack"] += 1
            return await super().ack(deliveries)

        async def ack_with_completions(self, deliveries, store, completions, ttl):
            self.calls["ack_with_completions"] += 1
            return await super().ack_with_completions(deliveries, store, completions, ttl)

    adapter = CountingAdapter(url, consumer="c1", key_prefix=prefix)
    sub_name = f"{prefix}-sub"
    await adapter.ensure_subscription(topic, sub_name, ack_deadline=5, start="0")
    store = RedisDedupStore(url, prefix=f"{prefix}:dedup")
    assert adapter.shares_store(store)
    assert not adapter.shares_store(RedisDedupStore(url.rsplit("/", 1)[0] + "/1"))
    subscriber = Subscriber(adapter, dedup=store)

    @subscriber.handler(sub_name)
    async def handle(message: Message) -> dict[str, str]:
        return {"seen": message.data.decode()}

    for i in range(20):
        await adapter.publish(topic, f"m{i}".encode(), {"idempotency-key": f"k{i}"})
    task = asyncio.ensure_future(subscriber.serve())
    await drive_until(SystemClock(), lambda: subscriber.stats[Outcome.ACKED] == 20, 10,
                      what="20 acks")
    await subscriber.shutdown(timeout=1)
    await task

    assert adapter.calls["ack"] == 0
    assert adapter.calls["ack_with_completions"] >= 1
    found = await store.claim(DedupKey(adapter.dedup_namespace(sub_name), "k7"), 5)
    assert isinstance(found, Completed) and found.result == {"seen": "m7"}
    assert (await adapter.client.xpending(topic, sub_name))["pending"] == 0
    await store.close()
    await adapter.close()


async def test_a_group_name_belongs_to_one_stream(names) -> None:
    url, topic, prefix = names
    adapter = await make(url, prefix, "c1", topic)
    other_topic = f"{topic}-other"
    with pytest.raises(ConfigurationError, match=f"'{prefix}-sub' already exists on topic"):
        await adapter.ensure_subscription(other_topic, f"{prefix}-sub")
    with pytest.raises(ConfigurationError, match="already exists on topic"):
        adapter.ensure_subscription_sync(other_topic, f"{prefix}-sub")
    assert not await adapter.client.exists(other_topic), "nothing was created for it"
    await adapter.ensure_subscription(topic, f"{prefix}-sub")  # the same stream: a no-op
    await adapter.close()


async def test_equal_entry_ids_on_two_streams_are_different_messages(names) -> None:
    """Two services on one Redis, each with a group called "workers" (#8.2)."""
    from reliable_sub import Message, Outcome, Subscriber
    from reliable_sub.dedup import RedisDedupStore
    from tests.redis_processes import poll_until

    url, topic, prefix = names
    store_prefix = f"{prefix}:dedup"  # one store, shared by both services
    handled: list[tuple[str, str]] = []
    subscribers = []
    for service in ("billing", "shipping"):
        adapter = RedisStreamsAdapter(url, key_prefix=f"{prefix}-{service}")
        stream = f"{topic}-{service}"
        await adapter.ensure_subscription(stream, "workers", start="0")
        # the same entry id on both streams, as two XADDs in one millisecond give
        await adapter.client.xadd(stream, {"data": service.encode()}, id="1700000000000-0")
        subscriber = Subscriber(adapter, dedup=RedisDedupStore(url, prefix=store_prefix))

        def make_handler(name: str):
            async def handle(message: Message) -> None:
                handled.append((name, message.id))

            return handle

        subscriber.handler("workers")(make_handler(service))
        subscribers.append(subscriber)
    tasks = [asyncio.ensure_future(s.serve()) for s in subscribers]
    try:
        await poll_until(lambda: sum(s.stats[Outcome.ACKED] + s.stats[Outcome.DUPLICATE]
                                     for s in subscribers) == 2, "both settled")
    finally:
        for subscriber in subscribers:
            await subscriber.shutdown(timeout=2)
        await asyncio.gather(*tasks)
    assert sorted(handled) == [("billing", "1700000000000-0"), ("shipping", "1700000000000-0")]
    assert all(s.stats[Outcome.DUPLICATE] == 0 for s in subscribers)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"data": b"x", "attributes": b"[1, 2]"}, "a JSON list, not an object"),
        ({"data": b"x", "attributes": b"{oops"}, "not JSON"),
        ({"data": b"x", "attributes": b"\xff\xfe"}, "not JSON"),
        ({"data": b"x", "attributes": b'{"n": 1}'}, "attribute 'n' is a int"),
        ({"data": b"x", "ordering-key": b"\xff"}, "ordering-key field is not UTF-8"),
        ({"payload": b"x"}, "no data field"),
    ],
)
async def test_an_unreadable_entry_is_dead_lettered_and_its_batch_handled(
    names, fields, problem
) -> None:
    """Entries written by another producer (#8.10, #8.11)."""
    from reliable_sub import DeadLetterPolicy, Message, Outcome, Subscriber
    from tests.redis_processes import poll_until

    url, topic, prefix = names
    adapter = await make(url, prefix, "c1", topic)
    dlq = f"{topic}-dlq"
    await adapter.ensure_subscription(dlq, f"{prefix}-dlq-sub", start="0")
    await adapter.publish(topic, b"before")
    await adapter.client.xadd(topic, fields)
    await adapter.publish(topic, b"after")
    handled: list[bytes] = []
    subscriber = Subscriber(adapter, dead_letter=DeadLetterPolicy(dlq, 3))

    @subscriber.handler(f"{prefix}-sub")
    async def handle(message: Message) -> None:
        handled.append(message.data)

    task = asyncio.ensure_future(subscriber.serve())
    try:
        await poll_until(lambda: subscriber.stats[Outcome.ACKED] == 2
                         and subscriber.stats[Outcome.DEAD_LETTERED] == 1, "all three settled")
        assert subscriber.healthy()
    finally:
        await subscriber.shutdown(timeout=2)
        await task
    assert handled == [b"before", b"after"]
    assert subscriber.stats.malformed == 1
    [dead] = await adapter.receive(f"{prefix}-dlq-sub", 10, 1)
    assert dead.message.attributes["error-type"] == "reliable_sub.errors.MalformedMessageError"
    assert problem in dead.message.attributes["error-message"]
    assert (await adapter.client.xpending(topic, f"{prefix}-sub"))["pending"] == 0
    await adapter.close()
