"""The Subscriber: receives, leases, deduplicates, runs handlers, retries, dead-letters, acks.

The path of one delivery reads top to bottom in :meth:`Subscriber._handle`::

    claim in the dedup store ── completed before ──► ack (duplicate)
        │  claimed by a live peer ──► nack until the peer is done (deferred)
        ▼
    handler (in-process retries) ── ok ──► complete in the store ► ack (acked)
        │ failed
        ▼
    release the claim ► last attempt ? publish to the dead-letter topic ► ack (dead_lettered)
                                     : nack with exponential backoff (retry)
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import random
import signal
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random_exponential,
)

from ._eager import start_eagerly
from ._flow import FlowGate
from ._settler import Settler
from .adapters.base import Adapter
from .clock import Clock, SystemClock
from .dedup import Claimed, Completed, DedupStore, encode_result, scoped_key
from .errors import ConfigurationError, ResultNotSerializableError
from .lease import LeaseManager
from .message import Delivery, Message
from .outcome import Outcome, SubscriberStats
from .policy import DeadLetterPolicy, FlowControl, LeasePolicy, RetryPolicy, check_count

logger = logging.getLogger(__name__)

# Pub/Sub keeps unacked messages 7 days by default; a dedup record should outlive any copy.
DEFAULT_DEDUP_TTL = 7 * 24 * 3600.0
# At most this many messages per receive call: large enough to amortise a round trip, small
# enough that one call does not take a whole flow-control budget from other subscriptions.
RECEIVE_BATCH = 100
# Seconds one receive call waits for messages before it returns empty and is made again.
RECEIVE_TIMEOUT = 5.0
# Backoff between failed receive calls (broker unreachable): from 0.1 s up to 10 s, jittered.
RECEIVE_RETRY_INITIAL = 0.1
RECEIVE_RETRY_MAX = 10.0
# Pub/Sub's own client runs callbacks on 10 threads by default; so do we for sync handlers.
DEFAULT_SYNC_WORKERS = 10
# A message a live peer is handling comes back when the peer's claim would lapse, but not sooner
# than this (nor later than RetryPolicy.max_backoff).
DEFER_MIN_DELAY = 1.0
# Pub/Sub attribute values are limited to 1024 bytes; the error message is cut to fit.
ERROR_MESSAGE_LIMIT = 1000
DEFAULT_STOP_TIMEOUT = 30.0
# Outcomes after which the next message of the same ordering key may run.
_DONE = frozenset({Outcome.ACKED, Outcome.DUPLICATE, Outcome.DEAD_LETTERED})
# On stop, receive loops are cancelled again at this interval until they have ended.
RECEIVER_STOP_WAIT = 1.0

HandlerT = TypeVar("HandlerT", bound=Callable[..., Any])


@dataclass(eq=False)
class _Route:
    """One subscription and its handler."""

    subscription: str
    handler: Callable[[Message], Any]
    is_async: bool
    namespace: str
    direct: bool = False  # async, no in-process retries: awaited without wrappers
    lease: LeaseManager | None = None
    receiver: asyncio.Task[None] | None = None
    # ordering key -> deliveries waiting for the running one of that key (ordered brokers)
    waiting: dict[str, deque[tuple[Delivery, str | None]]] = field(default_factory=dict)


class _Attempt:
    """What one delivery holds, so a stop can give back exactly that."""

    __slots__ = ("claim_key", "in_thread", "result_json")

    def __init__(self, claim_key: str | None) -> None:
        self.claim_key = claim_key
        self.in_thread = False
        self.result_json = "null"


class Subscriber:
    """Runs handlers for one or more subscriptions of one broker, with the full guarantees.

    Args:
        adapter: the broker (``MemoryAdapter``, ``RedisStreamsAdapter``, ``PubSubAdapter``).
        dedup: the idempotent-consumer store; None handles every delivery (no dedup).
        lease: lease extension policy.
        retry: in-process retries and redelivery backoff.
        dead_letter: where poison messages go; None retries them forever with backoff.
        flow_control: bounds on messages and bytes in flight.
        dedup_ttl: seconds a completed record is kept. It must cover the longest redelivery span
            (backoffs up to ``max_delivery_attempts`` plus ``max_lease_duration``).
        clock: time source for leases, backoff and retries (tests pass a ``ManualClock``).
        sync_workers: threads that run sync handlers.
        on_outcome: called in the event loop with each delivery's message and outcome.
        rng: random source for backoff jitter.
        receive_batch: most messages asked for in one receive call.
        receive_timeout: seconds one receive call waits for messages.
        stop_timeout: seconds in-flight handlers get to finish when a stop comes from a signal
            (``run``), a cancelled ``serve()``, or ``stop()``/``shutdown()`` without a timeout.
    """

    def __init__(
        self,
        adapter: Adapter,
        *,
        dedup: DedupStore | None = None,
        lease: LeasePolicy | None = None,
        retry: RetryPolicy | None = None,
        dead_letter: DeadLetterPolicy | None = None,
        flow_control: FlowControl | None = None,
        dedup_ttl: float = DEFAULT_DEDUP_TTL,
        clock: Clock | None = None,
        sync_workers: int = DEFAULT_SYNC_WORKERS,
        on_outcome: Callable[[Message, Outcome], None] | None = None,
        rng: random.Random | None = None,
        receive_batch: int = RECEIVE_BATCH,
        receive_timeout: float = RECEIVE_TIMEOUT,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT,
    ) -> None:
        self._adapter = adapter
        self._dedup = dedup
        self._lease_policy = lease or LeasePolicy()
        self._retry = retry or RetryPolicy()
        self._dead_letter = dead_letter
        self._flow_control = flow_control or FlowControl()
        self._dedup_ttl = dedup_ttl
        self._clock: Clock = clock or SystemClock()
        self._on_outcome = on_outcome
        self._rng = rng or random.Random()
        _check_positive("dedup_ttl", dedup_ttl)
        _check_positive("receive_timeout", receive_timeout)
        if not isinstance(stop_timeout, int | float) or not stop_timeout >= 0:
            raise ConfigurationError(
                f"Subscriber.stop_timeout must be in [0, inf), got {stop_timeout!r}"
            )
        check_count("Subscriber", "sync_workers", sync_workers)
        check_count("Subscriber", "receive_batch", receive_batch)
        self._sync_workers = sync_workers
        self._receive_batch = receive_batch
        self._receive_timeout = receive_timeout
        self._check_dedup_window()

        self.stats = SubscriberStats()
        self._routes: dict[str, _Route] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_event: asyncio.Event | None = None
        self._closed: asyncio.Event | None = None
        self._default_stop_timeout = float(stop_timeout)
        self._stop_timeout = self._default_stop_timeout
        self._done = threading.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._flow: FlowGate | None = None
        self._receiving = False
        self._ordered = False
        self._settler: Settler | None = None
        self._executor: ThreadPoolExecutor | None = None

    def _check_dedup_window(self) -> None:
        """Every dedup mechanism has a window, and the window is the bug: refuse a short one."""
        if self._dedup is None or self._dead_letter is None:
            return
        attempts = self._dead_letter.max_delivery_attempts
        backoffs = sum(self._retry.max_backoff_for(a) for a in range(1, attempts))
        span = backoffs + self._lease_policy.max_lease_duration
        if self._dedup_ttl < span:
            raise ConfigurationError(
                f"Subscriber.dedup_ttl={self._dedup_ttl:g}s is shorter than the longest "
                f"redelivery span {span:g}s (backoffs for {attempts} attempts, {backoffs:g}s, "
                f"plus max_lease_duration {self._lease_policy.max_lease_duration:g}s): a "
                "duplicate could arrive after its record expired; raise dedup_ttl to at least "
                f"{span:g}"
            )

    # -- registration ----------------------------------------------------------------------

    def handler(
        self, subscription: str, *, namespace: str | None = None
    ) -> Callable[[HandlerT], HandlerT]:
        """Register the decorated function as the handler of ``subscription``.

        Sync functions run in a worker thread, coroutine functions are awaited. The return value
        is stored (as JSON) in the dedup store. ``namespace`` scopes dedup keys (default: the
        subscription name).
        """
        if not isinstance(subscription, str) or not subscription:
            raise ConfigurationError(
                f"handler: subscription must be a non-empty str, got {subscription!r}"
            )

        def register(function: HandlerT) -> HandlerT:
            if not callable(function):
                raise ConfigurationError(f"handler: {function!r} is not callable")
            if subscription in self._routes:
                raise ConfigurationError(
                    f"subscription {subscription!r} already has a handler "
                    f"({self._routes[subscription].handler!r})"
                )
            if self._loop is not None:
                raise ConfigurationError("register handlers before the Subscriber starts")
            is_async = _is_async_callable(function)
            self._routes[subscription] = _Route(
                subscription=subscription,
                handler=function,
                is_async=is_async,
                namespace=namespace or subscription,
                direct=is_async and self._retry.in_process_attempts == 1,
            )
            return function

        return register

    def lease_manager(self, subscription: str) -> LeaseManager:
        """The running lease manager of ``subscription`` (for stats and inspection)."""
        route = self._routes[subscription]
        if route.lease is None:
            raise RuntimeError(f"subscription {subscription!r} is not running")
        return route.lease

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True between a successful start and the end of a stop."""
        return self._loop is not None

    def start(self) -> None:
        """Run in a background thread; returns once receiving has begun (or raises why not)."""
        if self._loop is not None:
            raise RuntimeError("Subscriber is already running")
        started = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            try:
                asyncio.run(self._serve(started))
            except BaseException as error:
                failure.append(error)
                if started.is_set():
                    logger.exception("Subscriber background thread failed")
            finally:
                started.set()

        self._done.clear()
        self._thread = threading.Thread(target=main, name="reliable-sub", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]

    def stop(self, timeout: float | None = None) -> None:
        """Stop gracefully from any thread but the Subscriber's own loop.

        Receiving stops; in-flight handlers get ``timeout`` seconds (wall clock) to finish; the
        rest are nacked for immediate redelivery; queued acks are flushed. Nothing is lost.
        """
        loop, stop_event = self._loop, self._stop_event
        if loop is None or stop_event is None:
            return
        if _running_loop() is loop:
            raise RuntimeError(
                "Subscriber.stop() blocks; inside its event loop use: await sub.shutdown(timeout)"
            )
        self._stop_timeout = self._default_stop_timeout if timeout is None else timeout
        loop.call_soon_threadsafe(stop_event.set)
        self._done.wait()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    async def shutdown(self, timeout: float | None = None) -> None:
        """The same as :meth:`stop`, awaited from inside the Subscriber's event loop."""
        if self._stop_event is None:
            return
        self._stop_timeout = self._default_stop_timeout if timeout is None else timeout
        self._stop_event.set()
        if self._closed is not None:
            await self._closed.wait()

    def run(self) -> None:
        """Block until SIGINT or SIGTERM (or :meth:`stop` from another thread), then stop."""

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.add_signal_handler(sig, self._request_stop)
                except (NotImplementedError, RuntimeError, ValueError):
                    logger.debug("cannot install a handler for %s outside the main thread", sig)
            await self.serve()

        asyncio.run(main())

    async def serve(self) -> None:
        """Run inside the current event loop until stopped (or cancelled, which also stops)."""
        await self._serve(None)

    def _request_stop(self) -> None:
        if self._stop_event is not None:
            self._stop_event.set()

    async def _serve(self, started: threading.Event | None) -> None:
        if self._loop is not None:
            raise RuntimeError("Subscriber is already running")
        if not self._routes:
            raise ConfigurationError(
                "Subscriber has no handlers; register one with @sub.handler(subscription)"
            )
        self._loop = asyncio.get_running_loop()
        self._stop_timeout = self._default_stop_timeout
        self._stop_event = asyncio.Event()
        self._closed = asyncio.Event()
        self._done.clear()
        try:
            await self._open()
            if started is not None:
                started.set()
            try:
                await self._stop_event.wait()
            except asyncio.CancelledError:
                await self._close(self._stop_timeout)  # cancelling serve() stops gracefully
                raise
            await self._close(self._stop_timeout)
        finally:
            self._closed.set()
            self._loop = None
            self._stop_event = None
            self._closed = None
            self._done.set()

    async def _open(self) -> None:
        self._flow = FlowGate(self._flow_control)
        self._settler = Settler(
            self._adapter,
            sleep=self._clock.sleep,
            dedup=self._dedup,
            dedup_ttl=self._dedup_ttl,
            on_refused=self._count_refused,
            on_error=self._count_settle_errors,
        )
        self._settler.start()
        self._executor = ThreadPoolExecutor(self._sync_workers, thread_name_prefix="reliable-sub")
        try:
            for route in self._routes.values():
                deadline = await self._adapter.subscription_ack_deadline(route.subscription)
                route.lease = LeaseManager(
                    self._adapter,
                    self._lease_policy,
                    clock=self._clock,
                    initial_deadline=deadline,
                    dedup=self._dedup,
                )
        except BaseException:
            await self._settler.stop()
            self._executor.shutdown(wait=False)
            raise
        loop = asyncio.get_running_loop()
        self._receiving = True
        self._ordered = self._adapter.capabilities.ordering
        for route in self._routes.values():
            assert route.lease is not None
            route.lease.start()
            route.receiver = loop.create_task(
                self._receive_loop(route), name=f"receive {route.subscription}"
            )

    async def _close(self, timeout: float) -> None:
        self._receiving = False
        receivers = {r.receiver for r in self._routes.values() if r.receiver is not None}
        while receivers:
            for task in receivers:
                task.cancel()
            # a client that swallows the cancellation still sees _receiving and stops
            _, receivers = await asyncio.wait(receivers, timeout=RECEIVER_STOP_WAIT)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=max(0.0, timeout))
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        for route in self._routes.values():
            waiting, route.waiting = route.waiting, {}
            for queue in waiting.values():
                await self._give_back_waiting(route, queue, Outcome.STOPPED)
            route.receiver = None
            if route.lease is not None:
                await route.lease.stop()
        if self._settler is not None:
            await self._settler.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # -- receiving ---------------------------------------------------------------------------

    async def _receive_loop(self, route: _Route) -> None:
        assert self._flow is not None and route.lease is not None
        flow, lease = self._flow, route.lease
        loop = asyncio.get_running_loop()
        while self._receiving:
            free = await flow.free_slots()
            deliveries = await self._receive(route, min(free, self._receive_batch))
            if not deliveries:
                continue
            now = self._clock.now()
            for delivery in deliveries:
                delivery.received_at = now  # the lease clock starts when receive returns
            flow.taken(len(deliveries))
            if self._dedup is None:
                lease.add(deliveries)
                for delivery in deliveries:
                    self._start(loop, route, delivery, None)
            else:
                await self._claim_and_start(loop, route, deliveries)

    async def _claim_and_start(
        self, loop: asyncio.AbstractEventLoop, route: _Route, deliveries: list[Delivery]
    ) -> None:
        """Claim a received batch in one store call; settle duplicates, start the rest."""
        assert self._dedup is not None and route.lease is not None
        namespace = route.namespace
        keys = [scoped_key(namespace, d.message.idempotency_key) for d in deliveries]
        ttl = route.lease.claim_ttl()
        try:
            claims = await self._dedup.claim_many(keys, ttl)
        except asyncio.CancelledError:
            for delivery in deliveries:
                self._settle(delivery, Outcome.STOPPED, 0.0)
            raise
        except Exception:
            self.stats.store_errors += 1
            logger.warning("dedup claim of %d messages failed; redelivering them later",
                           len(deliveries), exc_info=True)
            for delivery in deliveries:
                backoff = self._retry.backoff(delivery.message.delivery_attempt, self._rng)
                # even with min_backoff=0, a broken store must not spin the receive loop
                self._settle(delivery, Outcome.RETRY, max(DEFER_MIN_DELAY, backoff))
            return
        to_run: list[Delivery] = []
        run_keys: list[str] = []
        for delivery, key, claim in zip(deliveries, keys, claims, strict=True):
            if isinstance(claim, Claimed):
                to_run.append(delivery)
                run_keys.append(key)
            elif isinstance(claim, Completed):
                self._settle(delivery, Outcome.DUPLICATE, 0.0)
            else:
                delay = min(self._retry.max_backoff, max(DEFER_MIN_DELAY, claim.expires_in))
                self._settle(delivery, Outcome.DEFERRED, delay)
        route.lease.add(to_run, run_keys, ttl)
        for delivery, key in zip(to_run, run_keys, strict=True):
            self._start(loop, route, delivery, key)

    def _start(
        self,
        loop: asyncio.AbstractEventLoop,
        route: _Route,
        delivery: Delivery,
        claim_key: str | None,
    ) -> None:
        key = delivery.message.ordering_key
        if key is not None and self._ordered:
            # Pub/Sub may hand out several messages of one key at once: run them one at a time,
            # in the order received, as its own client does.
            queue = route.waiting.get(key)
            if queue is not None:
                queue.append((delivery, claim_key))
                return
            route.waiting[key] = deque()
        task = start_eagerly(loop, self._process(route, delivery, claim_key))
        if task is not None:
            self._track(task)

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _next_of_key(self, route: _Route, key: str, succeeded: bool) -> None:
        """After a delivery of ``key`` settled: start the next one, or give them all back.

        When one fails, those after it are nacked too: the broker redelivers them after the
        failed one, so nothing of the key overtakes it.
        """
        queue = route.waiting.get(key)
        if queue is None:
            return
        if succeeded and queue and self._receiving:
            delivery, claim_key = queue.popleft()
            loop = asyncio.get_running_loop()
            # a task, not an eager start: a long queue must not nest one call per message
            self._track(loop.create_task(self._process(route, delivery, claim_key)))
            return
        del route.waiting[key]
        outcome = Outcome.DEFERRED if self._receiving else Outcome.STOPPED
        await self._give_back_waiting(route, queue, outcome)

    async def _give_back_waiting(
        self, route: _Route, queue: deque[tuple[Delivery, str | None]], outcome: Outcome
    ) -> None:
        assert route.lease is not None
        while queue:
            delivery, claim_key = queue.popleft()
            route.lease.drop(delivery)
            if claim_key is not None:
                await self._release(claim_key)
            self._settle(delivery, outcome, 0.0)

    async def _receive(self, route: _Route, max_messages: int) -> list[Delivery]:
        """One receive call, retried with jittered exponential backoff while the broker fails."""

        def log_failure(state: Any) -> None:
            self.stats.receive_errors += 1
            logger.warning(
                "receive from %r failed (attempt %d): %r; retrying",
                route.subscription,
                state.attempt_number,
                state.outcome.exception() if state.outcome else None,
            )

        def retryable(error: BaseException) -> bool:
            # Some clients turn a cancellation into a connection error: never retry once closing.
            return self._receiving and isinstance(error, Exception)

        async for attempt in AsyncRetrying(
            wait=wait_random_exponential(
                multiplier=RECEIVE_RETRY_INITIAL, max=RECEIVE_RETRY_MAX
            ),
            retry=retry_if_exception(retryable),
            before_sleep=log_failure,
            sleep=self._clock.sleep,
        ):
            with attempt:
                return await self._adapter.receive(
                    route.subscription, max_messages, self._receive_timeout
                )
        return []  # the retry loop ended because the Subscriber is closing

    # -- one delivery --------------------------------------------------------------------------

    async def _process(self, route: _Route, delivery: Delivery, claim_key: str | None) -> None:
        attempt = _Attempt(claim_key)
        try:
            outcome, delay = await self._handle(route, delivery, attempt)
        except asyncio.CancelledError:
            await self._give_back(route, delivery, attempt)
            raise
        except Exception:  # a bug of ours must not lose the message
            logger.exception("processing message %s failed unexpectedly", delivery.message.id)
            assert route.lease is not None
            route.lease.drop(delivery)
            if attempt.claim_key is not None:
                await self._release(attempt.claim_key)
                attempt.claim_key = None
            outcome = Outcome.RETRY
            delay = self._retry.backoff(delivery.message.delivery_attempt, self._rng)
        self._settle(delivery, outcome, delay, attempt)
        key = delivery.message.ordering_key
        if key is not None and self._ordered:
            succeeded = outcome in _DONE
            await self._next_of_key(route, key, succeeded)

    async def _handle(
        self, route: _Route, delivery: Delivery, attempt: _Attempt
    ) -> tuple[Outcome, float]:
        """Run the handler (the claim, if any, is held); decide ack, retry or dead-letter."""
        assert route.lease is not None and self._flow is not None
        lease, message, flow = route.lease, delivery.message, self._flow
        size = delivery.size
        if not flow.try_acquire_bytes(size):
            await flow.acquire_bytes(size)
        try:
            lease.started(delivery)
            try:
                if route.direct:
                    result = await route.handler(message)
                else:
                    result = await self._invoke(route, message, attempt)
            except (Exception, SystemExit) as error:  # a handler's sys.exit() is its failure
                lease.finish(delivery)
                return await self._failed(delivery, attempt, error)
            lease.finish(delivery)
        finally:
            flow.release_bytes(size)
        if attempt.claim_key is not None:
            attempt.result_json = self._encode(result, message)
        return Outcome.ACKED, 0.0

    async def _invoke(self, route: _Route, message: Message, attempt: _Attempt) -> Any:
        """Call the handler, retrying in process the exceptions the RetryPolicy names."""
        call = self._call_async if route.is_async else self._call_in_thread
        retry = self._retry
        if retry.in_process_attempts == 1:
            return await call(route, message, attempt)
        async for try_ in AsyncRetrying(
            stop=stop_after_attempt(retry.in_process_attempts),
            wait=wait_exponential(multiplier=retry.in_process_wait),
            retry=retry_if_exception_type(retry.retry_on),
            reraise=True,
            sleep=self._clock.sleep,
        ):
            with try_:
                return await call(route, message, attempt)
        raise AssertionError("unreachable: reraise=True re-raises the last error")

    async def _call_async(self, route: _Route, message: Message, attempt: _Attempt) -> Any:
        result = route.handler(message)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def _call_in_thread(self, route: _Route, message: Message, attempt: _Attempt) -> Any:
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        call = functools.partial(context.run, route.handler, message)
        attempt.in_thread = True
        try:
            result = await loop.run_in_executor(self._executor, call)
        except asyncio.CancelledError:
            raise  # the thread runs on: its claim must not be released under it
        except BaseException:
            attempt.in_thread = False
            raise
        attempt.in_thread = False
        return result

    async def _failed(
        self, delivery: Delivery, attempt: _Attempt, error: BaseException
    ) -> tuple[Outcome, float]:
        message = delivery.message
        self.stats.handler_errors += 1
        if attempt.claim_key is not None:
            await self._release(attempt.claim_key)
            attempt.claim_key = None
        policy = self._dead_letter
        if policy is not None and message.delivery_attempt >= policy.max_delivery_attempts:
            logger.warning(
                "message %s failed delivery attempt %d of %d (%s: %s); dead-lettering to %r",
                message.id, message.delivery_attempt, policy.max_delivery_attempts,
                type(error).__name__, error, policy.topic,
            )
            try:
                await self._adapter.publish(
                    policy.topic, message.data, _dead_letter_attributes(message, error)
                )
            except Exception:
                logger.error(
                    "publishing message %s to dead-letter topic %r failed; it stays on %r and "
                    "is retried", message.id, policy.topic, message.subscription, exc_info=True,
                )
                return Outcome.RETRY, self._retry.backoff(message.delivery_attempt, self._rng)
            return Outcome.DEAD_LETTERED, 0.0
        delay = self._retry.backoff(message.delivery_attempt, self._rng)
        logger.info(
            "message %s failed delivery attempt %d (%s: %s); redelivering in %.1fs",
            message.id, message.delivery_attempt, type(error).__name__, error, delay,
        )
        return Outcome.RETRY, delay

    def _encode(self, result: Any, message: Message) -> str:
        try:
            return encode_result(result)
        except ResultNotSerializableError as error:
            logger.error("message %s: %s; storing null instead", message.id, error)
            return "null"

    async def _release(self, key: str) -> None:
        assert self._dedup is not None
        try:
            await self._dedup.release(key)
        except Exception:
            self.stats.store_errors += 1
            logger.warning("releasing dedup claim %r failed; it expires with its lease", key,
                           exc_info=True)

    async def _give_back(self, route: _Route, delivery: Delivery, attempt: _Attempt) -> None:
        """On stop: nack for immediate redelivery; free the claim unless a thread still runs."""
        assert route.lease is not None
        route.lease.drop(delivery)
        if attempt.claim_key is not None and not attempt.in_thread:
            await self._release(attempt.claim_key)
        self._settle(delivery, Outcome.STOPPED, 0.0)

    def _settle(
        self,
        delivery: Delivery,
        outcome: Outcome,
        delay: float,
        attempt: _Attempt | None = None,
    ) -> None:
        assert self._settler is not None and self._flow is not None
        if outcome is Outcome.ACKED or outcome is Outcome.DUPLICATE or (
            outcome is Outcome.DEAD_LETTERED
        ):
            completion = None
            if attempt is not None and attempt.claim_key is not None:
                completion = (attempt.claim_key, attempt.result_json)
            self._settler.ack(delivery, completion)
        else:
            self._settler.nack(delivery, delay)
        self._flow.settled()
        self.stats.outcomes[outcome] += 1
        if self._on_outcome is not None:
            try:
                self._on_outcome(delivery.message, outcome)
            except Exception:
                logger.exception("on_outcome callback failed")

    def _count_refused(self, refused: list[Delivery]) -> None:
        self.stats.acks_refused += len(refused)
        logger.info("broker refused %d acks (stale ack ids); those messages come back and are "
                    "deduplicated", len(refused))

    def _count_settle_errors(self, what: str, count: int) -> None:
        if what == "recording completions":
            self.stats.store_errors += count
        else:
            self.stats.ack_errors += count


def _dead_letter_attributes(message: Message, error: BaseException) -> dict[str, str]:
    attributes = dict(message.attributes)
    attributes.update(
        {
            "original-message-id": message.id,
            "original-subscription": message.subscription,
            "delivery-attempts": str(message.delivery_attempt),
            "error-type": f"{type(error).__module__}.{type(error).__qualname__}",
            "error-message": str(error)[:ERROR_MESSAGE_LIMIT],
        }
    )
    return attributes


def _is_async_callable(function: Callable[..., Any]) -> bool:
    while isinstance(function, functools.partial):
        function = function.func
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "__call__", None)  # noqa: B004
    )


def _check_positive(name: str, value: float) -> None:
    if not isinstance(value, int | float) or not value > 0:
        raise ConfigurationError(f"Subscriber.{name} must be in (0, inf), got {value!r}")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


__all__ = ["Subscriber"]

