"""Throughput on Apache Kafka: the Subscriber against raw client loops and FastStream (#45).

    python -m benchmarks.kafka            # print the tables
    python -m benchmarks.kafka --write    # ... and write the README section
    python -m benchmarks.kafka --quick    # a smoke test (small topics, one repetition)

Starts its own single-node Kafka (KRaft, ``tests/kafka_processes.py``, with the JIT's full tiers)
on free ports and fills two topics of 4 partitions once, keyed over 1,000 keys: RECORDS records
for (a)-(d), CONCURRENCY_RECORDS for (e). A topic is read, not drained, so every run of every
variant consumes the same records from the start of its topic, as a consumer group of its own.

What is measured:

* (a)-(d), a no-op ``async`` handler: the raw client loop (consume a batch, call the handler for
  each record, commit per batch) of confluent-kafka, our client, and of aiokafka beside it;
  FastStream's ``faststream.kafka`` subscriber (aiokafka underneath), one message per call and
  with ``batch=True``; our Subscriber on the KafkaAdapter without dedup, and with a
  RedisDedupStore on the local Redis. Interleaved repetitions, after a warm-up run of each.
* (e), a handler that awaits HANDLER_SECONDS (I/O-bound): our Subscriber's key-ordered
  concurrency at several ``max_concurrency`` limits against FastStream's partition-sequential
  consumption (one consumer per partition, one record at a time), against the bound each limit
  sets (``max_concurrency / HANDLER_SECONDS``), and our own ``ordering="partition"`` beside.
* (c) once more under cProfile, on (e)'s smaller topic: Python calls per record and the hottest
  functions of the event loop's thread.

A run's clock starts at the first record its handler sees (the group join before it is no
throughput) and stops when the handler has seen every record and the group's committed offsets
are the topic's ends (polled by a consumer of the group that never joins it); FastStream's
default commits in the background (aiokafka's auto-commit), so its clock stops at the last
handler call. Then every partition's commit must be at its end and the handler must have seen
each record once. The README's prose is ``templates/kafka.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import pstats
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import confluent_kafka
import redis.asyncio as aioredis
from faststream import AckPolicy

from benchmarks._brokers import POLL_INTERVAL, RUN_DEADLINE, Consumer, delete_keys, wait_drained
from benchmarks._common import (
    EPOLL_WAIT,
    MICROS,
    GcTimer,
    interleaved,
    paired_goal,
    positive_int,
    verdict,
)
from benchmarks._harness import (
    CpuThroughput,
    Run,
    add_runs,
    broker_table,
    command_line,
    measured_on,
    publish,
    render,
    table,
    versions,
)
from benchmarks._kafka_bench import (
    BATCH,
    HANDLER_SECONDS,
    KEYS,
    PARTITIONS,
    PAYLOAD,
    AiokafkaLoop,
    Commits,
    ConfluentLoop,
    FastStreamKafkaConsumer,
    KafkaSubscriber,
    Setup,
    ThreadCpu,
    Topic,
    cpu_between,
    fill,
    io_bound,
    no_op,
    no_op_batch,
    thread_cpu,
)
from tests.kafka_processes import JVM_OPTIONS, KafkaBroker
from tests.maven_jars import version as jar_version

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
RECORDS = 100_000  # (a)-(d)'s topic
# (e)'s topic: partition-sequential consumption of a 5 ms handler does at most 800 records/s
CONCURRENCY_RECORDS = 10_000
DEFAULT_REPETITIONS = 3
CONCURRENCY_REPETITIONS = 2  # (e)'s partition-sequential runs take ~20 s each
QUICK = (5_000, 1, 1_000)  # --quick: records, repetitions, (e)'s records (one run each)
# (e)'s limits on handlers in flight (@sub.handler(max_concurrency=...)); 1,000 is also the
# Subscriber's default FlowControl window.
CONCURRENCY_LIMITS = (10, 100, 1_000)
# The broker: the tests' JVM options less the C1-only flag (a broker that serves minutes of
# throughput wants C2, so that the broker is not what is measured).
BROKER_JVM_OPTIONS = tuple(option for option in JVM_OPTIONS if "TieredStopAtLevel" not in option)
HOTTEST = 12  # functions listed from (c)'s profile
PROFILED_POLL_INTERVAL = 0.05  # s between the profiled run's drain checks (timed runs: 1 ms)
# Untimed passes of (a) over the big topic before anything is timed: (a) is bound by the
# broker's fetches, and the broker's JIT keeps warming for several passes (here (a) went from
# ~50,000 to ~250,000 msgs/s over its first eight); a cold broker would flatter the ratios to (a).
BROKER_WARMUP_PASSES = 10
# The reference rows: the KafkaAdapter's old default, a partition paused once 1,000 of its records
# waited untaken, with librdkafka's own prefetch at its default of 100,000 records per partition.
# librdkafka drops what it prefetched for a paused partition and fetches it again on resume; a
# backlog drain paused and resumed every partition again and again (the default is now 10,000,
# with librdkafka's prefetch as deep).
REFERENCE_BUFFER = 1_000
REFERENCE_CONFIG = {"queued.min.messages": 100_000}
# Goals from the issue (#45).
SUB_VS_RAW, SUB_VS_FASTSTREAM, SUB_VS_FASTSTREAM_BATCH, DEDUP_VS_RAW = 0.5, 3.0, 1.0, 0.3
CONCURRENCY_VS_SEQUENTIAL, CONCURRENCY_VS_BOUND = 20.0, 0.5

RAW = f"(a) raw confluent-kafka: consume({BATCH}), async commit per batch"
RAW_AIOKAFKA = f"(a2) raw aiokafka: getmany(max_records={BATCH}), await commit() per batch"
FS_ONE = "(b1) FastStream (faststream.kafka), one message per call"
FS_BATCH = f"(b2) FastStream (faststream.kafka), batch=True, max_records={BATCH}"
SUB = "(c) Subscriber(KafkaAdapter), no dedup"
SUB_DEDUP = "(d) Subscriber + RedisDedupStore"
SUB_BUFFER = (f"(c′) as (c), the old default KafkaAdapter(buffer={REFERENCE_BUFFER:,}), librdkafka "
              "prefetching 100,000: reference, no goal")
VARIANTS = (RAW, RAW_AIOKAFKA, FS_ONE, FS_BATCH, SUB, SUB_DEDUP, SUB_BUFFER)
OURS = (SUB, SUB_DEDUP, SUB_BUFFER)
BACKGROUND_COMMITS = (FS_ONE, FS_BATCH)  # clock stops at the last handler call
SEQUENTIAL = f"FastStream, partition-sequential (max_workers={PARTITIONS}, AckPolicy.ACK)"
OURS_PARTITION = 'Subscriber, ordering="partition"'
SECTION_NAME = "kafka"
RUN_ID = uuid.uuid4().hex[:8]
ADAPTER_PREFIX = f"bench-{RUN_ID}"  # the adapter's settings topic and the dedup keys
_groups = iter(range(1, 1_000_000))


def ours_by_key(limit: int, buffer: int | None = None) -> str:
    name = f'Subscriber, ordering="key", max_concurrency={limit:,}'
    return name if buffer is None else f"{name}, old default buffer={buffer:,}: reference, no goal"


# (e)'s rows of ours by key: (variant, max_concurrency, KafkaAdapter buffer or its default)
BY_KEY: tuple[tuple[str, int, int | None], ...] = (
    *((ours_by_key(limit), limit, None) for limit in CONCURRENCY_LIMITS),
    (ours_by_key(CONCURRENCY_LIMITS[-1], REFERENCE_BUFFER), CONCURRENCY_LIMITS[-1],
     REFERENCE_BUFFER))
CONCURRENCY_VARIANTS = (SEQUENTIAL, OURS_PARTITION, *(variant for variant, _, _ in BY_KEY))


def bound(variant: str) -> float | None:
    """Records/s the variant's concurrency limit allows with HANDLER_SECONDS handlers."""
    for name, limit, _ in BY_KEY:
        if variant == name:
            return limit / HANDLER_SECONDS
    return None


# -- runs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KafkaRun(Run):
    """A timed run, its CPU seconds by thread (:class:`ThreadCpu`) and the full (oldest
    generation) collections of the cyclic GC within it."""

    threads: ThreadCpu
    full_collections: int


class Throughput(CpuThroughput):
    """One variant's timed runs, with their CPU time by thread."""

    def thread_micros(self, name: str) -> float:
        return self.median_micros(getattr(run.threads, name) for run in self.runs)

    @property
    def full_collections(self) -> float:
        return statistics.median(run.full_collections for run in self.runs)


@dataclass
class Bench:
    bootstrap: str
    redis_url: str
    redis: aioredis.Redis
    topics: dict[int, Topic]  # by their record counts

    def consumer(self, variant: str, setup: Setup) -> Consumer:
        tally = setup.tally
        if variant == RAW:
            return ConfluentLoop(setup)
        if variant == RAW_AIOKAFKA:
            return AiokafkaLoop(setup)
        if variant == FS_ONE:
            return FastStreamKafkaConsumer(setup, no_op(tally))
        if variant == FS_BATCH:
            return FastStreamKafkaConsumer(setup, no_op_batch(tally), batch=True,
                                           max_records=BATCH)
        if variant == SUB:
            return KafkaSubscriber(setup, ADAPTER_PREFIX)
        if variant == SUB_DEDUP:
            return KafkaSubscriber(setup, ADAPTER_PREFIX, redis_url=self.redis_url)
        if variant == SUB_BUFFER:
            return KafkaSubscriber(setup, ADAPTER_PREFIX, buffer=REFERENCE_BUFFER,
                                   consumer_config=REFERENCE_CONFIG)
        if variant == SEQUENTIAL:  # FastStream's partition-sequential mode needs manual acks
            return FastStreamKafkaConsumer(setup, io_bound(tally), max_workers=PARTITIONS,
                                           ack_policy=AckPolicy.ACK)
        if variant == OURS_PARTITION:
            return KafkaSubscriber(setup, ADAPTER_PREFIX, ordering="partition",
                                   handler=io_bound(tally))
        limit, buffer = next((limit, buffer) for name, limit, buffer in BY_KEY if variant == name)
        return KafkaSubscriber(setup, ADAPTER_PREFIX, handler=io_bound(tally),
                               max_concurrency=limit, buffer=buffer,
                               consumer_config=None if buffer is None else REFERENCE_CONFIG)

    async def run_once(self, variant: str, records: int,
                       profiler: cProfile.Profile | None = None) -> KafkaRun:
        """``variant`` reads the topic of ``records`` records from its start, as a new group."""
        setup = Setup(self.bootstrap, self.topics[records], f"bench-{RUN_ID}-g{next(_groups)}")
        commits = Commits(self.bootstrap, setup.group, setup.topic)
        harness = set(thread_cpu())  # threads before the consumer under test
        consumer = self.consumer(variant, setup)
        settled = _always if variant in BACKGROUND_COMMITS else commits.at_end
        try:
            await consumer.prepare()
            run = await timed(consumer, setup, settled, harness, profiler)
            await consumer.stop()
            await asyncio.to_thread(commits.check, variant)
            consumer.check()
        finally:
            await consumer.close()
            commits.close()
            if isinstance(consumer, KafkaSubscriber) and consumer.store is not None:
                await delete_keys(self.redis, f"{consumer.dedup_prefix}:*")
        return run


async def _always() -> bool:
    return True


async def timed(consumer: Consumer, setup: Setup, settled: Callable[[], Awaitable[bool]],
                harness: set[int], profiler: cProfile.Profile | None) -> KafkaRun:
    """Start ``consumer``; wall and CPU seconds from its first record to drained and settled.
    GC stays on, but for a profiled run (as the harness's Clock does: a collection's time would
    go to whichever function it interrupted)."""
    gc.collect()
    full_before = gc.get_stats()[-1]["collections"]
    with GcTimer() as gc_timer:
        if profiler is not None:
            gc.disable()
            profiler.enable()
        try:
            await consumer.start()
            drained = await wait_drained(
                consumer, settled, time.perf_counter() + RUN_DEADLINE,
                POLL_INTERVAL if profiler is None else PROFILED_POLL_INTERVAL)
            cpu, threads = time.process_time(), thread_cpu()
        finally:
            if profiler is not None:
                profiler.disable()
                gc.enable()
    tally = setup.tally
    return KafkaRun(drained - tally.first_wall, cpu - tally.first_cpu, gc_timer.seconds,
                    cpu_between(tally.first_threads, threads, harness),
                    gc.get_stats()[-1]["collections"] - full_before)


async def warm_broker(bench: Bench, records: int) -> list[float]:
    """BROKER_WARMUP_PASSES untimed runs of (a) over the big topic; their rates."""
    rates = []
    for number in range(1, BROKER_WARMUP_PASSES + 1):
        run = await bench.run_once(RAW, records)
        rates.append(records / run.seconds)
        print(f"  broker warm-up {number}/{BROKER_WARMUP_PASSES}: (a) {rates[-1]:,.0f} msg/s",
              file=sys.stderr)
    return rates


async def measure(bench: Bench, records: int, repetitions: int,
                  warmup: int) -> dict[str, Throughput]:
    """(a)-(d), interleaved, after one warm-up run each on (e)'s smaller topic."""
    return await interleaved(bench.run_once, VARIANTS, lambda v: Throughput(v, records),
                             records, repetitions, warmup)


async def measure_concurrency(bench: Bench, records: int,
                              repetitions: int) -> dict[str, Throughput]:
    """(e), interleaved (warm already)."""
    results = {variant: Throughput(variant, records) for variant in CONCURRENCY_VARIANTS}
    for repetition in range(1, repetitions + 1):
        for variant, result in results.items():
            run = await bench.run_once(variant, records)
            result.runs.append(run)
            print(f"  (e) run {repetition}/{repetitions}  {variant:<58} "
                  f"{records / run.seconds:>9,.0f} msg/s", file=sys.stderr)
    return results


@dataclass(frozen=True)
class Profile:
    """(c) under cProfile: Python calls and the hottest functions' own µs, per record."""

    records: int
    calls: float
    hottest: list[tuple[str, float, float]]  # (function, calls, own µs), per record


async def profile_subscriber(bench: Bench, records: int) -> Profile:
    profiler = cProfile.Profile()
    await bench.run_once(SUB, records, profiler=profiler)
    stats = pstats.Stats(profiler)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    working = [item for item in raw.items() if item[0][2] != EPOLL_WAIT]  # waiting is no work
    rows = sorted(working, key=lambda item: item[1][2], reverse=True)[:HOTTEST]
    return Profile(records, stats.total_calls / records,  # type: ignore[attr-defined]
                   [(_function_name(key), timing[1] / records, timing[2] * MICROS / records)
                    for key, timing in rows])


def _function_name(key: tuple[str, int, str]) -> str:
    """``path:line(name)``, the path from the package or the standard library on."""
    filename, line, name = key
    if filename == "~":  # a builtin
        return f"`{name}`"
    parts = Path(filename).parts
    for anchor in ("reliable_sub", "benchmarks", "asyncio", "faststream"):
        if anchor in parts:
            filename = "/".join(parts[parts.index(anchor):])
            break
    else:
        filename = Path(filename).name
    return f"`{filename}:{line}({name})`"


# -- report --------------------------------------------------------------------------------------


def main_table(results: dict[str, Throughput]) -> list[str]:
    return broker_table(results, RAW, [
        ("event-loop thread CPU µs/msg", lambda r: f"{r.thread_micros('loop'):.1f}"),
        ("adapter poll thread CPU µs/msg",
         lambda r: f"{r.thread_micros('poll'):.1f}" if r.variant in OURS else "–"),
        ("librdkafka threads CPU µs/msg", lambda r: f"{r.thread_micros('librdkafka'):.1f}"),
    ])


def concurrency_table(results: dict[str, Throughput]) -> list[str]:
    sequential = results[SEQUENTIAL].median
    ideal = PARTITIONS / HANDLER_SECONDS

    def limit_cell(row: Throughput) -> str:
        found = bound(row.variant)
        return "–" if found is None else f"{found:,.0f}"

    def to_bound(row: Throughput) -> str:
        found = bound(row.variant)
        return "–" if found is None else f"{row.median / found:.2f}×"

    return table(results.values(), [
        ("msgs/s", lambda r: f"{r.median:,.0f}"),
        ("client CPU µs/msg", lambda r: f"{r.cpu_micros_per_message:.1f}"),
        ("client CPU, of one core",
         lambda r: f"{r.cpu_micros_per_message * r.median / MICROS:.0%}"),
        ("ratio to FastStream partition-sequential", lambda r: f"{r.median / sequential:.1f}×"),
        (f"ratio to {PARTITIONS} partitions / {HANDLER_SECONDS * 1000:g} ms ({ideal:,.0f}/s)",
         lambda r: f"{r.median / ideal:.1f}×"),
        ("bound: max_concurrency / 5 ms, msgs/s", limit_cell),
        ("ratio to the bound", to_bound),
    ])


def shortfall(value: float, goal: float) -> str:
    return "" if value >= goal else f"; {1 - value / goal:.0%} short of it"


def goal_line(name: str, ours: Throughput, theirs: Throughput, target: float) -> str:
    return paired_goal(name, ours, theirs, target) + shortfall(ours.median / theirs.median,
                                                               target)


def main_goals(results: dict[str, Throughput]) -> list[str]:
    raw, sub = results[RAW], results[SUB]
    return [goal_line("(c) / (a)", sub, raw, SUB_VS_RAW),
            goal_line("(c) / (b1)", sub, results[FS_ONE], SUB_VS_FASTSTREAM),
            goal_line("(c) / (b2)", sub, results[FS_BATCH], SUB_VS_FASTSTREAM_BATCH),
            goal_line("(d) / (a)", results[SUB_DEDUP], raw, DEDUP_VS_RAW)]


def concurrency_goals(results: dict[str, Throughput]) -> list[str]:
    sequential = results[SEQUENTIAL].median
    lines = []
    for limit in CONCURRENCY_LIMITS:
        row = results[ours_by_key(limit)]
        limit_bound = limit / HANDLER_SECONDS
        for name, value, goal in (
                (f"(e) max_concurrency={limit:,} / FastStream partition-sequential",
                 row.median / sequential, CONCURRENCY_VS_SEQUENTIAL),
                (f"(e) max_concurrency={limit:,} / its bound ({limit_bound:,.0f} msgs/s)",
                 row.median / limit_bound, CONCURRENCY_VS_BOUND)):
            lines.append(verdict(name, value, goal) + shortfall(value, goal))
    return lines


def profile_lines(found: Profile) -> list[str]:
    lines = ["| function (own time) | calls per record | own µs per record (profiled) |",
             "|---|---:|---:|"]
    lines += [f"| {name} | {calls:.2f} | {micros:.2f} |" for name, calls, micros in found.hottest]
    return lines


def report(results: dict[str, Throughput], concurrency: dict[str, Throughput],
           found: Profile, args: argparse.Namespace, load: float, warmup: list[float],
           heap: int) -> str:
    raw, sub, full, buffered = (results[RAW], results[SUB], results[SUB_DEDUP],
                                results[SUB_BUFFER])
    librdkafka = f"{confluent_kafka.version()} (librdkafka {confluent_kafka.libversion()[0]})"
    return render(
        "kafka", measured_on=measured_on(args.command), kafka=jar_version("kafka"),
        versions=f"confluent-kafka {librdkafka}, " + versions("aiokafka", "faststream", "redis"),
        load=load, warmup_passes=len(warmup), warmup_first=warmup[0], warmup_last=warmup[-1],
        records=args.records, partitions=PARTITIONS, keys=KEYS,
        payload=len(PAYLOAD), repetitions=args.repetitions, table=main_table(results),
        goals=main_goals(results),
        sub_cost=sub.micros_per_message - raw.micros_per_message,
        dedup_cost=full.micros_per_message - sub.micros_per_message,
        sub_loop=sub.thread_micros("loop"), sub_poll=sub.thread_micros("poll"),
        raw_loop=raw.thread_micros("loop"), raw_cpu=raw.cpu_micros_per_message,
        raw_wall=raw.micros_per_message,
        sub_cpu=sub.cpu_micros_per_message, sub_wall=sub.micros_per_message,
        sub_gc=sub.gc_micros_per_message, sub_full=sub.full_collections, heap=heap,
        sub_waiting=1 - sub.cpu_micros_per_message / sub.micros_per_message,
        needed=raw.micros_per_message / SUB_VS_RAW,
        sub_vs_slowest=sub.median / min(raw.rates), dedup_vs_slowest=full.median / min(raw.rates),
        sub_rdk=sub.thread_micros("librdkafka"), buffered_rdk=buffered.thread_micros("librdkafka"),
        reference_buffer=REFERENCE_BUFFER, buffered=buffered.median,
        sub_vs_buffered=sub.median / buffered.median, goal_raw=SUB_VS_RAW,
        dedup_cpu=full.cpu_micros_per_message - sub.cpu_micros_per_message,
        buffered_cpu=buffered.cpu_micros_per_message,
        buffered_wall=buffered.micros_per_message,
        concurrency_records=args.concurrency_records,
        concurrency_repetitions=args.concurrency_repetitions,
        concurrency_table=concurrency_table(concurrency),
        concurrency_goals=concurrency_goals(concurrency),
        handler_ms=HANDLER_SECONDS * 1000, profile_records=found.records,
        profile_calls=found.calls, profile_table=profile_lines(found), batch=BATCH)


async def everything(args: argparse.Namespace, bootstrap: str) -> str:
    redis = aioredis.Redis.from_url(args.redis)
    try:
        await redis.ping()
        load = os.getloadavg()[0]
        heap = len(gc.get_objects())  # what a full collection walks, besides a run's own
        topics = {}
        for size in (args.records, args.concurrency_records):
            topics[size] = await asyncio.to_thread(fill, bootstrap, f"bench-{RUN_ID}-{size}",
                                                   size)
        bench = Bench(bootstrap, args.redis, redis, topics)
        warmup = await warm_broker(bench, args.records)
        results = await measure(bench, args.records, args.repetitions, args.concurrency_records)
        concurrency = await measure_concurrency(bench, args.concurrency_records,
                                                args.concurrency_repetitions)
        found = await profile_subscriber(bench, args.concurrency_records)
        print(f"(c) under cProfile: {found.calls:.1f} Python calls per record",
              file=sys.stderr)
        return report(results, concurrency, found, args, load, warmup, heap)
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--redis", default=DEFAULT_REDIS,
                        help=f"Redis URL for (d) (default {DEFAULT_REDIS})")
    add_runs(parser, RECORDS, DEFAULT_REPETITIONS, quick=QUICK,
             messages_help=f"records of (a)-(d)'s topic (default {RECORDS:,})")
    parser.add_argument("--concurrency-records", type=positive_int, default=CONCURRENCY_RECORDS,
                        help=f"records of (e)'s topic (default {CONCURRENCY_RECORDS:,})")
    parser.add_argument("--concurrency-repetitions", type=positive_int,
                        default=CONCURRENCY_REPETITIONS,
                        help=f"timed runs of each (e) variant (default {CONCURRENCY_REPETITIONS})")
    parser.add_argument("--write", action="store_true", help="write the README section")
    args = parser.parse_args(argv)
    args.records = args.messages
    if args.quick:
        args.records, args.repetitions, args.concurrency_records = QUICK
        args.concurrency_repetitions = 1
    if args.records == args.concurrency_records:
        parser.error("--messages and --concurrency-records must differ (a topic each)")
    args.command = command_line("kafka", argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-kafka-") as directory:
        broker = KafkaBroker(Path(directory), jvm_options=BROKER_JVM_OPTIONS)
        try:
            broker.start()
            section = asyncio.run(everything(args, broker.bootstrap))
        finally:
            broker.kill()
    publish(SECTION_NAME, section, write=args.write, append=True, started=started)


if __name__ == "__main__":
    main()
