"""The crash window of one store layout: milliseconds from a handler's effect to the moment its
completion is durable in the dedup store.

One Subscriber on Redis Streams (the shared Redis) handles a steady load; its handler waits a
random 0-50 ms and then records its effect with ``HINCRBY`` on Redis, as the chaos scenarios'
consumers do, noting when it sent that write and when it returned. The call that makes a
completion durable is wrapped to note when it returned: the store's ``complete_many``, or, with
the store on the broker's Redis, the adapter's ``ack_with_completions`` (one script records and
acks). A kill between the effect and the record leaves an effect without a record: its
redelivery runs the handler again. The window is taken from the moment the effect's write was
sent (it lands in Redis before its reply comes back, so this is the upper bound); the part of it
after the handler's return is what the library adds. The window, times the messages a consumer
handles per second, is how many effects a kill repeats on average.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from benchmarks._crash_layouts import LAYOUTS, private_redis
from reliable_sub import FlowControl, Message, Subscriber
from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
from reliable_sub.dedup import RedisDedupStore, SqlDedupStore
from reliable_sub.ports import Claimed, Completion, DedupStore
from tests.chaos.fleet import publish_steadily

FLOW = 50  # messages in flight per consumer, as in the chaos scenarios
DRAIN_WITHIN = 60.0  # seconds after the load for every completion to be recorded


@dataclass
class Window:
    """One layout's window from the effect, in milliseconds, over ``count`` messages; and the
    mean of its part after the handler returned."""

    layout: str
    count: int
    rate: float  # messages per second the consumer handled
    p50: float
    p90: float
    p99: float
    max: float
    mean: float
    mean_after_return: float

    @classmethod
    def of(cls, layout: str, windows_ms: Sequence[float], rate: float,
           after_return_ms: Sequence[float] = ()) -> Window:
        ordered = sorted(windows_ms)
        cuts = statistics.quantiles(ordered, n=100, method="inclusive")
        return cls(layout, len(ordered), rate, cuts[49], cuts[89], cuts[98], ordered[-1],
                   statistics.fmean(ordered),
                   statistics.fmean(after_return_ms) if after_return_ms else math.nan)

    @property
    def effects_at_risk(self) -> float:
        """Effects without their record at any instant, on average (Little's law): what one
        kill of this consumer repeats."""
        return self.rate * self.mean / 1000


def _stamping(call: Callable[..., Any], recorded: dict[str, float],
              completions_at: int) -> Callable[..., Any]:
    """``call`` wrapped to note when each completion it made durable returned."""

    async def stamped(*args: Any) -> Any:
        outcome = await call(*args)
        done = time.perf_counter()
        completions: Sequence[Completion] = args[completions_at]
        lost: list[Claimed] = outcome[1] if isinstance(outcome, tuple) else outcome
        refused = {claim.key for claim in lost}
        for completion in completions:
            if completion.claim.key not in refused:
                recorded[completion.claim.key.key] = done
        return outcome

    return stamped


async def measure(layout_key: str, *, messages: int, rate: float, redis_url: str,
                  postgres_url: str, seed: int = 1) -> Window:
    """The window of ``layout_key`` (see ``_crash_layouts``) over ``messages`` published at
    ``rate`` per second."""
    layout = LAYOUTS[layout_key]
    if layout.store_apart:
        with private_redis() as server:
            return await _measure(layout_key, messages, rate, redis_url, server.url,
                                  postgres_url, seed)
    return await _measure(layout_key, messages, rate, redis_url, redis_url, postgres_url, seed)


async def _measure(layout_key: str, messages: int, rate: float, broker_url: str,
                   store_url: str, postgres_url: str, seed: int) -> Window:
    layout = LAYOUTS[layout_key]
    name = f"window-{uuid.uuid4().hex[:10]}"
    topic, subscription = f"{name}-orders", f"{name}-shipping"
    adapter = RedisStreamsAdapter(broker_url, consumer="window", key_prefix=name)
    store: DedupStore
    if layout.dedup == "sql":
        store = SqlDedupStore(postgres_url, table=f"{name.replace('-', '_')}_processed")
        await store.create_schema()
    else:
        store = RedisDedupStore(store_url, prefix=f"{name}:dedup")
    sent: dict[str, float] = {}
    returned: dict[str, float] = {}
    effects = aioredis.Redis.from_url(broker_url)
    recorded: dict[str, float] = {}
    if adapter.shares_store(store):
        adapter.ack_with_completions = _stamping(  # type: ignore[method-assign]
            adapter.ack_with_completions, recorded, 2)
    else:
        store.complete_many = _stamping(  # type: ignore[method-assign]
            store.complete_many, recorded, 0)
    await adapter.ensure_subscription(topic, subscription, ack_deadline=30.0)
    rng = random.Random(seed)
    sub = Subscriber(adapter, dedup=store, flow_control=FlowControl(max_messages=FLOW),
                     receive_timeout=0.5)

    @sub.handler(subscription)
    async def effect(message: Message) -> None:
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        key = message.idempotency_key
        sent[key] = time.perf_counter()
        await effects.hincrby(f"{name}:effects", key, 1)
        returned[key] = time.perf_counter()

    try:
        async with sub:
            started = time.perf_counter()
            await publish_steadily(adapter, topic, messages, messages / rate)
            give_up = time.monotonic() + DRAIN_WITHIN
            while len(recorded) < messages:
                if time.monotonic() > give_up:
                    raise AssertionError(f"{layout.name}: {len(recorded)} of {messages} "
                                         f"completions recorded after {DRAIN_WITHIN}s")
                await asyncio.sleep(0.05)
            seconds = time.perf_counter() - started
    finally:
        await effects.aclose()
        await _tear_down(adapter, store, name, {broker_url, store_url})
    done = [key for key in returned if key in recorded]
    return Window.of(layout.name, [(recorded[key] - sent[key]) * 1000 for key in done],
                     messages / seconds, [(recorded[key] - returned[key]) * 1000 for key in done])


async def _tear_down(adapter: RedisStreamsAdapter, store: DedupStore, name: str,
                     urls: set[str]) -> None:
    await adapter.close()
    if isinstance(store, SqlDedupStore):
        async with store.engine.begin() as connection:
            await connection.run_sync(store.table.drop)
    await store.close()
    for url in urls:
        client = aioredis.Redis.from_url(url)
        try:
            keys = [key async for key in client.scan_iter(f"{name}*")]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()
