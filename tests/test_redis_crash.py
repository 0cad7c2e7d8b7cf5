"""A consumer process SIGKILLed mid-flight: its message is handled by a peer, its effect once.

Each test runs a child process with a Subscriber on RedisStreamsAdapter + RedisDedupStore (the
shared Redis on 127.0.0.1:6379), kills it at a point it announces on stdout, then lets a second
consumer (in this test's event loop) reclaim the message after the ack deadline. Keys are unique
per test and deleted afterwards, pass or fail.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import textwrap
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from reliable_sub import LeasePolicy, Message, Outcome, Subscriber
from reliable_sub.dedup import Completed, DedupKey
from reliable_sub.testing.services import redis_url
from tests.redis_processes import Child, poll_until

if importlib.util.find_spec("redis") is None and os.environ.get("CI", "").lower() != "true":
    pytest.skip('the Redis tests need pip install "reliable-sub[redis]"', allow_module_level=True)

from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
from reliable_sub.dedup import RedisDedupStore

if TYPE_CHECKING:
    import redis.asyncio as aioredis

# The subscription's ack deadline: a killed consumer's entry is reclaimable this long after its
# last extension. Leases (and dedup claims) are sized to it, so a dead claim lapses as fast.
ACK_DEADLINE = 1.0
LEASE = LeasePolicy(min_extension=0.5, max_extension=ACK_DEADLINE)
# Bound on every wait for something that should take about one ack deadline.
WITHIN = 10.0

# The consumer that gets killed. argv[1]: its settings as JSON. It prints
#   STARTED <id> <attempt>  when its handler starts (mode "mid-handler": then blocks forever);
#   HANDLED <id> <attempt>  after its handler's effect (mode "after-effect");
#   ACKING <ids>            when the Subscriber acks (mode "after-effect": then blocks forever,
#                           after the dedup completions of the batch were written; the adapter
#                           declines the Redis fast path, whose single script leaves no window
#                           between completion and XACK).
CHILD = textwrap.dedent(
    """
    import asyncio, json, sys, threading

    import redis

    from reliable_sub import LeasePolicy, Subscriber
    from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
    from reliable_sub.dedup import RedisDedupStore

    cfg = json.loads(sys.argv[1])
    effects = redis.Redis.from_url(cfg["url"])


    class AckNeverReturns(RedisStreamsAdapter):
        def shares_store(self, store):
            # No fast path (completions and XACK in one script): as with a store on another
            # Redis, the Settler writes completions with complete_many, then calls ack.
            return False

        async def ack(self, deliveries):
            print("ACKING", " ".join(d.message.id for d in deliveries), flush=True)
            await asyncio.Event().wait()  # never set: the kill lands here, before XACK


    async def main():
        adapter_type = AckNeverReturns if cfg["mode"] == "after-effect" else RedisStreamsAdapter
        adapter = adapter_type(cfg["url"], consumer=cfg["consumer"], key_prefix=cfg["prefix"])
        store = RedisDedupStore(cfg["url"], prefix=cfg["dedup_prefix"], owner=cfg["consumer"])
        sub = Subscriber(adapter, dedup=store, lease=LeasePolicy(
            min_extension=cfg["min_extension"], max_extension=cfg["max_extension"]))

        @sub.handler(cfg["subscription"])
        def handle(message):
            if cfg["mode"] == "mid-handler":
                print("STARTED", message.id, message.delivery_attempt, flush=True)
                threading.Event().wait()  # never set: the kill lands here
            effects.rpush(cfg["effects"], f"{message.id} {cfg['consumer']}")
            print("HANDLED", message.id, message.delivery_attempt, flush=True)
            return {"effect": message.id}

        await sub.serve()


    asyncio.run(main())
    """
)


@dataclass
class Scene:
    """Names on the shared Redis, unique to one test, and the parent's own connections."""

    url: str
    tmp_path: Path
    prefix: str = field(default_factory=lambda: f"test-crash-{uuid.uuid4().hex[:12]}")
    subscription: str = "billing"
    children: list[Child] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stream = f"{self.prefix}:orders"
        self.effects = f"{self.prefix}:effects"
        self.dedup_prefix = f"{self.prefix}:dedup"
        self.adapter = RedisStreamsAdapter(self.url, consumer="survivor", key_prefix=self.prefix)

    @property
    def raw(self) -> aioredis.Redis:
        return self.adapter.client

    def spawn(self, mode: str, consumer: str) -> Child:
        script = self.tmp_path / "consumer.py"
        script.write_text(CHILD)
        settings = {
            "url": self.url, "mode": mode, "consumer": consumer, "prefix": self.prefix,
            "dedup_prefix": self.dedup_prefix, "subscription": self.subscription,
            "effects": self.effects, "min_extension": LEASE.min_extension,
            "max_extension": LEASE.max_extension,
        }
        child = Child(script, json.dumps(settings))
        self.children.append(child)
        return child

    def dedup_key(self, message_id: str) -> DedupKey:
        return DedupKey(self.adapter.dedup_namespace(self.subscription), message_id)

    async def effect_list(self) -> list[str]:
        return [item.decode() for item in await self.raw.lrange(self.effects, 0, -1)]

    async def pending(self) -> list[dict[str, Any]]:
        return list(await self.raw.xpending_range(self.stream, self.subscription, "-", "+", 100))

    async def pending_count(self) -> int:
        return int((await self.raw.xpending(self.stream, self.subscription))["pending"])

    async def cleanup(self) -> None:
        for child in self.children:
            child.kill()
        keys = [key async for key in self.raw.scan_iter(match=f"{self.prefix}*", count=1000)]
        if keys:
            await self.raw.delete(*keys)
        await self.adapter.close()


@pytest.fixture
async def scene(tmp_path: Path) -> AsyncIterator[Scene]:
    scene = Scene(redis_url(), tmp_path)
    await scene.adapter.ensure_subscription(
        scene.stream, scene.subscription, ack_deadline=ACK_DEADLINE
    )
    try:
        yield scene
    finally:
        await scene.cleanup()


@dataclass
class Survivor:
    """The second consumer, run in the test's event loop; records what it saw."""

    sub: Subscriber
    store: RedisDedupStore
    calls: list[tuple[str, int]] = field(default_factory=list)
    outcomes: list[tuple[str, int, Outcome]] = field(default_factory=list)


@asynccontextmanager
async def survivor(scene: Scene) -> AsyncIterator[Survivor]:
    """A second consumer of the subscription, serving until the block ends (then stopped)."""
    store = RedisDedupStore(scene.url, prefix=scene.dedup_prefix, owner="survivor")
    outcomes: list[tuple[str, int, Outcome]] = []
    sub = Subscriber(
        scene.adapter, dedup=store, lease=LEASE,
        on_outcome=lambda m, o: outcomes.append((m.id, m.delivery_attempt, o)),
    )
    seen = Survivor(sub, store, outcomes=outcomes)

    @sub.handler(scene.subscription)
    async def handle(message: Message) -> dict[str, str]:
        seen.calls.append((message.id, message.delivery_attempt))
        await scene.raw.rpush(scene.effects, f"{message.id} survivor")
        return {"effect": message.id}

    task = asyncio.create_task(sub.serve(), name="survivor")
    try:
        await poll_until(lambda: sub.running or task.done(), "the survivor to start")
        yield seen
    finally:
        await sub.shutdown(timeout=5)
        await asyncio.wait_for(task, timeout=WITHIN)  # re-raises what serve() failed with
        await store.close()


def killed(child: Child) -> None:
    status = child.kill()
    assert status == -signal.SIGKILL, f"child ended with {status}, not by SIGKILL:\n{child.output}"


async def test_a_consumer_killed_mid_handler_leaves_its_message_to_a_peer(scene: Scene) -> None:
    child = scene.spawn("mid-handler", consumer="doomed")
    message_id = await scene.adapter.publish(scene.stream, b"order-1")

    started = await child.line("STARTED")
    assert started == f"STARTED {message_id} 1", child.output
    key = scene.dedup_key(message_id)
    redis_key = RedisDedupStore(prefix=scene.dedup_prefix).redis_key(key)
    held = await scene.raw.get(redis_key)
    assert held is not None and held.startswith(b"p:doomed."), "the child holds the claim"
    killed(child)

    assert await scene.effect_list() == [], "the killed handler had no effect"
    [entry] = await scene.pending()
    assert (entry["message_id"].decode(), entry["consumer"].decode()) == (message_id, "doomed")
    assert entry["times_delivered"] == 1
    # The dead consumer's claim lapses with its last lease (no later than its stream entry falls
    # due, since claims are renewed just after entries are extended). Waiting for that makes the
    # survivor's first reclaim the one that runs the handler (attempt 2) instead of deferring it.
    await poll_until(
        lambda: _is_none(scene.raw.get(redis_key)), "the dead consumer's claim to lapse",
        within=WITHIN,
    )

    async with survivor(scene) as peer:
        await poll_until(lambda: len(peer.outcomes) >= 1, "the survivor to settle it", WITHIN)
        assert peer.sub.running
    assert peer.calls == [(message_id, 2)], "handled once more, as delivery attempt 2"
    assert peer.outcomes == [(message_id, 2, Outcome.ACKED)]
    assert await scene.effect_list() == [f"{message_id} survivor"], "exactly one effect"
    assert scene.adapter.stats["reclaimed"] == 1
    assert await scene.pending_count() == 0, "nothing stays pending"
    assert (await scene.raw.get(redis_key) or b"").startswith(b"c:"), "recorded as completed"


async def test_a_consumer_killed_between_completion_and_ack_is_deduplicated(
    scene: Scene,
) -> None:
    child = scene.spawn("after-effect", consumer="doomed")
    message_id = await scene.adapter.publish(scene.stream, b"order-1")

    acking = await child.line("ACKING")
    assert acking == f"ACKING {message_id}", child.output
    assert f"HANDLED {message_id} 1" in child.lines, child.output
    killed(child)

    assert await scene.effect_list() == [f"{message_id} doomed"], "the child's effect happened"
    [entry] = await scene.pending()
    assert (entry["message_id"].decode(), entry["consumer"].decode()) == (message_id, "doomed")
    key = scene.dedup_key(message_id)
    redis_key = RedisDedupStore(prefix=scene.dedup_prefix).redis_key(key)
    raw_record = await scene.raw.get(redis_key)
    assert raw_record is not None and raw_record.startswith(b"c:"), raw_record
    assert json.loads(raw_record[2:]) == {"effect": message_id}, "the result is stored as JSON"
    checker = RedisDedupStore(scene.url, prefix=scene.dedup_prefix, owner="checker")
    try:
        found = await checker.claim(key, 30)
        assert isinstance(found, Completed) and found.result == {"effect": message_id}
    finally:
        await checker.close()

    async with survivor(scene) as peer:
        await poll_until(lambda: len(peer.outcomes) >= 1, "the survivor to settle it", WITHIN)
        assert peer.sub.running
    assert peer.outcomes == [(message_id, 2, Outcome.DUPLICATE)]
    assert peer.calls == [], "the handler is not called again"
    assert await scene.effect_list() == [f"{message_id} doomed"], "still exactly one effect"
    assert scene.adapter.stats["reclaimed"] == 1
    assert peer.sub.stats.store_errors == 0
    assert await scene.pending_count() == 0, "nothing stays pending"


async def _is_none(value: Any) -> bool:
    return (await value) is None
