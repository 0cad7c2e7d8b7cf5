"""Throughput of the full Subscriber pipeline against a bare receive → handle → ack loop.

    python -m benchmarks.memory_pipeline            # print the tables
    python -m benchmarks.memory_pipeline --write    # ... and rewrite the README section

Every run gets a fresh :class:`MemoryAdapter` backlog (``gc.freeze()``-d) and is timed until
``adapter.backlog(subscription) == 0``. The Subscriber runs as a task in the benchmark's own loop,
not with ``start()``, which would add a thread the bare loop does not have. One run per variant
is then profiled. The variants and the method are described in ``templates/memory_pipeline.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import time
from collections.abc import Coroutine
from typing import Any

from benchmarks._common import (
    README,
    StageProfile,
    Throughput,
    interleaved,
    pipeline_rules,
    rule,
)
from benchmarks._harness import (
    RATE_COLUMNS,
    Clock,
    Run,
    add_runs,
    check_main,
    command_line,
    measured_on,
    profile_stages,
    publish,
    render,
    stage_table,
    table,
)
from reliable_sub import MemoryDedupStore, Message, Subscriber
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.subscriber import RECEIVE_BATCH

TOPIC = "bench-topic"
SUBSCRIPTION = "bench-sub"
# Enough messages that even the bare loop runs for ~0.15 s (start-up and the poll interval are
# noise), few enough that all variants x REPETITIONS plus the profile take ~30 s on 2 cores.
DEFAULT_MESSAGES = 50_000
DEFAULT_REPETITIONS = 5
# A short untimed run of every variant first: imports, code caches, allocator pools.
WARMUP_MESSAGES = 2_000
PAYLOAD = b"x" * 64
# The bare loops wait this long in an empty receive; they never wait in a run (all published).
BARE_RECEIVE_TIMEOUT = 1.0
# How often the drain poller looks at the backlog; bounds the timing error of one run.
POLL_INTERVAL = 0.001
# A run that has not drained after this many seconds is a hang, not a slow result.
RUN_DEADLINE = 60.0
# Seconds the Subscriber gets to stop; nothing is in flight when it is asked to.
SHUTDOWN_TIMEOUT = 5.0
# The aim: the full pipeline at no less than this fraction of the bare loop's rate.
TARGET_RATIO = 0.5

BARE = "bare loop"
BARE_TASKS = "bare loop, task per message (reference)"
SUB_NO_DEDUP = "Subscriber (no dedup)"
SUB_DEDUP = "Subscriber + MemoryDedupStore"
VARIANTS = (BARE, BARE_TASKS, SUB_NO_DEDUP, SUB_DEDUP)

SECTION_NAME = "memory_pipeline"


async def noop_handler(message: Message) -> None:
    """The handler under test: a coroutine function that does nothing."""


# -- one run -----------------------------------------------------------------------------------


def fresh_adapter(messages: int) -> MemoryAdapter:
    """A new broker whose subscription holds ``messages`` published, unreceived messages."""
    adapter = MemoryAdapter()
    adapter.ensure_subscription_sync(TOPIC, SUBSCRIPTION)
    for _ in range(messages):
        adapter.publish_sync(TOPIC, PAYLOAD)
    return adapter


async def bare_loop(adapter: MemoryAdapter, total: int) -> None:
    """Receive a batch, await the handler for each message, ack the batch; nothing else."""
    handled = 0
    while handled < total:
        deliveries = await adapter.receive(SUBSCRIPTION, RECEIVE_BATCH, BARE_RECEIVE_TIMEOUT)
        for delivery in deliveries:
            await noop_handler(delivery.message)
        await adapter.ack(deliveries)
        handled += len(deliveries)


async def bare_task_per_message(adapter: MemoryAdapter, total: int) -> None:
    """Like :func:`bare_loop`, but the handlers of a batch run concurrently, one task each."""
    handled = 0
    while handled < total:
        deliveries = await adapter.receive(SUBSCRIPTION, RECEIVE_BATCH, BARE_RECEIVE_TIMEOUT)
        await asyncio.gather(*(noop_handler(delivery.message) for delivery in deliveries))
        await adapter.ack(deliveries)
        handled += len(deliveries)


async def wait_drained(adapter: MemoryAdapter, consumer: asyncio.Task[None]) -> float:
    """Poll until every message is acked; return ``time.perf_counter()`` at that moment."""
    give_up_at = time.perf_counter() + RUN_DEADLINE
    while True:
        now = time.perf_counter()
        if adapter.backlog(SUBSCRIPTION) == 0:
            return now
        if consumer.done():  # a consumer that died would otherwise look like a slow one
            consumer.result()
            raise RuntimeError("the consumer stopped before the backlog drained")
        if now > give_up_at:
            raise TimeoutError(
                f"{adapter.backlog(SUBSCRIPTION)} messages still unacked after {RUN_DEADLINE}s"
            )
        await asyncio.sleep(POLL_INTERVAL)


async def drain(adapter: MemoryAdapter, consumer: Subscriber | Coroutine[Any, Any, None],
                profiler: cProfile.Profile | None = None, *, cpu: bool = False) -> Run:
    """Time ``consumer`` (a Subscriber, served, or a bare loop) draining ``adapter``; stop it
    after the clock.

    The published backlog is kept out of the collector's way: with a real broker it would not
    be in the consumer's heap at all.
    """
    subscriber = consumer if isinstance(consumer, Subscriber) else None
    gc.collect()
    gc.freeze()
    task: asyncio.Task[None] | None = None
    try:
        with Clock(profiler, cpu=cpu) as clock:
            task = asyncio.create_task(consumer.serve() if subscriber is not None else consumer)
            clock.stop(await wait_drained(adapter, task))
    finally:  # stopping is not timed
        if subscriber is not None:
            await subscriber.shutdown(SHUTDOWN_TIMEOUT)
        if task is not None:
            await task
        gc.unfreeze()
    return clock.run()


async def run_once(variant: str, messages: int, profiler: cProfile.Profile | None = None) -> Run:
    """Consume ``messages`` pre-published messages with ``variant`` (wall and GC time only)."""
    adapter = fresh_adapter(messages)
    if variant not in (SUB_NO_DEDUP, SUB_DEDUP):
        bare = bare_task_per_message if variant == BARE_TASKS else bare_loop
        return await drain(adapter, bare(adapter, messages), profiler)
    subscriber = Subscriber(adapter, dedup=MemoryDedupStore() if variant == SUB_DEDUP else None)
    subscriber.handler(SUBSCRIPTION)(noop_handler)
    run = await drain(adapter, subscriber, profiler)
    if sum(subscriber.stats.outcomes.values()) != messages:
        raise RuntimeError(f"{variant}: outcomes {dict(subscriber.stats.outcomes)}")
    return run


async def measure(messages: int, repetitions: int) -> dict[str, Throughput[Run]]:
    """Warm every variant up, then time them round-robin so drift hits all of them alike."""
    return await interleaved(run_once, VARIANTS, lambda v: Throughput(v, messages), messages,
                             repetitions, WARMUP_MESSAGES)


# -- profile -----------------------------------------------------------------------------------

RECEIVE = "receive (adapter.receive, tenacity wrapper)"
LEASE = "lease add / started / finished / drop, histogram"
DEDUP = "dedup claim / complete (key, lock, JSON)"
TASK = "task per delivery, handler call (admit, dispatch, run, attempt)"
SETTLE = "settle: queue ack, batched adapter.ack"
FLOW = "flow control (slots, bytes, events)"
LOOP = "event loop: scheduling, task steps, done callbacks"
HARNESS = "benchmark drain poller"
GC_ROW = "cyclic GC (timed runs; off while profiling)"
STAGES = (RECEIVE, LEASE, DEDUP, TASK, SETTLE, FLOW, LOOP, HARNESS)


# The first matching rule wins. Everything unmatched takes the stages of its callers.
STAGE_RULES = (
    *pipeline_rules(receive=RECEIVE, lease=LEASE, task=TASK, settle=SETTLE, flow=FLOW,
                    loop=LOOP),
    rule(RECEIVE, "adapters/memory.py", "receive"),
    rule(RECEIVE, "adapters/_memory_queue.py", "take", "promote", "message", "next_due"),
    rule(DEDUP, "reliable_sub/dedup/_memory.py"),
    rule(DEDUP, "reliable_sub/dedup/_store_base.py"),
    rule(DEDUP, "reliable_sub/_runtime/claims.py"),
    rule(DEDUP, "reliable_sub/message.py", "idempotency_key"),
    rule(TASK, "reliable_sub/_runtime/decisions.py", "encode"),
    rule(TASK, "benchmarks/memory_pipeline.py", "noop_handler", "bare_loop",
         "bare_task_per_message", "<genexpr>"),
    rule(SETTLE, "adapters/memory.py", "ack"),
    rule(SETTLE, "adapters/_memory_queue.py", "release_key", "prune_acked", "compact_lease_heap"),
    rule(HARNESS, "benchmarks/memory_pipeline.py", "wait_drained"),
)


async def profile(messages: int) -> dict[str, StageProfile]:
    profiles = {}
    for variant in VARIANTS:
        profiler = cProfile.Profile()
        await run_once(variant, messages, profiler)
        profiles[variant] = profile_stages(profiler, variant, messages, STAGE_RULES, STAGES, LOOP)
    return profiles


# -- report ------------------------------------------------------------------------------------


def throughput_table(results: dict[str, Throughput[Run]]) -> list[str]:
    bare = results[BARE].median
    return table(results.values(), [
        *RATE_COLUMNS,
        ("µs/msg", lambda r: f"{r.micros_per_message:.1f}"),
        ("of which GC µs/msg", lambda r: f"{r.gc_micros_per_message:.1f}"),
        ("ratio to bare loop", lambda r: f"{r.median / bare:.2f}×"),
    ])


def profile_table(profiles: dict[str, StageProfile],
                  results: dict[str, Throughput[Run]]) -> list[str]:
    """µs/msg per stage under cProfile, and the full pipeline's scaled to its unprofiled cost.

    The profiled runs have GC disabled; the scaled column spreads the unprofiled µs/msg minus the
    GC time of the timed runs over the stages, and shows that GC time as a row of its own.
    """
    full, timed = profiles[SUB_DEDUP], results[SUB_DEDUP]
    unprofiled = timed.micros_per_message
    return stage_table(profiles, STAGES, reference=SUB_DEDUP,
                       scaled="full pipeline, scaled to unprofiled",
                       scale=(unprofiled - timed.gc_micros_per_message) / full.total,
                       total=unprofiled, rows=[(GC_ROW, timed.gc_micros_per_message)])


def reference_note(results: dict[str, Throughput[Run]]) -> str:
    """The aim as a budget of µs per message, and what the task-per-message row uses of it."""
    bare, tasks = results[BARE], results[BARE_TASKS]
    budget = bare.micros_per_message * (1 / TARGET_RATIO - 1)
    cost = tasks.micros_per_message - bare.micros_per_message
    return (
        f"The aim leaves {budget:.1f} µs/msg of overhead on top of the bare loop; running each "
        f"handler in its own task (reference row, {tasks.median / bare.median:.2f}×) costs "
        f"{cost:.1f} µs/msg of that by itself."
    )


def report(
    results: dict[str, Throughput[Run]],
    profiles: dict[str, StageProfile],
    command: str,
    messages: int,
    repetitions: int,
) -> str:
    bare, no_dedup, full = results[BARE], results[SUB_NO_DEDUP], results[SUB_DEDUP]
    ratio = full.median / bare.median
    verdict = "**met**" if ratio >= TARGET_RATIO else "**not met**"
    return render("memory_pipeline", measured_on=measured_on(command), messages=messages,
        repetitions=repetitions, throughput_table=throughput_table(results),
        TARGET_RATIO=TARGET_RATIO, verdict=verdict, ratio=ratio,
        dedup_cost=no_dedup.micros_per_message - bare.micros_per_message,
        store_cost=full.micros_per_message - no_dedup.micros_per_message,
        reference_note=reference_note(results), BARE=BARE, RECEIVE_BATCH=RECEIVE_BATCH,
        BARE_TASKS=BARE_TASKS, SUB_NO_DEDUP=SUB_NO_DEDUP, SUB_DEDUP=SUB_DEDUP,
        poll_ms=POLL_INTERVAL * 1000, profile_table=profile_table(profiles, results))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_runs(parser, DEFAULT_MESSAGES, DEFAULT_REPETITIONS)
    parser.add_argument("--write", action="store_true", help=f"rewrite the section in {README}")
    args = parser.parse_args(argv)
    check_main(parser, args, SECTION_NAME, STAGE_RULES)
    command = command_line("memory_pipeline", argv)

    async def measure_then_profile() -> tuple[dict[str, Throughput[Run]],
                                              dict[str, StageProfile]]:
        return await measure(args.messages, args.repetitions), await profile(args.messages)

    results, profiles = asyncio.run(measure_then_profile())
    publish(SECTION_NAME, report(results, profiles, command, args.messages, args.repetitions),
            write=args.write)


if __name__ == "__main__":
    main()
