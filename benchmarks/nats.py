"""Throughput on NATS JetStream: the Subscriber against a raw nats-py pull loop and FastStream.

    python -m benchmarks.nats            # print the table
    python -m benchmarks.nats --write    # ... and write the README section
    python -m benchmarks.nats --quick    # a smoke test (small backlog, two repetitions)

Starts its own ``nats-server -js`` (``tests/nats_processes.py``); every run gets a fresh stream
and durable consumer, timed by ``benchmarks._brokers.drain``, and the consumer connection's
traffic is read from the server's ``/connz``. ``--profile`` prints (c)'s hottest functions (not
written to the README). The variants and the method are described in ``templates/nats.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import nats.errors
import redis.asyncio as aioredis
from faststream.nats import JStream, NatsBroker, PullSub
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig

from benchmarks._brokers import (
    POLL_INTERVAL,
    Consumer,
    FastStreamConsumer,
    LoopConsumer,
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
from benchmarks.redis_streams import RoundTrips
from reliable_sub import Subscriber
from reliable_sub.adapters.nats_jetstream import NatsJetStreamAdapter
from reliable_sub.dedup import RedisDedupStore
from reliable_sub.subscriber import RECEIVE_BATCH

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_MESSAGES = 20_000
DEFAULT_REPETITIONS = 5
WARMUP_MESSAGES = 2_000
QUICK = (2_000, 2, 200)  # --quick: messages, repetitions, warm-up messages
PAYLOAD = b"x" * 64
PUBLISH_CHUNK = 1_000  # publish_async futures awaited together while publishing (not timed)
READ_COUNT = RECEIVE_BATCH  # messages per fetch for every variant: the Subscriber's batch
FETCH_TIMEOUT = 1.0  # (a)/(b)'s fetch timeout; a run never waits on it (all is published)
ACK_DEADLINE = 30.0
# The Subscriber's stop timeout. Nothing is in flight when it is asked to stop, but the adapter's
# receive is not cancel-safe, so a stop waits up to this long for the idle fetch in flight
# (receive_timeout, 5 s) before it cancels it: outside the clock, but 5 s per run otherwise.
SHUTDOWN_TIMEOUT = 0.5
# Goals from the issue.
NO_DEDUP_MIN_RATIO = 0.5  # (c) >= 0.5x (a), and ahead of FastStream
DEDUP_MIN_RATIO = 0.3  # (d) >= 0.3x (a)
BATCH_MIN_RATIO = 0.9  # (e) >= 0.9x (a): the batch handler goal of #26

RAW = "(a) raw nats-py: fetch(100), ack each"
FS_ONE = "(b1) FastStream PullSub(batch_size=100), one message per call"
FS_BATCH = "(b2) FastStream PullSub(batch_size=100, batch=True)"
SUB = "(c) Subscriber(NatsJetStreamAdapter), no dedup"
SUB_DEDUP = "(d) Subscriber + RedisDedupStore"
SUB_BATCH = "(e) Subscriber, batch=True handler, no dedup"
VARIANTS = (RAW, FS_ONE, FS_BATCH, SUB, SUB_DEDUP, SUB_BATCH)
SLUGS = {RAW: "raw", FS_ONE: "fs1", FS_BATCH: "fsb", SUB: "sub", SUB_DEDUP: "dedup",
         SUB_BATCH: "batch"}
SECTION_NAME = "nats"
RUN_ID = uuid.uuid4().hex[:8]
ADAPTER_PREFIX = f"bench-{RUN_ID}"  # the adapter's settings bucket: {prefix}-subscriptions


# -- the server --------------------------------------------------------------------------------


def monitor(port: int, endpoint: str) -> Any:
    """The JSON of the server's monitoring ``endpoint`` (``varz``, ``connz?...``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{endpoint}", timeout=5) as response:
        return json.load(response)


def connection_msgs(port: int, name: str) -> tuple[int, int]:
    """(messages in, messages out) of the open client connection called ``name``."""
    found = [c for c in monitor(port, "connz?limit=100000")["connections"] if c.get("name") == name]
    if len(found) != 1:
        raise RuntimeError(f"{len(found)} open connections named {name!r}, expected 1")
    return found[0]["in_msgs"], found[0]["out_msgs"]


# -- runs --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Names:
    """One run's stream (also its subject and the adapter's topic), consumer and connection."""

    base: str

    @property
    def stream(self) -> str:
        return self.base.replace("-", "_")

    @property
    def consumer(self) -> str:
        return f"{self.stream}_consumer"

    @property
    def dedup_prefix(self) -> str:
        return f"{self.base}-dedup"


_run_numbers: Counter[str] = Counter()


def next_names(variant: str) -> Names:
    slug = SLUGS[variant]
    _run_numbers[slug] += 1
    return Names(f"bench-nats-{RUN_ID}-{slug}-{_run_numbers[slug]}")


class NatsConsumer(Consumer):
    """A consumer of one run: the bench, the run's names; its connection is named ``base``."""

    def __init__(self, bench: Bench, names: Names, tally: Tally, total: int) -> None:
        super().__init__(tally, total)
        self.bench, self.names = bench, names

    async def add_consumer(self) -> None:
        """The consumer (a) and (b) read: the one ``ensure_subscription`` makes for (c)/(d)."""
        await self.bench.js.add_consumer(self.names.stream, ConsumerConfig(
            durable_name=self.names.consumer, ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ACK_DEADLINE, deliver_policy=DeliverPolicy.ALL,
            filter_subject=self.names.stream, max_deliver=-1))


class RawConsumer(NatsConsumer, LoopConsumer):
    """(a): fetch(100) → await the handler and ``msg.ack()`` for each → a flush at the end."""

    client: NatsClient | None = None
    pull: JetStreamContext.PullSubscription | None = None

    async def prepare(self) -> None:
        await self.add_consumer()
        self.client = await nats.connect(self.bench.url, name=self.names.base)
        self.pull = await self.client.jetstream().pull_subscribe_bind(
            durable=self.names.consumer, stream=self.names.stream)

    async def handle(self, msg: Any) -> None:
        """The handler under test: does nothing but count."""
        self.tally.handled += 1

    async def loop(self) -> None:
        assert self.client is not None and self.pull is not None
        handled = 0
        while handled < self.total:
            try:
                msgs = await self.pull.fetch(READ_COUNT, timeout=FETCH_TIMEOUT)
            except nats.errors.TimeoutError:
                continue
            for msg in msgs:
                await self.handle(msg)
                await msg.ack()
            handled += len(msgs)
        await self.client.flush()

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


class NatsFastStream(NatsConsumer, FastStreamConsumer):
    """(b1)/(b2): FastStream's pull subscriber, bound to the run's durable consumer."""

    def __init__(self, bench: Bench, names: Names, tally: Tally, total: int, *,
                 batch: bool) -> None:
        super().__init__(bench, names, tally, total)
        # logger=None turns FastStream's per-message logging off
        self.broker = NatsBroker(bench.url, name=names.base, logger=None)
        self.broker.subscriber(
            names.stream,
            stream=JStream(names.stream, declare=False),  # the benchmark made it
            durable=names.consumer,
            pull_sub=PullSub(batch_size=READ_COUNT, timeout=FETCH_TIMEOUT, batch=batch),
        )(faststream_handler(tally, batch=batch))

    async def prepare(self) -> None:
        await self.add_consumer()
        await self.broker.connect()


class NatsSubscriber(SubscriberConsumer):
    """(c)/(d)/(e): our Subscriber on the NatsJetStreamAdapter, with or without dedup, with a
    handler of one message or a batch handler."""

    def __init__(self, bench: Bench, names: Names, tally: Tally, total: int, *, dedup: bool,
                 batch: bool = False) -> None:
        self.bench, self.names = bench, names
        self.adapter = NatsJetStreamAdapter(bench.url, prefix=ADAPTER_PREFIX, name=names.base)
        self.store = (RedisDedupStore(bench.redis_url, prefix=names.dedup_prefix)
                      if dedup else None)
        super().__init__(tally, total, Subscriber(self.adapter, dedup=self.store),
                         SHUTDOWN_TIMEOUT)
        count_in(self.subscriber, names.consumer, tally, batch=batch)

    async def prepare(self) -> None:
        await self.adapter.ensure_subscription(
            self.names.stream, self.names.consumer, ack_deadline=ACK_DEADLINE, start="all")
        if self.store is not None:
            await self.store.client.ping()

    async def release(self) -> None:
        await self.adapter.close()
        if self.store is not None:
            await self.store.close()
            await delete_keys(self.bench.redis, f"{self.names.dedup_prefix}:*")


@dataclass(frozen=True)
class NatsRun(Run):
    """A timed run, and the consumer connection's messages in and out while the clock ran."""

    msgs_in: int
    msgs_out: int


@dataclass
class Bench:
    """What every run needs: the server, the control connection, Redis."""

    url: str
    monitor_port: int
    control: NatsClient
    js: JetStreamContext
    redis: aioredis.Redis
    redis_url: str

    def consumer(self, variant: str, names: Names, tally: Tally, total: int) -> Consumer:
        if variant == RAW:
            return RawConsumer(self, names, tally, total)
        if variant in (FS_ONE, FS_BATCH):
            return NatsFastStream(self, names, tally, total, batch=variant == FS_BATCH)
        return NatsSubscriber(self, names, tally, total, dedup=variant == SUB_DEDUP,
                              batch=variant == SUB_BATCH)

    async def publish_backlog(self, names: Names, total: int) -> None:
        await self.js.add_stream(StreamConfig(
            name=names.stream, subjects=[names.stream], storage=StorageType.FILE))
        for start in range(0, total, PUBLISH_CHUNK):
            futures = [await self.js.publish_async(names.stream, PAYLOAD, stream=names.stream)
                       for _ in range(min(PUBLISH_CHUNK, total - start))]
            await asyncio.gather(*futures)
        stored = (await self.js.stream_info(names.stream)).state.messages
        if stored != total:
            raise RuntimeError(f"stream {names.stream} holds {stored} messages, not {total}")

    def acked(self, names: Names) -> Callable[[], Awaitable[bool]]:
        """Whether the consumer's info shows nothing pending and nothing awaiting an ack."""

        async def settled() -> bool:
            info = await self.js.consumer_info(names.stream, names.consumer)
            return info.num_pending == 0 and info.num_ack_pending == 0

        return settled

    async def verify(self, names: Names, total: int) -> None:
        """The server's view after the clock: all delivered once and acked."""
        info = await self.js.consumer_info(names.stream, names.consumer)
        seen = (info.delivered.stream_seq if info.delivered else None,
                info.ack_floor.stream_seq if info.ack_floor else None,
                info.num_redelivered, info.num_ack_pending, info.num_pending)
        if seen != (total, total, 0, 0, 0):
            raise RuntimeError(f"consumer {names.consumer}: delivered, ack floor, redelivered, "
                               f"ack pending, pending = {seen}; expected {total}, {total}, 0, 0, 0")

    async def run_once(self, variant: str, total: int, *,
                       profiler: cProfile.Profile | None = None,
                       counter: RoundTrips | None = None) -> NatsRun:
        """Consume a fresh ``total``-message backlog with ``variant``."""
        names, tally = next_names(variant), Tally()
        await self.publish_backlog(names, total)
        consumer = self.consumer(variant, names, tally, total)
        try:
            await consumer.prepare()
            if counter is not None and isinstance(consumer, NatsSubscriber):
                assert consumer.store is not None
                client = consumer.store.client
                assert isinstance(client, aioredis.Redis)  # a URL of one server, not a cluster
                counter.install(client)
                counter.name_scripts(consumer.store)
            msgs_in, msgs_out = connection_msgs(self.monitor_port, names.base)
            run = await drain(consumer, self.acked(names), profiler, gc_off=False)
            sent, received = connection_msgs(self.monitor_port, names.base)
            await consumer.stop()
            await self.verify(names, total)
            consumer.check()
        finally:
            await consumer.close()
            await self.js.delete_stream(names.stream)
        return NatsRun(run.seconds, run.cpu_seconds, run.gc_seconds, sent - msgs_in,
                       received - msgs_out)


class Throughput(CpuThroughput):
    """One variant's timed runs, with CPU time and the broker's message counts."""

    @property
    def in_per_message(self) -> float:
        return statistics.median(run.msgs_in for run in self.runs) / self.messages

    @property
    def out_per_message(self) -> float:
        return statistics.median(run.msgs_out for run in self.runs) / self.messages


async def measure(bench: Bench, messages: int, repetitions: int,
                  warmup: int) -> dict[str, Throughput]:
    return await interleaved(bench.run_once, VARIANTS, lambda v: Throughput(v, messages),
                             messages, repetitions, warmup)


async def profile_subscriber(bench: Bench, messages: int) -> None:
    """(c) once under cProfile; its hottest functions to stderr."""
    profiler = cProfile.Profile()
    await bench.run_once(SUB, messages, profiler=profiler)
    for order in ("tottime", "cumulative"):
        print(f"\n(c) under cProfile, by {order}:", file=sys.stderr)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats(order).print_stats(30)


# -- report ------------------------------------------------------------------------------------


def table(results: dict[str, Throughput]) -> list[str]:
    return broker_table(results, RAW, [
        ("client→server msgs / msg", lambda r: f"{r.in_per_message:.3f}"),
        ("server→client msgs / msg", lambda r: f"{r.out_per_message:.3f}"),
    ])


def redis_round_trips(counter: RoundTrips, messages: int) -> str:
    kinds = ", ".join(f"{label} {count * 1000 / messages:,.1f}"
                      for label, count in counter.round_trips.most_common())
    return (f"{counter.round_trips.total() / messages:.4f} Redis round trips per message "
            f"(per 1,000 messages: {kinds})")


def report(results: dict[str, Throughput], counter: RoundTrips, command: str, messages: int,
           repetitions: int, server_versions: str, load: float) -> str:
    raw, sub, full = results[RAW], results[SUB], results[SUB_DEDUP]
    return render(
        "nats", measured_on=measured_on(command), server_versions=server_versions, load=load,
        messages=messages, repetitions=repetitions, table=table(results),
        goals=[paired_goal("(c) / (a)", sub, raw, NO_DEDUP_MIN_RATIO),
               paired_goal("(c) / (b1) FastStream, one message per call", sub, results[FS_ONE],
                           1.0),
               paired_goal("(c) / (b2) FastStream, batch=True", sub, results[FS_BATCH], 1.0),
               paired_goal("(d) / (a)", full, raw, DEDUP_MIN_RATIO),
               paired_goal("(e) / (a)", results[SUB_BATCH], raw, BATCH_MIN_RATIO)],
        sub_cost=sub.micros_per_message - raw.micros_per_message,
        dedup_cost=full.micros_per_message - sub.micros_per_message,
        round_trips=redis_round_trips(counter, messages), READ_COUNT=READ_COUNT,
        FETCH_TIMEOUT=FETCH_TIMEOUT, RECEIVE_BATCH=RECEIVE_BATCH, ACK_DEADLINE=ACK_DEADLINE,
        SHUTDOWN_TIMEOUT=SHUTDOWN_TIMEOUT, poll_ms=POLL_INTERVAL * 1000)


async def everything(args: argparse.Namespace, url: str, monitor_port: int) -> str:
    control = await nats.connect(url, name=f"bench-nats-{RUN_ID}-control")
    redis = aioredis.Redis.from_url(args.redis)
    try:
        await redis.ping()
        js = control.jetstream(timeout=10.0)
        bench = Bench(url, monitor_port, control, js, redis, args.redis)
        server = monitor(monitor_port, "varz")["version"]
        redis_server = (await redis.info("server"))["redis_version"]
        load = os.getloadavg()[0]
        results = await measure(bench, args.messages, args.repetitions, args.warmup)
        counter = RoundTrips()
        await bench.run_once(SUB_DEDUP, args.messages, counter=counter)
        if args.profile:
            await profile_subscriber(bench, args.messages)
        return report(results, counter, args.command, args.messages, args.repetitions,
                      f"nats-server {server}, Redis {redis_server}; "
                      f"{versions('nats-py', 'faststream', 'redis')}", load)
    finally:
        with contextlib.suppress(nats.errors.Error):  # gone with the server's store anyway
            await control.jetstream().delete_key_value(f"{ADAPTER_PREFIX}-subscriptions")
        await control.close()
        await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--redis", default=DEFAULT_REDIS,
                        help=f"Redis URL for (d) (default {DEFAULT_REDIS})")
    add_runs(parser, DEFAULT_MESSAGES, DEFAULT_REPETITIONS, quick=QUICK,
             messages_help="messages per run, a multiple of 100")
    parser.add_argument("--profile", action="store_true",
                        help="also profile (c) once and print its hottest functions")
    parser.add_argument("--write", action="store_true", help="write the README section")
    args = parser.parse_args(argv)
    apply_quick(args, WARMUP_MESSAGES, QUICK)
    if args.messages % READ_COUNT:
        # (b2) would wait out its batch timeout for the last, short batch
        parser.error(f"--messages must be a multiple of {READ_COUNT}")
    if shutil.which("nats-server") is None:
        parser.error("nats-server is not on PATH (Debian package nats-server)")
    args.command = command_line("nats", argv)

    from tests.nats_processes import NatsServer

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-nats-") as directory:
        server = NatsServer(Path(directory))
        server.start()
        try:
            section = asyncio.run(everything(args, server.url, server.monitor_port))
        finally:
            server.kill()
    publish(SECTION_NAME, section, write=args.write, append=True, started=started)


if __name__ == "__main__":
    main()
