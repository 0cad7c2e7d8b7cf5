"""One workload of the cost check, measured in this process; ``benchmarks.cost`` runs it.

``python -m benchmarks._cost_run WORKLOAD`` prints the workload's counts as JSON. Run it in a
fresh process with ``PYTHONHASHSEED=0`` (``benchmarks.cost`` does): the order of sets and dicts
of strings, and with it every count, is then the same run after run.

Each pass runs a fresh Subscriber over a fresh subscription whose messages were all published
before anything is counted, in one event loop:

1. a warm-up of ``WARMUP_MESSAGES``, not counted: imports done on first use, caches, scripts;
2. the *count pass*: the workload's messages through a no-op handler, counting Python calls, C
   calls, tasks created, broker and store calls (and on Redis the commands sent) from the start
   of ``serve()`` to the return of the ack that settles the last message;
3. (memory workloads) the *allocation passes*, :mod:`tracemalloc` tracing, through a handler
   that holds the first ``IN_FLIGHT`` messages (the default flow-control limit) until all of them
   are in flight: the blocks allocated since the start that are alive then, per message in
   flight; the objects in reference cycles (collected by hand, the collector being off); and,
   but for the sync workload, the blocks still alive once every message is acked, after
   ``messages`` and after ``LEAK_FACTOR`` times as many -- the difference, per message, is what
   each message leaves behind apart from structures of bounded size (full after the first).

What keeps the counts exact: a :class:`FrozenClock` (no lease tick, retry wait or flush timer
ever fires), ``loop_lag_warning=None`` (no watchdog thread), a seeded ``rng``, the cyclic GC off
during a pass (after ``gc.freeze()`` of what came before), and for the sync handler one worker
thread whose calls return only while the loop is idle (see ``IdleSignallingSelector``). On
Redis, replies split over socket reads as they happen to, and which connection answers first
varies: the Python calls (ours included) and allocations vary by a fraction of a percent, so
there only the exact counts are kept: round trips and tasks. The adapter's reclaim of idle entries
and the Subscriber's read of the dedup epoch run once per second of real time: during a count
they run once, at its start, however long a busy machine makes the pass
(``real_time_calls_once``).

On Kafka, the adapter's poll thread fetches on its own schedule, so every record is fetched into
the adapter's buffer before the pass starts (``KafkaWorld.prepare``): the event loop then never
waits for a fetch, and its calls, tasks and broker calls are exact. The poll thread's own work
(polls, fetches) follows timing and is not counted; what it asks of its client is (pauses,
resumes and commits, from the consumer's creation to its close), with the commit interval set
beyond any pass and started before it (``KAFKA_COMMIT_INTERVAL``). A receive waits (for acks
that free a key) for up to ``KAFKA_RECEIVE_TIMEOUT`` of real time: so long that it never times
out during a pass (a timeout would add a receive); the receive is cancel-safe, so a stop does
not wait for it. Of the allocation pass only the objects in reference cycles are kept: the poll
thread allocates and frees floats, tuples and the like as its polls fall, which changes what
CPython's free lists hold, and so whether the loop's next such object is a new block (traced) or
one freed since (not). The blocks held varied by up to 121 in 38,700 (3% of the tolerance, on a
loaded machine), the blocks left behind by up to 146 in 10,000 messages: too much for counts
that may differ by a hundredth of the tolerance.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import random
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._cost_clock import FrozenClock
from benchmarks._cost_counters import (
    ADAPTER_METHODS,
    STORE_METHODS,
    CallCounter,
    IdleSignallingSelector,
    RedisRoundTrips,
    Seams,
    TaskCounter,
)
from benchmarks._cost_workloads import WORKLOADS, Workload, World, make_world
from reliable_sub import FlowControl, Message, Subscriber
from reliable_sub.outcome import Outcome

try:
    import redis
except ImportError:  # the memory workloads run without it
    redis = None  # type: ignore[assignment]

WARMUP_MESSAGES = 300
# Held in the handler at once by the allocation pass: the default flow-control limit, the most
# a Subscriber keeps in flight unless told otherwise.
IN_FLIGHT = FlowControl().max_messages
# Real seconds a pass may take before it is a hang, not a slow machine.
PASS_DEADLINE = 120.0
SHUTDOWN_TIMEOUT = 5.0
# Real seconds an idle receive call waits: the Redis adapter's receive cannot be cancelled, so a
# stop waits for the one in flight (the memory adapter waits on the FrozenClock, which stays).
RECEIVE_TIMEOUT = 0.2
# ... on Kafka: longer than any pass (see the module's docstring); a stop cancels it.
KAFKA_RECEIVE_TIMEOUT = 60.0
# One thread for sync handlers: with more, which thread takes a call, and when threads start,
# depends on the OS scheduler.
SYNC_WORKERS = 1
# The leak measure compares the blocks alive after ``messages`` and after this many times as
# many, so structures of bounded size (full after the first) fall out.
LEAK_FACTOR = 3


# Longer than any count pass: the interval given to what otherwise runs every real second.
NEVER_AGAIN = 1e9


# -- one pass ------------------------------------------------------------------------------------


async def noop_handler(message: Message) -> None:
    """The handler under test: a coroutine function that does nothing."""


async def noop_batch_handler(messages: list[Message]) -> None:
    """The batch handler under test: a coroutine function that does nothing."""


@dataclass
class Pass:
    """One run of a workload through a Subscriber; subclasses decide what is measured."""

    workload: Workload
    messages: int
    idle: IdleSignallingSelector

    def handler(self) -> Callable[..., Any]:
        if self.workload.batch_handler:
            return noop_batch_handler
        if not self.workload.sync_handler:
            return noop_handler
        wait_idle = self.idle.wait_idle

        def noop_sync_handler(message: Message) -> None:
            """The sync handler under test: returns as soon as the loop is idle."""
            wait_idle()

        return noop_sync_handler

    def begin(self, world: World) -> None:
        """Called right before ``serve()`` starts (the start of the pass)."""

    async def during(self) -> None:
        """Runs beside the Subscriber until the last message is acked."""

    def drained(self) -> None:
        """Called synchronously in the ack that settles the last message."""

    def stopped(self) -> None:
        """Called once the Subscriber has stopped."""

    async def run(self) -> None:
        clock = FrozenClock()
        world = make_world(self.workload, clock)
        try:
            await world.prepare(self.messages)
            done = asyncio.Event()

            def drained() -> None:
                self.drained()
                done.set()

            self.seams = Seams(self.messages, drained)
            self.seams.wrap(world.adapter, ADAPTER_METHODS, "adapter")
            if world.store is not None:
                self.seams.wrap(world.store, STORE_METHODS, "store")
            receive_timeout = (KAFKA_RECEIVE_TIMEOUT if self.workload.broker == "kafka"
                               else RECEIVE_TIMEOUT)
            subscriber = Subscriber(
                world.adapter, dedup=world.store, clock=clock, loop_lag_warning=None,
                rng=random.Random(0), receive_timeout=receive_timeout,
                sync_workers=SYNC_WORKERS, **(_sdk_providers() if self.workload.traced else {}),
            )
            subscriber.handler(world.subscription, batch=self.workload.batch_handler)(
                self.handler())
            gc.collect()
            gc.freeze()
            gc.disable()
            try:
                with _deadline(PASS_DEADLINE):
                    serving = asyncio.create_task(subscriber.serve())
                    self.begin(world)
                    await self.during()
                    await done.wait()
                await subscriber.shutdown(SHUTDOWN_TIMEOUT)
                await serving
                self.stopped()
            finally:
                gc.enable()
                gc.unfreeze()
            outcomes = {o: n for o, n in subscriber.stats.outcomes.items() if n}
            if outcomes != {Outcome.ACKED: self.messages}:
                raise RuntimeError(f"outcomes {outcomes}, expected {self.messages} acked")
        finally:
            await world.clean_up()
            await world.adapter.close()


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Cancel the current task after ``seconds`` and raise TimeoutError then (one timer set up
    before anything is counted: ``asyncio.timeout`` is not in Python 3.10, and ``wait_for``
    would run the pass in a task of its own)."""
    task = asyncio.current_task()
    assert task is not None
    fired: list[bool] = []

    def fire() -> None:
        fired.append(True)
        task.cancel()

    timer = asyncio.get_running_loop().call_later(seconds, fire)
    try:
        yield
    except asyncio.CancelledError:
        if fired:
            raise TimeoutError(f"the pass was not done after {seconds}s: a hang") from None
        raise
    finally:
        timer.cancel()


@dataclass
class CountPass(Pass):
    """Counts calls, tasks, broker and store calls, Redis commands."""

    tasks: TaskCounter = field(default_factory=TaskCounter)

    def begin(self, world: World) -> None:
        self.kafka = getattr(world, "client_calls", None)
        self.calls = CallCounter()
        self.redis = RedisRoundTrips()
        if world.redis is not None:
            self.redis.install(world.redis)
        self.tasks.created.clear()
        self.tasks.ignored.clear()
        self.tasks.counting = self.seams.counting = self.redis.counting = True
        self.started = time.perf_counter()
        self.calls.start()

    def drained(self) -> None:
        self.calls.stop()
        self.seconds = time.perf_counter() - self.started
        self.tasks.counting = self.seams.counting = self.redis.counting = False

    def stopped(self) -> None:
        self.calls.finish(SHUTDOWN_TIMEOUT)

    def result(self, top: int) -> dict[str, Any]:
        self.tasks.check_installed()
        calls, c_calls, by_function = self.calls.counts()
        totals = {"calls": calls, "c_calls": c_calls, "tasks": self.tasks.total,
                  "round_trips": self.seams.total}
        detail: dict[str, Any] = {
            "round_trips": dict(sorted(self.seams.calls.items())),
            "tasks": dict(self.tasks.created.most_common()),
            "top_calls": by_function.most_common(top),
        }
        if self.tasks.ignored:
            detail["tasks_not_counted"] = dict(self.tasks.ignored.most_common())
        if self.workload.broker == "redis":
            totals["redis_round_trips"] = self.redis.total
            detail["redis_round_trips"] = dict(sorted(self.redis.sent.items()))
        if self.kafka is not None:  # the consumer's whole life: read once it has closed
            totals["kafka_pauses"] = self.kafka.total("pause", "resume")
            totals["kafka_commits"] = self.kafka.total("commit")
            detail["kafka_client_calls"] = dict(sorted(self.kafka.calls.items()))
        return {"totals": totals, "detail": detail}


@dataclass
class AllocationPass(Pass):
    """Blocks alive with up to ``in_flight`` messages held in the handler, blocks alive once
    every message is acked, and the objects in reference cycles the collector freed."""

    in_flight: int = IN_FLIGHT

    def handler(self) -> Callable[..., Any]:
        self.in_flight = min(self.in_flight, self.messages)
        self.garbage = self.held = 0
        if self.workload.sync_handler:
            return self._holding_sync_handler()
        # One future for every held handler: holding costs each a coroutine and one callback.
        self.gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.all_in = asyncio.Event()
        self.entered = 0

        async def holding_handler(message: Message) -> None:
            self.entered += 1
            if self.entered == self.in_flight:
                self.all_in.set()
            if not self.gate.done():
                await self.gate

        async def holding_batch_handler(messages: list[Message]) -> None:
            self.entered += len(messages)
            if self.entered >= self.in_flight:
                self.all_in.set()
            if not self.gate.done():
                await self.gate

        return holding_batch_handler if self.workload.batch_handler else holding_handler

    def _holding_sync_handler(self) -> Callable[[Message], Any]:
        """With one worker thread, the first call holds its message; the others wait for the
        thread in the loop. Once the loop is idle, everything it will take is in flight."""
        wait_idle = self.idle.wait_idle
        self.measured = False

        def holding_sync_handler(message: Message) -> None:
            wait_idle()
            if not self.measured:  # (one worker thread: never two calls at once)
                self.measured = True
                self.in_flight = self.seams.received
                self._measure_held()

        return holding_sync_handler

    def begin(self, world: World) -> None:
        tracemalloc.start()

    def _measure_held(self) -> None:
        self.garbage = gc.collect()
        self.held = _traced_blocks()

    async def during(self) -> None:
        if not self.workload.sync_handler:
            await self.all_in.wait()
            self._measure_held()
            self.gate.set_result(None)

    def drained(self) -> None:
        self.garbage += gc.collect()
        self.retained = _traced_blocks()
        tracemalloc.stop()


def _sdk_providers() -> dict[str, Any]:
    """OpenTelemetry SDK providers whose work all happens in the delivery path, in this
    thread: spans handed to an exporter that drops them, metrics read only when asked."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from benchmarks._telemetry_floor import NoOpSpanExporter

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(NoOpSpanExporter()))
    return {"tracer_provider": tracer_provider,
            "meter_provider": MeterProvider(metric_readers=[InMemoryMetricReader()])}


def _traced_blocks() -> int:
    """Memory blocks allocated since ``tracemalloc.start()`` and alive now."""
    return len(tracemalloc.take_snapshot().traces)


@contextlib.contextmanager
def real_time_calls_once() -> Iterator[None]:
    """The Redis adapter's reclaim of idle entries and the Subscriber's read of the dedup epoch,
    which run once per second of real time, run once per Subscriber run meanwhile: a pass counts
    the same calls however long a busy machine makes it."""
    from reliable_sub._runtime import claims
    from reliable_sub.adapters import redis_streams

    saved = redis_streams.RECLAIM_INTERVAL_MIN, redis_streams.RECLAIM_INTERVAL_MAX
    epoch_cache = claims.EpochCache
    redis_streams.RECLAIM_INTERVAL_MIN = redis_streams.RECLAIM_INTERVAL_MAX = NEVER_AGAIN
    claims.EpochCache = functools.partial(epoch_cache, interval=NEVER_AGAIN)  # type: ignore[misc]
    try:
        yield
    finally:
        redis_streams.RECLAIM_INTERVAL_MIN, redis_streams.RECLAIM_INTERVAL_MAX = saved
        claims.EpochCache = epoch_cache  # type: ignore[misc]


async def measure(name: str, top: int, idle: IdleSignallingSelector) -> dict[str, Any]:
    workload = WORKLOADS[name]
    messages = workload.messages
    # redis-py makes a task for some of the commands it sends (with a socket timeout, as the
    # write path decides): not the Subscriber's, and not the same from run to run.
    tasks = TaskCounter(ignore=(str(Path(redis.__file__).parent),) if redis else ())
    tasks.install()
    started = time.perf_counter()
    try:
        with real_time_calls_once():
            await CountPass(workload, WARMUP_MESSAGES, idle, tasks).run()
            counted = CountPass(workload, messages, idle, tasks)
            await counted.run()
        result = counted.result(top)
    finally:
        tasks.uninstall()
    if workload.broker == "redis":
        for varies in ("calls", "c_calls"):
            del result["totals"][varies]
    elif workload.broker == "kafka":
        # Only the objects in reference cycles: the blocks vary (see the module's docstring).
        once = AllocationPass(workload, messages, idle)
        await once.run()
        result["totals"]["garbage"] = once.garbage
    else:
        once = AllocationPass(workload, messages, idle)
        await once.run()
        result["totals"].update(held_blocks=once.held, garbage=once.garbage)
        result["in_flight"] = once.in_flight
        if workload.leak_pass:
            more = AllocationPass(workload, LEAK_FACTOR * messages, idle)
            await more.run()
            result["totals"]["retained_blocks"] = more.retained - once.retained
    result.update(workload=name, messages=messages, count_seconds=round(counted.seconds, 3),
                  seconds=round(time.perf_counter() - started, 2))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--top", type=int, default=20, help="functions with the most calls")
    args = parser.parse_args(argv)
    idle = IdleSignallingSelector()
    loop = asyncio.SelectorEventLoop(idle)
    asyncio.set_event_loop(loop)
    try:
        result = loop.run_until_complete(measure(args.workload, args.top, idle))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
