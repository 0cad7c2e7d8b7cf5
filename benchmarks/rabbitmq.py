"""Throughput on RabbitMQ: the Subscriber against a raw aio-pika consumer and FastStream.

    python -m benchmarks.rabbitmq            # print the table
    python -m benchmarks.rabbitmq --write    # ... and write the README section
    python -m benchmarks.rabbitmq --quick    # a smoke test (small backlog, two repetitions)

Every run gets a fresh quorum queue (behind a fresh fanout exchange, as the adapter lays a
subscription out) published with confirms, timed by ``benchmarks._brokers.drain``; afterwards
the queue must be empty. The variants and the method are described in
``templates/rabbitmq.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aio_pika
import redis.asyncio as aioredis
from faststream.rabbit import Channel, RabbitBroker, RabbitQueue

from benchmarks._brokers import (
    Consumer,
    FastStreamConsumer,
    SubscriberConsumer,
    Tally,
    count_in,
    delete_keys,
    drain,
    faststream_handler,
)
from benchmarks._common import interleaved, paired_goal
from benchmarks._harness import (
    CpuThroughput,
    Run,
    add_runs,
    apply_quick,
    broker_table,
    command_line,
    measured_on,
    publish,
    render,
    versions,
)
from reliable_sub import LeasePolicy, Subscriber
from reliable_sub.adapters.rabbitmq import RabbitMQAdapter
from reliable_sub.dedup import RedisDedupStore
from reliable_sub.outcome import Outcome

DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_MESSAGES = 20_000
DEFAULT_REPETITIONS = 5
WARMUP_MESSAGES = 2_000
QUICK = (2_000, 2, 200)  # --quick: messages, repetitions, warm-up messages
PAYLOAD = b"x" * 64
PREFETCH = 100  # (a) and (b); the Subscriber's is its flow-control window
PUBLISH_CHUNK = 1_000
ACK_DEADLINE = 30.0
SHUTDOWN_TIMEOUT = 0.5
MAX_LEASE = 1200.0
# Goals from the issue (#29).
NO_DEDUP_VS_RAW, NO_DEDUP_VS_FASTSTREAM, DEDUP_VS_RAW = 0.6, 2.0, 0.4

RAW = "(a) raw aio-pika: prefetch 100, one multiple-ack per 100"
FASTSTREAM = "(b) FastStream RabbitBroker subscriber, one message per call"
SUB = "(c) Subscriber(RabbitMQAdapter), no dedup"
SUB_DEDUP = "(d) Subscriber + RedisDedupStore"
VARIANTS = (RAW, FASTSTREAM, SUB, SUB_DEDUP)
SECTION_NAME = "rabbitmq"
RUN_ID = uuid.uuid4().hex[:8]
_runs = iter(range(1, 1_000_000))


@dataclass(frozen=True)
class Names:
    exchange: str
    queue: str
    dedup_prefix: str


def next_names() -> Names:
    n = next(_runs)
    return Names(f"bench-{RUN_ID}-x{n}", f"bench-{RUN_ID}-q{n}", f"bench-{RUN_ID}-d{n}")


class RabbitConsumer(Consumer):
    """A consumer of one run; the run is drained when :meth:`done`."""

    def __init__(self, bench: Bench, names: Names, tally: Tally, total: int) -> None:
        super().__init__(tally, total)
        self.bench, self.names = bench, names

    def done(self) -> bool:
        """Every message handled and its ack sent."""
        return self.tally.handled >= self.total


class RawConsumer(RabbitConsumer):
    """(a): an async callback that counts, acking every 100th message with ``multiple``."""

    connection: Any = None
    acked = 0

    async def prepare(self) -> None:
        self.connection = await aio_pika.connect(self.bench.amqp)
        self.channel = await self.connection.channel()
        await self.channel.set_qos(prefetch_count=PREFETCH)
        self.queue = await self.channel.get_queue(self.names.queue, ensure=True)

    async def handle(self, message: Any) -> None:
        self.tally.handled += 1
        if self.tally.handled % PREFETCH == 0 or self.tally.handled == self.total:
            await message.ack(multiple=True)
            self.acked = self.tally.handled

    async def start(self) -> None:
        await self.queue.consume(self.handle)

    def done(self) -> bool:
        return self.acked >= self.total

    async def close(self) -> None:
        if self.connection is not None:
            await self.connection.close()


class RabbitFastStream(RabbitConsumer, FastStreamConsumer):
    """(b): FastStream's subscriber, one message per call, acking after each."""

    def __init__(self, bench: Bench, names: Names, tally: Tally, total: int) -> None:
        super().__init__(bench, names, tally, total)
        self.broker = RabbitBroker(bench.amqp, logger=None)
        # the benchmark made the queue: FastStream consumes it without declaring it
        queue = RabbitQueue(names.queue, declare=False)
        self.broker.subscriber(queue, channel=Channel(prefetch_count=PREFETCH))(
            faststream_handler(tally, batch=False))

    async def prepare(self) -> None:
        await self.broker.connect()


class RabbitSubscriber(SubscriberConsumer):
    """(c)/(d): our Subscriber on the RabbitMQAdapter, without or with dedup."""

    def __init__(self, bench: Bench, names: Names, tally: Tally, total: int, *,
                 dedup: bool) -> None:
        self.bench, self.names = bench, names
        self.adapter = RabbitMQAdapter(bench.amqp, prefix=f"bench-{RUN_ID}")
        self.store = (RedisDedupStore(bench.redis_url, prefix=names.dedup_prefix)
                      if dedup else None)
        # leases under the broker's consumer_timeout (30 min), as the adapter's guide says
        super().__init__(tally, total, Subscriber(self.adapter, dedup=self.store,
                                                  lease=LeasePolicy(max_lease_duration=MAX_LEASE)),
                         SHUTDOWN_TIMEOUT)
        count_in(self.subscriber, names.queue, tally, batch=False)

    async def prepare(self) -> None:
        # the queue exists: this records the settings the adapter reads (topic, deadline)
        await self.adapter.ensure_subscription(self.names.exchange, self.names.queue,
                                               ack_deadline=ACK_DEADLINE)
        if self.store is not None:
            await self.store.client.ping()

    def done(self) -> bool:
        return self.subscriber.stats[Outcome.ACKED] >= self.total

    async def release(self) -> None:
        await self.adapter.close()
        if self.store is not None:
            await self.store.close()
            await delete_keys(self.bench.redis, f"{self.names.dedup_prefix}:*")


@dataclass
class Bench:
    amqp: str
    redis_url: str
    redis: aioredis.Redis
    control: Any  # an aio_pika connection for setting up and checking

    def consumer(self, variant: str, names: Names, tally: Tally,
                 total: int) -> RabbitConsumer | RabbitSubscriber:
        if variant == RAW:
            return RawConsumer(self, names, tally, total)
        if variant == FASTSTREAM:
            return RabbitFastStream(self, names, tally, total)
        return RabbitSubscriber(self, names, tally, total, dedup=variant == SUB_DEDUP)

    async def publish_backlog(self, names: Names, total: int) -> None:
        channel = await self.control.channel(publisher_confirms=True)
        exchange = await channel.declare_exchange(names.exchange, aio_pika.ExchangeType.FANOUT,
                                                  durable=True)
        queue = await channel.declare_queue(names.queue, durable=True,
                                            arguments={"x-queue-type": "quorum"})
        await queue.bind(exchange)
        for start in range(0, total, PUBLISH_CHUNK):
            await asyncio.gather(*(
                exchange.publish(aio_pika.Message(PAYLOAD, message_id=uuid.uuid4().hex,
                                                  delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                                 routing_key="")
                for _ in range(min(PUBLISH_CHUNK, total - start))))
        await channel.close()

    async def ready(self, names: Names) -> int:
        channel = await self.control.channel()
        queue = await channel.declare_queue(names.queue, passive=True)
        count = queue.declaration_result.message_count
        await channel.close()
        return int(count or 0)

    async def remove(self, names: Names) -> None:
        channel = await self.control.channel()
        for name in (names.queue, f"bench-{RUN_ID}.settings.{names.queue}"):
            await channel.queue_delete(name)
        await channel.exchange_delete(names.exchange)
        await channel.close()

    async def run_once(self, variant: str, total: int) -> Run:
        names, tally = next_names(), Tally()
        await self.publish_backlog(names, total)
        if await self.ready(names) != total:
            raise RuntimeError(f"queue {names.queue} does not hold {total} messages")
        consumer = self.consumer(variant, names, tally, total)

        async def settled() -> bool:
            return consumer.done()

        try:
            await consumer.prepare()
            run = await drain(consumer, settled)
            await consumer.stop()
            consumer.check()
        finally:
            await consumer.close()  # an unacked message would go back to the queue
        try:
            left = await self.ready(names)
            if left:
                raise RuntimeError(f"{variant}: {left} messages back in the queue")
        finally:
            await self.remove(names)
        return run


async def measure(bench: Bench, messages: int, repetitions: int,
                  warmup: int) -> dict[str, CpuThroughput]:
    return await interleaved(bench.run_once, VARIANTS, lambda v: CpuThroughput(v, messages),
                             messages, repetitions, warmup)


def report(results: dict[str, CpuThroughput], command: str, messages: int, repetitions: int,
           broker_version: str, load: float) -> str:
    raw = results[RAW]
    return render(
        "rabbitmq", measured_on=measured_on(command), broker_version=broker_version,
        versions=versions("aio-pika", "aiormq", "faststream", "redis"), load=load,
        messages=messages, repetitions=repetitions, table=broker_table(results, RAW),
        goals=[paired_goal("(c) / (a)", results[SUB], raw, NO_DEDUP_VS_RAW),
               paired_goal("(c) / (b) FastStream", results[SUB], results[FASTSTREAM],
                           NO_DEDUP_VS_FASTSTREAM),
               paired_goal("(d) / (a)", results[SUB_DEDUP], raw, DEDUP_VS_RAW)])


async def everything(args: argparse.Namespace) -> str:
    control = await aio_pika.connect(args.amqp)
    redis = aioredis.Redis.from_url(args.redis)
    try:
        await redis.ping()
        bench = Bench(args.amqp, args.redis, redis, control)
        server = control.transport.connection.server_properties if hasattr(
            control, "transport") else {}
        broker_version = str((server or {}).get("version", "?"))
        if isinstance(broker_version, bytes):
            broker_version = broker_version.decode()
        load = os.getloadavg()[0]
        results = await measure(bench, args.messages, args.repetitions, args.warmup)
        return report(results, args.command, args.messages, args.repetitions, broker_version,
                      load)
    finally:
        with contextlib.suppress(Exception):
            await control.close()
        await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--amqp", default=DEFAULT_AMQP, help=f"default {DEFAULT_AMQP}")
    parser.add_argument("--redis", default=DEFAULT_REDIS, help=f"default {DEFAULT_REDIS}")
    add_runs(parser, DEFAULT_MESSAGES, DEFAULT_REPETITIONS, quick=QUICK)
    parser.add_argument("--write", action="store_true", help="write the README section")
    args = parser.parse_args(argv)
    apply_quick(args, WARMUP_MESSAGES, QUICK)
    args.command = command_line("rabbitmq", argv)
    started = time.perf_counter()
    publish(SECTION_NAME, asyncio.run(everything(args)), write=args.write, append=True,
            started=started)


if __name__ == "__main__":
    main()
