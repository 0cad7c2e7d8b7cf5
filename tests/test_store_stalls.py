"""A dedup store whose connection hangs (not refused) must not double an effect (#24 item 8).

Two consumers share a Redis Streams subscription on the real Redis. Consumer A's dedup store
talks to Redis through a TCP proxy that stalls: every byte held back, nothing closed, as a
frozen server or a network partition does. A's handlers are running when the stall begins and
outlast it. Its lease tick used to await the claims' renewal after the broker extension: with
the store hung, the tick hung, every broker lease of A lapsed, consumer B reclaimed the
messages, the claims had expired in the store meanwhile, and B ran the handlers again beside
A's. The broker's extensions must go on whatever the store does, so B never sees them. Effects
are counted in this test, outside both consumers.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest

from reliable_sub import LeasePolicy, Message, Outcome, RetryPolicy, Subscriber
from reliable_sub.testing.services import redis_url
from reliable_sub.testing.tcp_proxy import TcpProxy

if importlib.util.find_spec("redis") is None and os.environ.get("CI", "").lower() != "true":
    pytest.skip('the Redis tests need pip install "reliable-sub[redis]"', allow_module_level=True)

import redis

from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
from reliable_sub.dedup import RedisDedupStore

# The subscription's ack deadline: an entry idle this long is reclaimed by the other consumer.
ACK_DEADLINE = 2.0
LEASE = LeasePolicy(min_extension=1.0, max_extension=ACK_DEADLINE)
# Longer than the ack deadline and the claims' lease (and the store client's socket timeout).
STALL = 8.0
MESSAGES = 10
WITHIN = 30.0


def wait_for(predicate: object, what: str, within: float = WITHIN) -> None:
    deadline = time.monotonic() + within
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within:g}s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def names() -> Iterator[tuple[str, str, str]]:
    suffix = uuid.uuid4().hex[:10]
    topic, subscription, prefix = f"stall-{suffix}", f"stall-sub-{suffix}", f"stall:{suffix}"
    yield topic, subscription, prefix
    client = redis.Redis.from_url(redis_url())
    try:
        client.delete(topic)
        for key in client.scan_iter(f"*{suffix}*"):
            client.delete(key)
    finally:
        client.close()


def test_a_hung_store_connection_does_not_let_a_running_handlers_lease_lapse(
    names: tuple[str, str, str],
) -> None:
    url = redis_url()
    topic, subscription, prefix = names
    setup = RedisStreamsAdapter(url)
    setup.ensure_subscription_sync(topic, subscription, ack_deadline=ACK_DEADLINE)
    setup.close_sync()
    effects: Counter[str] = Counter()
    runs: list[tuple[str, str]] = []
    lock = threading.Lock()
    release = threading.Event()

    def consumer(name: str, store_url: str) -> Subscriber:
        sub = Subscriber(
            RedisStreamsAdapter(url, consumer=name), dedup=RedisDedupStore(store_url,
                                                                           prefix=prefix),
            lease=LEASE, retry=RetryPolicy(min_backoff=0.5, max_backoff=1.0),
            receive_timeout=0.2, stop_timeout=10,
        )

        @sub.handler(subscription)
        def charge(message: Message) -> None:
            with lock:
                runs.append((name, message.id))
            release.wait(WITHIN)
            with lock:
                effects[message.id] += 1

        return sub

    with TcpProxy("127.0.0.1", 6379) as proxy:
        a = consumer("a", f"redis://127.0.0.1:{proxy.port}/0")
        b = consumer("b", url)
        publisher = RedisStreamsAdapter(url)
        ids = [publisher.publish_sync(topic, f"order-{i}".encode()) for i in range(MESSAGES)]
        publisher.close_sync()
        a.start()
        try:
            wait_for(lambda: len(runs) == MESSAGES, "A to run every handler")
            b.start()
            proxy.stall(STALL)
            wait_for(lambda: not proxy.stalled, "the stall to end", STALL + 5)
            release.set()
            wait_for(lambda: sum(a.stats.outcomes.values()) >= MESSAGES, "A to settle all")
            wait_for(lambda: sum(effects.values()) == len(runs), "every handler to end")
            assert a.healthy(), a.problems()
        finally:
            release.set()
            b.stop(timeout=5)
            a.stop(timeout=5)
    assert sorted(runs) == sorted(("a", message_id) for message_id in ids), (
        "B ran a message A was still running: A's broker lease lapsed while its store hung")
    assert effects == Counter({message_id: 1 for message_id in ids})
    assert a.stats[Outcome.ACKED] == MESSAGES
    assert b.stats[Outcome.ACKED] == 0 and b.stats[Outcome.DUPLICATE] == 0


def test_a_hung_store_makes_the_subscriber_unhealthy_naming_the_call() -> None:
    """A store that hangs on every claim for longer than ``unhealthy_after``: healthy() turns
    False, and problems() names the claim and its last error (a timeout)."""
    asyncio.run(_unhealthy_while_the_store_hangs())


async def _unhealthy_while_the_store_hangs() -> None:
    from reliable_sub import ManualClock, MemoryDedupStore
    from reliable_sub.adapters.memory import MemoryAdapter
    from reliable_sub.testing.timing import drive_until

    class HangingStore(MemoryDedupStore):
        async def claim_many(self, *args: object, **kwargs: object) -> list[object]:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("orders", "billing")
    sub = Subscriber(broker, dedup=HangingStore(clock=clock), clock=clock,
                     retry=RetryPolicy(min_backoff=1, max_backoff=2), unhealthy_after=30)
    sub.handler("billing")(lambda message: None)
    broker.publish_sync("orders", b"x")
    task = asyncio.ensure_future(sub.serve())
    try:
        await drive_until(clock, lambda: sub.running, 1.0)
        assert sub.healthy()
        await drive_until(clock, lambda: sub.stats.store_errors >= 1, 60, what="a timeout")
        assert sub.healthy(), "one failure is not an outage"
        await drive_until(clock, lambda: not sub.healthy(), 120, what="unhealthy")
        [problem] = sub.problems()
        assert problem.startswith("claiming in the dedup store has failed")
        assert "did not answer within" in problem
    finally:
        await sub.shutdown(timeout=1)
        await task
    assert sub.problems() == ["not running"]
