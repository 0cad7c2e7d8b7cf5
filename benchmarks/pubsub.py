"""Pub/Sub on the official emulator: the Subscriber against google-cloud-pubsub's own consumers.

    python -m benchmarks.pubsub                           # start an emulator, print the tables
    python -m benchmarks.pubsub --write                   # ... and rewrite the README section
    python -m benchmarks.pubsub --host 127.0.0.1:8085     # use an emulator that is running

Workload 1 drains a backlog with (a) streaming pull, (b) unary pull and (c) the Subscriber,
each run on a fresh topic, timed until every ack call returned (:class:`Tally`), then profiles
(c). Workload 2 runs (a) and (c) side by side with long handlers and logs what each channel
carried (:class:`RpcLog`, via gRPC interceptors). What the README says about both is in
``templates/pubsub.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import gc
import inspect
import math
import os
import pstats
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.api_core import exceptions as google_errors
from google.cloud import pubsub_v1
from google.cloud.pubsub_v1.subscriber.message import Message as GoogleMessage
from google.cloud.pubsub_v1.subscriber.scheduler import ThreadScheduler
from google.pubsub_v1.services.subscriber import SubscriberAsyncClient
from google.pubsub_v1.services.subscriber.transports import (
    SubscriberGrpcAsyncIOTransport,
    SubscriberGrpcTransport,
)

from benchmarks._common import (
    EPOLL_WAIT,
    MICROS,
    README,
    FunctionKey,
    GcTimer,
    StageProfile,
    interleaved_sync,
    pipeline_rules,
    rule,
)
from benchmarks._common import Throughput as _common_throughput
from benchmarks._harness import (
    RATE_COLUMNS,
    add_runs,
    check_main,
    command_line,
    measured_on,
    paired,
    profile_stages,
    publish,
    render,
    stage_table,
    table,
    versions,
)
from reliable_sub import LeaseManager, Message, Subscriber
from reliable_sub.adapters.pubsub import PubSubAdapter
from reliable_sub.message import Delivery
from reliable_sub.outcome import Outcome
from reliable_sub.subscriber import RECEIVE_BATCH
from reliable_sub.testing.services import EmulatorProcess

# -- the emulator --------------------------------------------------------------------------------

# The emulator accepts any project id of 6+ characters.
PROJECT = "bench-project"

# -- workload 1 -----------------------------------------------------------------------------------

# Streaming pull on the emulator runs at ~2k msgs/s, so 10,000 messages take ~5 s for (a).
DEFAULT_MESSAGES = 10_000
# Seven: single runs of (c) vary by up to 1.3x on 2 cores shared with the emulator's JVM.
DEFAULT_REPETITIONS = 7
# A short untimed run of every variant first: imports, channels, JIT in the emulator's JVM.
WARMUP_MESSAGES = 1_000
PAYLOAD = b"x" * 64
# The subscription's ack deadline in workload 1 (the Pub/Sub default); no run needs extensions.
ACK_DEADLINE = 10
# google-cloud-pubsub's FlowControl.max_messages for (a) (its default) and (b)'s pull size; the
# emulator returns at most 100 messages per pull or streamed response anyway.
GOOGLE_MAX_MESSAGES = 1000
# (b)'s RPC deadline for one pull; it never waits in a run (all published).
UNARY_PULL_TIMEOUT = 10.0
# After the clock: a pull with this deadline must find nothing left.
FINAL_PULL_TIMEOUT = 1.0
# Deadlines of the empty pulls that show how long the emulator holds an empty pull.
EMPTY_PULL_DEADLINES = (1.0, 5.0)
# The publisher batches this many messages per publish call (publishing is not timed).
PUBLISH_BATCH = 1_000
PUBLISH_LATENCY = 0.01
# A run that has not drained after this many seconds is a hang, not a slow result.
RUN_DEADLINE = 120.0
# While waiting for the drained event, wake this often to check the consumer is alive.
LIVENESS_INTERVAL = 0.5
# Seconds the consumers get to stop; nothing is in flight when they are asked to.
SHUTDOWN_TIMEOUT = 10.0

# -- workload 2 -----------------------------------------------------------------------------------

LONG_MESSAGES = 200
LONG_MIN_SECONDS = 5.0
LONG_MAX_SECONDS = 40.0
LONG_SEED = 20240611
LONG_ACK_DEADLINE = 10
# How often the long run looks whether a side is done (not timed: it bounds the wall column only).
LONG_POLL_INTERVAL = 0.1
LONG_RUN_DEADLINE = LONG_MAX_SECONDS + 80.0
# A modack of an ack id that had none before, sent within this many seconds of the ack id's
# arrival, is a *receipt* modack (google-cloud-pubsub sends one per streamed response).
RECEIPT_WINDOW = 1.0

# -- goals from the issue ------------------------------------------------------------------------

MIN_RATE_RATIO = 1.0  # (c) >= 1.0x (a) in msgs/s
MAX_CPU_RATIO = 1.0  # (c) <= (a) in client CPU per message
# For scale, the issue's own measurement of the Google client on this machine kind, µs/msg.
ISSUE_STREAMING_CPU = 94
ISSUE_UNARY_CPU = 31

STREAMING = "(a) google-cloud-pubsub streaming pull, subscribe() with FlowControl(1000)"
UNARY = "(b) google-cloud-pubsub unary pull(1000) + acknowledge per batch"
SUB = "(c) Subscriber(PubSubAdapter), default policies, no dedup"
VARIANTS = (STREAMING, UNARY, SUB)
SLUGS = {STREAMING: "streaming", UNARY: "unary", SUB: "sub"}
SHORT = {STREAMING: "(a)", UNARY: "(b)", SUB: "(c)"}

SECTION_NAME = "pubsub"

# Every topic and subscription this process creates starts with this.
NAME_PREFIX = f"bench-{uuid.uuid4().hex[:8]}"


# -- the emulator --------------------------------------------------------------------------------


class Emulator:
    """An emulator this process started (``host``), or one given with ``--host``."""

    def __init__(self, host: str | None) -> None:
        self.host = host or ""
        self.process: subprocess.Popen[bytes] | None = None
        self._started: EmulatorProcess | None = None
        self.log_path = ""
        self._pids: list[int] = []
        self._ticks = os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> Emulator:
        if not self.host:
            self._start()
        os.environ["PUBSUB_EMULATOR_HOST"] = self.host
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._started is not None:
            self._started.stop()

    def _start(self) -> None:
        self._started = EmulatorProcess()
        try:
            self._started.start()
        except RuntimeError as error:
            raise SystemExit(str(error)) from None
        self.process = self._started.process
        self.log_path = self._started.log_path
        self.host = self._started.host
        self._pids = self._group_pids()

    def _group_pids(self) -> list[int]:
        """The processes of the emulator's process group (the launcher script and its JVM)."""
        assert self.process is not None
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    stat = Path(f"/proc/{entry}/stat").read_text()
                    if int(stat.rsplit(")", 1)[1].split()[2]) == self.process.pid:
                        pids.append(int(entry))
        return pids

    def cpu_seconds(self) -> float | None:
        """User + sys seconds the emulator's processes have used (None: not ours to read)."""
        if not self._pids:
            return None
        total = 0
        for pid in self._pids:
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / self._ticks


# -- topics, subscriptions, backlogs -------------------------------------------------------------


@dataclass(frozen=True)
class Names:
    """One run's topic and subscription (short names and full paths)."""

    topic_id: str
    subscription_id: str

    @property
    def topic(self) -> str:
        return f"projects/{PROJECT}/topics/{self.topic_id}"

    @property
    def subscription(self) -> str:
        return f"projects/{PROJECT}/subscriptions/{self.subscription_id}"


class Bench:
    """The emulator, a publisher and an admin client shared by every run."""

    def __init__(self, emulator: Emulator) -> None:
        self.emulator = emulator
        self.publisher = pubsub_v1.PublisherClient(
            batch_settings=pubsub_v1.types.BatchSettings(
                max_messages=PUBLISH_BATCH, max_latency=PUBLISH_LATENCY
            )
        )
        self.admin = pubsub_v1.SubscriberClient()
        self._runs: Counter[str] = Counter()

    def close(self) -> None:
        self.publisher.stop()
        self.admin.close()

    def backlog(
        self, slug: str, payloads: Sequence[bytes], ack_deadline: int = ACK_DEADLINE
    ) -> Names:
        """A fresh topic and subscription with ``payloads`` published (not timed)."""
        self._runs[slug] += 1
        base = f"{NAME_PREFIX}-{slug}-{self._runs[slug]}"
        names = Names(f"{base}-topic", f"{base}-sub")
        self.publisher.create_topic(name=names.topic)
        self.admin.create_subscription(
            name=names.subscription, topic=names.topic, ack_deadline_seconds=ack_deadline
        )
        futures = [self.publisher.publish(names.topic, payload) for payload in payloads]
        ids = {future.result() for future in futures}
        if len(ids) != len(payloads):
            raise RuntimeError(f"published {len(ids)} distinct messages, not {len(payloads)}")
        return names

    def left_over(self, names: Names) -> int:
        """How many messages a pull with a short deadline still gets (should be none)."""
        try:
            response = self.admin.pull(
                subscription=names.subscription,
                max_messages=GOOGLE_MAX_MESSAGES,
                timeout=FINAL_PULL_TIMEOUT,
                retry=None,
            )
        except google_errors.DeadlineExceeded:
            return 0
        return len(response.received_messages)

    def empty_pull_waits(self) -> dict[float, float]:
        """Seconds an empty pull takes, by its deadline, on a fresh subscription."""
        names = self.backlog("empty", [])
        waits = {}
        try:
            for deadline in EMPTY_PULL_DEADLINES:
                started = time.perf_counter()
                with contextlib.suppress(google_errors.DeadlineExceeded):
                    self.admin.pull(
                        subscription=names.subscription, max_messages=1, timeout=deadline,
                        retry=None,
                    )
                waits[deadline] = time.perf_counter() - started
        finally:
            self.delete(names)
        return waits

    def delete(self, names: Names) -> None:
        with contextlib.suppress(google_errors.NotFound):
            self.admin.delete_subscription(subscription=names.subscription)
        with contextlib.suppress(google_errors.NotFound):
            self.publisher.delete_topic(topic=names.topic)


# -- workload 1: measuring one run ---------------------------------------------------------------


def process_cpu() -> float:
    """This process's CPU seconds, all threads, user + sys."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class Run:
    """One timed run."""

    seconds: float
    cpu_seconds: float  # the whole process
    thread_cpu_seconds: float  # the thread that ran the variant (the event loop's, for (c))
    gc_seconds: float
    emulator_cpu_seconds: float | None
    duplicates: int  # deliveries of a message already handled in the run


class Clock:
    """Wall, process CPU, calling thread CPU and emulator CPU from ``start()`` to ``stop()``."""

    def __init__(self, emulator: Emulator) -> None:
        self._emulator = emulator
        self._gc = GcTimer()
        self._start: tuple[float, float, float, float | None] = (0.0, 0.0, 0.0, None)
        self._stop = self._start

    def start(self) -> None:
        gc.collect()  # every run starts from the same heap, outside the clock
        self._gc.__enter__()
        emulator = self._emulator.cpu_seconds()
        self._start = (time.perf_counter(), process_cpu(), time.thread_time(), emulator)

    def stop(self) -> None:
        self._stop = (time.perf_counter(), process_cpu(), time.thread_time(), None)
        self._gc.__exit__()
        self._stop = (*self._stop[:3], self._emulator.cpu_seconds())

    def run(self, duplicates: int) -> Run:
        (wall0, cpu0, thread0, emu0), (wall1, cpu1, thread1, emu1) = self._start, self._stop
        emulator = None if emu0 is None or emu1 is None else emu1 - emu0
        return Run(
            wall1 - wall0, cpu1 - cpu0, thread1 - thread0, self._gc.seconds, emulator, duplicates
        )


class Tally:
    """Deliveries handled and acks confirmed in one run; safe from any thread.

    ``notify`` is called (under the lock) whenever the confirmed acks cover the backlog and every
    delivery handled so far.
    """

    def __init__(self, total: int, notify: Callable[[], None]) -> None:
        self.total = total
        self.handled: list[str] = []  # one message id per handler call (list.append is atomic)
        self.acked = 0
        self._notify = notify
        self._lock = threading.Lock()

    def add_acked(self, count: int) -> None:
        with self._lock:
            self.acked += count
            if self.acked >= self.total and self.acked >= len(self.handled):
                self._notify()

    def complete(self) -> bool:
        """Every message handled, and every delivery so far acked."""
        handled = list(self.handled)
        return self.acked >= len(handled) and len(set(handled)) >= self.total

    def check(self) -> int:
        """Raise unless each message was handled; return how many deliveries were duplicates."""
        distinct = len(set(self.handled))
        if distinct != self.total:
            raise RuntimeError(f"{distinct} distinct messages handled, not {self.total}")
        return len(self.handled) - distinct


def wait_complete(tally: Tally, done: threading.Event, check_alive: Callable[[], None]) -> None:
    """Block until the tally is complete (woken by ``done``); raise after ``RUN_DEADLINE``."""
    give_up_at = time.perf_counter() + RUN_DEADLINE
    while True:
        if done.wait(LIVENESS_INTERVAL):
            done.clear()
            if tally.complete():
                return
        check_alive()
        if time.perf_counter() > give_up_at:
            raise TimeoutError(
                f"{len(tally.handled)} handled, {tally.acked} acked of {tally.total} after "
                f"{RUN_DEADLINE:g} s"
            )


class CountingSubscriberClient(pubsub_v1.SubscriberClient):
    """google-cloud-pubsub's client, counting the ack ids of every acknowledge call that returned.

    Its streaming pull manager sends every ack through this method (``send_unary_ack``).
    """

    tally: Tally | None = None

    def acknowledge(self, *args: Any, **kwargs: Any) -> None:
        super().acknowledge(*args, **kwargs)
        if self.tally is not None:
            request = kwargs.get("request")
            ack_ids = kwargs["ack_ids"] if request is None else request.ack_ids
            self.tally.add_acked(len(ack_ids))


def run_streaming(bench: Bench, names: Names, total: int) -> Run:
    """``(a)``: ``subscribe()`` with a callback that records the id and acks."""
    done = threading.Event()
    tally = Tally(total, done.set)
    client = CountingSubscriberClient()
    client.tally = tally
    client.get_subscription(subscription=names.subscription)  # connect (untimed)

    def callback(message: GoogleMessage) -> None:
        """The handler under test: does nothing but record the id."""
        tally.handled.append(message.message_id)
        message.ack()

    clock = Clock(bench.emulator)
    clock.start()
    future = client.subscribe(
        names.subscription,
        callback,
        flow_control=pubsub_v1.types.FlowControl(max_messages=GOOGLE_MAX_MESSAGES),
    )

    def check_alive() -> None:
        if future.done():
            future.result()
            raise RuntimeError("the streaming pull stopped before the backlog drained")

    try:
        wait_complete(tally, done, check_alive)
        clock.stop()
    finally:
        future.cancel()
        with contextlib.suppress(Exception):
            future.result(timeout=SHUTDOWN_TIMEOUT)
        client.close()
    return clock.run(tally.check())


def run_unary(bench: Bench, names: Names, total: int) -> Run:
    """``(b)``: pull(1000) → handler for each → one acknowledge, in this thread."""
    done = threading.Event()
    tally = Tally(total, done.set)
    client = pubsub_v1.SubscriberClient()
    client.get_subscription(subscription=names.subscription)  # connect (untimed)
    handled = tally.handled

    def handle(message: Any) -> None:
        """The handler under test: does nothing but record the id."""
        handled.append(message.message_id)

    clock = Clock(bench.emulator)
    give_up_at = time.perf_counter() + RUN_DEADLINE
    clock.start()
    try:
        while True:
            response = client.pull(
                subscription=names.subscription,
                max_messages=GOOGLE_MAX_MESSAGES,
                timeout=UNARY_PULL_TIMEOUT,
            )
            ack_ids = []
            for received in response.received_messages:
                handle(received.message)
                ack_ids.append(received.ack_id)
            if ack_ids:
                client.acknowledge(subscription=names.subscription, ack_ids=ack_ids)
                tally.add_acked(len(ack_ids))
            if done.is_set():
                done.clear()
                if tally.complete():
                    break
            if time.perf_counter() > give_up_at:
                raise TimeoutError(f"{len(handled)} of {total} handled after {RUN_DEADLINE:g} s")
        clock.stop()
    finally:
        client.close()
    return clock.run(tally.check())


def aio_client(host: str, interceptors: Sequence[Any] = ()) -> SubscriberAsyncClient:
    """The async GAPIC client on a plain-text ``grpc.aio`` channel (as the adapter makes it)."""
    channel = grpc.aio.insecure_channel(host, interceptors=list(interceptors) or None)
    return SubscriberAsyncClient(transport=SubscriberGrpcAsyncIOTransport(channel=channel))


async def serve_subscriber(
    bench: Bench, names: Names, total: int, profiler: cProfile.Profile | None
) -> Run:
    """``(c)``: the Subscriber on a PubSubAdapter, in this event loop."""
    drained = asyncio.Event()
    tally = Tally(total, drained.set)
    client = aio_client(bench.emulator.host)
    adapter = PubSubAdapter(PROJECT, subscriber_client=client)
    subscriber = Subscriber(adapter)
    handled = tally.handled

    @subscriber.handler(names.subscription_id)
    async def handle(message: Message) -> None:
        """The handler under test: does nothing but record the id."""
        handled.append(message.id)

    acknowledge = adapter.ack

    async def counting_ack(deliveries: Sequence[Delivery]) -> list[Delivery]:
        refused = await acknowledge(deliveries)
        tally.add_acked(len(deliveries) - len(refused))
        return refused

    adapter.ack = counting_ack  # type: ignore[method-assign]
    task: asyncio.Task[None] | None = None
    try:
        await client.get_subscription(subscription=names.subscription)  # connect (untimed)
        await adapter.subscription_ack_deadline(names.subscription_id)  # cached (untimed)
        clock = Clock(bench.emulator)
        give_up_at = time.perf_counter() + RUN_DEADLINE
        clock.start()
        if profiler is not None:
            gc.disable()  # a collection would be charged to whatever happened to allocate
            profiler.enable()
        try:
            task = asyncio.create_task(subscriber.serve())
            while True:
                with contextlib.suppress(asyncio.TimeoutError):  # TimeoutError on 3.11+
                    await asyncio.wait_for(drained.wait(), LIVENESS_INTERVAL)
                if drained.is_set():
                    drained.clear()
                    if tally.complete():
                        break
                if task.done():
                    task.result()
                    raise RuntimeError("the Subscriber stopped before the backlog drained")
                if time.perf_counter() > give_up_at:
                    raise TimeoutError(
                        f"{len(handled)} handled, {tally.acked} acked of {total} after "
                        f"{RUN_DEADLINE:g} s"
                    )
            clock.stop()
        finally:
            if profiler is not None:
                profiler.disable()
                gc.enable()
        await subscriber.shutdown(SHUTDOWN_TIMEOUT)
        await task
        outcomes = dict(subscriber.stats.outcomes)
        if outcomes != {Outcome.ACKED: len(handled)}:
            raise RuntimeError(f"outcomes {outcomes}, expected {len(handled)} acked")
    finally:
        if task is not None and not task.done():
            await subscriber.shutdown(SHUTDOWN_TIMEOUT)
        await adapter.close()
    return clock.run(tally.check())


def run_once(
    bench: Bench, variant: str, messages: int, profiler: cProfile.Profile | None = None
) -> Run:
    """One run of ``variant`` on a fresh backlog, checked and deleted afterwards."""
    names = bench.backlog(SLUGS[variant], [PAYLOAD] * messages)
    try:
        if variant == STREAMING:
            run = run_streaming(bench, names, messages)
        elif variant == UNARY:
            run = run_unary(bench, names, messages)
        else:
            run = asyncio.run(serve_subscriber(bench, names, messages, profiler))
        left = bench.left_over(names)
        if left:
            raise RuntimeError(f"{variant}: a final pull still got {left} messages")
    finally:
        bench.delete(names)
    return run


# -- workload 1: repetitions ---------------------------------------------------------------------


class Throughput(_common_throughput[Run]):
    """The timed repetitions of one variant, with client, thread and emulator CPU time."""

    @property
    def cpus(self) -> list[float]:
        """Client CPU µs per message, run by run."""
        return [run.cpu_seconds * MICROS / self.messages for run in self.runs]

    @property
    def cpu_micros_per_message(self) -> float:
        return statistics.median(self.cpus)

    @property
    def thread_micros_per_message(self) -> float:
        return self.median_micros(run.thread_cpu_seconds for run in self.runs)

    @property
    def emulator_micros_per_message(self) -> float | None:
        spent = [run.emulator_cpu_seconds for run in self.runs]
        if any(seconds is None for seconds in spent):
            return None
        return self.median_micros(seconds for seconds in spent if seconds is not None)


def measure(bench: Bench, messages: int, repetitions: int) -> dict[str, Throughput]:
    return interleaved_sync(lambda variant, count: run_once(bench, variant, count), VARIANTS,
                            lambda variant: Throughput(variant, messages), messages, repetitions,
                            WARMUP_MESSAGES)


# -- workload 1: profile of (c) ------------------------------------------------------------------

RECEIVE_CALL = "receive: pull call (Subscriber._receive, tenacity, adapter.receive, GAPIC pull)"
RECEIVE_CONVERT = (
    "receive: response → Delivery/Message (adapter._delivery: proto-plus iteration and field "
    "access, publish_time → datetime, attempt count)"
)
LEASE = "lease: add / started / finish, histogram"
TASK = "handler dispatch: admit, a task per delivery, run/attempt, handler"
SETTLE = "settle: Settler, adapter.ack (chunks, attempt bookkeeping), GAPIC acknowledge"
FLOW = "flow control (slots, bytes, events)"
GRPC = "grpc.aio call objects, their tasks and callbacks (pull and acknowledge alike)"
LOOP = "event loop: scheduling, task steps, done callbacks"
IO_WAIT = "idle in epoll: waiting for the emulator"
HARNESS = "benchmark: drain wait, ack counting"
STAGES = (RECEIVE_CALL, RECEIVE_CONVERT, LEASE, TASK, SETTLE, FLOW, GRPC, LOOP, IO_WAIT, HARNESS)
CPU_STAGES = tuple(stage for stage in STAGES if stage != IO_WAIT)
GC_ROW = "cyclic GC (timed runs; off while profiling)"
OTHER_THREADS_ROW = "other threads: gRPC C-core I/O (timed runs: process − event loop thread CPU)"
# The profile's hottest functions listed under the stage table.
HOTTEST_FUNCTIONS = 8


def lines_of(function: Callable[..., Any]) -> range:
    """The source lines of ``function`` (its comprehensions start on one of them)."""
    source, start = inspect.getsourcelines(function)
    return range(start, start + len(source))


THIS_FILE = "benchmarks/pubsub.py"
ADAPTER_FILE = "adapters/pubsub.py"
# The first matching rule wins. Everything unmatched (proto-plus, google-api-core, tenacity,
# dataclass __init__s, builtins, helpers shared by two stages such as subscription_path) takes
# the stages of its callers.
STAGE_RULES = (
    *pipeline_rules(receive=RECEIVE_CALL, lease=LEASE, task=TASK, settle=SETTLE, flow=FLOW,
                    loop=LOOP, io_wait=IO_WAIT),
    rule(RECEIVE_CONVERT, ADAPTER_FILE, "_delivery", "_count_attempt", "_unreadable"),
    # read_each walks the proto-plus response into _delivery (one guard per message)
    rule(RECEIVE_CONVERT, "reliable_sub/entries.py", "read_each"),
    rule(RECEIVE_CONVERT, ADAPTER_FILE, "<lambda>", lines=lines_of(PubSubAdapter.receive)),
    rule(RECEIVE_CALL, ADAPTER_FILE, "receive", "subscription_ack_deadline"),
    rule(RECEIVE_CALL, "google/pubsub_v1/services/subscriber/async_client.py", "pull"),
    rule(TASK, THIS_FILE, "handle"),
    rule(SETTLE, ADAPTER_FILE, "ack", "_acknowledge", "_in_chunks", "_by_subscription", "_chunks"),
    rule(SETTLE, "google/pubsub_v1/services/subscriber/async_client.py", "acknowledge"),
    rule(GRPC, "grpc/aio/_call.py"),
    rule(GRPC, "grpc/aio/_channel.py"),
    rule(HARNESS, THIS_FILE, "serve_subscriber", "counting_ack", "add_acked", "complete"),
)


# This repository's root: profile entries under it are shown relative to it.
REPOSITORY = str(Path(__file__).resolve().parent.parent).replace(os.sep, "/")


def describe(key: FunctionKey) -> str:
    filename, line, name = key
    if filename == "~":
        return name
    path = filename.replace(os.sep, "/")
    for marker in ("site-packages/", f"{REPOSITORY}/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{line}({name})"


def profile(bench: Bench, messages: int) -> StageProfile:
    profiler = cProfile.Profile()
    run_once(bench, SUB, messages, profiler)
    raw: dict[FunctionKey, Any] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    hottest = sorted(
        ((describe(key), timing[2]) for key, timing in raw.items() if key[2] != EPOLL_WAIT),
        key=lambda item: -item[1],
    )[:HOTTEST_FUNCTIONS]
    return dataclasses.replace(
        profile_stages(profiler, "(c)", messages, STAGE_RULES, STAGES, LOOP),
        hottest=[(name, spent * MICROS / messages) for name, spent in hottest])


# -- workload 2: what each side's channel carried ------------------------------------------------


@dataclass(frozen=True)
class Modack:
    """One request that set ack deadlines: ModifyAckDeadline, or a StreamingPull request."""

    at: float
    via: str
    ack_ids: tuple[str, ...]
    seconds: tuple[int, ...]  # one per ack id


class RpcLog:
    """What one consumer's gRPC channel carried (filled by its interceptor; any thread).

    Times are this process's ``time.monotonic()``: when a response was read, when a request was
    sent. ``ack_deadline`` is the subscription's; messages streamed to a StreamingPull get the
    stream's ``stream_ack_deadline_seconds`` instead, as its requests last set it.
    """

    def __init__(self, ack_deadline: float) -> None:
        self._lock = threading.Lock()
        self.ack_deadline = ack_deadline
        self.stream_deadline: float | None = None
        self.arrived: dict[str, tuple[float, float]] = {}  # ack id → (when, initial deadline)
        self.modacks: list[Modack] = []
        self.acked: set[str] = set()
        self.ack_sends: list[tuple[float, tuple[str, ...]]] = []
        self.calls: Counter[str] = Counter()

    def call(self, method: str) -> None:
        with self._lock:
            self.calls[method] += 1

    def received(self, ack_ids: Iterable[str], *, streamed: bool) -> None:
        now = time.monotonic()
        with self._lock:
            deadline = self.ack_deadline
            if streamed and self.stream_deadline:
                deadline = self.stream_deadline
            for ack_id in ack_ids:
                self.arrived.setdefault(ack_id, (now, deadline))

    def modack(self, via: str, ack_ids: Sequence[str], seconds: Sequence[int]) -> None:
        if ack_ids:
            record = Modack(time.monotonic(), via, tuple(ack_ids), tuple(seconds))
            with self._lock:
                self.modacks.append(record)

    def ack(self, ack_ids: Sequence[str], sent_at: float) -> None:
        """``ack_ids`` were acknowledged by a call sent at ``sent_at`` (and confirmed)."""
        with self._lock:
            self.acked.update(ack_ids)
            self.ack_sends.append((sent_at, tuple(ack_ids)))

    def sending(self, details: Any, request: Any) -> tuple[str, float]:
        """A unary call about to be sent: its method, and when (a modack is logged now)."""
        method = method_name(details)
        self.call(method)
        if method == "ModifyAckDeadline":
            ids = list(request.ack_ids)
            self.modack(method, ids, [request.ack_deadline_seconds] * len(ids))
        return method, time.monotonic()

    def answered(self, method: str, request: Any, response: Any, sent_at: float) -> None:
        """A unary call sent at ``sent_at`` succeeded: its acks, or the ack ids it pulled."""
        if method == "Acknowledge":
            self.ack(list(request.ack_ids), sent_at)
        elif method == "Pull":
            self.received((r.ack_id for r in response.received_messages), streamed=False)

    def stream_request(self, request: Any) -> None:
        """A StreamingPull request: its acks and deadline changes count like unary calls."""
        self.call("StreamingPull request")
        if request.stream_ack_deadline_seconds:
            self.stream_deadline = float(request.stream_ack_deadline_seconds)
        ids = list(request.modify_deadline_ack_ids)
        self.modack("StreamingPull", ids, list(request.modify_deadline_seconds))
        if request.ack_ids:
            self.ack(list(request.ack_ids), time.monotonic())


def method_name(details: Any) -> str:
    method = details.method
    text = method.decode() if isinstance(method, bytes) else str(method)
    return text.rsplit("/", 1)[-1]


class _RecordingResponses:
    """A StreamingPull call whose responses' ack ids are logged as they are read."""

    def __init__(self, call: Any, log: RpcLog) -> None:
        self._call = call
        self._log = log

    def __iter__(self) -> _RecordingResponses:
        return self

    def __next__(self) -> Any:
        response = next(self._call)
        self._log.received(
            (received.ack_id for received in response.received_messages), streamed=True
        )
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class SyncInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Logs ``(a)``'s calls: unary ModifyAckDeadline/Acknowledge/Pull and the StreamingPull."""

    def __init__(self, log: RpcLog) -> None:
        self.log = log

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method, sent_at = self.log.sending(details, request)
        outcome = continuation(details, request)
        if outcome.exception() is None:
            self.log.answered(method, request, outcome.result(), sent_at)
        return outcome

    def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Iterator[Any]
    ) -> Any:
        self.log.call(method_name(details))
        log = self.log

        def requests() -> Iterator[Any]:
            for request in request_iterator:
                log.stream_request(request)
                yield request

        return _RecordingResponses(continuation(details, requests()), log)


class AioInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Logs ``(c)``'s unary calls on its ``grpc.aio`` channel (it makes no streaming calls)."""

    def __init__(self, log: RpcLog) -> None:
        self.log = log

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method, sent_at = self.log.sending(details, request)
        call = await continuation(details, request)
        try:
            response = await call
        except grpc.RpcError:
            return call  # the caller awaits the call and sees the error
        self.log.answered(method, request, response, sent_at)
        return call


@dataclass
class ModackSummary:
    """A side's deadline traffic, split into receipt modacks, lease extensions and nacks."""

    requests: Counter[str] = field(default_factory=Counter)
    ack_ids: Counter[str] = field(default_factory=Counter)
    seconds: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, log: RpcLog) -> ModackSummary:
        summary = cls()
        seen: set[str] = set()
        for modack in sorted(log.modacks, key=lambda m: m.at):
            if all(seconds == 0 for seconds in modack.seconds):
                kind = NACK
            elif all(
                ack_id not in seen
                and modack.at - log.arrived.get(ack_id, (-math.inf, 0.0))[0] <= RECEIPT_WINDOW
                for ack_id in modack.ack_ids
            ):
                kind = RECEIPT
            else:
                kind = EXTENSION
            if kind != NACK:
                summary.seconds.update(modack.seconds)
            summary.requests[kind] += 1
            summary.ack_ids[kind] += len(modack.ack_ids)
            summary.requests[modack.via] += kind != NACK
            seen.update(modack.ack_ids)
        return summary

    @property
    def deadline_requests(self) -> int:
        return self.requests[RECEIPT] + self.requests[EXTENSION]

    @property
    def deadline_ack_ids(self) -> int:
        return self.ack_ids[RECEIPT] + self.ack_ids[EXTENSION]


RECEIPT = "receipt"
EXTENSION = "extension"
NACK = "nack"


@dataclass(frozen=True)
class Margins:
    """How close each delivery's deadline came to running out, on this process's clock."""

    least: float  # least time left on a deadline when the next modack or ack was sent (s)
    lapsed: int  # deadlines that ran out before the next modack or ack was sent

    @classmethod
    def of(cls, log: RpcLog) -> Margins:
        events: dict[str, list[tuple[float, int | None]]] = {}
        for modack in log.modacks:
            for ack_id, seconds in zip(modack.ack_ids, modack.seconds, strict=True):
                events.setdefault(ack_id, []).append((modack.at, seconds))
        for sent_at, ack_ids in log.ack_sends:
            for ack_id in ack_ids:
                events.setdefault(ack_id, []).append((sent_at, None))
        least, lapsed = math.inf, 0
        for ack_id, (arrived, initial) in log.arrived.items():
            deadline = arrived + initial
            for at, seconds in sorted(events.get(ack_id, []), key=lambda event: event[0]):
                left = deadline - at
                least = min(least, left)
                lapsed += left < 0
                if not seconds:  # acked or nacked: no longer leased
                    break
                deadline = at + seconds
        return cls(least, lapsed)


# -- workload 2: the two sides -------------------------------------------------------------------


def long_durations() -> list[float]:
    rng = random.Random(LONG_SEED)
    return [round(rng.uniform(LONG_MIN_SECONDS, LONG_MAX_SECONDS), 1) for _ in range(LONG_MESSAGES)]


class Handlers:
    """Handler starts and finishes by message id, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.starts: Counter[str] = Counter()
        self.finished = 0
        self.finished_ids: set[str] = set()

    def started(self, message_id: str) -> None:
        with self._lock:
            self.starts[message_id] += 1

    def finish(self, message_id: str) -> None:
        with self._lock:
            self.finished += 1
            self.finished_ids.add(message_id)

    def done(self, total: int, log: RpcLog) -> bool:
        """Every message finished, none running, every delivery's ack confirmed."""
        with self._lock:
            running = self.starts.total() - self.finished
            finished, distinct = self.finished, len(self.finished_ids)
        return distinct >= total and running == 0 and len(log.acked) >= finished

    @property
    def redeliveries(self) -> int:
        return sum(1 for count in self.starts.values() if count > 1)


@dataclass
class LongSide:
    """One side of workload 2: its logs, how long it took, and how it stops."""

    label: str
    log: RpcLog = field(default_factory=lambda: RpcLog(LONG_ACK_DEADLINE))
    handlers: Handlers = field(default_factory=Handlers)
    seconds: float | None = None
    lease_stats: dict[str, int] | None = None
    # (c) only: CPU of the event loop thread from the start until (c) was done (the benchmark's
    # own poller runs on it too, LONG_POLL_INTERVAL apart)
    thread_cpu_seconds: float | None = None


class GoogleLongSide:
    """``(a)`` in workload 2: streaming pull, a callback thread per message, ``time.sleep``."""

    def __init__(self, host: str, names: Names, durations: list[float]) -> None:
        self.side = LongSide(STREAMING)
        self.names = names
        self.durations = durations
        channel = grpc.intercept_channel(
            grpc.insecure_channel(host), SyncInterceptor(self.side.log)
        )
        self.client = pubsub_v1.SubscriberClient(transport=SubscriberGrpcTransport(channel=channel))
        self.future: Any = None

    def prepare(self) -> None:
        self.client.get_subscription(subscription=self.names.subscription)

    def start(self) -> None:
        handlers, durations = self.side.handlers, self.durations

        def callback(message: GoogleMessage) -> None:
            handlers.started(message.message_id)
            time.sleep(durations[int(message.data)])
            handlers.finish(message.message_id)
            message.ack()

        executor = ThreadPoolExecutor(LONG_MESSAGES, thread_name_prefix="bench-google-callback")
        self.future = self.client.subscribe(
            self.names.subscription,
            callback,
            flow_control=pubsub_v1.types.FlowControl(max_messages=GOOGLE_MAX_MESSAGES),
            scheduler=ThreadScheduler(executor),
        )

    def check_alive(self) -> None:
        if self.future is not None and self.future.done():
            self.future.result()
            raise RuntimeError("(a)'s streaming pull stopped before every message was handled")

    def stop(self) -> None:
        if self.future is not None:
            self.future.cancel()
            with contextlib.suppress(Exception):
                self.future.result(timeout=SHUTDOWN_TIMEOUT)
            self.future = None
        self.client.close()


class OurLongSide:
    """``(c)`` in workload 2: the Subscriber with default policies, ``asyncio.sleep``."""

    def __init__(self, host: str, names: Names, durations: list[float]) -> None:
        self.side = LongSide(SUB)
        self.names = names
        self.client = aio_client(host, [AioInterceptor(self.side.log)])
        self.adapter = PubSubAdapter(PROJECT, subscriber_client=self.client)
        self.subscriber = Subscriber(self.adapter)
        self.task: asyncio.Task[None] | None = None
        self.lease: LeaseManager | None = None
        handlers = self.side.handlers

        @self.subscriber.handler(names.subscription_id)
        async def handle(message: Message) -> None:
            handlers.started(message.id)
            await asyncio.sleep(durations[int(message.data)])
            handlers.finish(message.id)

    async def prepare(self) -> None:
        await self.client.get_subscription(subscription=self.names.subscription)
        await self.adapter.subscription_ack_deadline(self.names.subscription_id)

    def start(self) -> None:
        self.task = asyncio.create_task(self.subscriber.serve())

    def check_alive(self) -> None:
        if self.task is not None and self.task.done():
            self.task.result()
            raise RuntimeError("(c)'s Subscriber stopped before every message was handled")
        if self.lease is None and self.subscriber.running:
            with contextlib.suppress(KeyError, RuntimeError):
                self.lease = self.subscriber.lease_manager(self.names.subscription_id)

    async def stop(self) -> None:
        if self.lease is not None:
            stats = self.lease.stats
            self.side.lease_stats = {
                "extend calls": stats.extend_calls,
                "ack ids extended": stats.extended_ack_ids,
                "refused": stats.refused,
                "max-lease reached": stats.max_lease_reached,
                "extend errors": stats.extend_errors,
            }
        if self.task is not None:
            await self.subscriber.shutdown(SHUTDOWN_TIMEOUT)
            await self.task
            self.task = None
        await self.adapter.close()


@dataclass
class LongResult:
    empty_pull_waits: dict[float, float]
    durations: list[float]
    sides: dict[str, LongSide]
    summaries: dict[str, ModackSummary]
    margins: dict[str, Margins]


async def long_handlers(bench: Bench) -> LongResult:
    """Workload 2: both sides at once, each on its own subscription."""
    waits = bench.empty_pull_waits()
    durations = long_durations()
    payloads = [str(index).encode() for index in range(LONG_MESSAGES)]
    google_names = bench.backlog("long-google", payloads, LONG_ACK_DEADLINE)
    our_names = bench.backlog("long-ours", payloads, LONG_ACK_DEADLINE)
    google = GoogleLongSide(bench.emulator.host, google_names, durations)
    ours = OurLongSide(bench.emulator.host, our_names, durations)
    try:
        google.prepare()
        await ours.prepare()
        started, thread_started = time.perf_counter(), time.thread_time()
        google.start()
        ours.start()
        give_up_at = started + LONG_RUN_DEADLINE
        while google.side.seconds is None or ours.side.seconds is None:
            await asyncio.sleep(LONG_POLL_INTERVAL)  # polling both sides, with the deadline below
            now = time.perf_counter()
            ours.check_alive()
            if ours.side.seconds is None and ours.side.handlers.done(LONG_MESSAGES, ours.side.log):
                ours.side.seconds = now - started
                ours.side.thread_cpu_seconds = time.thread_time() - thread_started
                await ours.stop()
            google.check_alive()
            if google.side.seconds is None and google.side.handlers.done(
                LONG_MESSAGES, google.side.log
            ):
                google.side.seconds = now - started
                await asyncio.to_thread(google.stop)
            if now > give_up_at:
                raise TimeoutError(f"workload 2 not done after {LONG_RUN_DEADLINE:g} s")
    finally:
        if google.side.seconds is None:
            await asyncio.to_thread(google.stop)
        if ours.side.seconds is None:
            await ours.stop()
        bench.delete(google_names)
        bench.delete(our_names)
    sides = {STREAMING: google.side, SUB: ours.side}
    return LongResult(
        waits,
        durations,
        sides,
        {label: ModackSummary.of(side.log) for label, side in sides.items()},
        {label: Margins.of(side.log) for label, side in sides.items()},
    )


# -- report --------------------------------------------------------------------------------------


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}×" if base else "–"


def throughput_table(results: dict[str, Throughput]) -> list[str]:
    base = results[STREAMING]

    def emulator(result: Throughput) -> str:
        micros = result.emulator_micros_per_message
        return "–" if micros is None else f"{micros:.1f}"

    return table(results.values(), [
        *RATE_COLUMNS,
        ("msgs/s ratio to (a)", lambda r: ratio(r.median, base.median)),
        ("client CPU µs/msg", lambda r: f"{r.cpu_micros_per_message:.1f}"),
        ("min – max CPU µs/msg", lambda r: f"{min(r.cpus):.1f} – {max(r.cpus):.1f}"),
        ("CPU ratio to (a)",
         lambda r: ratio(r.cpu_micros_per_message, base.cpu_micros_per_message)),
        ("of which GC µs/msg", lambda r: f"{r.gc_micros_per_message:.1f}"),
        ("emulator CPU µs/msg", emulator),
    ])


def throughput_goals(results: dict[str, Throughput]) -> list[str]:
    ours, theirs = results[SUB], results[STREAMING]

    def goal(name: str, value: float, mine: list[float], others: list[float],
             met: Callable[[float], bool]) -> str:
        ratios, repetitions = paired(mine, others, met)
        hits = sum(met(r) for r in ratios)
        noise = ("; the repetitions fall on both sides of the goal, so this verdict is within "
                 "run-to-run noise") if 0 < hits < len(ratios) else ""
        return f"- {'yes' if met(value) else '**no**'}: {name}, {value:.2f}× ({repetitions}{noise})"

    return [
        goal(f"(c) ≥ {MIN_RATE_RATIO:g}× (a) in msgs/s — {ours.median:,.0f} vs "
             f"{theirs.median:,.0f} msgs/s", ours.median / theirs.median, ours.rates,
             theirs.rates, lambda r: r >= MIN_RATE_RATIO),
        goal(f"(c) ≤ (a) in client CPU per message — {ours.cpu_micros_per_message:.1f} vs "
             f"{theirs.cpu_micros_per_message:.1f} µs/msg",
             ours.cpu_micros_per_message / theirs.cpu_micros_per_message, ours.cpus,
             theirs.cpus, lambda r: r <= MAX_CPU_RATIO),
    ]


def profile_table(prof: StageProfile, timed: Throughput) -> list[str]:
    """µs/msg per stage under cProfile, and scaled to the unprofiled process CPU.

    The scaled column spreads the event loop thread's unprofiled CPU µs/msg, less GC, over the CPU
    stages in proportion, and adds GC and the other threads' CPU as rows of their own, so that
    it adds up to the unprofiled client CPU µs/msg.
    """
    thread, gc_time = timed.thread_micros_per_message, timed.gc_micros_per_message
    total = timed.cpu_micros_per_message
    return stage_table(
        {"(c) profiled µs/msg": prof}, STAGES, reference="(c) profiled µs/msg",
        scaled="(c) scaled to unprofiled client CPU µs/msg",
        scale=max(0.0, thread - gc_time) / prof.total_of(CPU_STAGES), total=total,
        unscaled=[IO_WAIT],
        rows=[(GC_ROW, gc_time), (OTHER_THREADS_ROW, max(0.0, total - thread))])


def long_table(long: LongResult) -> list[str]:
    google, ours = long.sides[STREAMING], long.sides[SUB]
    summaries = long.summaries
    a, c = summaries[STREAMING], summaries[SUB]

    def row(name: str, theirs: float | str, mine: float | str, compare: bool = True) -> str:
        cells = [f"{v:,}" if isinstance(v, int) else str(v) for v in (theirs, mine)]
        if compare and isinstance(theirs, int | float) and isinstance(mine, int | float):
            cells.append(ratio(mine, theirs) if theirs else "–")
        else:
            cells.append("–")
        return f"| {name} | " + " | ".join(cells) + " |"

    def span(values: set[int]) -> str:
        return f"{min(values)}–{max(values)}" if values else "–"

    def wall(side: LongSide) -> str:
        return "–" if side.seconds is None else f"{side.seconds:.1f}"

    return [
        "| metric | (a) google-cloud-pubsub streaming pull | (c) Subscriber(PubSubAdapter) "
        "| (c) / (a) |",
        "|---|--:|--:|--:|",
        row("handler starts", google.handlers.starts.total(), ours.handlers.starts.total()),
        row(
            "**redeliveries** (messages whose handler started more than once)",
            google.handlers.redeliveries,
            ours.handlers.redeliveries,
            compare=False,
        ),
        row("wall time until every message handled and acked (s)", wall(google), wall(ours),
            compare=False),
        row(
            "**deadline requests** (ModifyAckDeadline calls + StreamingPull requests with "
            "modacks, deadline > 0)",
            a.deadline_requests,
            c.deadline_requests,
        ),
        row("… of which receipt modacks", a.requests[RECEIPT], c.requests[RECEIPT]),
        row("… of which lease extensions", a.requests[EXTENSION], c.requests[EXTENSION]),
        row("… sent as StreamingPull requests", a.requests["StreamingPull"],
            c.requests["StreamingPull"]),
        row("ack ids in those requests", a.deadline_ack_ids, c.deadline_ack_ids),
        row("… in receipt modacks", a.ack_ids[RECEIPT], c.ack_ids[RECEIPT]),
        row("… in lease extensions", a.ack_ids[EXTENSION], c.ack_ids[EXTENSION]),
        row("deadlines requested (s)", span(a.seconds), span(c.seconds), compare=False),
        row("nack requests (deadline 0)", a.requests[NACK], c.requests[NACK]),
        row(
            "least time left on a deadline when the next modack or ack was sent (s)",
            f"{long.margins[STREAMING].least:.1f}",
            f"{long.margins[SUB].least:.1f}",
            compare=False,
        ),
        row(
            "deadlines that ran out before the next modack or ack was sent",
            long.margins[STREAMING].lapsed,
            long.margins[SUB].lapsed,
            compare=False,
        ),
        row("Acknowledge calls", google.log.calls["Acknowledge"], ours.log.calls["Acknowledge"]),
        row("StreamingPull streams opened", google.log.calls["StreamingPull"],
            ours.log.calls["StreamingPull"], compare=False),
        row("Pull calls", google.log.calls["Pull"], ours.log.calls["Pull"], compare=False),
        row("event loop thread CPU while (c) ran (s)", "–",
            "–" if ours.thread_cpu_seconds is None else f"{ours.thread_cpu_seconds:.2f}",
            compare=False),
    ]


def long_goals(long: LongResult) -> list[str]:
    google, ours = long.sides[STREAMING], long.sides[SUB]
    a, c = long.summaries[STREAMING], long.summaries[SUB]
    redelivered = ours.handlers.redeliveries
    fewer = c.deadline_requests < a.deadline_requests
    lease_only = c.requests[EXTENSION] < a.requests[EXTENSION]
    return [
        f"- {'yes' if redelivered == 0 else '**no**'}: zero redeliveries for (c) — {redelivered} "
        f"(google-cloud-pubsub: {google.handlers.redeliveries})",
        f"- {'yes' if fewer else '**no**'}: fewer extension requests than (a) — "
        f"{c.deadline_requests:,} vs {a.deadline_requests:,} requests that set a deadline "
        f"(counting (a)'s receipt modacks); lease extensions alone "
        f"{c.requests[EXTENSION]:,} vs {a.requests[EXTENSION]:,} "
        f"({'fewer' if lease_only else '**not fewer**'}); ack ids "
        f"{c.deadline_ack_ids:,} vs {a.deadline_ack_ids:,}",
    ]


def idle_pulls(long: LongResult) -> str:
    """What (c)'s receive loop did while every handler slept: a paragraph and a newline, or
    nothing."""
    ours = long.sides[SUB]
    if ours.seconds is None or ours.thread_cpu_seconds is None:
        return ""
    pulls = ours.log.calls["Pull"]
    (short, short_wait), (long_deadline, long_wait) = sorted(long.empty_pull_waits.items())[:2]
    text = (
        f"(c) made {pulls:,} Pull calls for {LONG_MESSAGES} messages "
        f"({pulls / ours.seconds:.1f} a second) while its handlers slept; its event loop thread "
        f"used {ours.thread_cpu_seconds:.2f} s of CPU in those {ours.seconds:.1f} s. On this "
        f"emulator an empty pull with a {long_deadline:g} s deadline returned after "
        f"{long_wait:.2f} s, one with {short:g} s after {short_wait:.2f} s, which is why "
        "`PubSubAdapter.receive` stops pulling once less than `MIN_PULL_WINDOW` of its timeout "
        "is left instead of firing short empty pulls back to back."
    )
    return text + "\n"


def report(
    results: dict[str, Throughput],
    prof: StageProfile,
    long: LongResult,
    command: str,
    messages: int,
    repetitions: int,
    load: float,
) -> str:
    ours, theirs, unary = results[SUB], results[STREAMING], results[UNARY]
    lease = long.sides[SUB].lease_stats or {}
    lease_text = ", ".join(f"{name} {value:,}" for name, value in lease.items()) or "not read"
    hottest = "; ".join(f"`{name}` {micros:.1f}" for name, micros in prof.hottest)
    durations = long.durations
    duplicates = ", ".join(
        f"{SHORT[variant]} {sum(run.duplicates for run in result.runs)}"
        for variant, result in results.items()
    )
    return render(
        "pubsub", measured_on=measured_on(command), load=load, messages=messages,
        repetitions=repetitions, versions=versions("google-cloud-pubsub", "grpcio", "proto-plus",
                                                   "protobuf"),
        throughput_table=throughput_table(results), throughput_goals=throughput_goals(results),
        ours=ours, over_unary=ours.cpu_micros_per_message - unary.cpu_micros_per_message,
        over_streaming=ours.cpu_micros_per_message - theirs.cpu_micros_per_message,
        duplicates=duplicates, profile_table=profile_table(prof, ours), hottest=hottest,
        min_durations=min(durations), max_durations=max(durations),
        mean_duration=statistics.mean(durations), long_table=long_table(long),
        long_goals=long_goals(long), lease_text=lease_text, idle_pulls=idle_pulls(long),
        ISSUE_STREAMING_CPU=ISSUE_STREAMING_CPU, ISSUE_UNARY_CPU=ISSUE_UNARY_CPU,
        GOOGLE_MAX_MESSAGES=GOOGLE_MAX_MESSAGES, RECEIVE_BATCH=RECEIVE_BATCH,
        ACK_DEADLINE=ACK_DEADLINE, FINAL_PULL_TIMEOUT=FINAL_PULL_TIMEOUT,
        LONG_MESSAGES=LONG_MESSAGES, LONG_MIN_SECONDS=LONG_MIN_SECONDS,
        LONG_MAX_SECONDS=LONG_MAX_SECONDS, LONG_ACK_DEADLINE=LONG_ACK_DEADLINE,
        LONG_SEED=LONG_SEED, RECEIPT_WINDOW=RECEIPT_WINDOW,
        LONG_POLL_INTERVAL=LONG_POLL_INTERVAL)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--host", default=None, help="host:port of a running emulator (default: start one)"
    )
    add_runs(parser, DEFAULT_MESSAGES, DEFAULT_REPETITIONS)
    parser.add_argument("--write", action="store_true", help=f"rewrite the section in {README}")
    args = parser.parse_args(argv)
    check_main(parser, args, SECTION_NAME, STAGE_RULES, markers=False)
    command = command_line("pubsub", argv)
    started = time.perf_counter()
    load = os.getloadavg()[0]
    with Emulator(args.host) as emulator:
        bench = Bench(emulator)
        try:
            print(f"emulator at {emulator.host}", file=sys.stderr)
            results = measure(bench, args.messages, args.repetitions)
            prof = profile(bench, args.messages)
            print("workload 2 (about a minute)", file=sys.stderr)
            long = asyncio.run(long_handlers(bench))
        finally:
            bench.close()
    publish(SECTION_NAME,
            report(results, prof, long, command, args.messages, args.repetitions, load),
            write=args.write, append=True, started=started)


if __name__ == "__main__":
    main()
