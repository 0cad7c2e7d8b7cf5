"""Decisions: what an outcome does to a delivery's lease, claim and settle.

Every delivery ends here, whatever ended it::

    handler returned ─────────► record its result (or, transactional, nothing) + ack  "acked"
    Decision redeliver ───────► release the claim (failures kept) + nack with delay   "retried"
    Decision dead-lettered ───► release the claim (failures cleared) + ack         "dead_lettered"
    claim held by a peer ─────► nack after the peer's claim would lapse               "deferred"
    unreadable, hung on peers ► dead-letter now (or redeliver without a policy)
    max_lease_duration ───────► give back what has not started; cancel or count what runs
    cancelled by a stop ──────► nack at once; a running thread keeps its claim        "stopped"

:meth:`Decisions.settle` hands each to the settler, and tells the dispatcher that its ordering key
may move on. Nothing here holds the run: it is built with the parts it decides over.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from .._text import safe_repr, safe_str
from ..dedup import Claimed, InProgress, encode_result
from ..errors import (
    ClaimLostError,
    HandlerTimeoutError,
    MalformedMessageError,
    ResultNotSerializableError,
)
from ..idempotency.transactional import Committed
from ..message import Message
from ..middleware import Decision, Verdict
from ..middleware.dead_letter import (
    ATTEMPTS_USED_UP,
    REJECTED,
    RUNNING_TOO_LONG,
    UNREADABLE,
    log_fields,
)
from ..outcome import Outcome, SubscriberStats
from ..policy import RetryPolicy
from ..telemetry.consumer import DeliveryTelemetry
from .claims import Claims
from .inflight import CancelReason, Stage
from .lanes import Config, Item, Lane, RunState
from .members import ACKED
from .settler import Settle
from .workers import WorkerThreads

logger = logging.getLogger("reliable_sub.subscriber")

# A message a live peer is handling comes back when the peer's claim would lapse, but not sooner
# than this (nor later than RetryPolicy.max_backoff, unless that is shorter than this).
DEFER_MIN_DELAY = 1.0


def cancel(item: Item, reason: CancelReason) -> None:
    """Cancel ``item``'s task (if it still runs), saying why."""
    if item.task is not None and not item.task.done():
        item.cancel_reason = reason
        item.task.cancel()


class Decisions:
    """Turns outcomes into settles for one run.

    Args:
        config, state: the run's configuration and switches.
        claims: the claim lifecycle (failure counts, completions, releases).
        stats: the Subscriber's counters.
        workers: the sync handlers' threads (whether one is free).
        telemetry: the run's telemetry, or None.
        add_settle, add_settles: the settler's queue, for one settle or several.

    A failed attempt's dead-letter-or-backoff decision is its lane's (``Lane.failure``).
    """

    def __init__(
        self,
        config: Config,
        state: RunState,
        claims: Claims,
        stats: SubscriberStats,
        workers: WorkerThreads,
        telemetry: DeliveryTelemetry | None,
        add_settle: Callable[[Settle], None],
        add_settles: Callable[[list[Settle]], None],
    ) -> None:
        self._config = config
        self._state = state
        self._claims = claims
        self._stats = stats
        self._workers = workers
        self._telemetry = telemetry
        self._add_settle = add_settle
        self._add_settles = add_settles
        # the dispatcher's: after a delivery of an ordering key is decided (see wire_keys)
        self._key_decided: Callable[[Lane, str, Outcome, Item], None] | None = None

    def wire_keys(self, key_decided: Callable[[Lane, str, Outcome, Item], None]) -> None:
        """Tell ``key_decided`` of each decided delivery of an ordered lane that has a key."""
        self._key_decided = key_decided

    def settle(
        self,
        item: Item,
        outcome: Outcome,
        *,
        ack: bool,
        delay: float = 0.0,
        completion: Any = None,
        release: Claimed | None = None,
    ) -> None:
        """Queue ``item``'s ack or nack (with the store write it needs)."""
        self._add_settle(Settle(item, outcome, ack=ack, delay=delay, completion=completion,
                                release=release))
        lane = item.lane
        key = item.delivery.message.ordering_key
        if key is not None and lane.ordered and item.task is not None:
            assert self._key_decided is not None
            self._key_decided(lane, key, outcome, item)

    # -- after the handler --------------------------------------------------------------------

    def succeeded(self, lane: Lane, item: Item, result: Any) -> None:
        """The handler returned ``result``: record it with the ack."""
        if isinstance(result, Committed):  # recorded in the handler's transaction: only ack
            self._claims.drop(item)
            self.settle(item, ACKED, ack=True)
            return
        claims = self._claims
        if item.claim is None:  # the fast path: nothing to record
            if claims.failure_counts:
                claims.forget(lane.namespace, item)
            if not lane.ordered or item.delivery.message.ordering_key is None:
                self._add_settle(Settle(item, ACKED, ack=True))  # (settle(), inline)
            else:
                self.settle(item, ACKED, ack=True)
            return
        result_json = "null" if result is None else self.encode(result, item.delivery.message)
        self.settle(item, ACKED, ack=True,
                    completion=claims.completion(item, result_json))

    def succeeded_many(self, lane: Lane, items: list[Item]) -> None:
        """A batch handler's call succeeded for each of ``items``: record null with each ack."""
        if self._claims.failure_counts:
            for item in items:
                self.succeeded(lane, item, None)
            return
        ordered = lane.ordered
        plain: list[Settle] = []  # nothing to record, no ordering key to hand on: queued together
        for item in items:
            if item.claim is None and (not ordered or item.delivery.message.ordering_key is None):
                plain.append(Settle(item, ACKED, ack=True))
            else:
                self.succeeded(lane, item, None)
        if plain:
            self._add_settles(plain)

    def apply(self, item: Item, decision: Decision) -> None:
        """Settle ``item`` as ``decision`` says."""
        lane = item.lane
        verdict = decision.verdict
        if verdict is Verdict.ACK:
            self.succeeded(lane, item, decision.result)
            return
        if verdict is Verdict.FAILED:  # a middleware of the user's passed a failure outward
            assert decision.error is not None
            self._state.track(self.decide_failure(item, decision.error))
            return
        self._stats.handler_errors += 1
        item.error = decision.error
        self._claims.set_failures(lane.namespace, item, decision.failures)
        if verdict is Verdict.DEAD_LETTERED:
            reason = ATTEMPTS_USED_UP
            if lane.route.retry.is_permanent(decision.error):
                self._stats.rejected += 1
                reason = REJECTED
            self._dead_lettered(item, reason)
            self._claims.forget(lane.namespace, item)
            self.settle(item, Outcome.DEAD_LETTERED, ack=True,
                        release=self._claims.release_dead_lettered(item))
        else:
            self.settle(item, Outcome.RETRY, ack=False,
                        delay=self._redelivery_delay(decision, lane.route.retry),
                        release=self._claims.release(item))

    def _redelivery_delay(self, decision: Decision, retry: RetryPolicy) -> float:
        """``decision.delay`` as seconds the broker can take: a middleware of the user's may
        return anything (NaN, inf, a str), which must not fail the nack of the batch."""
        delay = decision.delay
        if isinstance(delay, int | float) and not isinstance(delay, bool) and delay >= 0:
            return min(float(delay), retry.max_backoff)
        logger.warning("a middleware's redelivery delay %s is not a number of seconds >= 0; "
                       "using the RetryPolicy's backoff", safe_repr(delay, 100))
        return retry.backoff(max(1, decision.failures), self._config.rng)

    def claim_lost(self, lane: Lane, item: Item, error: ClaimLostError) -> None:
        """A transactional handler's claim was taken over: rolled back; the peer has it."""
        item.duration = lane.lease.finished(item)
        self._stats.lost_claims += 1
        self._claims.drop(item)  # the peer's now: nothing to release
        logger.warning("%s; deferring it", error, extra={"message_id": item.message_id})
        self.settle(item, Outcome.DEFERRED, ack=False,
                    delay=self.defer_delay(lane.route.lease.max_lease_duration,
                                           lane.route.retry))

    async def decide_failure(self, item: Item, error: BaseException) -> None:
        """The attempt failed with ``error``, outside the route's chain: decide and settle."""
        item.stage = Stage.SETTLING
        decision = await item.lane.failure.after_failure(item.delivery.message, item.failures,
                                                         error)
        self.apply(item, decision)

    def encode(self, result: Any, message: Message) -> str:
        """``result`` as the JSON the store records ("null" when it cannot be)."""
        try:
            return encode_result(result)
        except ResultNotSerializableError as error:
            logger.error("message %s: %s; storing null instead", message.id, safe_str(error),
                         extra={"message_id": message.id, "subscription": message.subscription})
            return "null"

    # -- without the handler -------------------------------------------------------------------

    def in_progress_elsewhere(self, item: Item, verdict: InProgress) -> None:
        """A live peer holds ``item``'s claim: defer it, or dead-letter it when the peer's
        handler has overrun max_lease_duration max_delivery_attempts times."""
        policy = item.lane.route.dead_letter
        if policy is not None and verdict.failures >= policy.max_delivery_attempts:
            item.failures = verdict.failures
            error = HandlerTimeoutError(
                f"the handler of message {item.message_id} is still running on a peer after "
                f"{verdict.failures} periods of max_lease_duration="
                f"{item.lane.route.lease.max_lease_duration:g}s"
            )
            self._state.track(self._dead_letter_unhandled(item, error, RUNNING_TOO_LONG))
            return
        self.settle(item, Outcome.DEFERRED, ack=False,
                    delay=self.defer_delay(verdict.expires_in, item.lane.route.retry))

    def defer_delay(self, wanted: float, retry: RetryPolicy) -> float:
        """A redelivery delay of at least DEFER_MIN_DELAY, capped by the route's
        ``retry.max_backoff`` above it."""
        cap = max(DEFER_MIN_DELAY, retry.max_backoff)
        if not wanted < math.inf:
            return cap
        return min(cap, max(DEFER_MIN_DELAY, wanted))

    def malformed(self, item: Item) -> None:
        """``item`` cannot be read: dead-letter it, or redeliver it late without a policy."""
        self._stats.malformed += 1
        error = MalformedMessageError(
            f"message {item.message_id} of {item.delivery.message.subscription!r} cannot be "
            f"read: {item.delivery.malformed}"
        )
        item.stage = Stage.SETTLING
        route = item.lane.route
        if route.dead_letter is not None:
            self._state.track(self._dead_letter_unhandled(item, error, UNREADABLE))
            return
        logger.error("%s; no dead-letter policy, so it is redelivered in %gs", error,
                     route.retry.max_backoff,
                     extra=log_fields(item.delivery.message, item.failures, "retried"))
        self.settle(item, Outcome.RETRY, ack=False, delay=route.retry.max_backoff)

    async def _dead_letter_unhandled(self, item: Item, error: BaseException, reason: str) -> None:
        """Dead-letter a message no handler ran for (unreadable, or hung on a peer)."""
        item.stage = Stage.SETTLING
        message = item.delivery.message
        decision = await item.lane.failure.dead_letter(message, item.failures, error, reason)
        item.error = error
        self._claims.forget(item.lane.namespace, item)
        if decision.verdict is Verdict.DEAD_LETTERED:
            self._dead_lettered(item, reason)
            self.settle(item, Outcome.DEAD_LETTERED, ack=True,
                        release=self._claims.release_dead_lettered(item))
        else:
            self.settle(item, Outcome.RETRY, ack=False, delay=decision.delay,
                        release=self._claims.release(item))

    def _dead_lettered(self, item: Item, reason: str) -> None:
        policy = item.lane.route.dead_letter
        if self._telemetry is not None and policy is not None:
            assert item.lane.telemetry is not None
            self._telemetry.dead_lettered(item.lane.telemetry, item, policy.topic, reason)

    # -- giving back ---------------------------------------------------------------------------

    async def cancelled(self, item: Item) -> None:
        """``item``'s task was cancelled by us, for ``item.cancel_reason``."""
        reason = item.cancel_reason
        lane = item.lane
        if reason is CancelReason.TIMEOUT and item.stage is Stage.RUNNING:
            item.duration = lane.lease.finished(item)
            await self.decide_failure(item, HandlerTimeoutError(
                f"handler {lane.route.name} ran past max_lease_duration="
                f"{lane.route.lease.max_lease_duration:g}s and was cancelled"
            ))
            return
        if item.stage is Stage.SETTLING:
            return  # already decided
        outcome = Outcome.REQUEUED if reason is CancelReason.EXPIRED else Outcome.STOPPED
        # a thread still running keeps the claim: a redelivery must wait for it, not run beside
        release = None if item.thread_running else self._claims.release(item)
        self.settle(item, outcome, ack=False, release=release)

    async def max_lease_reached(self, items: list[Item]) -> None:
        """Lease manager callback: ``items`` reached max_lease_duration."""
        overran: list[Item] = []
        for item in items:
            if item.stage is Stage.WAITING:
                if item.task is not None:
                    if not item.lane.route.is_async and self._workers.saturated:
                        item.lane.starved = True
                    cancel(item, CancelReason.EXPIRED)
                else:  # queued behind its ordering key
                    self._requeue_waiting(item, Outcome.REQUEUED)
            elif item.stage is Stage.RUNNING:
                if item.lane.route.is_async:
                    cancel(item, CancelReason.TIMEOUT)
                else:
                    overran.append(item)
        if overran:
            await self._overran(overran)

    async def _overran(self, items: list[Item]) -> None:
        """Sync handlers still running at max_lease_duration: a thread cannot be interrupted.

        Each further period counts as a failed attempt (written with the claim's renewals, so a
        peer that receives the redelivery can dead-letter it once the count is reached), and
        the message is given back to the broker; the claim stays held while the thread runs.
        """
        for item in items:
            lane = item.lane
            max_lease = lane.route.lease.max_lease_duration
            failures = self._claims.record_failure(lane.namespace, item)
            logger.warning(
                "sync handler %s has run past max_lease_duration=%gs on message %s (counted as "
                "failed attempt %d); its message is given back and its claim kept while the "
                "thread runs", lane.route.name, max_lease, item.message_id, failures,
                extra=log_fields(item.delivery.message, failures, "overran"),
            )
        try:
            await self._config.adapter.nack([item.delivery for item in items], 0.0)
        except Exception:
            logger.warning("nack after max_lease_duration failed", exc_info=True)

    def _requeue_waiting(self, item: Item, outcome: Outcome) -> None:
        key = item.delivery.message.ordering_key
        queue = item.lane.keys.get(key) if key is not None else None
        if queue is not None and item in queue:
            queue.remove(item)
        self.settle(item, outcome, ack=False, release=self._claims.release(item))
