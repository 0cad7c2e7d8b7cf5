"""One run of a Subscriber inside one event loop: receive, claim, dispatch, decide, settle.

The path of one delivery reads top to bottom here::

    receive ─► lease ─► claim (batch) ── completed ─► ack "duplicate"
                            │  held by a peer ─► nack "deferred" (dead-letter if it has failed
                            │                    max_delivery_attempts times meanwhile)
                            ▼ claimed
               its own task: wait for its ordering key, a worker thread, byte budget
                            ▼ (no handler starts once a stop began)
               the route's chain: your middleware ─► DeadLetterOrBackoff ─► InProcessRetry
                                  ─► handler          (or the handler alone: the fast path)
                            │
               Decision ── ack ─► record result + ack                         "acked"
                        ── redeliver ─► release claim (failures kept) + nack  "retried"
                        ── dead-lettered ─► release claim + ack               "dead_lettered"

Every ack and nack goes through the settler, which confirms it with the broker (and the result
with the store) before the delivery's lease, claim and flow-control slot are let go.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import math
import random
import sys
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, cast

from opentelemetry import context as otel_context
from tenacity import AsyncRetrying, retry_if_exception, wait_random_exponential

from .._callables import settled_result
from .._text import safe_repr, safe_str
from ..clock import Clock, within
from ..dedup import Claimed, Completed, DedupStore, InProgress, encode_result
from ..errors import (
    ClaimLostError,
    HandlerTimeoutError,
    MalformedMessageError,
    ResultNotSerializableError,
    UnknownTopicError,
)
from ..idempotency.transactional import Committed, TransactionalStore, transactional_handler
from ..message import Delivery, Message
from ..middleware import CallNext, Context, Decision, Middleware, Verdict, chain
from ..middleware.dead_letter import DeadLetterOrBackoff, log_fields
from ..middleware.retry import InProcessRetry
from ..outcome import DeliveryEvent, Outcome, SubscriberStats
from ..policy import DeadLetterPolicy, FlowControl, LeasePolicy, RetryPolicy
from ..ports import Adapter
from ..telemetry.consumer import DeliveryTelemetry, RouteTelemetry, SubscriberTelemetry
from .claims import Claims
from .flow import FlowGate
from .health import Health
from .inflight import CancelReason, InFlight, Stage
from .lease import LeaseManager
from .settler import Settle, Settler
from .supervisor import Supervisor
from .watchdog import LoopWatchdog
from .workers import WorkerThreads

logger = logging.getLogger("reliable_sub.subscriber")

# A message a live peer is handling comes back when the peer's claim would lapse, but not sooner
# than this (nor later than RetryPolicy.max_backoff, unless that is shorter than this).
DEFER_MIN_DELAY = 1.0
# Backoff between failed receive calls (broker unreachable): from 0.1 s up to 2 s, jittered;
# the cap bounds how long a consumer idles after the broker is back (a failover, a restart).
RECEIVE_RETRY_INITIAL = 0.1
RECEIVE_RETRY_MAX = 2.0
# A receive call still unanswered after twice its timeout plus this (seconds) counts as hung
# and fails (slack for a reclaim pass, a cluster client's first slot map, a loaded host).
RECEIVE_STALL_SLACK = 2.0
# After a stop cancels the async handlers still running at its deadline, each gets this long
# (real seconds) to end; one that swallows the cancellation is then left behind, logged.
CANCEL_GRACE = 5.0
# Receive calls still in flight when a stop begins get this long beyond receive_timeout to
# return before they are cancelled (and a cancelled call this long to end).
RECEIVE_GRACE = 1.0
# Queued acks and nacks get at least this long (real seconds) after the handlers are done,
# even when the stop timeout has already passed.
FLUSH_GRACE = 5.0
# A claim call gets as long as the claims it takes last (the first lease), but at least this
# long (seconds): a store whose connection hangs fails the call, and the batch is redelivered.
MIN_STORE_CALL_BOUND = 1.0
CLAIM_CALL = "claiming in the dedup store"
# Outcomes after which the next message of the same ordering key may run.
_DONE = frozenset({Outcome.ACKED, Outcome.DUPLICATE, Outcome.DEAD_LETTERED})

_current_claim: contextvars.ContextVar[Claimed | None] = contextvars.ContextVar(
    "reliable_sub_current_claim", default=None
)
# The delivery whose handler the current task runs (for the end of the middleware chain).
_current_item: contextvars.ContextVar[InFlight] = contextvars.ContextVar("reliable_sub_item")


def current_claim() -> Claimed | None:
    """The dedup claim the running handler holds (its key and fencing token), or None.

    Pass ``claim.token`` to a system that can reject writes from a stale claim holder.
    """
    return _current_claim.get()


@dataclass(frozen=True)
class Config:
    """What a Subscriber was configured with; a Runtime reads it."""

    adapter: Adapter
    dedup: DedupStore | None
    lease: LeasePolicy
    retry: RetryPolicy
    dead_letter: DeadLetterPolicy | None
    flow_control: FlowControl
    dedup_ttl: float
    clock: Clock
    sync_workers: int
    rng: random.Random
    receive_batch: int
    receive_timeout: float
    loop_lag_warning: float | None
    dedup_purge_interval: float | None
    on_outcome: Callable[[Message, Outcome], None] | None
    on_event: Callable[[DeliveryEvent], None] | None
    middleware: tuple[Middleware, ...]
    telemetry: SubscriberTelemetry
    unhealthy_after: float


@dataclass(eq=False)
class Route:
    """A subscription and its handler, as registered."""

    subscription: str
    handler: Callable[[Message], Any]
    is_async: bool
    namespace: str | None
    name: str
    middleware: tuple[Middleware, ...] = ()
    # handler(message, connection): its writes and its dedup record commit in one transaction
    transactional: bool = False


@dataclass(eq=False)
class Lane:
    """One route during one run."""

    route: Route
    namespace: str
    lease: LeaseManager
    ordered: bool
    # the middleware chain, or None: no middleware of the user's and no in-process retries,
    # so the handler is called directly and failures go straight to DeadLetterOrBackoff
    call: CallNext | None
    # the handler as called with the message alone (a transactional one wrapped in its
    # transaction)
    handler: Callable[[Message], Any]
    receive_call: asyncio.Task[list[Delivery]] | None = None
    # deliveries were given back at max_lease_duration for want of a worker thread: receive
    # again only once one is free, so peers get them rather than this Subscriber again
    starved: bool = False
    # ordering key -> deliveries waiting for the running one of that key
    keys: dict[str, deque[InFlight]] = field(default_factory=dict)
    # its span name and attributes, while telemetry is on
    telemetry: RouteTelemetry | None = None
    # the receive call's name in the log and in health reports
    receive_name: str = ""


class Runtime:
    """Receives, runs and settles the messages of every route, until :meth:`close`."""

    def __init__(self, config: Config, routes: list[Route], stats: SubscriberStats) -> None:
        self.config = config
        self.routes = routes
        self.stats = stats
        self.lanes: dict[str, Lane] = {}
        self.claims = Claims(config.dedup, config.dedup_ttl)
        self.flow = FlowGate(config.flow_control)
        self.health = Health(config.clock.now, config.unhealthy_after)
        self.workers = WorkerThreads(config.sync_workers)
        self.items: set[InFlight] = set()
        self.settler = Settler(
            config.adapter, claims=self.claims, stats=stats,
            on_settled=self._on_settled, clock=config.clock, health=self.health,
        )
        self.supervisor = Supervisor(config.clock.sleep, config.clock.now)
        self.failure = DeadLetterOrBackoff(config.retry, config.dead_letter, config.adapter,
                                           config.rng)
        self.watchdog: LoopWatchdog | None = None
        self.telemetry: DeliveryTelemetry | None = None  # this run's, if an SDK records
        self.receiving = False
        self.accepting = False  # False once a stop began: no handler starts after that
        self._side_tasks: set[asyncio.Task[None]] = set()

    # -- opening -------------------------------------------------------------------------------

    async def open(self) -> None:
        """Check names, build lanes, start receiving (raises why not, having started nothing)."""
        config, adapter = self.config, self.config.adapter
        policy = config.dead_letter
        if policy is not None and not await adapter.topic_exists(policy.topic):
            raise UnknownTopicError(
                f"dead-letter topic {policy.topic!r} does not exist; create it before "
                f"starting (adapter.ensure_topic_sync({policy.topic!r}))"
            )
        telemetry = self.telemetry = config.telemetry.for_run(
            adapter.capabilities.messaging_system)
        for route in self.routes:
            deadline = await adapter.subscription_ack_deadline(route.subscription)
            route_telemetry = on_extended = None
            if telemetry is not None:
                topic = await adapter.subscription_topic(route.subscription)
                route_telemetry = telemetry.route(route.subscription, topic, deadline)
                on_extended = functools.partial(telemetry.extended, route_telemetry)
            lease = LeaseManager(
                adapter, config.lease, clock=config.clock, initial_deadline=deadline,
                dedup=self.claims if config.dedup is not None else None,
                on_max_lease=self._max_lease_reached, on_extended=on_extended,
                health=self.health, subscription=route.subscription,
            )
            self.lanes[route.subscription] = Lane(
                route=route,
                namespace=route.namespace or adapter.dedup_namespace(route.subscription),
                lease=lease,
                ordered=adapter.capabilities.ordering,
                call=self._chain_of(route),
                handler=self._handler_of(route),
                telemetry=route_telemetry,
                receive_name=f"receiving from {route.subscription!r}",
            )
        self.receiving = self.accepting = True
        self.supervisor.spawn("settler", self.settler.run)
        for lane in self.lanes.values():
            name = lane.route.subscription
            self.supervisor.spawn(f"lease manager of {name!r}", lane.lease.run)
            self.supervisor.spawn(
                f"receive loop of {name!r}", functools.partial(self._receive_loop, lane),
                keep_running=lambda: self.receiving,
            )
        purge = getattr(config.dedup, "purge_expired", None)
        if purge is not None and config.dedup_purge_interval is not None:
            self.supervisor.spawn("dedup purge", functools.partial(
                self._purge_loop, purge, config.dedup_purge_interval))
        if config.loop_lag_warning is not None:
            self.watchdog = LoopWatchdog(
                asyncio.get_running_loop(), config.loop_lag_warning, self._describe_task
            )
            self.watchdog.start()

    def _handler_of(self, route: Route) -> Callable[[Message], Any]:
        if not route.transactional:
            return route.handler
        store = cast(TransactionalStore, self.config.dedup)  # checked at registration
        return transactional_handler(
            route.handler, store, retention=self.config.dedup_ttl, is_async=route.is_async,
            claim_of=current_claim, encode=self._encode,
        )

    async def _purge_loop(
        self, purge: Callable[[], Coroutine[Any, Any, int]], interval: float
    ) -> None:
        """Delete expired dedup records every ``interval`` seconds (the store's own batches)."""
        while True:
            await self.config.clock.sleep(interval)
            try:
                deleted = await purge()
            except Exception:
                self.stats.store_errors += 1
                logger.warning("purging expired dedup records failed; trying again in %gs",
                               interval, exc_info=True)
                continue
            self.stats.purged_records += deleted
            if deleted:
                logger.debug("purged %d expired dedup records", deleted)

    def _chain_of(self, route: Route) -> CallNext | None:
        """The route's middleware chain (built once), or None for the direct fast path."""
        config = self.config
        layers: list[Middleware] = [*config.middleware, *route.middleware]
        retries = config.retry.in_process_attempts > 1
        if not layers and not retries:
            return None
        layers.append(self.failure)
        if retries:
            on_retry = self._retried if self.telemetry is not None else None
            layers.append(InProcessRetry(config.retry, config.clock, on_retry))

        async def call_handler(context: Context) -> Decision:
            return await self._call_handler(route)

        return chain(layers, call_handler)

    def _retried(self, attempt: int, error: BaseException | None) -> None:
        assert self.telemetry is not None
        self.telemetry.retried(_current_item.get(), attempt, error)

    # (methods, not attribute reads: a stop may flip these while a coroutine awaits)
    def _still_receiving(self) -> bool:
        return self.receiving

    def _still_accepting(self) -> bool:
        return self.accepting

    def problems(self) -> list[str]:
        """What is wrong with this run (empty when healthy): loops being restarted, and calls
        that have kept failing for ``unhealthy_after`` seconds."""
        return self.supervisor.problems() + self.health.problems()

    # -- receiving -----------------------------------------------------------------------------

    async def _receive_loop(self, lane: Lane) -> None:
        config, flow = self.config, self.flow
        while self.receiving:
            free = await flow.free_slots()
            if not self.receiving or free <= 0:
                return
            if lane.starved:
                lane.starved = False
                if self.workers.saturated:
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
            if call.cancelled() and not self._still_receiving():
                return None
            raise
        finally:
            lane.receive_call = None

    async def _until_a_worker_is_free(self) -> list[Delivery]:
        await self.workers.wait_for_a_free_slot()
        return []

    async def _receive(self, lane: Lane, max_messages: int) -> list[Delivery]:
        """One receive call, retried with jittered exponential backoff while the broker fails."""
        subscription = lane.route.subscription
        call = lane.receive_name

        def log_failure(state: Any) -> None:
            self.stats.receive_errors += 1
            self.health.failed(call, state.outcome.exception() if state.outcome else None)

        def retryable(error: BaseException) -> bool:
            # Some clients turn a cancellation into a connection error: never retry once closing.
            return self.receiving and isinstance(error, Exception)

        async for attempt in AsyncRetrying(
            wait=wait_random_exponential(multiplier=RECEIVE_RETRY_INITIAL, max=RECEIVE_RETRY_MAX),
            retry=retry_if_exception(retryable),
            before_sleep=log_failure,
            sleep=self.config.clock.sleep,
        ):
            with attempt:
                timeout = self.config.receive_timeout
                # bounded: a broker connection that hangs (an adapter whose client has no
                # read timeout) fails the call like any other failure, so it is retried on a
                # fresh one and healthy() can tell; an adapter takes about `timeout`
                deliveries = await within(
                    self.config.clock,
                    self.config.adapter.receive(subscription, max_messages, timeout),
                    2 * timeout + RECEIVE_STALL_SLACK, "receive")
                self.health.ok(call)
                return deliveries
        return []  # the retry loop ended because the Subscriber is closing

    async def _admit(self, lane: Lane, deliveries: list[Delivery]) -> None:
        """Lease a received batch, claim it in one store call, and start or settle each."""
        now = self.config.clock.now()
        items = []
        for delivery in deliveries:
            delivery.received_at = now  # the lease clock starts when receive returns
            items.append(InFlight(delivery, lane))
        telemetry = self.telemetry
        if telemetry is not None:
            assert lane.telemetry is not None
            telemetry.received(lane.telemetry, items, lane.route.name)
        self.flow.taken(len(items))
        self.items.update(items)
        ttl = lane.lease.claim_ttl()
        lane.lease.add(items, ttl)
        if not self.accepting:  # the stop began while this batch was being received
            for item in items:
                self._settle(item, Outcome.STOPPED, ack=False)
            return
        good = [item for item in items if item.delivery.malformed is None]
        for item in items:
            if item.delivery.malformed is not None:
                self._malformed(item)
        if not good:
            return
        if self.claims.store is None:
            for item in good:
                item.failures = self.claims.failures_without_store(lane.namespace, item)
                self._dispatch(lane, item)
            return
        try:
            # bounded: a store that hangs must not hold this receive loop (and its batch) for
            # ever; past the claims' ttl they are moot anyway
            verdicts = await within(self.config.clock, self.claims.claim(lane.namespace, good, ttl),
                                    max(MIN_STORE_CALL_BOUND, ttl), "dedup claim", cancel=False)
        except asyncio.CancelledError:
            for item in good:  # claims taken by the cancelled call lapse with their TTL
                self._settle(item, Outcome.STOPPED, ack=False)
            raise
        except Exception as error:
            self.stats.store_errors += 1
            self.health.failed(CLAIM_CALL, error)
            delay = self._defer_delay(self.config.retry.backoff(1, self.config.rng))
            for item in good:
                if item.stage is Stage.WAITING:  # not given back meanwhile (max_lease_duration)
                    self._settle(item, Outcome.RETRY, ack=False, delay=delay)
            return
        self.health.ok(CLAIM_CALL)
        blocked: set[str] = set()  # ordering keys with a message that must not be overtaken
        for item, verdict in zip(good, verdicts, strict=True):
            if item.stage is not Stage.WAITING:
                # given back while the claim call ran (it outlasted max_lease_duration): not
                # to be run now; a claim it took is ended, so the redelivery need not wait
                if isinstance(verdict, Claimed):
                    self._track(self._release_late(item, verdict))
                continue
            if telemetry is not None:
                telemetry.dedup_verdict(item, verdict)
            key = item.delivery.message.ordering_key if lane.ordered else None
            if key is not None and key in blocked:
                self._settle(item, Outcome.REQUEUED, ack=False, delay=DEFER_MIN_DELAY,
                             release=self.claims.release(item))
            elif isinstance(verdict, Completed):
                self._settle(item, Outcome.DUPLICATE, ack=True)
            elif isinstance(verdict, InProgress):
                if key is not None:
                    blocked.add(key)
                self._in_progress_elsewhere(item, verdict)
            elif not self._still_accepting():
                self._settle(item, Outcome.STOPPED, ack=False, release=self.claims.release(item))
            else:
                self._dispatch(lane, item)

    async def _release_late(self, item: InFlight, claim: Claimed) -> None:
        item.claim = None
        try:
            await within(self.config.clock, self.claims.release_many([claim]),
                         max(MIN_STORE_CALL_BOUND, item.route.lease.claim_ttl()), "dedup release",
                         cancel=False)
        except Exception as error:  # it lapses with its ttl
            self.stats.store_errors += 1
            self.health.failed("releasing dedup claims", error)

    def _in_progress_elsewhere(self, item: InFlight, verdict: InProgress) -> None:
        policy = self.config.dead_letter
        if policy is not None and verdict.failures >= policy.max_delivery_attempts:
            # A peer's handler has run past max_lease_duration that many times: give up on it.
            item.failures = verdict.failures
            error = HandlerTimeoutError(
                f"the handler of message {item.message_id} is still running on a peer after "
                f"{verdict.failures} periods of max_lease_duration="
                f"{self.config.lease.max_lease_duration:g}s"
            )
            self._track(self._dead_letter_unhandled(item, error))
            return
        self._settle(item, Outcome.DEFERRED, ack=False,
                     delay=self._defer_delay(verdict.expires_in))

    def _defer_delay(self, wanted: float) -> float:
        """A redelivery delay of at least DEFER_MIN_DELAY, capped by max_backoff above it."""
        cap = max(DEFER_MIN_DELAY, self.config.retry.max_backoff)
        if not wanted < math.inf:
            return cap
        return min(cap, max(DEFER_MIN_DELAY, wanted))

    # -- dispatching ---------------------------------------------------------------------------

    def _dispatch(self, lane: Lane, item: InFlight) -> None:
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

    def _start(self, item: InFlight, eager: bool = True) -> None:
        # the task (and a sync handler's thread) runs with the delivery's span as current
        token = None
        if item.span is not None:
            assert self.telemetry is not None
            token = otel_context.attach(self.telemetry.context_of(item))
        try:
            if eager:
                item.task = _new_task(self._run(item))
            else:
                item.task = asyncio.get_running_loop().create_task(self._run(item))
        finally:
            if token is not None:
                otel_context.detach(token)

    def _track(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = _new_task(coroutine)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _run(self, item: InFlight) -> None:
        """One delivery in its own task: wait for resources, run the handler, decide."""
        # set here, not only by _start: an eagerly started task runs this far (and maybe to
        # its end) before the constructor returns
        item.task = asyncio.current_task()
        lane: Lane = item.route
        route = lane.route
        size = item.delivery.size
        holds_bytes = holds_thread = False
        try:
            if not self.flow.try_acquire_bytes(size):
                await self.flow.acquire_bytes(size)
            holds_bytes = True
            if not route.is_async:
                await self.workers.acquire()
                holds_thread = True
            if not self._still_accepting():
                self._settle(item, Outcome.STOPPED, ack=False, release=self.claims.release(item))
                return
            needs_refresh = item.claim is not None and lane.lease.claim_needs_refresh(item)
            if needs_refresh and not await self._refresh_claim(lane, item):
                return
            await self._attempt(lane, item)
        except asyncio.CancelledError:
            if item.cancel_reason is None:  # not ours (the loop is going away): give it back
                item.cancel_reason = CancelReason.STOP
                await self._cancelled(item)
                raise
            await self._cancelled(item)
        except Exception:  # a bug of ours must not lose the message
            logger.exception("processing message %s failed unexpectedly", item.message_id)
            if item.stage is not Stage.SETTLING:
                self._settle(item, Outcome.RETRY, ack=False,
                             delay=self.config.retry.backoff(1, self.config.rng),
                             release=self.claims.release(item))
        finally:
            if holds_bytes:
                self.flow.release_bytes(size)
            if holds_thread:
                self.workers.release()

    async def _refresh_claim(self, lane: Lane, item: InFlight) -> bool:
        """Re-claim a claim that lapsed while ``item`` waited to start; False if not ours."""
        ttl = lane.lease.claim_ttl()
        try:
            verdict = await within(self.config.clock, self.claims.refresh(item, ttl),
                                   max(MIN_STORE_CALL_BOUND, ttl), "dedup claim", cancel=False)
        except Exception as error:
            self.stats.store_errors += 1
            self.health.failed(CLAIM_CALL, error)
            self._settle(item, Outcome.RETRY, ack=False, delay=self._defer_delay(0.0),
                         release=self.claims.release(item))
            return False
        self.health.ok(CLAIM_CALL)
        if self.telemetry is not None:
            self.telemetry.dedup_verdict(item, verdict)
        if isinstance(verdict, Claimed):
            lane.lease.claim_taken(item, ttl)
            return True
        if isinstance(verdict, Completed):
            self._settle(item, Outcome.DUPLICATE, ack=True)
        else:
            self._in_progress_elsewhere(item, verdict)
        return False

    async def _attempt(self, lane: Lane, item: InFlight) -> None:
        """Run the handler once (through the route's middleware) and settle by its decision."""
        message = item.delivery.message
        item.stage = Stage.RUNNING
        lane.lease.started(item)
        claim_token = _current_claim.set(item.claim)
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
                    decision = await self.failure.after_failure(message, item.failures, error)
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
                decision = await self.failure.after_failure(message, item.failures, error)
            finally:
                _current_item.reset(item_token)
            if type(decision) is not Decision:  # a middleware of the user's returned that
                decision = await self.failure.after_failure(message, item.failures, TypeError(
                    f"the middleware of {lane.route.name} returned {safe_repr(decision, 100)}, "
                    "not a Decision; return what call_next(context) returned, or a Decision"))
            item.duration = lane.lease.finished(item)
            self._apply(item, decision)
        finally:
            _current_claim.reset(claim_token)

    async def _call_handler(self, route: Route) -> Decision:
        """The end of a middleware chain: the handler's return value or what it raised."""
        item = _current_item.get()
        try:
            result = await self._call(item.route, item)
        except BaseException as error:
            if _ours(item, error) or isinstance(error, ClaimLostError):
                raise  # not the handler's failure: past the middleware, to _attempt
            return Decision.failed(error)
        return Decision.ack(result)

    async def _call(self, lane: Lane, item: InFlight) -> Any:
        handler, message = lane.handler, item.delivery.message
        if lane.route.is_async:
            result = handler(message)
            if inspect.iscoroutine(result):
                result = await result
        else:
            future = self.workers.run(handler, message)
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

    def _succeeded(self, lane: Lane, item: InFlight, result: Any) -> None:
        if isinstance(result, Committed):  # recorded in the handler's transaction: only ack
            self.claims.drop(item)
            self._settle(item, Outcome.ACKED, ack=True)
            return
        result_json = "null"
        if item.claim is not None:
            result_json = self._encode(result, item.delivery.message)
        self.claims.forget(lane.namespace, item)
        self._settle(item, Outcome.ACKED, ack=True,
                     completion=self.claims.completion(item, result_json))

    def _apply(self, item: InFlight, decision: Decision) -> None:
        """Settle ``item`` as ``decision`` says."""
        lane: Lane = item.route
        verdict = decision.verdict
        if verdict is Verdict.ACK:
            self._succeeded(lane, item, decision.result)
            return
        if verdict is Verdict.FAILED:  # a middleware of the user's passed a failure outward
            assert decision.error is not None
            self._track(self._decide_failure(item, decision.error))
            return
        self.stats.handler_errors += 1
        item.error = decision.error
        self.claims.set_failures(lane.namespace, item, decision.failures)
        if verdict is Verdict.DEAD_LETTERED:
            self._dead_lettered(item)
            self.claims.forget(lane.namespace, item)
            self._settle(item, Outcome.DEAD_LETTERED, ack=True,
                         release=self.claims.release_dead_lettered(item))
        else:
            self._settle(item, Outcome.RETRY, ack=False, delay=self._redelivery_delay(decision),
                         release=self.claims.release(item))

    def _redelivery_delay(self, decision: Decision) -> float:
        """``decision.delay`` as seconds the broker can take: a middleware of the user's may
        return anything (NaN, inf, a str), which must not fail the nack of the batch."""
        delay = decision.delay
        if isinstance(delay, int | float) and not isinstance(delay, bool) and delay >= 0:
            return min(float(delay), self.config.retry.max_backoff)
        logger.warning("a middleware's redelivery delay %s is not a number of seconds >= 0; "
                       "using the RetryPolicy's backoff", safe_repr(delay, 100))
        return self.config.retry.backoff(max(1, decision.failures), self.config.rng)

    def _claim_lost(self, lane: Lane, item: InFlight, error: ClaimLostError) -> None:
        """A transactional handler's claim was taken over: rolled back; the peer has it."""
        item.duration = lane.lease.finished(item)
        self.stats.lost_claims += 1
        self.claims.drop(item)  # the peer's now: nothing to release
        logger.warning("%s; deferring it", error, extra={"message_id": item.message_id})
        self._settle(item, Outcome.DEFERRED, ack=False,
                     delay=self._defer_delay(self.config.lease.max_lease_duration))

    async def _decide_failure(self, item: InFlight, error: BaseException) -> None:
        item.stage = Stage.SETTLING
        decision = await self.failure.after_failure(item.delivery.message, item.failures, error)
        self._apply(item, decision)

    async def _dead_letter_unhandled(self, item: InFlight, error: BaseException) -> None:
        """Dead-letter a message no handler ran for (unreadable, or hung on a peer)."""
        item.stage = Stage.SETTLING
        message = item.delivery.message
        decision = await self.failure.dead_letter(message, item.failures, error)
        item.error = error
        self.claims.forget(item.route.namespace, item)
        if decision.verdict is Verdict.DEAD_LETTERED:
            self._dead_lettered(item)
            self._settle(item, Outcome.DEAD_LETTERED, ack=True,
                         release=self.claims.release_dead_lettered(item))
        else:
            self._settle(item, Outcome.RETRY, ack=False, delay=decision.delay,
                         release=self.claims.release(item))

    def _dead_lettered(self, item: InFlight) -> None:
        if self.telemetry is not None and self.config.dead_letter is not None:
            self.telemetry.dead_lettered(item, self.config.dead_letter.topic)

    def _encode(self, result: Any, message: Message) -> str:
        try:
            return encode_result(result)
        except ResultNotSerializableError as error:
            logger.error("message %s: %s; storing null instead", message.id, safe_str(error),
                         extra={"message_id": message.id, "subscription": message.subscription})
            return "null"

    # -- failures ------------------------------------------------------------------------------

    def _malformed(self, item: InFlight) -> None:
        self.stats.malformed += 1
        error = MalformedMessageError(
            f"message {item.message_id} of {item.delivery.message.subscription!r} cannot be "
            f"read: {item.delivery.malformed}"
        )
        item.stage = Stage.SETTLING
        if self.config.dead_letter is not None:
            self._track(self._dead_letter_unhandled(item, error))
            return
        logger.error("%s; no dead-letter policy, so it is redelivered in %gs", error,
                     self.config.retry.max_backoff,
                     extra=log_fields(item.delivery.message, item.failures, "retried"))
        self._settle(item, Outcome.RETRY, ack=False, delay=self.config.retry.max_backoff)

    # -- giving back ---------------------------------------------------------------------------

    async def _cancelled(self, item: InFlight) -> None:
        """``item``'s task was cancelled by us, for ``item.cancel_reason``."""
        reason = item.cancel_reason
        lane: Lane = item.route
        if reason is CancelReason.TIMEOUT and item.stage is Stage.RUNNING:
            item.duration = lane.lease.finished(item)
            await self._decide_failure(item, HandlerTimeoutError(
                f"handler {lane.route.name} ran past max_lease_duration="
                f"{self.config.lease.max_lease_duration:g}s and was cancelled"
            ))
            return
        if item.stage is Stage.SETTLING:
            return  # already decided
        outcome = Outcome.REQUEUED if reason is CancelReason.EXPIRED else Outcome.STOPPED
        # a thread still running keeps the claim: a redelivery must wait for it, not run beside
        release = None if item.thread_running else self.claims.release(item)
        self._settle(item, outcome, ack=False, release=release)

    def _cancel(self, item: InFlight, reason: CancelReason) -> None:
        if item.task is not None and not item.task.done():
            item.cancel_reason = reason
            item.task.cancel()

    async def _max_lease_reached(self, items: list[InFlight]) -> None:
        """Lease manager callback: ``items`` reached max_lease_duration."""
        overran: list[InFlight] = []
        for item in items:
            if item.stage is Stage.WAITING:
                if item.task is not None:
                    if not item.route.route.is_async and self.workers.saturated:
                        item.route.starved = True
                    self._cancel(item, CancelReason.EXPIRED)
                else:  # queued behind its ordering key
                    self._requeue_waiting(item, Outcome.REQUEUED)
            elif item.stage is Stage.RUNNING:
                if item.route.route.is_async:
                    self._cancel(item, CancelReason.TIMEOUT)
                else:
                    overran.append(item)
        if overran:
            await self._overran(overran)

    async def _overran(self, items: list[InFlight]) -> None:
        """Sync handlers still running at max_lease_duration: a thread cannot be interrupted.

        Each further period counts as a failed attempt (written with the claim's renewals, so a
        peer that receives the redelivery can dead-letter it once the count is reached), and
        the message is given back to the broker; the claim stays held while the thread runs.
        """
        max_lease = self.config.lease.max_lease_duration
        for item in items:
            lane: Lane = item.route
            failures = self.claims.record_failure(lane.namespace, item)
            logger.warning(
                "sync handler %s has run past max_lease_duration=%gs on message %s (counted as "
                "failed attempt %d); its message is given back and its claim kept while the "
                "thread runs", lane.route.name, max_lease, item.message_id, failures,
                extra=log_fields(item.delivery.message, failures, "overran"),
            )
        try:
            await self.config.adapter.nack([item.delivery for item in items], 0.0)
        except Exception:
            logger.warning("nack after max_lease_duration failed", exc_info=True)

    def _requeue_waiting(self, item: InFlight, outcome: Outcome) -> None:
        lane: Lane = item.route
        key = item.delivery.message.ordering_key
        queue = lane.keys.get(key) if key is not None else None
        if queue is not None and item in queue:
            queue.remove(item)
        self._settle(item, outcome, ack=False, release=self.claims.release(item))

    # -- settling ------------------------------------------------------------------------------

    def _settle(
        self,
        item: InFlight,
        outcome: Outcome,
        *,
        ack: bool,
        delay: float = 0.0,
        completion: Any = None,
        release: Claimed | None = None,
    ) -> None:
        self.settler.add(Settle(item, outcome, ack=ack, delay=delay, completion=completion,
                                release=release))
        lane: Lane = item.route
        key = item.delivery.message.ordering_key
        if key is not None and lane.ordered and item.task is not None:
            self._next_of_key(lane, key, outcome, item)

    def _next_of_key(self, lane: Lane, key: str, outcome: Outcome, item: InFlight) -> None:
        """After a delivery of ``key`` was decided: start the next one, or give them all back.

        When one did not succeed, those after it go back too: the broker redelivers them after
        it, so nothing of the key overtakes it.
        """
        queue = lane.keys.get(key)
        if queue is None:
            return
        if outcome in _DONE and self.accepting:
            if queue:
                # not eager: a long queue of handlers that never wait must not nest calls
                self._start(queue.popleft(), eager=False)
            else:
                del lane.keys[key]
            return
        del lane.keys[key]
        requeued = Outcome.REQUEUED if self.accepting else Outcome.STOPPED
        while queue:
            waiting = queue.popleft()
            self.settler.add(Settle(waiting, requeued, ack=False, delay=DEFER_MIN_DELAY,
                                    release=self.claims.release(waiting)))

    def _on_settled(self, settle: Settle, refused: bool) -> None:
        """The settler confirmed ``settle``: let the delivery go and report its outcome."""
        item = settle.item
        item.stage = Stage.DONE
        item.route.lease.drop(item)
        self.items.discard(item)
        self.flow.settled()
        outcome = Outcome.ACK_REFUSED if refused else settle.outcome
        self.stats.outcomes[outcome] += 1
        if self.telemetry is not None:
            assert item.route.telemetry is not None
            self.telemetry.settled(item.route.telemetry, item, outcome, settle.delay)
        config = self.config
        if config.on_outcome is not None:
            try:
                config.on_outcome(item.delivery.message, outcome)
            except Exception:
                logger.exception("on_outcome callback failed")
        if config.on_event is not None:
            message = item.delivery.message
            event = DeliveryEvent(message, outcome, message.delivery_attempt, item.failures,
                                  item.error, item.duration, settle.delay)
            try:
                config.on_event(event)
            except Exception:
                logger.exception("on_event callback failed")

    # -- closing -------------------------------------------------------------------------------

    async def close(self, timeout: float, force: asyncio.Event) -> None:
        """Stop: receive no more, give back what has not started, let running handlers finish
        within ``timeout`` real seconds, settle, and release the adapter and store."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.receiving = self.accepting = False
        running = [i for i in self.items if i.stage is Stage.RUNNING]
        logger.info(
            "stopping: %d handlers running, %d deliveries not started; waiting up to %gs",
            len(running), sum(1 for i in self.items if i.stage is Stage.WAITING), timeout,
            extra={"running": len(running), "timeout": timeout},
        )
        self.flow.close()
        if self.config.adapter.capabilities.cancel_safe_receive:
            self._cancel_receive_calls()
        self._give_back_unstarted()
        # A receive call cancelled in flight may have taken messages at the broker that then
        # wait out their ack deadline; so where that can happen the calls in flight may return
        # (within receive_timeout), and what they bring is given straight back.
        receivers = [f"receive loop of {name!r}" for name in self.lanes]
        patience = min(deadline, loop.time() + self.config.receive_timeout + RECEIVE_GRACE)
        await self.supervisor.wait(receivers, max(0.0, patience - loop.time()))
        self._cancel_receive_calls()
        await self.supervisor.wait(receivers, RECEIVE_GRACE)
        await self.supervisor.stop(*receivers)
        await self._wait_for_handlers(deadline, force)
        await self._wait_side_tasks(deadline, force)
        flush = max(deadline, loop.time() + FLUSH_GRACE)
        if force.is_set():
            self.settler.give_up_now()
        forcing = loop.create_task(_on_force(force, self.settler.give_up_now))
        try:
            await self.settler.drain(flush)
        finally:
            forcing.cancel()
        logger.info("drained: every delivery of this run is settled")
        await self.supervisor.stop()
        if self.watchdog is not None:
            self.watchdog.stop()
        self.workers.shutdown()
        await self._release_connections()

    async def abort(self) -> None:
        """Undo a failed :meth:`open`: stop what it started and release connections."""
        self.receiving = self.accepting = False
        self.flow.close()
        await self.supervisor.stop()
        if self.watchdog is not None:
            self.watchdog.stop()
        await self._release_connections()

    def _cancel_receive_calls(self) -> None:
        for lane in self.lanes.values():
            if lane.receive_call is not None:
                lane.receive_call.cancel()

    def _give_back_unstarted(self) -> None:
        # Messages queued behind a running one of their ordering key stay queued: they go back
        # when it is settled (_next_of_key), so no peer can run them before it has finished.
        for item in list(self.items):
            if item.stage is Stage.WAITING:
                self._cancel(item, CancelReason.STOP)

    async def _wait_for_handlers(self, deadline: float, force: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()

        def unfinished() -> set[asyncio.Task[None]]:
            return {i.task for i in self.items if i.task is not None and not i.task.done()}

        await _wait_until(unfinished(), deadline, force)
        stubborn = [i for i in self.items
                    if i.task is not None and not i.task.done() and i.stage is Stage.RUNNING]
        for item in stubborn:
            if item.route.route.is_async:
                self._cancel(item, CancelReason.STOP)
        threads = [i for i in stubborn if not i.route.route.is_async]
        if threads and not force.is_set():
            logger.warning(
                "%d sync handlers are still running at the stop deadline; a thread cannot be "
                "interrupted, so the stop waits for them (their leases and claims stay renewed, "
                "their results are recorded and acked); stop again (a second SIGINT/SIGTERM) "
                "to force", len(threads),
                extra={"message_ids": [i.message_id for i in threads[:20]]},
            )
            await _wait_until({i.task for i in threads if i.task is not None}, math.inf, force)
        if force.is_set():
            for item in self.items:
                if item.stage is Stage.RUNNING and item.task is not None:
                    self._cancel(item, CancelReason.STOP)
        pending = unfinished()
        if pending:
            grace = loop.time() + CANCEL_GRACE
            _, pending = await asyncio.wait(pending, timeout=max(0.0, grace - loop.time()))
        for task in pending:
            logger.error("a handler ignored its cancellation for %gs; leaving it behind (task "
                         "%r)", CANCEL_GRACE, task.get_name())
        for item in list(self.items):
            if item.task in pending and item.stage is not Stage.SETTLING:
                self._settle(item, Outcome.STOPPED, ack=False)
        for lane in self.lanes.values():  # behind a handler left running (a forced stop)
            queues, lane.keys = lane.keys, {}
            for queue in queues.values():
                for item in queue:
                    self._settle(item, Outcome.STOPPED, ack=False,
                                 release=self.claims.release(item))

    async def _wait_side_tasks(self, deadline: float, force: asyncio.Event) -> None:
        if self._side_tasks:
            loop = asyncio.get_running_loop()
            await _wait_until(set(self._side_tasks), max(deadline, loop.time() + FLUSH_GRACE),
                              force)

    async def _release_connections(self) -> None:
        """The adapter's and store's connections belong to this run's loop: release them."""
        for name, resource in (("adapter", self.config.adapter), ("dedup store",
                                                                   self.config.dedup)):
            if resource is None:
                continue
            try:
                await resource.close()
            except Exception:
                logger.warning("closing the %s failed", name, exc_info=True)

    def _describe_task(self, task: asyncio.Task[Any] | None) -> str | None:
        if task is None:
            return None
        for item in self.items:
            if item.task is task:
                route = item.route.route
                return (f"handler {route.name} of subscription {route.subscription!r} "
                        f"(message {item.message_id})")
        return None


async def _wait_until(tasks: set[asyncio.Task[None]], deadline: float,
                      force: asyncio.Event) -> None:
    """Wait for ``tasks`` until the loop clock reaches ``deadline`` or ``force`` is set."""
    if not tasks or force.is_set():
        return
    loop = asyncio.get_running_loop()
    forced = loop.create_task(force.wait())
    try:
        timeout = None if deadline == math.inf else max(0.0, deadline - loop.time())
        pending = set(tasks)
        while pending and not forced.done():
            done, _ = await asyncio.wait(pending | {forced}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                return
            pending -= done
            if timeout is not None:
                timeout = max(0.0, deadline - loop.time())
    finally:
        forced.cancel()


def _ours(item: InFlight, error: BaseException) -> bool:
    """Whether ``error`` is a cancellation of the delivery's task by the Subscriber (or by
    whoever owns the loop), as opposed to something the handler raised."""
    return isinstance(error, asyncio.CancelledError) and (
        item.cancel_reason is not None or _cancel_requested()
    )


def _cancel_requested() -> bool:
    """Whether the current task was asked to cancel (as opposed to a handler raising
    CancelledError by itself); Python 3.10 cannot tell, and then only our own reasons count."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False


async def _on_force(force: asyncio.Event, action: Callable[[], None]) -> None:
    await force.wait()
    action()


if sys.version_info >= (3, 12):
    def _new_task(coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A task that runs its first step at once (eager start), as its own task."""
        return asyncio.Task(coroutine, loop=asyncio.get_running_loop(), eager_start=True)
else:
    def _new_task(coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(coroutine)
