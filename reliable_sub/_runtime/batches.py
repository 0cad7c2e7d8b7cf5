"""Batch handlers at run time: deliveries gathered into batches, one task and one call each.

::

    dispatch ─► the lane's open batch (a new one, and its task, for the first delivery)
       │        full at max_batch; otherwise closed after max_wait (0: once this receive's
       ▼        deliveries are in)
    its task: byte budget for the batch, a worker thread (sync handlers), no start once a
       │      stop began, claims that lapsed while it waited re-taken
       ▼
    bodies decoded (a typed handler): one that does not validate is rejected alone
       ▼
    handler(batch) ─ returned ─► each message acked (a BatchResult's failures failed)
                   └ raised ───► bisected (:mod:`~reliable_sub._runtime.bisection`): called
                                 again in halves, so that a message fails for its own failure,
                                 not its neighbours'

Everything after the call is per message, as for any handler: results recorded with the ack,
failures counted, redelivered with backoff or dead-lettered by the lane's policies. Every
delivery of a batch has the batch's task as its own (``item.task``), so a stop or
max_lease_duration cancelling one of them cancels the batch, and all of it is given back or
failed alike.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .._bodies import body_of
from ..batches import BatchResult, BatchSpec
from ..clock import sleep_or_event
from ..dedup import Claimed
from ..middleware import Decision, Verdict
from ..outcome import Outcome
from .batch_calls import BatchCalls
from .bisection import Bisection, Failure
from .flow import FlowGate
from .inflight import CancelReason, Stage
from .lanes import Config, Item, Lane, RunState, SettleCall, new_task
from .members import RUNNING, SETTLING, WAITING
from .workers import WorkerThreads

logger = logging.getLogger("reliable_sub.subscriber")


class _Batch:
    """Deliveries gathered for one call."""

    __slots__ = ("full", "items", "started", "task")

    def __init__(self) -> None:
        self.items: list[Item] = []
        self.full = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.started = False  # its task ran its first step


class Batches:
    """Gathers one batch handler's deliveries and runs each batch in a task of its own.

    Args:
        lane: the batch handler's lane.
        spec: its limits and argument types.
        config, state, flow, workers: the run's configuration, switches, byte budget and
            threads.
        refresh_claim: re-takes a claim that lapsed while its delivery waited (False: not
            ours any more, and settled).
        settle, apply, cancelled, release: the decisions, as the dispatcher has them.
        succeeded: acks the deliveries a call succeeded for.
        retried: telemetry's event for an in-process retry of a delivery, or None.
    """

    def __init__(
        self,
        lane: Lane,
        spec: BatchSpec,
        config: Config,
        state: RunState,
        flow: FlowGate,
        workers: WorkerThreads,
        *,
        refresh_claim: Callable[[Lane, Item], Awaitable[bool]],
        settle: SettleCall,
        succeeded: Callable[[Lane, list[Item]], None],
        apply: Callable[[Item, Decision], None],
        cancelled: Callable[[Item], Awaitable[None]],
        release: Callable[[Item], Claimed | None],
        retried: Callable[[Item, int, BaseException | None], None] | None = None,
    ) -> None:
        self._lane = lane
        self._spec = spec
        self._config = config
        self._state = state
        self._flow = flow
        self._workers = workers
        self._refresh_claim = refresh_claim
        self._settle = settle
        self._succeeded = succeeded
        self._apply = apply
        self._cancelled = cancelled
        self._release = release
        self._open: _Batch | None = None
        self._calls = BatchCalls(lane, spec, config.clock, workers, retried)
        route = lane.route
        # a failed call's messages are called again in halves (a batch of one is alone already)
        self._bisection = None if spec.max_batch == 1 else Bisection(
            state, route.retry, route.dead_letter, call=self._call_again,
            returned=self._returned, fail=self._fail, give_back=self._stopped)

    def add(self, item: Item) -> None:
        """Put ``item`` in the open batch (opening one, and starting its task, if none is)."""
        batch = self._open
        if batch is None:
            batch = self._open = _Batch()
            # not eager: the task's first step comes after this receive's deliveries are in
            batch.task = new_task(self._run(batch), eager=False)
            batch.task.add_done_callback(functools.partial(self._ended, batch))
        batch.items.append(item)
        item.task = batch.task
        if len(batch.items) >= self._spec.max_batch:
            self._open = None
            batch.full.set()

    def add_many(self, items: list[Item]) -> None:
        """:meth:`add` each of ``items``, in order."""
        add = self.add
        for item in items:
            add(item)

    def _ended(self, batch: _Batch, task: asyncio.Task[None]) -> None:
        """A batch's task is done. One cancelled before its first step never ran ``_run``
        (Python raises at the coroutine's entry): give its deliveries back here."""
        if self._open is batch:
            self._open = None
        if not batch.started:
            self._cancelled_batch(batch.items)

    async def _run(self, batch: _Batch) -> None:
        batch.started = True
        items = batch.items
        holds_bytes = holds_thread = False
        size = 0
        try:
            try:
                await self._gather(batch)
            finally:
                if self._open is batch:
                    self._open = None
            # (a list, not a generator: on 3.11 a generator is a call per item)
            size = sum([len(item.delivery.message.data) for item in items])
            if not self._flow.try_acquire_bytes(size):
                await self._flow.acquire_bytes(size)
            holds_bytes = True
            if not self._lane.route.is_async:
                await self._workers.acquire()
                holds_thread = True
            if not self._state.accepting:
                for item in items:
                    if item.stage is Stage.WAITING:
                        self._settle(item, Outcome.STOPPED, ack=False,
                                     release=self._release(item))
                return
            await self._attempt(await self._still_ours(items))
        except asyncio.CancelledError:
            theirs = not any(item.cancel_reason is not None for item in items)
            self._cancelled_batch(items)
            if theirs:  # not ours (the loop is going away): given back, and on it goes
                raise
        except Exception:  # a bug of ours must not lose the messages
            logger.exception("processing a batch of %d messages failed unexpectedly",
                             len(items))
            for item in items:
                if item.stage in (Stage.WAITING, Stage.RUNNING):
                    self._settle(item, Outcome.RETRY, ack=False,
                                 delay=self._lane.route.retry.backoff(1, self._config.rng),
                                 release=self._release(item))
        finally:
            if holds_bytes:
                self._flow.release_bytes(size)
            if holds_thread:
                self._workers.release()

    def _cancelled_batch(self, items: list[Item]) -> None:
        """The batch of ``items`` was cancelled: decide each undecided one by its reason."""
        # one cancelled delivery cancels its batch: the others share its reason
        reason = next((item.cancel_reason for item in items if item.cancel_reason is not None),
                      CancelReason.STOP)
        for item in items:
            if item.cancel_reason is None:
                item.cancel_reason = reason
        undecided = [item for item in items if item.stage in (Stage.WAITING, Stage.RUNNING)]
        if undecided:
            # beside the batch's task: another delivery of the batch reaching
            # max_lease_duration cancels it again, which must not cut these decisions short
            self._state.track(self._give_back(undecided))

    async def _give_back(self, items: list[Item]) -> None:
        """Decide each of a cancelled batch's undecided ``items`` by its cancel reason."""
        for item in items:
            if item.stage in (Stage.WAITING, Stage.RUNNING):
                await self._cancelled(item)

    async def _gather(self, batch: _Batch) -> None:
        """Wait until ``batch`` is full or its time to gather is up."""
        # (with no wait, nothing: the task's first step comes after the receive loop's turn,
        # which put every delivery of its receive in)
        if self._spec.max_wait:
            await sleep_or_event(self._config.clock, batch.full, self._spec.max_wait)

    async def _still_ours(self, items: list[Item]) -> list[Item]:
        """Those of ``items`` still waiting for this call, with their claims (re-taken when
        they lapsed meanwhile)."""
        lane = self._lane
        lease = lane.lease
        ours = []
        for item in items:
            if item.stage is WAITING and (
                    item.claim is None or not lease.claim_needs_refresh(item)
                    or await self._refresh_claim(lane, item)):
                ours.append(item)
        return ours

    async def _attempt(self, items: list[Item]) -> None:
        """Decode, call the handler once for ``items``, and decide each (bisecting a failed
        call)."""
        if not items:
            return
        lane, spec = self._lane, self._spec
        for item in items:
            item.stage = RUNNING
        lane.lease.started_many(items)
        bodies: list[Any] | None = None
        if spec.decode is not None:
            bodies, items = self._decoded(items)
            if not items:
                return
        decision = await self._calls.decision(items, bodies)
        lane.lease.finished_many(items)
        if decision.verdict is Verdict.ACK:
            if decision.result is None:
                self._succeeded(lane, items)
            else:
                self._returned(items, decision.result)
            return
        assert decision.error is not None
        if self._bisection is not None and len(items) > 1:
            await self._bisection.run(items, decision.error)
        else:
            self._fail([(item, decision.error) for item in items])

    def _decoded(self, items: list[Item]) -> tuple[list[Any], list[Item]]:
        """The bodies of ``items``, and those whose bodies decoded; one that does not decode
        (its validator raised) fails alone, now."""
        spec = self._spec
        assert spec.decode is not None
        bodies, valid, failures = [], [], []
        for item in items:
            try:
                bodies.append(body_of(spec.decode, spec.body_name, item.delivery.message))
            except BaseException as error:  # a validator's: this message alone fails
                failures.append((item, error))
                continue
            valid.append(item)
        if failures:  # their time is the decoding's: one sample
            self._lane.lease.finished_many([item for item, _ in failures])
            self._fail(failures)
        return bodies, valid

    def _returned(self, items: list[Item], result: Any) -> None:
        """A call for ``items`` returned ``result`` (None or a BatchResult): ack each, but for
        those the BatchResult names, which fail with their own errors."""
        failures: list[Failure] = []
        if isinstance(result, BatchResult) and result.failed:
            failed, succeeded = result.failed, []
            for item in items:
                failure = failed.get(item.message_id)
                if failure is None:
                    succeeded.append(item)
                else:
                    failures.append((item, failure))
            items = succeeded
        if items:
            self._succeeded(self._lane, items)
        if failures:
            self._fail(failures)

    def _fail(self, failures: list[Failure]) -> None:
        """Each item failed with its error: decided from here on (as Decisions.decide_failure),
        beside this task, so that the batch's timeout or a stop cannot cut the decisions
        short."""
        for item, _ in failures:
            item.stage = SETTLING
        self._state.track(self._fail_each(failures))

    def _stopped(self, items: list[Item]) -> None:
        """A stop began before ``items`` were called (again): given back, nothing counted."""
        for item in items:
            self._settle(item, Outcome.STOPPED, ack=False, release=self._release(item))

    async def _call_again(self, items: list[Item]) -> Decision:
        """One more call of the handler (part of a failed batch), with fresh bodies and lists,
        and its in-process retries; one processing-time sample."""
        lease = self._lane.lease
        lease.started_many(items)
        bodies = self._calls.fresh_bodies(items)
        decision = (bodies if isinstance(bodies, Decision)
                    else await self._calls.decision(items, bodies))
        lease.finished_many(items)
        return decision

    async def _fail_each(self, failures: list[tuple[Item, BaseException]]) -> None:
        """Each item failed with its error: retried or dead-lettered by the lane's policies."""
        failure = self._lane.failure
        for item, error in failures:
            decision = await failure.after_failure(item.delivery.message, item.failures, error)
            self._apply(item, decision)
