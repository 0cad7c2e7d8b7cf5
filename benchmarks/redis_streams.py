"""Throughput on Redis Streams: the Subscriber against a raw redis-py loop and FastStream.

    python -m benchmarks.redis_streams            # print the tables
    python -m benchmarks.redis_streams --write    # ... and rewrite the README section

Every run drains a fresh ``COPY`` of one pre-published template stream with a fresh group at
``0`` (unique key names, deleted afterwards), timed by ``benchmarks._brokers.drain``; then one
instrumented run per variant counts round trips, and (a), (c), (d), (e) are profiled. The
variants and the method are described in ``templates/redis_streams.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import redis.utils
from faststream.redis import RedisBroker, StreamSub
from faststream.redis.schemas import stream_sub as faststream_stream_sub
from redis.commands.core import AsyncScript

from benchmarks import _brokers
from benchmarks._brokers import (
    POLL_INTERVAL,
    RUN_DEADLINE,
    SCAN_COUNT,
    Consumer,
    LoopConsumer,
    SubscriberConsumer,
    Tally,
    count_in,
    delete_keys,
    drain,
    faststream_handler,
)
from benchmarks._common import README, StageProfile, interleaved, pipeline_rules, rule
from benchmarks._harness import (
    CpuThroughput,
    Run,
    add_runs,
    broker_table,
    check_main,
    command_line,
    measured_on,
    paired,
    profile_stages,
    publish,
    render,
    stage_table,
    versions,
)
from reliable_sub import Subscriber
from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
from reliable_sub.dedup import RedisDedupStore
from reliable_sub.subscriber import RECEIVE_BATCH

__all__ = ["POLL_INTERVAL", "RUN_DEADLINE", "Tally", "count_in", "delete_keys"]  # telemetry's

DEFAULT_URL = "redis://127.0.0.1:6379/0"
# Enough entries that the raw loop runs for ~0.15 s (start-up and the poll interval are noise);
# FastStream's one-message-per-call mode needs ~7 s for them, which bounds the whole run.
DEFAULT_MESSAGES = 20_000
# Seven, not five: other processes on a 2-core machine (Redis itself, test suites) make single
# runs vary by up to 2x; the median of seven interleaved runs is steadier.
DEFAULT_REPETITIONS = 7
# A short untimed run of every variant first: imports, connections, script loads, code caches.
WARMUP_MESSAGES = 2_000
PAYLOAD = b"x" * 64
# XADDs per pipeline round trip while publishing the template streams (not timed).
PUBLISH_CHUNK = 1_000
# Entries per read for every variant: the Subscriber's receive batch.
READ_COUNT = RECEIVE_BATCH
# The raw loop blocks this long in an empty XREADGROUP; it never waits in a run (all published).
RAW_BLOCK_MS = 1_000
# The subscription's ack deadline for the Subscriber runs (entries idle longer are reclaimed).
ACK_DEADLINE = 30.0
# Seconds the Subscriber gets to stop; nothing is in flight when it is asked to.
SHUTDOWN_TIMEOUT = 5.0

# Goals from the issue.
NO_DEDUP_MIN_RATIO = 0.3  # (c) >= 0.3x the raw loop, and ahead of FastStream's batch mode
DEDUP_MIN_RATIO = 0.15  # (d) >= 0.15x the raw loop ...
DEDUP_MIN_FACTOR_OVER_FASTSTREAM = 5.0  # ... and >= 5x FastStream one message per call
BATCH_MIN_RATIO = 0.85  # (e) >= 0.85x the raw loop ...
BATCH_MIN_FACTOR_OVER_FASTSTREAM = 1.5  # ... and >= 1.5x FastStream's batch mode
# For scale, the issue's own measurement on this machine kind (2026-11-22), msgs/s.
ISSUE_RAW_RATE = 146_000
ISSUE_FASTSTREAM_RATE = 2_900
ISSUE_FASTSTREAM_BATCH_RATE = 29_000

RAW = "(a) raw redis-py loop: XREADGROUP COUNT 100, one XACK per batch"
FS_ONE = "(b1) FastStream StreamSub, one message per call"
FS_BATCH = "(b2) FastStream StreamSub, batch=True"
SUB = "(c) Subscriber(RedisStreamsAdapter), no dedup"
SUB_DEDUP = "(d) Subscriber + RedisDedupStore"
SUB_BATCH = "(e) Subscriber, batch=True handler, no dedup"
VARIANTS = (RAW, FS_ONE, FS_BATCH, SUB, SUB_DEDUP, SUB_BATCH)
SLUGS = {RAW: "raw", FS_ONE: "fs1", FS_BATCH: "fsb", SUB: "sub", SUB_DEDUP: "dedup",
         SUB_BATCH: "batch"}
PROFILED = (RAW, SUB, SUB_DEDUP, SUB_BATCH)

SECTION_NAME = "redis_streams"

# Every key this process writes starts with this (letters, digits, '-' and ':' only: it is also
# a SCAN pattern).
KEY_PREFIX = f"bench-redis-streams-{uuid.uuid4().hex[:8]}"


# -- keys --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunKeys:
    """The names one run uses; every key it writes starts with ``base``."""

    base: str

    def __getattr__(self, name: str) -> str:
        """``stream``, ``group``, ``consumer``, ``adapter_prefix``, ``dedup_prefix``."""
        if name in ("stream", "group", "consumer", "adapter_prefix", "dedup_prefix"):
            return f"{self.base}:{name.removesuffix('_prefix')}"
        raise AttributeError(name)


_run_numbers: Counter[str] = Counter()


def next_keys(variant: str) -> RunKeys:
    slug = SLUGS[variant]
    _run_numbers[slug] += 1
    return RunKeys(f"{KEY_PREFIX}:{slug}:{_run_numbers[slug]}")


async def publish_template(control: aioredis.Redis, name: str, entries: int) -> None:
    """A stream of ``entries`` entries, published with pipelined XADDs (not timed)."""
    for start in range(0, entries, PUBLISH_CHUNK):
        async with control.pipeline(transaction=False) as pipe:
            for _ in range(min(PUBLISH_CHUNK, entries - start)):
                pipe.xadd(name, {"data": PAYLOAD})
            await pipe.execute()
    if await control.xlen(name) != entries:
        raise RuntimeError(f"template {name!r} has {await control.xlen(name)} entries")


# -- round-trip counting -----------------------------------------------------------------------


@dataclass
class RoundTrips:
    """Round trips and commands sent through the instrumented clients, by name."""

    script_names: dict[str, str] = field(default_factory=dict)
    round_trips: Counter[str] = field(default_factory=Counter)
    commands: Counter[str] = field(default_factory=Counter)
    deepcopies: int = 0

    def name_scripts(self, owner: object) -> None:
        """Label EVALSHA calls of the scripts ``owner`` registered by its attribute names.

        ``_ack_complete`` is labelled ``ack_complete``, ``_claim_script`` ``claim``.
        """
        for attribute, value in vars(owner).items():
            if isinstance(value, AsyncScript):
                name = attribute.strip("_").removesuffix("_script")
                self.script_names[value.sha] = f"EVALSHA {name}"

    def _label(self, args: tuple[Any, ...]) -> str:
        command = str(args[0]).upper()
        if command == "EVALSHA" and len(args) > 1:
            return self.script_names.get(str(args[1]), "EVALSHA (other)")
        return command

    def install(self, client: aioredis.Redis) -> None:
        """Count every command and pipeline ``client`` sends from now on (instance attributes)."""
        send: Callable[..., Awaitable[Any]] = client.execute_command
        make_pipeline = client.pipeline

        async def execute_command(*args: Any, **options: Any) -> Any:
            label = self._label(args)
            self.round_trips[label] += 1
            self.commands[label] += 1
            return await send(*args, **options)

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = make_pipeline(*args, **kwargs)
            run = pipe.execute

            async def execute(raise_on_error: bool = True) -> Any:
                queued = Counter(self._label(args) for args, _ in pipe.command_stack)
                self.round_trips["pipeline of " + "+".join(sorted(queued))] += 1
                self.commands.update(queued)
                return await run(raise_on_error)

            pipe.execute = execute  # type: ignore[method-assign]
            return pipe

        client.execute_command = execute_command  # type: ignore[method-assign]
        client.pipeline = pipeline  # type: ignore[method-assign]

    @contextlib.contextmanager
    def counting_deepcopies(self) -> Iterator[None]:
        """Count the deep copies FastStream's ``StreamSub.add_prefix`` makes."""
        namespace = vars(faststream_stream_sub)  # it calls the deepcopy it imported
        original: Callable[..., Any] = namespace["deepcopy"]

        def deepcopy(value: Any, memo: Any = None) -> Any:
            self.deepcopies += 1
            return original(value, memo)

        namespace["deepcopy"] = deepcopy
        try:
            yield
        finally:
            namespace["deepcopy"] = original


# -- the consumers -----------------------------------------------------------------------------


class RedisRun:
    """What a consumer of one run shares: the control client, URL, keys, round-trip counter."""

    def __init__(self, control: aioredis.Redis, url: str, keys: RunKeys,
                 counter: RoundTrips | None = None) -> None:
        self.control, self.url, self.keys, self.counter = control, url, keys, counter

    def count(self, client: aioredis.Redis, *script_owners: object) -> None:
        if self.counter is not None:
            self.counter.install(client)
            for owner in script_owners:
                self.counter.name_scripts(owner)

    async def create_group(self) -> None:
        await self.control.xgroup_create(self.keys.stream, self.keys.group, id="0")


class RawConsumer(LoopConsumer):
    """``(a)``: XREADGROUP COUNT 100 → await the handler for each entry → one XACK."""

    def __init__(self, run: RedisRun, tally: Tally, total: int) -> None:
        super().__init__(tally, total)
        self.run, self.keys = run, run.keys
        self.client = aioredis.Redis.from_url(run.url, decode_responses=False)

    async def prepare(self) -> None:
        await self.run.create_group()
        await self.client.ping()
        self.run.count(self.client)

    async def handle_entry(self, fields: dict[bytes, bytes]) -> None:
        """The handler under test: does nothing but count."""
        self.tally.handled += 1

    async def raw_read(self) -> Any:
        return await self.client.xreadgroup(self.keys.group, self.keys.consumer,
                                            {self.keys.stream: ">"}, count=READ_COUNT,
                                            block=RAW_BLOCK_MS)

    async def raw_ack(self, ids: list[bytes]) -> None:
        await self.client.xack(self.keys.stream, self.keys.group, *ids)

    async def loop(self) -> None:
        handled = 0
        while handled < self.total:
            for _stream, entries in await self.raw_read():
                ids = []
                for entry_id, fields in entries:
                    await self.handle_entry(fields)
                    ids.append(entry_id)
                await self.raw_ack(ids)
                handled += len(ids)

    async def close(self) -> None:
        await self.client.aclose()


class RedisFastStream(_brokers.FastStreamConsumer):
    """``(b1)``/``(b2)``: FastStream's stream subscriber with a consumer group."""

    def __init__(self, run: RedisRun, tally: Tally, total: int, *, batch: bool,
                 middlewares: Sequence[Any] = ()) -> None:
        super().__init__(tally, total)
        self.run = run
        # logger=None turns FastStream's per-message logging off (its docs' way; not in its types)
        self.broker = RedisBroker(run.url, logger=None,  # type: ignore[arg-type]
                                  middlewares=tuple(middlewares))
        stream = StreamSub(run.keys.stream, group=run.keys.group, consumer=run.keys.consumer,
                           batch=batch, max_records=READ_COUNT)
        self.broker.subscriber(stream=stream)(faststream_handler(tally, batch=batch))

    async def prepare(self) -> None:
        await self.run.create_group()  # at 0; FastStream would create it at $
        client = await self.broker.connect()
        await client.ping()
        self.run.count(client)


class RedisSubscriber(SubscriberConsumer):
    """``(c)``/``(d)``/``(e)``: our Subscriber on the RedisStreamsAdapter, with or without
    dedup, with a handler of one message or a batch handler (and the Subscriber's other
    ``options``: ``benchmarks.telemetry``'s providers)."""

    def __init__(self, run: RedisRun, tally: Tally, total: int, *, dedup: bool,
                 batch: bool = False, **options: Any) -> None:
        keys = run.keys
        self.run = run
        self.adapter = RedisStreamsAdapter(run.url, consumer=keys.consumer,
                                           key_prefix=keys.adapter_prefix)
        self.store = (RedisDedupStore(self.adapter.client, prefix=keys.dedup_prefix)
                      if dedup else None)
        super().__init__(tally, total, Subscriber(self.adapter, dedup=self.store, **options),
                         SHUTDOWN_TIMEOUT)
        count_in(self.subscriber, keys.group, tally, batch=batch)

    async def prepare(self) -> None:
        await self.adapter.ensure_subscription(self.run.keys.stream, self.run.keys.group,
                                               ack_deadline=ACK_DEADLINE, start="0")
        await self.adapter.client.ping()
        self.run.count(self.adapter.client, self.adapter,
                       *([self.store] if self.store is not None else []))

    async def release(self) -> None:
        await self.adapter.close()


def make_consumer(variant: str, run: RedisRun, tally: Tally, total: int) -> Consumer:
    if variant == RAW:
        return RawConsumer(run, tally, total)
    if variant in (FS_ONE, FS_BATCH):
        return RedisFastStream(run, tally, total, batch=variant == FS_BATCH)
    return RedisSubscriber(run, tally, total, dedup=variant == SUB_DEDUP,
                           batch=variant == SUB_BATCH)


# -- one run -----------------------------------------------------------------------------------


def no_pending(control: aioredis.Redis, keys: RunKeys) -> Callable[[], Awaitable[bool]]:
    """Whether ``XPENDING`` shows nothing pending for the run's group."""

    async def settled() -> bool:
        return (await control.xpending(keys.stream, keys.group))["pending"] == 0

    return settled


async def verify_group(control: aioredis.Redis, keys: RunKeys, total: int) -> None:
    """Everything read, nothing lagging, nothing pending (Redis's own view, after the clock)."""
    for group in await control.xinfo_groups(keys.stream):
        if group["name"].decode() == keys.group:
            read, lag, pending = group["entries-read"], group["lag"], group["pending"]
            if (read, lag, pending) != (total, 0, 0):
                raise RuntimeError(
                    f"group {keys.group}: entries-read {read}, lag {lag}, pending {pending}; "
                    f"expected {total}, 0, 0"
                )
            return
    raise RuntimeError(f"group {keys.group} not found")


@dataclass
class Bench:
    """What every run needs: the control client, the URL and the template streams."""

    control: aioredis.Redis
    url: str
    templates: dict[int, str] = field(default_factory=dict)

    async def template(self, entries: int) -> str:
        if entries not in self.templates:
            name = f"{KEY_PREFIX}:template:{entries}"
            await publish_template(self.control, name, entries)
            self.templates[entries] = name
        return self.templates[entries]

    async def run_once(self, variant: str, entries: int, *,
                       profiler: cProfile.Profile | None = None,
                       counter: RoundTrips | None = None) -> Run:
        """Consume a fresh copy of the ``entries``-entry template with ``variant``."""
        control, keys, tally = self.control, next_keys(variant), Tally()
        if not await control.copy(await self.template(entries), keys.stream):
            raise RuntimeError(f"COPY to {keys.stream} failed (key exists?)")
        consumer = make_consumer(variant, RedisRun(control, self.url, keys, counter), tally,
                                 entries)
        try:
            await consumer.prepare()
            with (counter.counting_deepcopies() if counter is not None
                  else contextlib.nullcontext()):
                run = await drain(consumer, no_pending(control, keys), profiler)
                await consumer.stop()
            await verify_group(control, keys, entries)
            consumer.check()
        finally:
            await consumer.close()
            await delete_keys(control, f"{keys.base}:*")
        return run


async def count_round_trips(bench: Bench, messages: int) -> dict[str, RoundTrips]:
    """One untimed, instrumented run of every variant."""
    counts = {}
    for variant in VARIANTS:
        counts[variant] = RoundTrips()
        await bench.run_once(variant, messages, counter=counts[variant])
    return counts


# -- profile -----------------------------------------------------------------------------------

RECEIVE = "receive: XREADGROUP round trip (send, hiredis parse), entries → Delivery/Message"
LEASE = "lease: add / claim_ttl / started / finish, histogram"
DEDUP_CLAIM = "dedup claim_many: keys, claim script round trip, results"
TASK = "handler dispatch: admit, a task per delivery, run/attempt, handler"
SETTLE = "settle: result JSON, Settler, completions + ack script round trip (XACK in (a))"
FLOW = "flow control (slots, bytes, events)"
SOCKET = "socket reads (asyncio transport callbacks, StreamReader)"
LOOP = "event loop: scheduling, task steps, done callbacks"
IO_WAIT = "idle in epoll: waiting for Redis replies"
HARNESS = "benchmark drain poller"
STAGES = (RECEIVE, LEASE, DEDUP_CLAIM, TASK, SETTLE, FLOW, SOCKET, LOOP, IO_WAIT, HARNESS)
CPU_STAGES = tuple(stage for stage in STAGES if stage != IO_WAIT)
GC_ROW = "cyclic GC (timed runs; off while profiling)"
IDLE_ROW = "idle: waiting for Redis (timed runs: wall − process CPU)"


THIS_FILE = "benchmarks/redis_streams.py"
BROKERS_FILE = "benchmarks/_brokers.py"
ADAPTER_FILE = "adapters/redis_streams.py"
# The first matching rule wins. Everything unmatched (redis-py, asyncio streams, tenacity,
# dataclass __init__s, builtins, helpers shared by two stages) takes the stages of its callers.
STAGE_RULES = (
    *pipeline_rules(receive=RECEIVE, lease=LEASE, task=TASK, settle=SETTLE, flow=FLOW,
                    loop=LOOP, io_wait=IO_WAIT),
    rule(RECEIVE, ADAPTER_FILE, "receive", "_read_new", "_reclaim_due", "_delivery", "_unreadable",
         "_malformed", "<lambda>", "_text", "_subscription"),
    rule(RECEIVE, "adapters/_redis_entries.py"),
    rule(RECEIVE, "reliable_sub/entries.py", "read_each"),
    rule(RECEIVE, THIS_FILE, "raw_read"),
    rule(DEDUP_CLAIM, "reliable_sub/_runtime/claims.py", "claim", "refresh", "key_of"),
    rule(DEDUP_CLAIM, "reliable_sub/dedup/_redis.py", "claim_many", "redis_key", "_key_part",
         "_namespace_tag", "_remaining"),
    rule(DEDUP_CLAIM, "reliable_sub/dedup/_store_base.py", "next", "__init__", "claim"),
    rule(DEDUP_CLAIM, "reliable_sub/message.py", "idempotency_key"),
    rule(TASK, "reliable_sub/_runtime/batches.py"),
    rule(TASK, THIS_FILE, "loop", "handle_entry"),
    rule(TASK, BROKERS_FILE, "handle_message", "handle_batch"),
    rule(SETTLE, "reliable_sub/_runtime/decisions.py", "encode"),
    rule(SETTLE, "reliable_sub/_runtime/claims.py", "completion", "release", "forget"),
    rule(SETTLE, "reliable_sub/_results.py", "encode_result", "checked_result_json"),
    rule(SETTLE, "reliable_sub/dedup/_redis.py", "complete_many", "completion_records",
         "same_server"),
    rule(SETTLE, "reliable_sub/_redis_clients.py", "same_server"),
    rule(SETTLE, ADAPTER_FILE, "ack", "ack_with_completions", "shares_store", "_by_subscription"),
    rule(SETTLE, THIS_FILE, "raw_ack"),
    rule(SOCKET, "asyncio/selector_events.py", "_read_ready", "_read_ready__get_buffer",
         "_read_ready__data_received"),
    rule(HARNESS, BROKERS_FILE, "wait_drained"),
)


async def profile(bench: Bench, messages: int) -> dict[str, StageProfile]:
    profiles = {}
    for variant in PROFILED:
        profiler = cProfile.Profile()
        await bench.run_once(variant, messages, profiler=profiler)
        profiles[variant] = profile_stages(profiler, variant, messages, STAGE_RULES, STAGES, LOOP)
    return profiles


# -- report ------------------------------------------------------------------------------------

# (variant, baseline, factor, text): variant at no less than factor times baseline (strictly
# more when the factor is 1)
GOALS = (
    (SUB, RAW, NO_DEDUP_MIN_RATIO, f"(c) ≥ {NO_DEDUP_MIN_RATIO}× (a)"),
    (SUB, FS_BATCH, 1.0, "(c) ahead of FastStream with batch=True"),
    (SUB_DEDUP, RAW, DEDUP_MIN_RATIO, f"(d) ≥ {DEDUP_MIN_RATIO}× (a)"),
    (SUB_DEDUP, FS_ONE, DEDUP_MIN_FACTOR_OVER_FASTSTREAM,
     f"(d) ≥ {DEDUP_MIN_FACTOR_OVER_FASTSTREAM:g}× FastStream one message per call"),
    (SUB_BATCH, RAW, BATCH_MIN_RATIO, f"(e) ≥ {BATCH_MIN_RATIO}× (a)"),
    (SUB_BATCH, FS_BATCH, BATCH_MIN_FACTOR_OVER_FASTSTREAM,
     f"(e) ≥ {BATCH_MIN_FACTOR_OVER_FASTSTREAM:g}× FastStream with batch=True"),
)


def goal_lines(results: dict[str, CpuThroughput]) -> list[str]:
    """Each goal on the medians, and how many interleaved repetitions met it on their own."""
    lines = []
    for variant, baseline, factor, text in GOALS:
        ours, theirs = results[variant], results[baseline]

        def met(ratio: float, factor: float = factor) -> bool:
            return ratio > 1.0 if factor == 1.0 else ratio >= factor

        ratio = ours.median / theirs.median
        _, repetitions = paired(ours.rates, theirs.rates, met)
        lines.append(
            f"- {'yes' if met(ratio) else '**no**'}: {text} — {ours.median:,.0f} vs "
            f"{theirs.median:,.0f} msgs/s, {ratio:.3f}× ({repetitions})"
        )
    return lines


def completion_path(counter: RoundTrips) -> str:
    """How (d)'s completions reached Redis, as the instrumented run saw it."""
    labels = list(counter.round_trips)
    if any(label.startswith("pipeline") for label in labels):
        return "as a pipeline of `SET … PX` per settled batch, then the batch's ack script"
    if any("complete" in label for label in labels):
        return (
            "in the adapter's ack script, in the same call as the batch's XACK (the fast path "
            "for a store on the adapter's Redis)"
        )
    return "as the round-trip table shows"


def round_trip_table(counts: dict[str, RoundTrips], messages: int) -> list[str]:
    lines = [
        "| Variant | round trips / msg | commands sent / msg | round trips by kind, per 1,000 msgs "
        "| StreamSub deep copies / msg |",
        "|---|---:|---:|---|---:|",
    ]
    for variant, counter in counts.items():
        kinds = ", ".join(
            f"{label} {count * 1000 / messages:,.1f}"
            for label, count in counter.round_trips.most_common()
        )
        copies = f"{counter.deepcopies / messages:.2f}" if variant in (FS_ONE, FS_BATCH) else "–"
        lines.append(
            f"| {variant} | {counter.round_trips.total() / messages:.4f} | "
            f"{counter.commands.total() / messages:.4f} | {kinds} | {copies} |"
        )
    return lines


def profile_table(profiles: dict[str, StageProfile],
                  results: dict[str, CpuThroughput]) -> list[str]:
    """µs/msg per stage under cProfile, and (d)'s scaled to its unprofiled cost.

    The scaled column spreads (d)'s unprofiled process CPU µs/msg, less its GC time, over the CPU
    stages in proportion, and shows the GC time and the unprofiled idle time (wall − CPU) as rows
    of their own, so it adds up to the unprofiled µs/msg.
    """
    full, timed = profiles[SUB_DEDUP], results[SUB_DEDUP]
    scale = (timed.cpu_micros_per_message - timed.gc_micros_per_message) / full.total_of(CPU_STAGES)
    return stage_table(
        profiles, STAGES, reference=SUB_DEDUP, scaled="(d) scaled to unprofiled µs/msg",
        scale=scale, total=timed.micros_per_message, unscaled=[IO_WAIT],
        rows=[(GC_ROW, timed.gc_micros_per_message),
              (IDLE_ROW, timed.idle_micros_per_message)])


def report(
    results: dict[str, CpuThroughput],
    counts: dict[str, RoundTrips],
    profiles: dict[str, StageProfile],
    command: str,
    messages: int,
    repetitions: int,
    server: str,
    load: float,
) -> str:
    raw, sub, full = results[RAW], results[SUB], results[SUB_DEDUP]
    return render(
        "redis_streams", measured_on=measured_on(command), server=server,
        versions=versions("redis", "hiredis", "faststream"),
        hiredis=redis.utils.HIREDIS_AVAILABLE, load=load, messages=messages,
        repetitions=repetitions, table=broker_table(results, RAW), goal_lines=goal_lines(results),
        sub_cost=sub.micros_per_message - raw.micros_per_message,
        dedup_cost=full.micros_per_message - sub.micros_per_message,
        ISSUE_RAW_RATE=ISSUE_RAW_RATE, ISSUE_FASTSTREAM_RATE=ISSUE_FASTSTREAM_RATE,
        ISSUE_FASTSTREAM_BATCH_RATE=ISSUE_FASTSTREAM_BATCH_RATE, READ_COUNT=READ_COUNT,
        RECEIVE_BATCH=RECEIVE_BATCH, ACK_DEADLINE=ACK_DEADLINE,
        completions=completion_path(counts[SUB_DEDUP]), poll_ms=POLL_INTERVAL * 1000,
        round_trips=round_trip_table(counts, messages),
        profile_table=profile_table(profiles, results))


async def with_bench(url: str, work: Callable[[Bench], Awaitable[Any]]) -> Any:
    """Run ``work`` with a control client; delete every key this process wrote, whatever happens."""
    control = aioredis.Redis.from_url(url, decode_responses=False)
    try:
        await control.ping()
        return await work(Bench(control, url))
    finally:
        await delete_keys(control, f"{KEY_PREFIX}:*")
        left = [key async for key in control.scan_iter(match=f"{KEY_PREFIX}*", count=SCAN_COUNT)]
        await control.aclose()
        if left:
            print(f"warning: {len(left)} benchmark keys left in Redis: {left[:5]}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", default=DEFAULT_URL, help=f"Redis URL (default {DEFAULT_URL})")
    add_runs(parser, DEFAULT_MESSAGES, DEFAULT_REPETITIONS)
    parser.add_argument("--write", action="store_true", help=f"rewrite the section in {README}")
    args = parser.parse_args(argv)
    check_main(parser, args, SECTION_NAME, STAGE_RULES)
    command = command_line("redis_streams", argv)

    async def everything(bench: Bench) -> str:
        server = (await bench.control.info("server"))["redis_version"]
        load = os.getloadavg()[0]
        results = await interleaved(bench.run_once, VARIANTS,
                                    lambda v: CpuThroughput(v, args.messages), args.messages,
                                    args.repetitions, WARMUP_MESSAGES)
        counts = await count_round_trips(bench, args.messages)
        profiles = await profile(bench, args.messages)
        return report(
            results, counts, profiles, command, args.messages, args.repetitions, server, load
        )

    started = time.perf_counter()
    publish(SECTION_NAME, asyncio.run(with_bench(args.url, everything)), write=args.write,
            started=started)


if __name__ == "__main__":
    main()
