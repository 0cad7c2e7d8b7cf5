"""Dispatch: one admitted delivery to its handler, in its own task.

::

    dispatch ── its ordering key busy? ─► queue behind it (started when that one is decided)
       ▼
    its own task: byte budget, a worker thread (sync handlers), no start once a stop began,
       │          a claim that lapsed while it waited re-taken
       ▼
    the route's chain: your middleware ─► DeadLetterOrBackoff ─► InProcessRetry ─► handler
       │   (or the handler alone: the direct fast path, no object per message on success)
       ▼
    the decision ─► :class:`~reliable_sub._runtime.decisions.Decisions` (succeeded, apply, ...)

The handler's task runs with the delivery's span as the current one, and with
:func:`~reliable_sub._runtime.current.current_claim` set. A cancellation is the Subscriber's (a
stop, max_lease_duration) only when it says so (``cancel_reason``) or the task was asked to
cancel; a CancelledError a handler raises by itself is its failure.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from types import CoroutineType
from typing import Any

from opentelemetry import context as otel_context

from .._callables import settled_result
from .._text import safe_repr
from ..clock import within
from ..dedup import Claimed, Completed, InProgress
from ..errors import ClaimLostError
from ..middleware import CallNext, Context, Decision, Middleware, chain
from ..middleware.dead_letter import DeadLetterOrBackoff
from ..middleware.retry import InProcessRetry
from ..outcome import Outcome, SubscriberStats
from ..policy import RetryPolicy
from ..telemetry.consumer import DeliveryTelemetry
from .claims import CLAIM_CALL, MIN_STORE_CALL_BOUND, Claims
from .current import CURRENT_CLAIM
from .decisions import DEFER_MIN_DELAY
from .flow import FlowGate
from .health import Health
from .inflight import CancelReason, cancel_requested
from .lanes import EAGER_TASKS, Config, Item, Lane, Route, RunState, SettleCall, new_task
from .members import RUNNING, SETTLING
from .workers import WorkerThreads

logger = logging.getLogger("reliable_sub.subscriber")

# Outcomes after which the next message of the same ordering key may run.
_DONE = frozenset({Outcome.ACKED, Outcome.DUPLICATE, Outcome.DEAD_LETTERED})

# The delivery whose handler the current task runs (for the end of the middleware chain).
_current_item: contextvars.ContextVar[Item] = contextvars.ContextVar("reliable_sub_item")
# (a module global, so a test can put the old eager start back: tests/test_stateful.py)
_new_task = new_task


def _new_task_in(context: otel_context.Context, coroutine: Coroutine[Any, Any, None],
                 eager: bool) -> asyncio.Task[None]:
    """A delivery's task, made with ``context`` attached (called in a copied context)."""
    otel_context.attach(context)
    return _new_task(coroutine, eager)


class Dispatcher:
    """Runs admitted deliveries, one task each, and hands each outcome to the decisions.

    Args:
        config, state: the run's configuration and switches.
        flow, workers: the byte budget and the sync handlers' threads.
        claims, stats, health: for re-taking a claim that lapsed while its delivery waited.
        telemetry: the run's telemetry, or None.
        settle, succeeded, apply, claim_lost, cancelled, in_progress_elsewhere, defer_delay:
            the :class:`~reliable_sub._runtime.decisions.Decisions` methods of those names.

    A failed attempt's dead-letter-or-backoff decision is its lane's (``Lane.failure``),
    awaited right after the attempt.
    """

    def __init__(
        self,
        config: Config,
        state: RunState,
        flow: FlowGate,
        workers: WorkerThreads,
        claims: Claims,
        stats: SubscriberStats,
        health: Health,
        telemetry: DeliveryTelemetry | None,
        *,
        settle: SettleCall,
        succeeded: Callable[[Lane, Item, Any], None],
        apply: Callable[[Item, Decision], None],
        claim_lost: Callable[[Lane, Item, ClaimLostError], None],
        cancelled: Callable[[Item], Awaitable[None]],
        in_progress_elsewhere: Callable[[Item, InProgress], None],
        defer_delay: Callable[[float, RetryPolicy], float],
    ) -> None:
        self._config = config
        self._state = state
        self._flow = flow
        self._workers = workers
        self._claims = claims
        self._stats = stats
        self._health = health
        self._telemetry = telemetry
        self._settle = settle
        self._succeeded = succeeded
        self._apply = apply
        self._claim_lost = claim_lost
        self._cancelled = cancelled
        self._in_progress_elsewhere = in_progress_elsewhere
        self._defer_delay = defer_delay

    def chain_of(self, route: Route, failure: DeadLetterOrBackoff) -> CallNext | None:
        """The route's middleware chain (built once), or None for the direct fast path."""
        config = self._config
        layers: list[Middleware] = [*config.middleware, *route.middleware]
        retries = route.retry.in_process_attempts > 1
        if not layers and not retries:
            return None
        layers.append(failure)
        if retries:
            on_retry = self._retried if self._telemetry is not None else None
            layers.append(InProcessRetry(route.retry, config.clock, on_retry))

        async def call_handler(context: Context) -> Decision:
            return await self._call_handler()

        return chain(layers, call_handler)

    def _retried(self, attempt: int, error: BaseException | None) -> None:
        assert self._telemetry is not None
        self._telemetry.retried(_current_item.get(), attempt, error)

    # -- ordering keys ---------------------------------------------------------------------------

    def dispatch(self, lane: Lane, item: Item) -> None:
        """Start ``item``'s task, or queue it behind the running delivery of its ordering key."""
        key = item.delivery.message.ordering_key if lane.ordered else None
        if key is not None:
            # Pub/Sub may hand out several messages of one key at once: run them one at a time,
            # in the order received, as its own client does.
            queue = lane.keys.get(key)
            if queue is not None:
                queue.append(item)
                return
            lane.keys[key] = deque()
        self._start(item)

    def dispatch_many(self, lane: Lane, items: list[Item]) -> None:
        """:meth:`dispatch` each of ``items``, in order: a batch handler's join its batches at
        once, but for those an ordering key holds back."""
        collector = lane.collector
        if collector is not None and not lane.ordered:
            collector.add_many(items)
            return
        ordered, start = lane.ordered, self._start
        for item in items:
            if ordered and item.delivery.message.ordering_key is not None:
                self.dispatch(lane, item)  # queued behind its key's running delivery, or started
            elif collector is not None:
                collector.add(item)
            else:
                start(item)

    def key_decided(self, lane: Lane, key: str, outcome: Outcome, item: Item) -> None:
        """After a delivery of ``key`` was decided: start the next one, or give them all back.

        When one did not succeed, those after it go back too: the broker redelivers them after
        it, so nothing of the key overtakes it.
        """
        queue = lane.keys.get(key)
        if queue is None:
            return
        accepting = self._state.accepting
        if outcome in _DONE and accepting:
            if queue:
                # not eager: a long queue of handlers that never wait must not nest calls
                self._start(queue.popleft(), eager=False)
            else:
                del lane.keys[key]
            return
        del lane.keys[key]
        requeued = Outcome.REQUEUED if accepting else Outcome.STOPPED
        while queue:
            waiting = queue.popleft()
            self._settle(waiting, requeued, ack=False, delay=DEFER_MIN_DELAY,
                         release=self._claims.release(waiting))

    # -- one delivery's task --------------------------------------------------------------------

    def _start(self, item: Item, eager: bool = True) -> None:
        collector = item.lane.collector
        if collector is not None:  # a batch handler's: the item joins a batch
            collector.add(item)
            return
        if item.span is None:
            item.task = _new_task(self._run(item), eager)
            return
        # the task (and a sync handler's thread) runs with the delivery's span as current: made
        # in a copy of this context with the span attached (the task copies that one), so there
        # is nothing to detach here
        assert self._telemetry is not None
        item.task = contextvars.copy_context().run(_new_task_in, self._telemetry.context_of(item),
                                                   self._run(item), eager)

    async def _run(self, item: Item) -> None:
        """One delivery in its own task: wait for resources, run the handler, decide."""
        if EAGER_TASKS:
            # set here, not only by _start: an eagerly started task runs this far (and maybe
            # to its end) before the constructor returns
            item.task = asyncio.current_task()
        lane = item.lane
        flow = self._flow
        size = len(item.delivery.message.data)  # (Delivery.size, without the call)
        holds_bytes = holds_thread = False
        try:
            if not flow.try_acquire_bytes(size):
                await flow.acquire_bytes(size)
            holds_bytes = True
            if not lane.route.is_async:
                await self._workers.acquire()
                holds_thread = True
            if not self._state.accepting:
                self._settle(item, Outcome.STOPPED, ack=False, release=self._claims.release(item))
            elif (item.claim is None or not lane.lease.claim_needs_refresh(item)
                    or await self.refresh_claim(lane, item)):
                await self._attempt(lane, item)
        except asyncio.CancelledError:
            if item.cancel_reason is None:  # not ours (the loop is going away): give it back
                item.cancel_reason = CancelReason.STOP
                await self._cancelled(item)
                raise
            await self._cancelled(item)
        except Exception:  # a bug of ours must not lose the message
            logger.exception("processing message %s failed unexpectedly", item.message_id)
            if item.stage is not SETTLING:
                retry = item.lane.route.retry
                self._settle(item, Outcome.RETRY, ack=False,
                             delay=retry.backoff(1, self._config.rng),
                             release=self._claims.release(item))
        finally:
            if holds_bytes:
                flow.release_bytes(size)
            if holds_thread:
                self._workers.release()

    async def refresh_claim(self, lane: Lane, item: Item) -> bool:
        """Re-claim a claim that lapsed while ``item`` waited to start; False if not ours."""
        ttl = lane.lease.claim_ttl()
        try:
            verdict = await within(self._config.clock, self._claims.refresh(item, ttl),
                                   max(MIN_STORE_CALL_BOUND, ttl), "dedup claim", cancel=False)
        except Exception as error:
            self._stats.store_errors += 1
            self._health.failed(CLAIM_CALL, error)
            self._settle(item, Outcome.RETRY, ack=False,
                         delay=self._defer_delay(0.0, lane.route.retry),
                         release=self._claims.release(item))
            return False
        self._health.ok(CLAIM_CALL)
        if self._telemetry is not None:
            self._telemetry.dedup_verdict(item, verdict)
        if isinstance(verdict, Claimed):
            lane.lease.claim_taken(item, ttl)
            return True
        if isinstance(verdict, Completed):
            self._settle(item, Outcome.DUPLICATE, ack=True)
        else:
            self._in_progress_elsewhere(item, verdict)
        return False

    async def _attempt(self, lane: Lane, item: Item) -> None:
        """Run the handler once (through the route's middleware) and hand on its decision."""
        message = item.delivery.message
        item.stage = RUNNING
        lane.lease.started(item)
        claim_token = CURRENT_CLAIM.set(item.claim)
        try:
            if lane.call is None:  # the direct fast path: no per-message objects on success
                try:
                    result = await self._call(lane, item)
                except BaseException as error:
                    if _ours(item, error):
                        raise
                    if isinstance(error, ClaimLostError):
                        self._claim_lost(lane, item, error)
                        return
                    # Anything a handler raises is its failure: Exception, SystemExit,
                    # KeyboardInterrupt, a CancelledError it raised itself, a BaseException.
                    item.duration = lane.lease.finished(item)
                    decision = await lane.failure.after_failure(message, item.failures, error)
                    self._apply(item, decision)
                    return
                item.duration = lane.lease.finished(item)
                self._succeeded(lane, item, result)
                return
            item_token = _current_item.set(item)
            try:
                decision = await lane.call(
                    Context(message, item.failures, item.claim, lane.route.name)
                )
            except BaseException as error:  # a middleware of the user's raised: its failure
                if _ours(item, error):
                    raise
                if isinstance(error, ClaimLostError):
                    self._claim_lost(lane, item, error)
                    return
                decision = await lane.failure.after_failure(message, item.failures, error)
            finally:
                _current_item.reset(item_token)
            if type(decision) is not Decision:  # a middleware of the user's returned that
                decision = await lane.failure.after_failure(message, item.failures, TypeError(
                    f"the middleware of {lane.route.name} returned {safe_repr(decision, 100)}, "
                    "not a Decision; return what call_next(context) returned, or a Decision"))
            item.duration = lane.lease.finished(item)
            self._apply(item, decision)
        finally:
            CURRENT_CLAIM.reset(claim_token)

    async def _call_handler(self) -> Decision:
        """The end of a middleware chain: the handler's return value or what it raised."""
        item = _current_item.get()
        try:
            result = await self._call(item.lane, item)
        except BaseException as error:
            if _ours(item, error) or isinstance(error, ClaimLostError):
                raise  # not the handler's failure: past the middleware, to _attempt
            return Decision.failed(error)
        return Decision.ack(result)

    async def _call(self, lane: Lane, item: Item) -> Any:
        handler, message = lane.handler, item.delivery.message
        if lane.route.is_async:
            result = handler(message)
            if type(result) is CoroutineType:  # inspect.iscoroutine, without the call
                result = await result
        else:
            future = self._workers.run(handler, message)
            item.thread_running = True
            ok, result = await future  # if this task is cancelled, the thread still runs
            item.thread_running = False
            if not ok:
                raise result
        if result is not None:
            # a sync wrapper's coroutine, a returned task: awaited here, in the loop (never
            # acked unrun); a generator: refused
            result = await settled_result(result, lane.route.name)
        return result


def _ours(item: Item, error: BaseException) -> bool:
    """Whether ``error`` is a cancellation of the delivery's task by the Subscriber (or by
    whoever owns the loop), as opposed to something the handler raised."""
    return isinstance(error, asyncio.CancelledError) and (
        item.cancel_reason is not None or cancel_requested()
    )
