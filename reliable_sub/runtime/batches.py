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
                   └ raised ───► each message failed, as if its own handler had raised

Everything after the call is per message, as for any handler: results recorded with the ack,
failures counted, redelivered with backoff or dead-lettered by the lane's policies. Every
delivery of a batch has the batch's task as its own (``item.task``), so a stop or
max_lease_duration cancelling one of them cancels the batch, and all of it is given back or
failed alike.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import CoroutineType
from typing import Any

from .._bodies import body_of
from .._callables import settled_result
from ..batches import BatchResult, BatchSpec
from ..clock import sleep_or_event
from ..dedup import Claimed
from ..middleware import Decision, Verdict
from ..middleware.retry import InProcessRetry
from ..outcome import Outcome
from .current import CURRENT_BATCH, BatchClaims
from .flow import FlowGate
from .inflight import CancelReason, Stage, cancel_requested
from .lanes import Config, Item, Lane, RunState, SettleCall, new_task
from .workers import WorkerThreads

logger = logging.getLogger("reliable_sub.subscriber")


class _Batch:
    """Deliveries gathered for one call."""

    __slots__ = ("full", "items", "task")

    def __init__(self) -> None:
        self.items: list[Item] = []
        self.full = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


class Batches:
    """Gathers one batch handler's deliveries and runs each batch in a task of its own.

    Args:
        lane: the batch handler's lane.
        spec: its limits and argument types.
        config, state, flow, workers: the run's configuration, switches, byte budget and
            threads.
        refresh_claim: re-takes a claim that lapsed while its delivery waited (False: not
            ours any more, and settled).
        settle, succeeded, apply, cancelled, release: the decisions, as the dispatcher has them.
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
        succeeded: Callable[[Lane, Item, Any], None],
        apply: Callable[[Item, Decision], None],
        cancelled: Callable[[Item], Awaitable[None]],
        release: Callable[[Item], Claimed | None],
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
        retry = lane.route.retry
        self._retry = (InProcessRetry(retry, config.clock) if retry.in_process_attempts > 1
                       else None)

    def add(self, item: Item) -> None:
        """Put ``item`` in the open batch (opening one, and starting its task, if none is)."""
        batch = self._open
        if batch is None:
            batch = self._open = _Batch()
            batch.task = new_task(self._run(batch), eager=False)
        batch.items.append(item)
        item.task = batch.task
        if len(batch.items) >= self._spec.max_batch:
            self._open = None
            batch.full.set()

    async def _run(self, batch: _Batch) -> None:
        items = batch.items
        holds_bytes = holds_thread = False
        size = 0
        try:
            try:
                await self._gather(batch)
            finally:
                if self._open is batch:
                    self._open = None
            size = sum(item.delivery.size for item in items)
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
            await self._attempt([item for item in items if await self._still_ours(item)])
        except asyncio.CancelledError:
            theirs = not any(item.cancel_reason is not None for item in items)
            # one cancelled delivery cancels its batch: the others share its reason
            reason = next((item.cancel_reason for item in items
                           if item.cancel_reason is not None), CancelReason.STOP)
            for item in items:
                if item.cancel_reason is None:
                    item.cancel_reason = reason
            undecided = [item for item in items if item.stage in (Stage.WAITING, Stage.RUNNING)]
            if undecided:
                # beside this task: another delivery of the batch reaching max_lease_duration
                # cancels it again, which must not cut these decisions short
                self._state.track(self._give_back(undecided))
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

    async def _still_ours(self, item: Item) -> bool:
        if item.stage is not Stage.WAITING:
            return False
        lane = self._lane
        return (item.claim is None or not lane.lease.claim_needs_refresh(item)
                or await self._refresh_claim(lane, item))

    async def _attempt(self, items: list[Item]) -> None:
        """Decode, call the handler once for ``items``, and decide each."""
        if not items:
            return
        lane, spec = self._lane, self._spec
        for item in items:
            item.stage = Stage.RUNNING
        lane.lease.started_many(items)
        arguments: tuple[Any, ...]
        if spec.decode is None:
            arguments = ([item.delivery.message for item in items],)
        else:
            bodies: list[Any] = []
            valid: list[Item] = []
            for item in items:
                try:
                    bodies.append(body_of(spec.decode, spec.body_name, item.delivery.message))
                except Exception as error:  # BodyValidationError: this message alone fails
                    await self._failed(item, error)
                    continue
                valid.append(item)
            if not valid:
                return
            items = valid
            arguments = ((bodies, [item.delivery.message for item in items])
                         if spec.takes_messages else (bodies,))
        decision = await (self._retry.run(self._decide, items, arguments)
                          if self._retry is not None else self._decide(items, arguments))
        if decision.verdict is not Verdict.ACK:
            assert decision.error is not None
            for item in items:
                await self._failed(item, decision.error)
            return
        failed = decision.result.failed if isinstance(decision.result, BatchResult) else None
        if not failed:
            lane.lease.finished_many(items)
            for item in items:
                self._succeeded(lane, item, None)
            return
        succeeded = [item for item in items if item.message_id not in failed]
        lane.lease.finished_many(succeeded)
        for item in succeeded:
            self._succeeded(lane, item, None)
        for item in items:
            failure = failed.get(item.message_id)
            if failure is not None:
                await self._failed(item, failure)

    async def _decide(self, items: list[Item], arguments: tuple[Any, ...]) -> Decision:
        """One call of the handler, as a Decision: what it returned, or what it raised."""
        try:
            result = await self._call(items, arguments)
        except BaseException as error:
            if isinstance(error, asyncio.CancelledError) and (
                    cancel_requested() or any(i.cancel_reason is not None for i in items)):
                raise  # ours: a stop or max_lease_duration
            return Decision.failed(error)
        if isinstance(result, BatchResult):
            unknown = result.failed.keys() - {item.message_id for item in items}
            if unknown:
                return Decision.failed(TypeError(
                    f"batch handler {self._lane.route.name} returned a BatchResult naming "
                    f"messages not in its batch ({', '.join(sorted(unknown)[:5])}); name "
                    "failed messages by their Message.id"))
        return Decision.ack(result)

    async def _call(self, items: list[Item], arguments: tuple[Any, ...]) -> Any:
        route = self._lane.route
        handler = self._lane.handler
        claims = CURRENT_BATCH.set(BatchClaims(items))
        try:
            if route.is_async:
                result = handler(*arguments)
                if type(result) is CoroutineType:
                    result = await result
            else:
                future = self._workers.run(handler, *arguments)
                for item in items:
                    item.thread_running = True
                ok, result = await future  # if this task is cancelled, the thread still runs
                for item in items:
                    item.thread_running = False
                if not ok:
                    raise result
            if result is not None:
                result = await settled_result(result, route.name)
            return result
        finally:
            CURRENT_BATCH.reset(claims)

    async def _failed(self, item: Item, error: BaseException) -> None:
        """``item`` failed with ``error``: retried or dead-lettered by the lane's policies."""
        lane = self._lane
        item.duration = lane.lease.finished(item)
        decision = await lane.failure.after_failure(item.delivery.message, item.failures, error)
        self._apply(item, decision)
