"""Throughput on SQS (ElasticMQ): the Subscriber against a raw aiobotocore loop (#49).

    python -m benchmarks.sqs            # print the tables
    python -m benchmarks.sqs --write    # ... and write the README section
    python -m benchmarks.sqs --quick    # a smoke test (small queues, one repetition)

Starts its own ElasticMQ (``tests/sqs_processes.py``, in memory, with the JVM's full JIT) on a
free port. Every run gets a fresh standard queue filled with ``SendMessageBatch`` before the
clock starts (untimed), and drains it with one variant and a no-op handler: (a) the raw
aiobotocore loop, (c) our Subscriber on the SqsAdapter, (d) the same with a RedisDedupStore on
the local Redis. The server is warmed by untimed passes of (a), every variant by a warm-up run;
then the variants run interleaved, and (a), (c) and (d) once more each under cProfile. The clock
stops when the consumer's ``DeleteMessageBatch`` replies have deleted the whole backlog (seen
through botocore's events on the consumer's client, which also count its requests); the queue
must then be empty. The README's prose is ``templates/sqs.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis

from benchmarks._brokers import Consumer, delete_keys, drain
from benchmarks._common import (
    MICROS,
    Rule,
    StageProfile,
    interleaved,
    paired_goal,
    pipeline_rules,
    rule,
)
from benchmarks._harness import (
    CpuThroughput,
    Run,
    add_runs,
    apply_quick,
    broker_table,
    check_main,
    command_line,
    measured_on,
    profile_stages,
    publish,
    render,
    stage_table,
    table,
    versions,
)
from benchmarks._sqs_bench import (
    ACK_DEADLINE,
    BATCH,
    BODY,
    FILL_CALLS,
    POOL,
    RAW_LOOPS,
    RAW_WAIT,
    SERVER_JVM_OPTIONS,
    SHUTDOWN_TIMEOUT,
    Counts,
    Queues,
    RawLoop,
    Setup,
    SqsSubscriber,
    client_of,
    process_cpu_seconds,
    server,
)
from reliable_sub.adapters.sqs import DEFAULT_RECEIVE_CALLS
from reliable_sub.subscriber import RECEIVE_BATCH, RECEIVE_TIMEOUT
from tests.maven_jars import version as jar_version

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_MESSAGES = 20_000
DEFAULT_REPETITIONS = 7
WARMUP_MESSAGES = 10_000
QUICK = (2_000, 1, 500)  # --quick: messages, repetitions, warm-up messages
# Untimed passes of (a) over a full backlog before anything else: ElasticMQ's JIT keeps warming
# over the first ~10,000-20,000 messages (benchmarks/sqs_clients_spike.py).
SERVER_WARMUP_PASSES = 2
PROFILED_MESSAGES = 10_000  # each profiled run's backlog
# Goals from the issue (#49).
SUB_VS_RAW, DEDUP_VS_RAW = 0.6, 0.4

RAW = f"(a) raw aiobotocore: {RAW_LOOPS} loops of ReceiveMessage(10) → DeleteMessageBatch"
SUB = "(c) Subscriber(SqsAdapter), no dedup"
SUB_DEDUP = "(d) Subscriber + RedisDedupStore"
VARIANTS = (RAW, SUB, SUB_DEDUP)
PROFILED = VARIANTS
SECTION_NAME = "sqs"
RUN_ID = uuid.uuid4().hex[:8]
_runs = iter(range(1, 1_000_000))

RECEIVE_MESSAGE, DELETE_BATCH = "ReceiveMessage", "DeleteMessageBatch"


# -- runs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SqsRun(Run):
    """A timed run, the server's CPU seconds within it, the consumer's requests (and its dedup
    store's Redis round trips, by kind) while the clock ran."""

    server_cpu_seconds: float
    counts: Counts
    redis: Counter[str] | None


class Throughput(CpuThroughput):
    """One variant's timed runs, with CPU time (client and server) and request counts."""

    def median_of(self, value: Callable[[SqsRun], float]) -> float:
        return statistics.median(value(run) for run in self.runs)

    def per_message(self, value: Callable[[SqsRun], float]) -> float:
        return self.median_of(value) / self.messages

    @property
    def server_micros(self) -> float:
        return self.per_message(lambda run: run.server_cpu_seconds) * MICROS

    def in_flight(self, operation: str) -> float:
        """Mean calls of ``operation`` in flight over the run (median of the runs)."""
        return self.median_of(lambda run: run.counts.busy.get(operation, 0.0) / run.seconds)


@dataclass
class Bench:
    options: dict[str, str]
    server_pid: int
    queues: Queues
    redis: aioredis.Redis
    redis_url: str

    def consumer(self, variant: str, setup: Setup, dedup_prefix: str) -> Consumer:
        if variant == RAW:
            return RawLoop(setup)
        if variant == SUB:
            return SqsSubscriber(setup)
        return SqsSubscriber(setup, redis_url=self.redis_url, dedup_prefix=dedup_prefix)

    async def run_once(self, variant: str, messages: int,
                       profiler: cProfile.Profile | None = None) -> SqsRun:
        """Drain a fresh queue of ``messages`` with ``variant``."""
        name = f"bench-{RUN_ID}-{next(_runs)}"
        url = await self.queues.make(name, messages)
        setup = Setup(self.options, name, url, messages)
        dedup_prefix = f"{name}-dedup"
        consumer = self.consumer(variant, setup, dedup_prefix)
        requests = setup.requests
        seen: list[tuple[Counts, Counter[str] | None]] = []

        def round_trips() -> Counter[str] | None:
            found = consumer.redis if isinstance(consumer, SqsSubscriber) else None
            return None if found is None else found.round_trips

        async def settled() -> bool:
            if requests.deleted < messages:
                return False
            trips = round_trips()
            seen.append((requests.snapshot(), None if trips is None else Counter(trips)))
            return True

        try:
            await consumer.prepare()
            requests.reset()
            trips = round_trips()
            if trips is not None:
                trips.clear()
            server_cpu = process_cpu_seconds(self.server_pid)
            run = await drain(consumer, settled, profiler)
            server_cpu = process_cpu_seconds(self.server_pid) - server_cpu
            await consumer.stop()
            consumer.check()
            if requests.delete_failed:
                raise RuntimeError(f"{variant}: {requests.delete_failed} delete entries failed")
            await self.queues.check_empty(url, variant)
        finally:
            await consumer.close()
            await self.queues.delete(url)
            if variant == SUB_DEDUP:
                await delete_keys(self.redis, f"{dedup_prefix}:*")
        counts, redis_trips = seen[0]
        return SqsRun(run.seconds, run.cpu_seconds, run.gc_seconds, server_cpu, counts,
                      redis_trips)


async def warm_server(bench: Bench, messages: int, passes: int) -> list[float]:
    """``passes`` untimed runs of (a) over a full backlog; their rates."""
    rates = []
    for number in range(1, passes + 1):
        run = await bench.run_once(RAW, messages)
        rates.append(messages / run.seconds)
        print(f"  server warm-up {number}/{passes}: (a) {rates[-1]:,.0f} msg/s", file=sys.stderr)
    return rates


# -- profile -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Package(Rule):
    """Every function of an installed package (``path``: its import name): a file under a
    directory of that name."""

    def matches(self, filename: str, line: int, name: str) -> bool:
        return f"/{self.path}/" in filename.replace(os.sep, "/")


def package(stage: str, name: str) -> Package:
    return Package(stage, name)


RECEIVE = "receive: receive loop, adapter.receive, leases, replies → Delivery/Message"
LEASE = "lease manager: add / started / finished, histogram"
DEDUP = "dedup: claim and completion scripts (keys, JSON, redis-py, round trips)"
TASK = "handler dispatch: admit, a task per delivery, run/attempt, handler"
SETTLE = "settle: Settler, adapter.ack, DeleteMessageBatch entries, leases dropped"
FLOW = "flow control (slots, bytes, events)"
BOTOCORE = ("aiobotocore/botocore, the rest of a call: validation, endpoint rules, "
            "serialization, request and header objects, events")
USER_AGENT = "botocore: the User-Agent header, built again for every request"
SIGN = "botocore: SigV4 signing"
PARSE = "botocore: reply parsing"
HTTP = "aiohttp (yarl, multidict): connection pool, HTTP write and read, socket send"
LOOP = "event loop: scheduling, task steps, done callbacks"
IO_WAIT = "idle in epoll: waiting for the server"
HARNESS = "benchmark: drain poller, request-counting hooks"
CLIENT_STAGES = (BOTOCORE, USER_AGENT, SIGN, PARSE, HTTP)
OUR_STAGES = (RECEIVE, LEASE, TASK, SETTLE, FLOW)
STAGES = (*OUR_STAGES[:2], DEDUP, *OUR_STAGES[2:], *CLIENT_STAGES, LOOP, IO_WAIT, HARNESS)
CPU_STAGES = tuple(stage for stage in STAGES if stage != IO_WAIT)
GC_ROW = "cyclic GC (timed runs; off while profiling)"
IDLE_ROW = "idle: waiting for the server or a CPU (timed runs: wall − process CPU)"

BENCH_FILE = "benchmarks/_sqs_bench.py"
BROKERS_FILE = "benchmarks/_brokers.py"
CONSUMING = "adapters/_sqs_consuming.py"
LEASES = "adapters/_sqs_leases.py"
# The first matching rule wins. Everything unmatched (asyncio's transports and locks, json,
# email's header classes, tenacity, builtins, helpers shared by two stages) takes the stages
# of its callers.
STAGE_RULES: tuple[Rule, ...] = (
    *pipeline_rules(receive=RECEIVE, lease=LEASE, task=TASK, settle=SETTLE, flow=FLOW,
                    loop=LOOP, io_wait=IO_WAIT),
    rule(RECEIVE, "adapters/sqs.py", "receive", "_subscription"),
    rule(RECEIVE, CONSUMING, "receive", "_receive", "_receive_once", "_delivery",
         "_unreadable", "_between_receives"),
    rule(RECEIVE, "adapters/_sqs_messages.py", "incoming", "_data", "_text_of", "_sent_at"),
    rule(RECEIVE, LEASES, "received", "_prune"),
    rule(RECEIVE, "reliable_sub/entries.py", "read_each"),
    rule(RECEIVE, BENCH_FILE, "receiver", "loop"),
    rule(SETTLE, "adapters/sqs.py", "ack"),
    rule(SETTLE, CONSUMING, "ack", "_split", "_apply", "record"),
    rule(SETTLE, "adapters/_sqs_batches.py"),
    rule(SETTLE, LEASES, "split", "deleted", "drop"),
    rule(DEDUP, "reliable_sub/_runtime/claims.py"),
    rule(DEDUP, "reliable_sub/dedup/_redis.py"),
    rule(DEDUP, "reliable_sub/dedup/_store_base.py"),
    rule(DEDUP, "reliable_sub/_results.py"),
    rule(DEDUP, "reliable_sub/_redis_clients.py"),
    rule(DEDUP, "reliable_sub/_runtime/decisions.py", "encode"),
    rule(DEDUP, "reliable_sub/message.py", "idempotency_key"),
    package(DEDUP, "redis"),
    rule(TASK, BROKERS_FILE, "handle_message"),
    rule(TASK, BENCH_FILE, "handle"),
    rule(HARNESS, BROKERS_FILE, "wait_drained"),
    rule(HARNESS, BENCH_FILE, "_request", "_moved", "_call", "_answered", "_received",
         "_deleted", "execute_command", "execute", "_label"),
    rule(PARSE, "botocore/parsers.py"),  # aiobotocore's too
    rule(USER_AGENT, "botocore/useragent.py"),
    rule(SIGN, "botocore/auth.py"),
    rule(SIGN, "botocore/signers.py"),  # aiobotocore's too
    package(BOTOCORE, "botocore"),
    package(BOTOCORE, "aiobotocore"),
    *(package(HTTP, name) for name in ("aiohttp", "yarl", "multidict", "propcache")),
)


async def profile(bench: Bench, messages: int) -> dict[str, StageProfile]:
    profiles = {}
    for variant in PROFILED:
        profiler = cProfile.Profile()
        await bench.run_once(variant, messages, profiler=profiler)
        profiles[variant] = profile_stages(profiler, variant, messages, STAGE_RULES, STAGES, LOOP)
        print(f"  profiled {variant}: {profiles[variant].total:.1f} µs/msg", file=sys.stderr)
    return profiles


# -- report --------------------------------------------------------------------------------------


def main_table(results: dict[str, Throughput]) -> list[str]:
    return broker_table(results, RAW, [
        ("server CPU µs/msg", lambda r: f"{r.server_micros:.1f}"),
    ])


def redis_cell(row: Throughput) -> str:
    if row.runs[0].redis is None:
        return "–"
    return f"{row.per_message(lambda run: (run.redis or Counter()).total()):.4f}"


def requests_table(results: dict[str, Throughput]) -> list[str]:
    def other(run: SqsRun) -> float:
        counts = run.counts
        return sum(calls for name, calls in counts.operations.items()
                   if name not in (RECEIVE_MESSAGE, DELETE_BATCH))

    def per_receive(run: SqsRun) -> float:
        counts = run.counts
        return counts.received / max(1, counts.calls(RECEIVE_MESSAGE) - counts.empty_receives)

    def per_delete(run: SqsRun) -> float:
        return run.counts.deleted / max(1, run.counts.calls(DELETE_BATCH))

    return table(results.values(), [
        ("HTTP requests / msg", lambda r: f"{r.per_message(lambda run: run.counts.http):.4f}"),
        ("ReceiveMessage / msg",
         lambda r: f"{r.per_message(lambda run: run.counts.calls(RECEIVE_MESSAGE)):.4f}"),
        ("of which empty / msg",
         lambda r: f"{r.per_message(lambda run: run.counts.empty_receives):.4f}"),
        ("DeleteMessageBatch / msg",
         lambda r: f"{r.per_message(lambda run: run.counts.calls(DELETE_BATCH)):.4f}"),
        ("other calls / msg", lambda r: f"{r.per_message(other):.4f}"),
        ("msgs per non-empty receive", lambda r: f"{r.median_of(per_receive):.2f}"),
        ("entries per delete", lambda r: f"{r.median_of(per_delete):.2f}"),
        ("receives in flight (mean)", lambda r: f"{r.in_flight(RECEIVE_MESSAGE):.2f}"),
        ("deletes in flight (mean)", lambda r: f"{r.in_flight(DELETE_BATCH):.2f}"),
        ("Redis round trips / msg", redis_cell),
    ])


def redis_kinds(row: Throughput) -> str:
    """(d)'s Redis round trips per 1,000 messages, by kind (the median run's of each)."""
    def count(kind: str) -> Callable[[SqsRun], float]:
        return lambda run: (run.redis or Counter())[kind]

    kinds = sorted({kind for run in row.runs for kind in (run.redis or {})})
    return ", ".join(f"{kind} {row.per_message(count(kind)) * 1000:,.1f}" for kind in kinds)


def profile_table(profiles: dict[str, StageProfile],
                  results: dict[str, Throughput]) -> list[str]:
    """µs/msg per stage under cProfile, and (c)'s scaled to its unprofiled cost (as in
    ``benchmarks.redis_streams``)."""
    profiled, timed = profiles[SUB], results[SUB]
    scale = ((timed.cpu_micros_per_message - timed.gc_micros_per_message)
             / profiled.total_of(CPU_STAGES))
    return stage_table(
        profiles, STAGES, reference=SUB, scaled="(c) scaled to unprofiled µs/msg", scale=scale,
        total=timed.micros_per_message, unscaled=[IO_WAIT],
        rows=[(GC_ROW, timed.gc_micros_per_message), (IDLE_ROW, timed.idle_micros_per_message)])


def report(results: dict[str, Throughput], profiles: dict[str, StageProfile],
           args: argparse.Namespace, load: tuple[float, float], warmup: list[float],
           redis_version: str) -> str:
    raw, sub, full = results[RAW], results[SUB], results[SUB_DEDUP]
    sub_profile, raw_profile = profiles[SUB], profiles[RAW]
    # (c)'s unprofiled CPU (less GC) spread over its profiled CPU stages, as in the table
    scale = ((sub.cpu_micros_per_message - sub.gc_micros_per_message)
             / sub_profile.total_of(CPU_STAGES))
    raw_requests, sub_requests, dedup_requests = (
        row.per_message(lambda run: run.counts.http) for row in (raw, sub, full))
    return render(
        "sqs", measured_on=measured_on(args.command), elasticmq=jar_version("elasticmq"),
        jvm=" ".join(SERVER_JVM_OPTIONS), redis_version=redis_version,
        versions=versions("aiobotocore", "botocore", "aiohttp", "redis"),
        load=load[0], load_end=load[1], messages=args.messages, repetitions=args.repetitions,
        warmup_passes=len(warmup), warmup_rates=" then ".join(f"{r:,.0f}" for r in warmup) or "–",
        warmup=args.warmup, body=len(BODY), fill_calls=FILL_CALLS, table=main_table(results),
        requests_table=requests_table(results),
        goals=[paired_goal("(c) / (a)", sub, raw, SUB_VS_RAW),
               paired_goal("(d) / (a)", full, raw, DEDUP_VS_RAW)],
        cpu_sub=raw.cpu_micros_per_message / sub.cpu_micros_per_message,
        cpu_dedup=raw.cpu_micros_per_message / full.cpu_micros_per_message,
        sub_cost=sub.micros_per_message - raw.micros_per_message,
        dedup_cost=full.micros_per_message - sub.micros_per_message,
        sub_cpu_cost=sub.cpu_micros_per_message - raw.cpu_micros_per_message,
        dedup_cpu_cost=full.cpu_micros_per_message - sub.cpu_micros_per_message,
        raw_cpu=raw.cpu_micros_per_message, raw_wall=raw.micros_per_message,
        sub_cpu=sub.cpu_micros_per_message, sub_wall=sub.micros_per_message,
        raw_client=raw_profile.total_of(CLIENT_STAGES) / raw_profile.total_of(CPU_STAGES),
        sub_client=sub_profile.total_of(CLIENT_STAGES) / sub_profile.total_of(CPU_STAGES),
        client_scaled=sub_profile.total_of(CLIENT_STAGES) * scale,
        per_call=sub_profile.total_of(CLIENT_STAGES) * scale / sub_requests,
        user_agent=sub_profile.micros[USER_AGENT] / sub_profile.total_of(CLIENT_STAGES),
        ours_scaled=sub_profile.total_of(OUR_STAGES) * scale, sub_gc=sub.gc_micros_per_message,
        raw_gc=raw.gc_micros_per_message,
        raw_receives=raw.in_flight(RECEIVE_MESSAGE), sub_receives=sub.in_flight(RECEIVE_MESSAGE),
        per_receive=BATCH * DEFAULT_RECEIVE_CALLS,
        raw_requests=raw_requests, sub_requests=sub_requests, dedup_requests=dedup_requests,
        dedup_trips=full.per_message(lambda run: (run.redis or Counter()).total()),
        redis_kinds=redis_kinds(full), profiled_messages=args.profiled_messages,
        profile_table=profile_table(profiles, results), raw_loops=RAW_LOOPS,
        raw_wait=RAW_WAIT, batch=BATCH, ack_deadline=ACK_DEADLINE, pool=POOL,
        receive_calls=DEFAULT_RECEIVE_CALLS, receive_batch=RECEIVE_BATCH,
        receive_timeout=RECEIVE_TIMEOUT, shutdown_timeout=SHUTDOWN_TIMEOUT)


async def everything(args: argparse.Namespace, options: dict[str, str], pid: int) -> str:
    redis = aioredis.Redis.from_url(args.redis)
    control, context = await client_of(options)
    try:
        await redis.ping()
        redis_version = str((await redis.info("server"))["redis_version"])
        load = os.getloadavg()[0]
        bench = Bench(options, pid, Queues(control), redis, args.redis)
        warmup = await warm_server(bench, args.messages, args.warmup_passes)
        results = await interleaved(bench.run_once, VARIANTS,
                                    lambda v: Throughput(v, args.messages), args.messages,
                                    args.repetitions, args.warmup)
        profiles = await profile(bench, args.profiled_messages)
        return report(results, profiles, args, (load, os.getloadavg()[0]), warmup,
                      redis_version)
    finally:
        await context.__aexit__(None, None, None)
        await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--redis", default=DEFAULT_REDIS,
                        help=f"Redis URL for (d) (default {DEFAULT_REDIS})")
    add_runs(parser, DEFAULT_MESSAGES, DEFAULT_REPETITIONS, quick=QUICK,
             messages_help=f"messages per run (default {DEFAULT_MESSAGES:,})")
    parser.add_argument("--write", action="store_true", help="write the README section")
    args = parser.parse_args(argv)
    check_main(parser, args, SECTION_NAME, STAGE_RULES, markers=False)
    apply_quick(args, WARMUP_MESSAGES, QUICK)
    args.warmup_passes = 0 if args.quick else SERVER_WARMUP_PASSES
    args.profiled_messages = args.warmup if args.quick else PROFILED_MESSAGES
    args.command = command_line("sqs", argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-sqs-") as directory:
        elasticmq = server(Path(directory))
        elasticmq.start()
        try:
            assert elasticmq.process is not None
            section = asyncio.run(everything(args, elasticmq.client_options,
                                             elasticmq.process.pid))
        finally:
            elasticmq.kill()
    publish(SECTION_NAME, section, write=args.write, append=True, started=started)


if __name__ == "__main__":
    main()
