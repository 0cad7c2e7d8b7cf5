"""Receiving and admission: one loop per subscription, from the broker's receive to dispatch.

::

    free flow-control slots ─► receive (retried with backoff while the broker fails; bounded)
       ▼
    admit the batch: stamp it, lease it, count it, start its spans
       │  a stop began meanwhile ─► give it all back                         "stopped"
       │  unreadable ─► decisions.malformed
       ▼
    claim the batch's keys in one store call (without a store: its failure counts in memory)
       │  completed ─► ack                                                 "duplicate"
       │  held by a live peer ─► decisions.in_progress_elsewhere            "deferred"
       │  behind a held message of its ordering key ─► nack                 "requeued"
       ▼ claimed
    dispatch (:mod:`reliable_sub._runtime.dispatcher`)

A lane whose deliveries were given back for want of a worker thread ("starved") waits for one
before it receives again, so peers get those deliveries rather than this Subscriber again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception, wait_random_exponential

from ..clock import within
from ..dedup import Claimed, Completed, InProgress
from ..message import Delivery
from ..outcome import Outcome, SubscriberStats
from ..policy import RetryPolicy
from ..telemetry.consumer import DeliveryTelemetry
from .claims import CLAIM_CALL, MIN_STORE_CALL_BOUND, Claims
from .decisions import DEFER_MIN_DELAY
from .flow import FlowGate
from .health import Health
from .inflight import InFlight
from .lanes import Config, Item, Lane, RunState, SettleCall
from .members import DUPLICATE, WAITING
from .workers import WorkerThreads

logger = logging.getLogger("reliable_sub.subscriber")

# Backoff between failed receive calls (broker unreachable): from 0.1 s up to 2 s, jittered;
# the cap bounds how long a consumer idles after the broker is back (a failover, a restart).
RECEIVE_RETRY_INITIAL = 0.1
RECEIVE_RETRY_MAX = 2.0
# A receive call still unanswered after twice its timeout plus this (seconds) counts as hung
# and fails (slack for a reclaim pass, a cluster client's first slot map, a loaded host).
RECEIVE_STALL_SLACK = 2.0


class Receiver:
    """Receives and admits the deliveries of every lane of one run.

    Args:
        config, state: the run's configuration and switches (``state.items`` gains each
            admitted delivery).
        flow, workers: flow-control slots; whether a worker thread is free.
        claims, stats, health: the batch's claim call, and what its failures count as.
        telemetry: the run's telemetry, or None.
        dispatch, dispatch_many: the dispatcher's entries (for one delivery, for several).
        settle, malformed, in_progress_elsewhere, defer_delay: the
            :class:`~reliable_sub._runtime.decisions.Decisions` methods of those names.
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
        dispatch: Callable[[Lane, Item], None],
        dispatch_many: Callable[[Lane, list[Item]], None],
        settle: SettleCall,
        malformed: Callable[[Item], None],
        in_progress_elsewhere: Callable[[Item, InProgress], None],
        defer_delay: Callable[[float, RetryPolicy], float],
    ) -> None:
        self.config = config
        self._state = state
        self._flow = flow
        self._workers = workers
        self._claims = claims
        self._stats = stats
        self._health = health
        self._telemetry = telemetry
        self._dispatch = dispatch
        self._dispatch_many = dispatch_many
        self._settle = settle
        self._malformed = malformed
        self._in_progress_elsewhere = in_progress_elsewhere
        self._defer_delay = defer_delay

    async def loop(self, lane: Lane) -> None:
        """Receive and admit ``lane``'s deliveries while the run receives."""
        config, flow, state = self.config, self._flow, self._state
        while state.receiving:
            free = await flow.free_slots()
            if lane.flow is not None and free > 0:  # the handler's own max_concurrency
                free = min(free, await lane.flow.free_slots())
            if not state.receiving or free <= 0:
                return
            if lane.starved:
                lane.starved = False
                if self._workers.saturated:
                    if await self._as_receive_call(lane, self._until_a_worker_is_free()) is None:
                        return
                    continue
            deliveries = await self._as_receive_call(
                lane, self._receive(lane, min(free, config.receive_batch))
            )
            if deliveries is None:
                return
            if deliveries:
                await self._admit(lane, deliveries)
            # yield between batches: handlers that never wait must not starve the loop
            await asyncio.sleep(0)

    async def _as_receive_call(
        self, lane: Lane, coroutine: Coroutine[Any, Any, list[Delivery]]
    ) -> list[Delivery] | None:
        """Await ``coroutine`` as ``lane``'s receive call, which a stop may cancel; None when
        the stop did."""
        call = asyncio.get_running_loop().create_task(coroutine)
        lane.receive_call = call
        try:
            return await call
        except asyncio.CancelledError:
            if call.cancelled() and not _receiving(self._state):
                return None
            raise
        finally:
            lane.receive_call = None

    async def _until_a_worker_is_free(self) -> list[Delivery]:
        await self._workers.wait_for_a_free_slot()
        return []

    async def _receive(self, lane: Lane, max_messages: int) -> list[Delivery]:
        """One receive call, retried with jittered exponential backoff while the broker fails."""
        subscription = lane.route.subscription
        call = lane.receive_name
        config, state = self.config, self._state

        def log_failure(attempt: Any) -> None:
            self._stats.receive_errors += 1
            self._health.failed(call, attempt.outcome.exception() if attempt.outcome else None)

        def retryable(error: BaseException) -> bool:
            # Some clients turn a cancellation into a connection error: never retry once closing.
            return state.receiving and isinstance(error, Exception)

        async for attempt in AsyncRetrying(
            wait=wait_random_exponential(multiplier=RECEIVE_RETRY_INITIAL, max=RECEIVE_RETRY_MAX),
            retry=retry_if_exception(retryable),
            before_sleep=log_failure,
            sleep=config.clock.sleep,
        ):
            with attempt:
                timeout = config.receive_timeout
                # bounded: a broker connection that hangs (an adapter whose client has no
                # read timeout) fails the call like any other failure, so it is retried on a
                # fresh one and healthy() can tell; an adapter takes about `timeout`
                deliveries = await within(
                    config.clock, config.adapter.receive(subscription, max_messages, timeout),
                    2 * timeout + RECEIVE_STALL_SLACK, "receive")
                self._health.ok(call)
                return deliveries
        return []  # the retry loop ended because the Subscriber is closing

    async def _admit(self, lane: Lane, deliveries: list[Delivery]) -> None:
        """Lease a received batch, claim it in one store call, and start or settle each."""
        now = self.config.clock.now()
        items: list[Item] = []
        for delivery in deliveries:
            delivery.received_at = now  # the lease clock starts when receive returns
            items.append(InFlight(delivery, lane))
        telemetry = self._telemetry
        if telemetry is not None:
            assert lane.telemetry is not None
            telemetry.received(lane.telemetry, items, lane.route.name)
        state, claims, settle = self._state, self._claims, self._settle
        self._flow.taken(len(items))
        if lane.flow is not None:
            lane.flow.taken(len(items))
        state.items.update(items)
        ttl = lane.lease.claim_ttl()
        lane.lease.add(items, ttl)
        if not state.accepting:  # the stop began while this batch was being received
            for item in items:
                settle(item, Outcome.STOPPED, ack=False)
            return
        good = [item for item in items if item.delivery.malformed is None]
        for item in items:
            if item.delivery.malformed is not None:
                self._malformed(item)
        if not good:
            return
        if claims.store is None:
            if claims.failure_counts:
                for item in good:
                    item.failures = claims.failures_without_store(lane.namespace, item)
            self._dispatch_many(lane, good)
            return
        try:
            # bounded: a store that hangs must not hold this receive loop (and its batch) for
            # ever; past the claims' ttl they are moot anyway
            verdicts = await within(self.config.clock, claims.claim(lane.namespace, good, ttl),
                                    max(MIN_STORE_CALL_BOUND, ttl), "dedup claim", cancel=False)
        except asyncio.CancelledError:
            for item in good:  # claims taken by the cancelled call lapse with their TTL
                settle(item, Outcome.STOPPED, ack=False)
            raise
        except Exception as error:
            self._stats.store_errors += 1
            self._health.failed(CLAIM_CALL, error)
            retry = lane.route.retry  # the handler's own, or the Subscriber's
            delay = self._defer_delay(retry.backoff(1, self.config.rng), retry)
            for item in good:
                if item.stage is WAITING:  # not given back meanwhile (max_lease_duration)
                    settle(item, Outcome.RETRY, ack=False, delay=delay)
            return
        self._health.ok(CLAIM_CALL)
        blocked: set[str] = set()  # ordering keys with a message that must not be overtaken
        for item, verdict in zip(good, verdicts, strict=True):
            if item.stage is not WAITING:
                # given back while the claim call ran (it outlasted max_lease_duration): not
                # to be run now; a claim it took is ended, so the redelivery need not wait
                if isinstance(verdict, Claimed):
                    state.track(self._release_late(item, verdict))
                continue
            if telemetry is not None:
                telemetry.dedup_verdict(item, verdict)
            key = item.delivery.message.ordering_key if lane.ordered else None
            if key is not None and key in blocked:
                settle(item, Outcome.REQUEUED, ack=False, delay=DEFER_MIN_DELAY,
                       release=claims.release(item))
            elif isinstance(verdict, Completed):
                settle(item, DUPLICATE, ack=True)
            elif isinstance(verdict, InProgress):
                if key is not None:
                    blocked.add(key)
                self._in_progress_elsewhere(item, verdict)
            elif not _accepting(state):
                settle(item, Outcome.STOPPED, ack=False, release=claims.release(item))
            else:
                self._dispatch(lane, item)

    async def _release_late(self, item: Item, claim: Claimed) -> None:
        item.claim = None
        try:
            await within(self.config.clock, self._claims.release_many([claim]),
                         max(MIN_STORE_CALL_BOUND, item.lane.lease.claim_ttl()), "dedup release",
                         cancel=False)
        except Exception as error:  # it lapses with its ttl
            self._stats.store_errors += 1
            self._health.failed("releasing dedup claims", error)


# (functions, not attribute reads: a stop may flip these while a coroutine awaits, which a type
# checker that narrowed the attribute before the await would not see)
def _receiving(state: RunState) -> bool:
    return state.receiving


def _accepting(state: RunState) -> bool:
    return state.accepting
