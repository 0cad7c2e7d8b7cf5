"""The Pub/Sub benchmark's workload 2: long handlers, (a) and (c) side by side.

Each side's gRPC channel carries an interceptor that logs into an :class:`RpcLog` every
ModifyAckDeadline call, every StreamingPull request's modacks, every ack and when each ack id
arrived; :class:`ModackSummary` splits the deadline traffic into receipt modacks, lease extensions
and nacks, :class:`Margins` finds how close each deadline came to running out. A side is done
when every handler finished and every delivery's ack returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.cloud import pubsub_v1
from google.cloud.pubsub_v1.subscriber.message import Message as GoogleMessage
from google.cloud.pubsub_v1.subscriber.scheduler import ThreadScheduler
from google.pubsub_v1.services.subscriber.transports import (
    SubscriberGrpcTransport,
)

from benchmarks._pubsub_bench import (
    GOOGLE_MAX_MESSAGES,
    PROJECT,
    SHUTDOWN_TIMEOUT,
    STREAMING,
    SUB,
    Bench,
    Names,
    aio_client,
)
from reliable_sub import LeaseManager, Message, Subscriber
from reliable_sub.adapters.pubsub import PubSubAdapter

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
        row("**redeliveries** (messages whose handler started more than once)",
            google.handlers.redeliveries, ours.handlers.redeliveries, compare=False),
        row("wall time until every message handled and acked (s)", wall(google), wall(ours),
            compare=False),
        row("**deadline requests** (ModifyAckDeadline calls + StreamingPull requests with "
            "modacks, deadline > 0)", a.deadline_requests, c.deadline_requests),
        row("… of which receipt modacks", a.requests[RECEIPT], c.requests[RECEIPT]),
        row("… of which lease extensions", a.requests[EXTENSION], c.requests[EXTENSION]),
        row("… sent as StreamingPull requests", a.requests["StreamingPull"],
            c.requests["StreamingPull"]),
        row("ack ids in those requests", a.deadline_ack_ids, c.deadline_ack_ids),
        row("… in receipt modacks", a.ack_ids[RECEIPT], c.ack_ids[RECEIPT]),
        row("… in lease extensions", a.ack_ids[EXTENSION], c.ack_ids[EXTENSION]),
        row("deadlines requested (s)", span(a.seconds), span(c.seconds), compare=False),
        row("nack requests (deadline 0)", a.requests[NACK], c.requests[NACK]),
        row("least time left on a deadline when the next modack or ack was sent (s)",
            f"{long.margins[STREAMING].least:.1f}", f"{long.margins[SUB].least:.1f}",
            compare=False),
        row("deadlines that ran out before the next modack or ack was sent",
            long.margins[STREAMING].lapsed, long.margins[SUB].lapsed, compare=False),
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


