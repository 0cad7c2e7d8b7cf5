"""A Redis restart under a running Subscriber: connections drop, nothing is lost.

Every test starts a PRIVATE redis-server on a free loopback port (never the shared one), runs a
Subscriber in the test's event loop with handlers held in flight, SIGKILLs the server, starts it
again on the same port and directory, and checks that the Subscriber recovered by itself.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from reliable_sub import Message, Subscriber
from tests.redis_processes import POLL_INTERVAL, RedisServer, poll_until

if importlib.util.find_spec("redis") is None and os.environ.get("CI", "").lower() != "true":
    pytest.skip('the Redis tests need pip install "reliable-sub[redis]"', allow_module_level=True)

import redis

from reliable_sub.adapters.redis_streams import RedisStreamsAdapter

TOPIC, SUBSCRIPTION = "orders", "billing"
# Long enough that no entry is reclaimed during the outage: every redelivery seen is a bug.
ACK_DEADLINE = 5.0
BATCH = 5
WITHIN = 10.0


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[RedisServer]]:
    """Private servers the test starts; each is killed at the end, pass or fail."""
    started: list[RedisServer] = []
    try:
        yield started
    finally:
        for server in started:
            server.kill()


def private_redis(servers: list[RedisServer], tmp_path: Path, *, appendonly: bool) -> RedisServer:
    server = RedisServer(tmp_path, appendonly=appendonly)
    servers.append(server)
    server.start()
    return server


@dataclass
class Consumer:
    """A Subscriber whose handlers record message ids, then wait until released."""

    adapter: RedisStreamsAdapter
    sub: Subscriber
    release: asyncio.Event = field(default_factory=asyncio.Event)
    handled: Counter[str] = field(default_factory=Counter)


@asynccontextmanager
async def consuming(url: str) -> AsyncIterator[Consumer]:
    adapter = RedisStreamsAdapter(url, consumer="consumer-1")
    await adapter.ensure_subscription(TOPIC, SUBSCRIPTION, ack_deadline=ACK_DEADLINE)
    consumer = Consumer(adapter, Subscriber(adapter))

    @consumer.sub.handler(SUBSCRIPTION)
    async def handle(message: Message) -> None:
        consumer.handled[message.id] += 1
        await consumer.release.wait()  # the first batch is held in flight until released

    task = asyncio.create_task(consumer.sub.serve(), name="consumer")
    try:
        await poll_until(lambda: consumer.sub.running or task.done(), "the Subscriber to start")
        yield consumer
    finally:
        consumer.release.set()
        await consumer.sub.shutdown(timeout=5)
        await asyncio.wait_for(task, timeout=WITHIN)  # re-raises what serve() failed with
        await adapter.close()


async def publish_batch(adapter: RedisStreamsAdapter, label: str) -> list[str]:
    """BATCH messages: the first through the blocking twin (its own client), the rest async.

    The async publishes are retried on ConnectionError, as a publisher would while Redis is
    still down.
    """
    ids = [await asyncio.to_thread(adapter.publish_sync, TOPIC, f"{label}-0".encode())]
    for i in range(1, BATCH):
        ids.append(await publish_retrying(adapter, f"{label}-{i}".encode()))
    return ids


async def publish_retrying(adapter: RedisStreamsAdapter, data: bytes) -> str:
    give_up = time.monotonic() + WITHIN
    while True:
        try:
            return await adapter.publish(TOPIC, data)
        except redis.ConnectionError:
            if time.monotonic() > give_up:
                raise
            await asyncio.sleep(POLL_INTERVAL)  # a publisher's retry backoff


async def hold_first_batch_through_a_kill(consumer: Consumer, server: RedisServer) -> list[str]:
    """Publish a batch, hold its handlers in flight, SIGKILL the server and see the outage."""
    first = await publish_batch(consumer.adapter, "first")
    await poll_until(lambda: all(consumer.handled[i] for i in first), "the first batch in flight")
    server.kill()
    await poll_until(lambda: consumer.sub.stats.receive_errors > 0, "a failed receive", WITHIN)
    assert consumer.sub.running
    return first


def group_is_back(server: RedisServer) -> bool:
    with redis.Redis.from_url(server.url, socket_timeout=5) as client:
        if not client.exists(TOPIC):
            return False
        return any(g["name"] == SUBSCRIPTION.encode() for g in client.xinfo_groups(TOPIC))


def settings_are_back(server: RedisServer) -> bool:
    with redis.Redis.from_url(server.url, socket_timeout=5) as client:
        return bool(client.hexists("reliable-sub:subscriptions", SUBSCRIPTION))


def pending_count(server: RedisServer) -> int:
    with redis.Redis.from_url(server.url, socket_timeout=5) as client:
        return int(client.xpending(TOPIC, SUBSCRIPTION)["pending"])


async def test_a_restart_with_persistence_loses_nothing(
    servers: list[RedisServer], tmp_path: Path
) -> None:
    server = private_redis(servers, tmp_path, appendonly=True)
    async with consuming(server.url) as consumer:
        first = await hold_first_batch_through_a_kill(consumer, server)

        server.start()  # same port, same AOF
        with redis.Redis.from_url(server.url, socket_timeout=5) as client:
            assert client.xlen(TOPIC) == BATCH, "the AOF kept the stream"
            assert client.xpending(TOPIC, SUBSCRIPTION)["pending"] == BATCH, "and its PEL"
        consumer.release.set()
        second = await publish_batch(consumer.adapter, "second")

        await poll_until(
            lambda: all(consumer.handled[i] for i in first + second), "both batches", WITHIN
        )
        await poll_until(lambda: pending_count(server) == 0, "every ack to land", WITHIN)
        assert consumer.sub.running, "the Subscriber survived the outage"
        stats = consumer.sub.stats
    assert stats.receive_errors > 0, "it saw the outage"
    assert stats.acks_refused == 0, "the acks of handlers held over the restart were accepted"
    assert consumer.handled == Counter({i: 1 for i in first + second}), "and nothing came twice"
    assert pending_count(server) == 0
    assert server.starts == 2


async def test_a_restart_without_persistence_recreates_the_group(
    servers: list[RedisServer], tmp_path: Path
) -> None:
    server = private_redis(servers, tmp_path, appendonly=False)
    async with consuming(server.url) as consumer:
        first = await hold_first_batch_through_a_kill(consumer, server)

        server.start()
        with redis.Redis.from_url(server.url, socket_timeout=5) as client:
            assert not client.exists(TOPIC), "without persistence the stream is gone"
        consumer.release.set()  # their acks meet an empty Redis: refused or failed, harmless
        await poll_until(lambda: group_is_back(server), "the adapter to recreate the group")
        # ... and the subscription's settings, so that new consumers can join (written just
        # after the group)
        await poll_until(lambda: settings_are_back(server), "the subscription's settings")
        second = await publish_batch(consumer.adapter, "second")

        await poll_until(lambda: all(consumer.handled[i] for i in second), "the second batch")
        await poll_until(lambda: pending_count(server) == 0, "every ack to land", WITHIN)
        assert consumer.sub.running, "the Subscriber survived the outage"
        stats = consumer.sub.stats
    assert stats.receive_errors > 0, "it saw the outage"
    assert all(consumer.handled[i] >= 1 for i in first), "the in-flight ones ran before the kill"
    assert all(consumer.handled[i] == 1 for i in second)
    assert pending_count(server) == 0


async def test_a_restart_without_persistence_loses_nothing_published_after_it(
    servers: list[RedisServer], tmp_path: Path
) -> None:
    server = private_redis(servers, tmp_path, appendonly=False)
    async with consuming(server.url) as consumer:
        first = await hold_first_batch_through_a_kill(consumer, server)

        # No await from the restart to the publish: the Subscriber (in this event loop) cannot
        # touch Redis in between, so a publisher that is quicker than the consumer is simulated
        # deterministically.
        server.start()
        early = consumer.adapter.publish_sync(TOPIC, b"published-right-after-the-restart")
        consumer.release.set()
        await poll_until(lambda: group_is_back(server), "the adapter to recreate the group")
        later = await publish_retrying(consumer.adapter, b"published-once-the-group-is-back")
        await poll_until(lambda: consumer.handled[later] > 0, "the later message", WITHIN)
        # Streams deliver in order: once the later entry was read, the early one was too.
        assert consumer.handled[early] == 1, "the entry published right after the restart"
        await poll_until(lambda: pending_count(server) == 0, "every ack to land", WITHIN)
        assert consumer.sub.running
    assert all(consumer.handled[i] >= 1 for i in first)


async def test_the_first_async_publish_after_a_restart_succeeds(
    servers: list[RedisServer], tmp_path: Path
) -> None:
    server = private_redis(servers, tmp_path, appendonly=True)
    adapter = RedisStreamsAdapter(server.url, consumer="publisher")
    try:
        await adapter.ensure_subscription(TOPIC, SUBSCRIPTION, ack_deadline=ACK_DEADLINE)
        before = [await adapter.publish(TOPIC, b"before"), adapter.publish_sync(TOPIC, b"sync")]
        server.kill()
        server.start()
        after_sync = adapter.publish_sync(TOPIC, b"sync after")  # recovers: retried by redis-py
        after = await adapter.publish(TOPIC, b"after")  # the first async call after the restart
        with redis.Redis.from_url(server.url, socket_timeout=5) as client:
            ids = [entry_id.decode() for entry_id, _ in client.xrange(TOPIC)]
        assert ids == [*before, after_sync, after]
    finally:
        await adapter.close()
