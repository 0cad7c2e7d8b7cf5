"""The Kafka benchmark's pieces: its topics, the group commits it waits for, the handlers, the
consumers it times, and where each run's CPU time went, thread by thread.

A :class:`Topic` is filled once (:func:`fill`) and read by every run as a new consumer group;
:class:`Commits` reads a group's committed offsets with a consumer that never joins it.
:class:`Tally` counts what a handler saw and takes the clocks at the first record, so a run is
timed from its first record (the group join before it is no throughput). :func:`thread_cpu`
splits the process's CPU time between the event loop's thread, the KafkaAdapter's poll thread
and librdkafka's own threads (``/proc/self/task/*/schedstat``, nanoseconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiokafka
import confluent_kafka
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from faststream.kafka import KafkaBroker as FastStreamKafka

from benchmarks import _brokers
from benchmarks._brokers import FastStreamConsumer, LoopConsumer, SubscriberConsumer
from reliable_sub import Message, Subscriber
from reliable_sub.adapters.kafka import KafkaAdapter
from reliable_sub.dedup import RedisDedupStore
from reliable_sub.subscriber import RECEIVE_BATCH

PARTITIONS = 4
KEYS = 1_000  # record keys str(n % KEYS): each partition holds about KEYS / PARTITIONS of them
PAYLOAD = b"x" * 64
PRODUCER_LINGER_MS = 20  # filling the topics (untimed)
BATCH = RECEIVE_BATCH  # records per consume / getmany / FastStream batch: the Subscriber's
POLL_TIMEOUT = 1.0  # s a raw loop's consume may wait; a run never waits on it (all is there)
# librdkafka's 1 s default idles a busy consumer between fetches; the adapter sets 10 ms, and so
# does (a), so that both run the client configured alike.
FETCH_QUEUE_BACKOFF_MS = 10
HANDLER_SECONDS = 0.005  # (e)'s handler: await asyncio.sleep(HANDLER_SECONDS)
ACK_DEADLINE = 30.0
SHUTDOWN_TIMEOUT = 0.5  # the adapter's receive is cancel-safe: a stop has nothing to wait for
# The KafkaAdapter names its poll threads so (reliable_sub/adapters/_kafka_consumer.py).
POLL_THREAD_PREFIX = "reliable-sub-kafka-"
LIBRDKAFKA_THREAD_PREFIX = "rdk:"  # librdkafka names its threads rdk:main, rdk:broker1 ...

# -- topics and commits --------------------------------------------------------------------------


@dataclass(frozen=True)
class Topic:
    """A filled topic: its name and each partition's end offset."""

    name: str
    ends: dict[int, int]

    @property
    def records(self) -> int:
        return sum(self.ends.values())


def fill(bootstrap: str, name: str, records: int) -> Topic:
    """Create ``name`` with PARTITIONS partitions and produce ``records`` keyed records."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, PARTITIONS, 1)])[name].result(timeout=30)
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap,
                                         "linger.ms": PRODUCER_LINGER_MS})
    for number in range(records):
        while True:
            try:
                producer.produce(name, PAYLOAD, key=str(number % KEYS).encode())
                break
            except BufferError:  # the local queue is full: let it drain
                producer.poll(0.05)
    if producer.flush(60):
        raise RuntimeError(f"{name}: records left unsent")
    probe = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": "probe"})
    try:
        ends = {partition: probe.get_watermark_offsets(TopicPartition(name, partition),
                                                       timeout=10)[1]
                for partition in range(PARTITIONS)}
    finally:
        probe.close()
    topic = Topic(name, ends)
    if topic.records != records:
        raise RuntimeError(f"{name} holds {topic.records} records, not {records}")
    return topic


class Commits:
    """A group's committed offsets, read by a consumer of that group that never joins it."""

    def __init__(self, bootstrap: str, group: str, topic: Topic) -> None:
        self.topic = topic
        self.client = confluent_kafka.Consumer({"bootstrap.servers": bootstrap,
                                                "group.id": group, "enable.auto.commit": False})

    def read(self) -> dict[int, int]:
        found = self.client.committed([TopicPartition(self.topic.name, partition)
                                       for partition in self.topic.ends], timeout=10)
        return {entry.partition: entry.offset for entry in found}

    async def at_end(self) -> bool:
        """Whether every partition's commit is at its end (polled while a run settles)."""
        return await asyncio.to_thread(self.read) == self.topic.ends

    def check(self, variant: str) -> None:
        found = self.read()
        if found != self.topic.ends:
            raise RuntimeError(f"{variant}: committed {found}, expected the ends "
                               f"{self.topic.ends}")

    def close(self) -> None:
        self.client.close()


# -- CPU time by thread --------------------------------------------------------------------------


def thread_cpu() -> dict[int, float]:
    """Seconds each live thread of this process has run on a CPU, by native thread id."""
    found = {}
    for task in os.scandir("/proc/self/task"):
        with contextlib.suppress(OSError, ValueError), open(f"{task.path}/schedstat") as stat:
            found[int(task.name)] = int(stat.read().split()[0]) / 1e9
    return found


def _comm(thread: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/self/task/{thread}/comm") as comm:
        return comm.read().strip()
    return ""


@dataclass(frozen=True)
class ThreadCpu:
    """A run's CPU seconds on the event loop's thread, the adapter's poll threads and
    librdkafka's threads (of the consumer under test: the harness's own started before)."""

    loop: float = 0.0
    poll: float = 0.0
    librdkafka: float = 0.0


def cpu_between(before: dict[int, float], after: dict[int, float],
                harness: set[int]) -> ThreadCpu:
    """:class:`ThreadCpu` from two :func:`thread_cpu` readings; threads in ``harness`` (alive
    before the consumer under test was made) left out, but for the event loop's."""
    loop_thread = threading.main_thread().native_id or 0
    polls = {thread.native_id for thread in threading.enumerate()
             if thread.name.startswith(POLL_THREAD_PREFIX)}
    spent = {thread: seconds - before.get(thread, 0.0) for thread, seconds in after.items()}
    return ThreadCpu(
        loop=spent.get(loop_thread, 0.0),
        poll=sum(spent[thread] for thread in polls if thread in spent),
        librdkafka=sum(seconds for thread, seconds in spent.items()
                       if thread not in harness and thread != loop_thread
                       and _comm(thread).startswith(LIBRDKAFKA_THREAD_PREFIX)))


# -- handlers ------------------------------------------------------------------------------------


class Tally(_brokers.Tally):
    """Records handled in the current run, and the clocks at the first one."""

    __slots__ = ("first_cpu", "first_threads", "first_wall")

    def __init__(self) -> None:
        super().__init__()
        self.first_wall = self.first_cpu = 0.0
        self.first_threads: dict[int, float] = {}

    def mark(self) -> None:
        self.first_threads = thread_cpu()
        self.first_wall, self.first_cpu = time.perf_counter(), time.process_time()


def no_op(tally: Tally) -> Callable[[Any], Awaitable[None]]:
    """The handler of (a)-(d): counts one record (a body, a Message, a client's record)."""

    async def handle(_: Any) -> None:
        if not tally.handled:
            tally.mark()
        tally.handled += 1

    return handle


def no_op_batch(tally: Tally) -> Callable[[list[Any]], Awaitable[None]]:
    """(b2)'s handler: counts a batch of bodies."""

    async def handle(bodies: list[Any]) -> None:
        if not tally.handled:
            tally.mark()
        tally.handled += len(bodies)

    return handle


def io_bound(tally: Tally) -> Callable[[Any], Awaitable[None]]:
    """(e)'s handler: waits HANDLER_SECONDS (a call to another service), then counts."""

    async def handle(_: Any) -> None:
        if not tally.handled:
            tally.mark()
        await asyncio.sleep(HANDLER_SECONDS)
        tally.handled += 1

    return handle


# -- consumers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """What one run's consumer gets: the broker, the topic, its own group, its tally."""

    bootstrap: str
    topic: Topic
    group: str
    tally: Tally = field(default_factory=Tally)


class ConfluentLoop(LoopConsumer):
    """(a): ``consume(BATCH)`` on the event loop's thread → ``await handler(record)`` for each
    → ``commit(asynchronous=True)`` (the positions consumed), until every record was seen."""

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup.tally, setup.topic.records)
        self.topic, self.handle = setup.topic.name, no_op(setup.tally)
        self.client = confluent_kafka.Consumer({
            "bootstrap.servers": setup.bootstrap, "group.id": setup.group,
            "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS})

    async def prepare(self) -> None:
        self.client.subscribe([self.topic])  # joins at the first consume

    async def loop(self) -> None:
        seen = 0
        while seen < self.total:
            batch = self.client.consume(BATCH, POLL_TIMEOUT)
            for record in batch:
                if record.error() is not None:
                    raise confluent_kafka.KafkaException(record.error())
                await self.handle(record)
            if batch:
                seen += len(batch)
                self.client.commit(asynchronous=True)

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)


class AiokafkaLoop(LoopConsumer):
    """(a2): ``getmany(max_records=BATCH)`` → the handler for each → ``await commit()``."""

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup.tally, setup.topic.records)
        self.handle = no_op(setup.tally)
        self.client = aiokafka.AIOKafkaConsumer(
            setup.topic.name, bootstrap_servers=setup.bootstrap, group_id=setup.group,
            enable_auto_commit=False, auto_offset_reset="earliest")

    async def prepare(self) -> None:
        await self.client.start()

    async def loop(self) -> None:
        seen = 0
        while seen < self.total:
            batches = await self.client.getmany(timeout_ms=int(POLL_TIMEOUT * 1000),
                                                max_records=BATCH)
            for records in batches.values():
                for record in records:
                    await self.handle(record)
                seen += len(records)
            if batches:
                await self.client.commit()

    async def close(self) -> None:
        await self.client.stop()


class FastStreamKafkaConsumer(FastStreamConsumer):
    """(b1)/(b2), and (e)'s partition-sequential baseline: ``faststream.kafka.KafkaBroker``
    (aiokafka) with one subscriber in the run's group."""

    def __init__(self, setup: Setup, handler: Callable[..., Awaitable[None]],
                 **options: Any) -> None:
        super().__init__(setup.tally, setup.topic.records)
        self.broker = FastStreamKafka(setup.bootstrap, logger=None)  # no per-message logging
        self.broker.subscriber(setup.topic.name, group_id=setup.group,
                               auto_offset_reset="earliest", **options)(handler)

    async def prepare(self) -> None:
        await self.broker.connect()


class KafkaSubscriber(SubscriberConsumer):
    """(c)/(d)/(e): our Subscriber on the KafkaAdapter, default policies (and the adapter's
    defaults, but for ``buffer`` and ``consumer_config`` if given); the subscription made
    (untimed) by ``ensure_subscription(start="earliest")``."""

    def __init__(self, setup: Setup, prefix: str, *, redis_url: str | None = None,
                 ordering: str = "key", handler: Callable[[Message], Awaitable[None]] | None = None,
                 max_concurrency: int | None = None, buffer: int | None = None,
                 consumer_config: dict[str, Any] | None = None) -> None:
        self.setup, self.ordering = setup, ordering
        options: dict[str, Any] = {} if buffer is None else {"buffer": buffer}
        self.adapter = KafkaAdapter(setup.bootstrap, prefix=prefix,
                                    consumer_config=consumer_config, **options)
        self.dedup_prefix = f"{prefix}-dedup-{setup.group}"
        self.store = (None if redis_url is None
                      else RedisDedupStore(redis_url, prefix=self.dedup_prefix))
        super().__init__(setup.tally, setup.topic.records,
                         Subscriber(self.adapter, dedup=self.store), SHUTDOWN_TIMEOUT)
        self.subscriber.handler(setup.group, max_concurrency=max_concurrency)(
            handler or no_op(setup.tally))

    async def prepare(self) -> None:
        await self.adapter.ensure_subscription(self.setup.topic.name, self.setup.group,
                                               ack_deadline=ACK_DEADLINE, start="earliest",
                                               ordering=self.ordering)
        if self.store is not None:
            await self.store.client.ping()

    async def release(self) -> None:
        await self.adapter.close()
        if self.store is not None:
            await self.store.close()
