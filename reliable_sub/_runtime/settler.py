"""Settles deliveries in batches: the dedup store write first, then one broker call.

A handler's result is recorded as soon as it returns, in a lane of its own, never behind acks,
nacks or releases in flight: between a handler's effect and its durable record a crash makes the
redelivery run it again, so that window is one store call. Recorded, it is acked with the rest
(the Redis fast path records inside its ack script). Everything else settled since the last call
goes out together: releases in one store call, acks in one broker call; nacks, in a lane of their
own, in one call per delay (a nack may publish a delayed copy, and a broker that blocks
publishing must not hold the acks back); up to ``MAX_CALLS_IN_FLIGHT`` calls of each lane at
once.

A failed call is retried with backoff until it succeeds: a message whose result is not recorded
must not be acked, and its lease and claim stay alive meanwhile. Only when a stop's deadline has
passed does a batch give up: its messages come back after their ack deadline, and a completion
never written is logged at ERROR.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from ..clock import Clock, SystemClock, within
from ..errors import ConfigurationError
from ..message import Delivery
from ..outcome import Outcome, SubscriberStats
from ..ports import AcksWithCompletions, Adapter, Claimed, Completion
from .claims import Claims
from .health import Health
from .inflight import InFlight, Stage
from .members import SETTLING

# The name this module's records always had (it was public): logging set-ups name it.
logger = logging.getLogger("reliable_sub.runtime.settler")

T = TypeVar("T")

# Waits between tries of a failed call: from 0.1 s, doubling, at most 5 s.
RETRY_WAIT_MIN = 0.1
RETRY_WAIT_MAX = 5.0
# Batches sent at once; more wait and grow meanwhile.
MAX_CALLS_IN_FLIGHT = 4
# Seconds one call of a batch may take before it counts as failed and is tried again: a hung
# connection must not hold a batch, its leases and flow slots for ever (generous: hundreds of
# completions on a loaded database are slow, not hung).
CALL_BOUND = 30.0
# Delays below this are not rounded (10 ** (exponent - 1) would underflow for subnormals).
MIN_QUANTIZED = 1e-6


def quantize_delay(delay: float) -> float:
    """Round a nack delay up to two significant digits so jittered delays can share a call
    (a delay too small to round, under a microsecond, is kept as it is)."""
    if not delay > 0:  # NaN too
        return 0.0
    if delay < MIN_QUANTIZED or math.isinf(delay):
        return delay
    step = 10.0 ** (math.floor(math.log10(delay)) - 1)
    return math.ceil(delay / step - 1e-9) * step


class Settle:
    """How one delivery ends: ack or nack (with a delay), and what the store records."""

    __slots__ = ("ack", "completion", "delay", "item", "outcome", "release")

    def __init__(
        self,
        item: InFlight[Any],
        outcome: Outcome,
        *,
        ack: bool,
        delay: float = 0.0,
        completion: Completion | None = None,
        release: Claimed | None = None,
    ) -> None:
        self.item = item
        self.outcome = outcome
        self.ack = ack
        self.delay = delay
        self.completion = completion
        self.release = release


class Party(enum.Enum):
    """Whom a settle call talks to: its failures count as that party's errors."""

    STORE = "store"
    BROKER = "broker"


_STORE = frozenset({Party.STORE})
_BROKER = frozenset({Party.BROKER})
# The Redis ack script records completions and acks in one call: a failure is both.
_BOTH = frozenset({Party.STORE, Party.BROKER})


class _GiveUp(Exception):
    """The stop deadline passed while a call was still failing."""


class _Lane:
    """Settles waiting to go out, and the calls (tasks) sending them: at most
    MAX_CALLS_IN_FLIGHT at once, each taking everything that waits when it starts."""

    def __init__(self, send: Callable[[list[Settle]], Coroutine[Any, Any, None]],
                 gather: bool) -> None:
        self._send = send
        self._gather = gather  # let what finishes in this loop turn join the batch
        self.waiting: list[Settle] = []
        self.calls: set[asyncio.Task[None]] = set()
        self._queued = asyncio.Event()
        self._slot_free = asyncio.Event()

    def add(self, settle: Settle) -> None:
        self.waiting.append(settle)
        if len(self.waiting) == 1:  # with more, the event is set already (run clears it,
            self._queued.set()  # then takes all that wait, with no await between)

    def extend(self, settles: list[Settle]) -> None:
        self.waiting.extend(settles)
        self._queued.set()

    @property
    def pending(self) -> int:
        return len(self.waiting) + len(self.calls)

    @property
    def can_send(self) -> bool:
        return bool(self.waiting) and len(self.calls) < MAX_CALLS_IN_FLIGHT

    async def run(self) -> None:
        while True:
            await self._queued.wait()
            if self._gather:
                await asyncio.sleep(0)
            while self.waiting and len(self.calls) >= MAX_CALLS_IN_FLIGHT:
                self._slot_free.clear()
                await self._slot_free.wait()
            self._queued.clear()
            self.send_waiting()

    def send_waiting(self) -> None:
        if not self.waiting:
            return
        batch, self.waiting = self.waiting, []
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self.calls.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self.calls.discard(task)
        self._slot_free.set()


class Settler:
    """Queues settles and sends them in batches, confirming each with ``on_settled``.

    Args:
        adapter: the broker.
        claims: the run's claim lifecycle: completions and releases go to its store, kept for
            its ``retention`` (completed records and failure counts).
        stats: counters of store and broker errors and refused acks.
        on_settled: called with settles confirmed together and the ack ids the broker
            refused among them.
        clock: waits between retries and bounds each call (the Subscriber's clock).
        health: where failed and succeeded calls are reported.
    """

    def __init__(
        self,
        adapter: Adapter,
        *,
        claims: Claims,
        stats: SubscriberStats,
        on_settled: Callable[[list[Settle], set[str]], None],
        clock: Clock | None = None,
        health: Health | None = None,
    ) -> None:
        self._adapter = adapter
        self._claims = claims
        self._stats = stats
        self._on_settled = on_settled
        self._clock: Clock = clock or SystemClock()
        self._health = health or Health(self._clock.now, math.inf)
        # results to record first; then the rest: acks (releases first), and nacks apart
        self._recording = _Lane(self._record, gather=False)
        self._settling = _Lane(self._send, gather=True)
        self._nacking = _Lane(self._send, gather=True)
        self._lanes = (self._recording, self._settling, self._nacking)
        self._give_up_at: float | None = None
        self._combined: AcksWithCompletions | None = None
        store = claims.store
        if (store is not None and isinstance(adapter, AcksWithCompletions)
                and adapter.shares_store(store)):
            self._combined = adapter

    @property
    def pending(self) -> int:
        """Settles queued or in a call not yet confirmed."""
        return sum(lane.pending for lane in self._lanes)

    def add(self, settle: Settle) -> None:
        """Queue ``settle``: a result to record goes out at once (with those already
        waiting), the rest with the next batch."""
        settle.item.stage = SETTLING
        if settle.completion is not None and settle.release is None:
            self._recording.add(settle)
        elif settle.ack:
            self._settling.add(settle)
        else:
            self._nacking.add(settle)

    def add_many(self, settles: list[Settle]) -> None:
        """Queue ``settles``, none of which has a result to record, for the next batch."""
        for settle in settles:
            settle.item.stage = SETTLING
        acks = [settle for settle in settles if settle.ack]
        if len(acks) < len(settles):
            self._nacking.extend([settle for settle in settles if not settle.ack])
        if acks:
            self._settling.extend(acks)

    async def drain(self, give_up_at: float) -> None:
        """Wait until everything queued is confirmed; calls still failing at ``give_up_at``
        (the event loop's clock) give up."""
        self._give_up_at = give_up_at
        lanes = self._lanes
        while any(lane.pending for lane in lanes):
            for lane in lanes:
                if lane.can_send:
                    lane.send_waiting()
            calls = set().union(*(lane.calls for lane in lanes))
            if calls:
                await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(0)

    def give_up_now(self) -> None:
        """Failing calls stop retrying at their next failure (a forced stop)."""
        self._give_up_at = -math.inf

    async def run(self) -> None:
        """Record results and send batches as settles arrive, until cancelled."""
        loop = asyncio.get_running_loop()
        lanes = {loop.create_task(lane.run()) for lane in self._lanes}
        try:
            done, _ = await asyncio.wait(lanes, return_when=asyncio.FIRST_COMPLETED)
            for lane in done:
                lane.result()  # raises what ended it, for the supervisor
        finally:
            for lane in lanes:
                lane.cancel()

    async def _record(self, batch: list[Settle]) -> None:
        """Record ``batch``'s results, then hand them to the ack lane (the Redis fast path:
        record and ack in its one call)."""
        try:
            completions = [s.completion for s in batch if s.completion is not None]
            if self._combined is not None:
                assert self._claims.store is not None
                refused, lost = await self._retry(
                    "recording completions and acking at the broker", len(batch), _BOTH,
                    self._combined.ack_with_completions, [s.item.delivery for s in batch],
                    self._claims.store, completions, self._claims.retention,
                )
                self._report_lost(lost)
                self._on_settled(batch, self._count_refused(refused))
                return
            lost = await self._retry("recording completions in the dedup store",
                                     len(completions), _STORE,
                                     self._claims.complete_many, completions)
            self._report_lost(lost)
        except _GiveUp:
            self._abandon(batch, "acked")
            return
        except Exception:
            self._failed_unexpectedly(batch)
            return
        for settle in batch:
            settle.completion = None  # recorded
        self._settling.extend(batch)

    async def _send(self, batch: list[Settle]) -> None:
        """Send a lane's batch: all acks, or all nacks (completions come with acks only)."""
        acking = batch[0].ack
        try:
            try:
                refused = await (self._send_acks(batch) if acking else self._send_nacks(batch))
            except _GiveUp:
                self._abandon(batch, "acked" if acking else "nacked")
                return
            self._on_settled(batch, refused)
        except Exception:
            self._failed_unexpectedly(batch)

    def _failed_unexpectedly(self, batch: list[Settle]) -> None:
        """A bug of ours (a settle the calls could not take): let go of what is left of the
        batch, or its flow slots and leases would be held for good; unacked, its messages come
        back after their ack deadline."""
        left = [settle for settle in batch if settle.item.stage is not Stage.DONE]
        logger.exception("settling a batch of %d deliveries failed unexpectedly; %d of them "
                         "come back after their ack deadline", len(batch), len(left))
        for settle in left:
            settle.outcome = Outcome.STOPPED
        self._on_settled(left, set())

    async def _send_acks(self, acks: list[Settle]) -> set[str]:
        """Ack ``acks`` (their results, if any, are recorded already)."""
        releases = [s.release for s in acks if s.release is not None]
        if releases:
            await self._release(releases)
        refused = await self._retry("acking at the broker", len(acks), _BROKER,
                                    self._adapter.ack, [s.item.delivery for s in acks])
        return self._count_refused(refused)

    def _count_refused(self, refused: list[Delivery]) -> set[str]:
        if refused:
            self._stats.acks_refused += len(refused)
            logger.info("broker refused %d acks (stale ack ids); those messages come back and "
                        "are deduplicated", len(refused))
        return {delivery.ack_id for delivery in refused}

    async def _send_nacks(self, nacks: list[Settle]) -> set[str]:
        releases = [s.release for s in nacks if s.release is not None]
        if releases:
            await self._release(releases)
        by_delay: dict[float, list[Delivery]] = {}
        for settle in nacks:
            by_delay.setdefault(quantize_delay(settle.delay), []).append(settle.item.delivery)
        for delay, deliveries in by_delay.items():
            await self._retry("nacking at the broker", len(deliveries), _BROKER, self._adapter.nack,
                              deliveries, delay)
        return set()  # nothing to refuse

    async def _release(self, releases: list[Claimed]) -> None:
        await self._retry("releasing dedup claims", len(releases), _STORE,
                          self._claims.release_many, releases)

    def _report_lost(self, lost: list[Claimed]) -> None:
        if not lost:
            return
        self._stats.lost_claims += len(lost)
        logger.warning(
            "%d completions were refused: a peer holds their keys (their claims lapsed before "
            "the results were recorded, so those messages may run twice)", len(lost),
            extra={"keys": [claim.key for claim in lost[:20]]},
        )

    async def _retry(
        self, what: str, count: int, parties: frozenset[Party],
        call: Callable[..., Awaitable[T]], *args: Any,
    ) -> T:
        tries = 0
        while True:
            try:
                # a store call is left to finish past its bound rather than cancelled (store
                # clients may not survive a cancellation mid-call); a broker call is cancelled
                result = await within(self._clock, call(*args), CALL_BOUND,
                                      f"{what} for {count} deliveries",
                                      cancel=Party.STORE not in parties)
            except ConfigurationError:
                raise  # a bug, not an outage: retrying cannot help
            except Exception as error:
                tries += 1
                if Party.STORE in parties:
                    self._stats.store_errors += 1
                if Party.BROKER in parties:
                    self._stats.ack_errors += 1
                self._health.failed(what, error)
                if self._give_up_at is not None and (
                    asyncio.get_running_loop().time() >= self._give_up_at
                ):
                    logger.error("%s for %d deliveries failed %d times and the Subscriber is "
                                 "stopping: giving up", what, count, tries)
                    raise _GiveUp() from None
                await self._clock.sleep(
                    min(RETRY_WAIT_MAX, RETRY_WAIT_MIN * 2 ** (tries - 1)))
                continue
            self._health.ok(what)
            return result

    def _abandon(self, settles: list[Settle], verb: str) -> None:
        unrecorded = [s for s in settles if s.completion is not None]
        if unrecorded:
            logger.error(
                "%d results were not recorded before the stop: their messages come back after "
                "their ack deadline and their handlers run again",
                len(unrecorded),
                extra={"message_ids": [s.item.message_id for s in unrecorded[:20]]},
            )
        logger.warning("%d deliveries could not be %s before the stop; they come back after "
                       "their ack deadline", len(settles), verb)
        for settle in settles:
            settle.outcome = Outcome.STOPPED
        self._on_settled(settles, set())
