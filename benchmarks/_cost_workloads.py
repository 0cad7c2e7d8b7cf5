"""The workloads of the cost check, and the brokers they run on (``benchmarks._cost_run`` runs
them; none of this runs while anything is counted)."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any

from benchmarks._cost_clock import FrozenClock
from reliable_sub import MemoryDedupStore
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.ports import Outgoing

TOPIC = "cost-topic"
SUBSCRIPTION = "cost-sub"
PAYLOAD = b"x" * 64
REDIS_URL = os.environ.get("RELIABLE_SUB_REDIS_URL", "redis://127.0.0.1:6379/0")
# Messages per pipelined publish while a Redis stream is filled.
PUBLISH_CHUNK = 1_000
# The Redis subscription's ack deadline: nothing in these runs comes near it.
ACK_DEADLINE = 30.0


@dataclass(frozen=True)
class Workload:
    """What one workload runs: its broker, with or without dedup, which handler, how many."""

    broker: str  # "memory" or "redis"
    dedup: bool
    messages: int
    description: str
    sync_handler: bool = False
    batch_handler: bool = False
    traced: bool = False  # the OpenTelemetry SDK on: a span and metrics per delivery
    # The leak measure needs the structures of bounded size (the lease histogram keeps 2,000
    # samples) full after the first pass: messages well above their bound.
    leak_pass: bool = True


WORKLOADS = {
    "memory": Workload(
        "memory", dedup=False, messages=5_000,
        description="MemoryAdapter, an `async def` no-op handler, no dedup",
    ),
    "memory+dedup": Workload(
        "memory", dedup=True, messages=5_000,
        description="the same with a MemoryDedupStore (its completed records stay, kept for "
        "`dedup_ttl`: they are its blocks left behind)",
    ),
    # Each message is a hand-off to the thread and back, ~0.5 ms: fewer of them, too few for
    # the leak measure (the async workloads' covers all but the hand-off).
    "memory, sync handler": Workload(
        "memory", dedup=False, messages=1_000, sync_handler=True, leak_pass=False,
        description="a `def` no-op handler on one worker thread (`sync_workers=1`) whose calls "
        "return only while the event loop is idle, so every message is received, run and "
        "acked on its own: the sync path with no batching at all",
    ),
    "memory, batch handler": Workload(
        "memory", dedup=False, messages=5_000, batch_handler=True,
        description="an `async def` no-op batch handler (`batch=True`: up to 100 messages a "
        "call, what one receive brought), no dedup",
    ),
    "memory, traced": Workload(
        "memory", dedup=False, messages=5_000, traced=True,
        description="the `memory` workload with the OpenTelemetry SDK: a span per delivery "
        "(exported in process by a SimpleSpanProcessor to an exporter that drops them) and "
        "metrics (read by an InMemoryMetricReader, never during a pass); counts the SDK's "
        "calls too, so an SDK upgrade may move them",
    ),
    # Fewer: a Redis count pass takes about 0.1 s.
    "redis": Workload(
        "redis", dedup=False, messages=1_000,
        description="RedisStreamsAdapter on the local Redis, no dedup",
    ),
    "redis+dedup": Workload(
        "redis", dedup=True, messages=1_000,
        description="the same with a RedisDedupStore on the adapter's client (completions "
        "written in the ack script)",
    ),
}


# -- brokers -------------------------------------------------------------------------------------


class MemoryWorld:
    """A fresh MemoryAdapter subscription (and MemoryDedupStore) on the pass's clock."""

    def __init__(self, workload: Workload, clock: FrozenClock) -> None:
        self.adapter: Any = MemoryAdapter(clock=clock)
        self.store: Any = MemoryDedupStore(clock=clock) if workload.dedup else None
        self.subscription = SUBSCRIPTION
        self.redis: Any = None

    async def prepare(self, messages: int) -> None:
        self.adapter.ensure_subscription_sync(TOPIC, SUBSCRIPTION)
        for _ in range(messages):
            self.adapter.publish_sync(TOPIC, PAYLOAD)

    async def clean_up(self) -> None:
        """Nothing outlives the process."""


class RedisWorld:
    """A fresh stream and group on the local Redis, under key names unique to this pass; the
    dedup store shares the adapter's client (the fast path: completions in the ack script)."""

    def __init__(self, workload: Workload, clock: FrozenClock) -> None:
        from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
        from reliable_sub.dedup import RedisDedupStore

        self.prefix = f"cost-check-{uuid.uuid4().hex}"
        self.adapter: Any = RedisStreamsAdapter(
            REDIS_URL, consumer="cost", key_prefix=f"{self.prefix}:adapter"
        )
        self.redis = self.adapter.client
        self.store: Any = (
            RedisDedupStore(self.redis, prefix=f"{self.prefix}:dedup") if workload.dedup else None
        )
        self.stream = f"{self.prefix}:stream"
        self.subscription = f"{self.prefix}:group"

    async def prepare(self, messages: int) -> None:
        await self.adapter.ensure_subscription(
            self.stream, self.subscription, ack_deadline=ACK_DEADLINE, start="0"
        )
        for start in range(0, messages, PUBLISH_CHUNK):
            count = min(PUBLISH_CHUNK, messages - start)
            results = await self.adapter.publish_many([Outgoing(self.stream, PAYLOAD)] * count)
            if any(isinstance(result, Exception) for result in results):
                raise RuntimeError(f"publishing to {self.stream} failed: {results[:3]}")

    async def clean_up(self) -> None:
        keys = [key async for key in self.redis.scan_iter(match=f"{self.prefix}:*", count=1000)]
        if keys:
            await self.redis.unlink(*keys)


def make_world(workload: Workload, clock: FrozenClock) -> MemoryWorld | RedisWorld:
    return MemoryWorld(workload, clock) if workload.broker == "memory" else RedisWorld(
        workload, clock
    )
