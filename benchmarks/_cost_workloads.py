"""The workloads of the cost check, and the brokers they run on (``benchmarks._cost_run`` runs
them; none of this runs while anything is counted)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks._cost_clock import FrozenClock
from benchmarks._cost_counters import KafkaClientCalls
from reliable_sub import MemoryDedupStore
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.ports import Outgoing

TOPIC = "cost-topic"
SUBSCRIPTION = "cost-sub"
PAYLOAD = b"x" * 64
REDIS_URL = os.environ.get("RELIABLE_SUB_REDIS_URL", "redis://127.0.0.1:6379/0")
# Messages per pipelined publish while a Redis stream is filled.
PUBLISH_CHUNK = 1_000
# The Redis and Kafka subscriptions' ack deadline: nothing in these runs comes near it.
ACK_DEADLINE = 30.0
# The Kafka broker the Kafka workloads run on (tests/test_cost.py passes the test run's own;
# ``python -m benchmarks.cost`` starts one when it is not set).
KAFKA_BOOTSTRAP_ENV = "RELIABLE_SUB_COST_KAFKA_BOOTSTRAP"
# The Kafka topic: partitions, and record keys str(n % KAFKA_KEYS), as benchmarks/kafka.py's.
KAFKA_PARTITIONS = 4
KAFKA_KEYS = 1_000
# Seconds between the Kafka consumer's periodic commits while its state changes: its first
# goes before the pass (KafkaWorld.prepare), so that the pass makes none, and the consumer
# commits exactly twice in its life, whatever the poll thread's timing. The default (0.1 s)
# would commit once per 0.1 s of real time; and the first periodic commit, if it fell in the
# pass, was made or not as the poll thread got its turn: a drain of 250 ms under the profiler
# was seen to give it none. (Commits happen on the poll thread: what is counted on the event
# loop's does not depend on this.)
KAFKA_COMMIT_INTERVAL = 1e9
# Real seconds filling and prefetching a pass's topic may take before it is a hang.
KAFKA_PREPARE_TIMEOUT = 60.0
KAFKA_PREFETCH_POLL = 0.01


@dataclass(frozen=True)
class Workload:
    """What one workload runs: its broker, with or without dedup, which handler, how many."""

    broker: str  # "memory", "redis" or "kafka"
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
    "kafka": Workload(
        "kafka", dedup=False, messages=5_000, leak_pass=False,  # blocks: see _cost_run
        description=f"KafkaAdapter on a local Kafka node, a topic of {KAFKA_PARTITIONS} "
        f"partitions keyed over {KAFKA_KEYS:,} keys (`ordering=\"key\"`: a key's records one "
        "at a time), an `async def` no-op handler, no dedup; every record fetched into the "
        "adapter's buffer before the pass starts, so the event loop's work does not follow "
        "fetch timing",
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


class KafkaWorld:
    """A fresh topic (``KAFKA_PARTITIONS`` partitions, filled by a client of its own) and
    consumer group (``start="earliest"``) on the Kafka node at ``KAFKA_BOOTSTRAP_ENV``, under
    names unique to this pass; its consumer's client calls are counted from its creation to its
    close (:class:`KafkaClientCalls`).

    :meth:`prepare` fills the topic with one record more than the pass's, makes the adapter's
    consumer of the subscription on this event loop (the one the Subscriber's receives then
    find) and waits until it has fetched every record: during the pass the poll thread fetches
    nothing, and the loop's work is the same whatever the fetches' timing. (Reading the
    adapter's private state, ``_consumers`` and the partition queues: it has no public way to
    prefetch. A workload whose backlog is more than the adapter's ``buffer`` per partition
    stops waiting once the partitions still short are paused, and its counts then follow fetch
    timing.) Then it receives and acks the extra record and waits for the periodic commit that
    follows: the next is ``KAFKA_COMMIT_INTERVAL`` away, so the pass's only commit is the
    consumer's last, as it closes."""

    def __init__(self, workload: Workload, clock: FrozenClock) -> None:
        from reliable_sub.adapters.kafka import KafkaAdapter

        bootstrap = os.environ.get(KAFKA_BOOTSTRAP_ENV)
        if not bootstrap:
            raise RuntimeError(f"the Kafka workloads need a Kafka node: set ${KAFKA_BOOTSTRAP_ENV} "
                               "to its host:port (python -m benchmarks.cost starts one)")
        self.bootstrap = bootstrap
        self.prefix = f"cost-check-{uuid.uuid4().hex}"
        self.client_calls = KafkaClientCalls()
        self.client_calls.install()
        self.adapter: Any = KafkaAdapter(bootstrap, prefix=self.prefix,
                                         commit_interval=KAFKA_COMMIT_INTERVAL)
        self.store: Any = None
        self.redis: Any = None
        self.topic = f"{self.prefix}-topic"
        self.subscription = f"{self.prefix}-group"

    async def prepare(self, messages: int) -> None:
        await self.adapter.ensure_subscription(
            self.topic, self.subscription, ack_deadline=ACK_DEADLINE,
            partitions=KAFKA_PARTITIONS, start="earliest")
        ends = await asyncio.to_thread(_fill_kafka, self.bootstrap, self.topic, messages + 1)
        settings = self.adapter._subscriptions[self.subscription]
        consumer = self.adapter._consumers.of(self.subscription, settings)
        await self._until(lambda: _prefetched(consumer, ends), consumer,
                          f"fetch {messages + 1} records")
        taken = await self.adapter.receive(self.subscription, 1, KAFKA_PREPARE_TIMEOUT)
        if len(taken) != 1 or await self.adapter.ack(taken):
            raise RuntimeError(f"{self.subscription}: the record received before the pass "
                               f"was not acked: {taken}")
        await self._until(lambda: self.client_calls.total("commit") > 0, consumer,
                          "commit the record received before the pass")

    async def _until(self, done: Callable[[], bool], consumer: Any, what: str) -> None:
        give_up = time.monotonic() + KAFKA_PREPARE_TIMEOUT
        while not done():
            if consumer.finished:
                raise RuntimeError(f"the Kafka consumer of {self.subscription} ended: "
                                   f"{consumer.failure}")
            if time.monotonic() > give_up:
                raise TimeoutError(f"the Kafka consumer of {self.subscription} did not {what} "
                                   f"within {KAFKA_PREPARE_TIMEOUT}s")
            await asyncio.sleep(KAFKA_PREFETCH_POLL)

    async def clean_up(self) -> None:
        """Close the adapter (its consumer commits and leaves the group: the last client calls
        counted), then delete the pass's topics and group."""
        try:
            await self.adapter.close()
        finally:
            self.client_calls.uninstall()
        await asyncio.to_thread(_delete_kafka, self.bootstrap,
                                [self.topic, f"{self.prefix}-subscriptions"], self.subscription)


def _prefetched(consumer: Any, ends: dict[int, int]) -> bool:
    """Whether the consumer holds every record of the topic (``ends``: each partition's end
    offset, its first being 0), or has paused every partition it holds fewer of."""
    with consumer._lock:
        if not consumer.joined or set(consumer._queues) != set(ends):
            return False
        short = {partition for partition, queue in consumer._queues.items()
                 if len(queue.fresh) < ends[partition]}
        return bool(short <= consumer._paused)


def _fill_kafka(bootstrap: str, topic: str, messages: int) -> dict[int, int]:
    """Produce ``messages`` records to ``topic``, keyed over ``KAFKA_KEYS`` keys (partitioned by
    murmur2, as the adapter's producer does); each partition's end offset then."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20,
                         "partitioner": "murmur2_random", "enable.idempotence": True})
    for number in range(messages):
        while True:
            try:
                producer.produce(topic, PAYLOAD, key=str(number % KAFKA_KEYS).encode())
                break
            except BufferError:  # the local queue is full: let it drain
                producer.poll(0.05)
    if producer.flush(KAFKA_PREPARE_TIMEOUT):
        raise RuntimeError(f"{topic}: records left unsent")
    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic}-probe"})
    try:
        ends = {partition: probe.get_watermark_offsets(TopicPartition(topic, partition),
                                                       timeout=KAFKA_PREPARE_TIMEOUT)[1]
                for partition in range(KAFKA_PARTITIONS)}
    finally:
        probe.close()
    if sum(ends.values()) != messages:
        raise RuntimeError(f"{topic} holds {sum(ends.values())} records, not {messages}")
    return ends


def _delete_kafka(bootstrap: str, topics: list[str], group: str) -> None:
    """Delete a pass's topics and group, as far as the node lets (what is left only takes room
    on a test node: a failure here is no failure of the measurement)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = [*admin.delete_topics(topics, operation_timeout=30).values(),
               *admin.delete_consumer_groups([group], request_timeout=30).values()]
    for future in futures:
        try:
            future.result(timeout=KAFKA_PREPARE_TIMEOUT)
        except KafkaException as error:
            print(f"cost check: cleaning up Kafka: {error}", file=sys.stderr)


World = MemoryWorld | RedisWorld | KafkaWorld


def make_world(workload: Workload, clock: FrozenClock) -> World:
    if workload.broker == "kafka":
        return KafkaWorld(workload, clock)
    return MemoryWorld(workload, clock) if workload.broker == "memory" else RedisWorld(
        workload, clock
    )
