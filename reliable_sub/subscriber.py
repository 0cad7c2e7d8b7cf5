"""The Subscriber: register handlers, then run them with the full guarantees.

The path of one delivery is in :mod:`reliable_sub._runtime` (a module per stage, wired by
:mod:`~reliable_sub._runtime.pipeline`); this module is the facade
users see: configuration checked up front, ``@sub.handler``, and the lifecycle --
``start``/``stop`` (a background thread), ``run`` (blocking, stopped by SIGINT/SIGTERM),
``serve``/``shutdown`` (inside your event loop), and the ``with``/``async with`` forms.

Ownership: the Subscriber closes the adapter and the dedup store when a run ends (their
connections belong to the run's event loop). Both stay usable: the next call, or the next run,
opens new connections.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider

from ._bodies import typed_handler
from ._callables import check_not_generator, check_takes, is_async_callable
from ._checks import (
    check_dedup_window,
    check_route_names,
    check_subscriber_arguments,
    checked_middleware,
    handler_policies,
)
from ._lifecycle import Service
from ._runtime.lanes import Config, Route
from ._runtime.lease import LeaseManager
from ._runtime.pipeline import Runtime
from .batches import batch_spec, check_batch_options
from .clock import Clock, SystemClock
from .dedup import DedupStore
from .errors import ConfigurationError
from .idempotency.transactional import TransactionalStore
from .message import Message
from .middleware import Middleware
from .outcome import DeliveryEvent, Outcome, SubscriberStats
from .policy import (
    DeadLetterPolicy,
    FlowControl,
    LeasePolicy,
    RetryPolicy,
    TelemetryPolicy,
    check_count,
    check_seconds,
)
from .ports import Adapter
from .telemetry.consumer import SubscriberTelemetry
from .telemetry.publishing import instrument_publishes

logger = logging.getLogger(__name__)

# Pub/Sub keeps unacked messages 7 days by default; a dedup record should outlive any copy.
DEFAULT_DEDUP_TTL = 7 * 24 * 3600.0
# At most this many messages per receive call: large enough to amortise a round trip, small
# enough that one call does not take a whole flow-control budget from other subscriptions.
RECEIVE_BATCH = 100
# Seconds one receive call waits for messages before it returns empty and is made again.
RECEIVE_TIMEOUT = 5.0
# Pub/Sub's own client runs callbacks on 10 threads by default; so do we for sync handlers.
DEFAULT_SYNC_WORKERS = 10
# Real seconds running handlers get to finish when a stop does not name a timeout. Kubernetes
# sends SIGKILL terminationGracePeriodSeconds (30 s by default) after SIGTERM: keep this below.
DEFAULT_STOP_TIMEOUT = 30.0
# Real seconds of event-loop lag after which the watchdog warns that a handler blocks the loop.
DEFAULT_LOOP_LAG_WARNING = 1.0
# Seconds a call the Subscriber depends on (receive, claim, ack, extend...) may keep failing,
# with no success between, before healthy() turns False: long enough for a broker failover or a
# restart (seconds), short enough for a readiness probe to act within a minute.
DEFAULT_UNHEALTHY_AFTER = 30.0
# Seconds between deletions of expired dedup records, for stores that keep them until deleted
# (SqlDedupStore; Redis expires its keys itself). Every consumer purges; deletes are batched.
DEFAULT_DEDUP_PURGE_INTERVAL = 300.0

HandlerT = TypeVar("HandlerT", bound=Callable[..., Any])


class Subscriber(Service):
    """Runs handlers for one or more subscriptions of one broker, with the full guarantees.

    Args:
        adapter: the broker (``MemoryAdapter``, ``RedisStreamsAdapter``, ``PubSubAdapter``).
        dedup: the idempotent-consumer store; None handles every delivery (no dedup).
        lease: lease extension policy.
        retry: in-process retries and redelivery backoff.
        dead_letter: where poison messages go; None retries them forever with backoff.
        flow_control: bounds on messages and bytes in flight.
        dedup_ttl: seconds a completed record (and a failure count) is kept. It must cover the
            longest redelivery span (backoffs up to ``max_delivery_attempts`` plus
            ``max_lease_duration``).
        clock: time source for leases, backoff and retries (tests pass a ``ManualClock``).
        sync_workers: threads that run sync handlers.
        on_outcome: called in the event loop with each delivery's message and outcome, once
            the broker confirmed its ack or nack.
        on_event: called likewise with a :class:`DeliveryEvent` (outcome, error, handler
            duration, delay, attempt, failures): for metrics and tracing.
        middleware: wrapped around every handler, the first outermost (see
            :mod:`reliable_sub.middleware`); a handler's own ``middleware=`` go inside these.
        rng: random source for backoff jitter.
        receive_batch: most messages asked for in one receive call.
        receive_timeout: seconds one receive call waits for messages.
        stop_timeout: real seconds running handlers get to finish when a stop names no timeout
            (a signal under ``run``, a cancelled ``serve()``, ``stop()``/``shutdown()``).
        loop_lag_warning: real seconds of event-loop lag after which a WARNING names the
            handler blocking the loop; None turns the watchdog off.
        dedup_purge_interval: seconds between ``dedup.purge_expired()`` calls, for a store
            that has one (``SqlDedupStore``); None never purges (run it yourself, e.g. cron).
        tracer_provider: where the span of each delivery attempt goes (default:
            OpenTelemetry's global providers, read when a run starts; without an SDK nothing is
            recorded, at no cost). Given here, both providers also record the publishes made
            through ``adapter`` (``adapter.instrument_publishes``): dead letters, and your own
            ``publish``/``publish_sync`` on it. See
            :mod:`reliable_sub.telemetry`.
        meter_provider: where the consumer metrics go, as ``tracer_provider``.
        telemetry: what the spans carry (:class:`~reliable_sub.policy.TelemetryPolicy`: link
            to or child of the producer's span; the idempotency key hashed, raw or not at all).
        unhealthy_after: seconds a call the Subscriber depends on (receiving, claiming or
            completing in the dedup store, acking, extending leases) may keep failing, with no
            success between, before :meth:`healthy` turns False.

    The Subscriber closes ``adapter`` and ``dedup`` when a run ends; both reconnect if used
    again (by you, or by the next run).
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
        on_event: Callable[[DeliveryEvent], None] | None = None,
        middleware: Sequence[Middleware] = (),
        rng: random.Random | None = None,
        receive_batch: int = RECEIVE_BATCH,
        receive_timeout: float = RECEIVE_TIMEOUT,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT,
        loop_lag_warning: float | None = DEFAULT_LOOP_LAG_WARNING,
        dedup_purge_interval: float | None = DEFAULT_DEDUP_PURGE_INTERVAL,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        telemetry: TelemetryPolicy | None = None,
        unhealthy_after: float = DEFAULT_UNHEALTHY_AFTER,
    ) -> None:
        check_subscriber_arguments(adapter, dedup, lease, retry, dead_letter, flow_control,
                                   clock, rng, on_outcome, on_event, tracer_provider,
                                   meter_provider, telemetry)
        check_seconds("Subscriber", "dedup_ttl", dedup_ttl)
        check_seconds("Subscriber", "unhealthy_after", unhealthy_after)
        check_seconds("Subscriber", "receive_timeout", receive_timeout)
        if loop_lag_warning is not None:
            check_seconds("Subscriber", "loop_lag_warning", loop_lag_warning)
        if dedup_purge_interval is not None:
            check_seconds("Subscriber", "dedup_purge_interval", dedup_purge_interval)
        super().__init__(stop_timeout=stop_timeout, logger=logger)
        check_count("Subscriber", "sync_workers", sync_workers)
        check_count("Subscriber", "receive_batch", receive_batch)
        self._config = Config(
            adapter=adapter,
            dedup=dedup,
            lease=lease or LeasePolicy(),
            retry=retry or RetryPolicy(),
            dead_letter=dead_letter,
            flow_control=flow_control or FlowControl(),
            dedup_ttl=dedup_ttl,
            clock=clock or SystemClock(),
            sync_workers=sync_workers,
            rng=rng or random.Random(),
            receive_batch=receive_batch,
            receive_timeout=receive_timeout,
            loop_lag_warning=loop_lag_warning,
            dedup_purge_interval=dedup_purge_interval,
            on_outcome=on_outcome,
            on_event=on_event,
            middleware=checked_middleware(middleware, "Subscriber.middleware"),
            telemetry=SubscriberTelemetry(tracer_provider, meter_provider, telemetry),
            unhealthy_after=float(unhealthy_after),
        )
        config = self._config
        if config.dedup is not None:
            check_dedup_window("", dedup_ttl, config.retry, config.dead_letter,
                               config.lease)
        self.stats = SubscriberStats()
        self._routes: dict[str, Route] = {}
        self._runtime: Runtime | None = None
        instrument_publishes(adapter, tracer_provider, meter_provider)

    # -- registration ----------------------------------------------------------------------

    def handler(
        self,
        subscription: str,
        *,
        namespace: str | None = None,
        middleware: Sequence[Middleware] = (),
        transactional: bool = False,
        retry: RetryPolicy | None = None,
        dead_letter: DeadLetterPolicy | None = None,
        non_retryable: tuple[type[BaseException], ...] = (),
        in_process_retry: int | None = None,
        timeout: float | None = None,
        max_concurrency: int | None = None,
        batch: bool = False,
        max_batch: int | None = None,
        max_wait: float | None = None,
    ) -> Callable[[HandlerT], HandlerT]:
        """Register the decorated function as the handler of ``subscription``.

        Sync functions run in a worker thread, coroutine functions in their own task. The
        return value is stored (as JSON; a pydantic model or dataclass as its JSON form) in the
        dedup store.

        A handler whose first parameter is annotated with a pydantic model, a dataclass or a
        TypedDict gets the body decoded from JSON and validated (``def charge(order: Order)``),
        and the Message as well when its second parameter is annotated ``Message`` or named
        ``message``. A body that does not validate fails the message for good (a
        :class:`~reliable_sub.Reject`): it is dead-lettered at its first attempt.

        ``namespace`` scopes dedup keys (default: the adapter's name for the broker, topic and
        subscription). ``middleware`` wraps this handler only, inside the Subscriber-wide ones.
        ``retry`` and ``dead_letter`` replace the Subscriber's policies for this handler (an
        omitted one is the Subscriber's); ``non_retryable`` adds exception types to the retry
        policy's (see :class:`~reliable_sub.RetryPolicy`) and ``in_process_retry`` sets its
        ``in_process_attempts`` (calls before a failure counts); ``timeout`` is this handler's
        ``LeasePolicy.max_lease_duration``; ``max_concurrency`` bounds its messages in flight
        (received and not yet acked or nacked), within the Subscriber's ``FlowControl``.

        ``transactional=True`` (needs a :class:`~reliable_sub.dedup.SqlDedupStore`): the
        handler is called as ``handler(message, connection)``, with a SQLAlchemy connection in
        an open transaction (``AsyncConnection`` for a coroutine function, ``Connection`` for a
        sync one). Its writes and the message's dedup record commit together, conditional on
        this delivery still holding the claim; if a peer took the key over meanwhile,
        everything is rolled back and the message is deferred to the peer. Do not commit on
        the connection yourself.

        ``batch=True``: the handler takes a list of the messages received together (of bodies,
        when annotated ``list[Order]``; the Messages too as a second parameter annotated
        ``list[Message]`` or named ``messages``), at most ``max_batch`` (default 100), waiting
        up to ``max_wait`` seconds after the first for more (default 0: what one receive
        brought). Claims, leases, acks and dead letters stay per message; return a
        :class:`~reliable_sub.BatchResult` to fail some of them, raise to fail all.
        """
        route_middleware = checked_middleware(middleware, "handler middleware")
        check_route_names(subscription, namespace)
        check_batch_options(f"handler {subscription!r}", batch, max_batch, max_wait,
                            per_message=transactional or bool(
                                route_middleware or self._config.middleware))
        if transactional:
            self._check_transactional(subscription)
        own_retry, own_dead_letter, own_lease = handler_policies(
            f"handler {subscription!r}", self._config, retry=retry, dead_letter=dead_letter,
            non_retryable=non_retryable, timeout=timeout, max_concurrency=max_concurrency,
            in_process_retry=in_process_retry)

        def register(function: HandlerT) -> HandlerT:
            if not callable(function):
                raise ConfigurationError(f"handler: {function!r} is not callable")
            where = f"handler of {subscription!r}"
            check_not_generator(function, where)
            spec = typed = None
            if batch:
                spec = batch_spec(function, where, max_batch=max_batch, max_wait=max_wait,
                                  lease=own_lease)
                arguments = spec.arguments
            else:
                typed = typed_handler(function, where)
                arguments = ["message"] if typed is None else typed.arguments
            if transactional:
                arguments.append("connection")
            check_takes(function, len(arguments), f"handler({', '.join(arguments)})", where)
            if subscription in self._routes:
                raise ConfigurationError(
                    f"subscription {subscription!r} already has a handler "
                    f"({self._routes[subscription].handler!r})"
                )
            if self._loop is not None:
                raise ConfigurationError("register handlers before the Subscriber starts")
            self._routes[subscription] = Route(
                subscription=subscription,
                handler=function if typed is None else typed.call,
                is_async=is_async_callable(function),
                namespace=namespace,
                name=_name_of(function),
                middleware=route_middleware,
                transactional=transactional,
                retry=own_retry,
                dead_letter=own_dead_letter,
                lease=own_lease,
                max_concurrency=max_concurrency,
                batch=spec,
            )
            return function

        return register

    def _check_transactional(self, subscription: str) -> None:
        store = self._config.dedup
        if not isinstance(store, TransactionalStore):
            raise ConfigurationError(
                f"handler {subscription!r}: transactional=True needs a dedup store that commits "
                f"in the handler's transaction (SqlDedupStore), got {store!r}; pass "
                "Subscriber(..., dedup=SqlDedupStore(url))"
            )

    def lease_manager(self, subscription: str) -> LeaseManager:
        """The running lease manager of ``subscription`` (for stats and inspection)."""
        runtime = self._runtime
        if subscription not in self._routes:
            raise ConfigurationError(f"subscription {subscription!r} has no handler")
        if runtime is None or subscription not in runtime.lanes:
            raise RuntimeError(f"subscription {subscription!r} is not running")
        return runtime.lanes[subscription].lease

    # -- lifecycle (start/stop, run, serve/shutdown, with: see reliable_sub._lifecycle) ---------

    _usual_name = "sub"
    _work_under_way = "running handlers"
    _forced_stop_gives_up = ("running sync handlers are left to their threads, failing acks "
                             "are given up")

    def healthy(self) -> bool:
        """True while running and handling (for a readiness probe): False while a receive
        loop, lease manager or settler failed and is being restarted, or while a call it
        depends on (receiving, claiming or completing in the dedup store, acking, extending
        leases) has kept failing for ``unhealthy_after`` seconds. :meth:`problems` says why."""
        return self._runtime is not None and not self.problems()

    def problems(self) -> list[str]:
        """Why :meth:`healthy` is False, one line each with the last error (empty when
        healthy); ``["not running"]`` when the Subscriber is not running."""
        runtime = self._runtime
        if runtime is None:
            return ["not running"]
        return runtime.problems()

    def stop(self, timeout: float | None = None) -> None:
        """Stop gracefully, from any thread but the Subscriber's own loop.

        Receiving stops at once and nothing not yet started will start; running handlers get
        ``timeout`` real seconds (default: ``stop_timeout``) to finish and are then acked as
        usual; async handlers still running are cancelled and their messages given back; sync
        handlers (threads cannot be interrupted) are waited for. A second ``stop()`` while one
        is under way forces it: nothing more is waited for.
        """
        super().stop(timeout)

    async def _open(self) -> None:
        if not self._routes:
            raise ConfigurationError(
                "Subscriber has no handlers; register one with @sub.handler(subscription)"
            )
        runtime = Runtime(self._config, list(self._routes.values()), self.stats)
        try:
            await runtime.open()
        except BaseException:
            await runtime.abort()
            raise
        self._runtime = runtime
        self._log_started(runtime)

    async def _close(self, timeout: float, force: asyncio.Event) -> None:
        runtime = self._runtime
        try:
            if runtime is not None:
                await runtime.close(timeout, force)
        finally:
            self._runtime = None

    def _log_started(self, runtime: Runtime) -> None:
        config = self._config
        logger.info(
            "started: subscriptions %s on %s, dedup %s, dead letter %s, %s, stop_timeout %gs",
            sorted(self._routes), type(config.adapter).__name__,
            config.dedup if config.dedup is not None else "off",
            config.dead_letter if config.dead_letter is not None else "off",
            config.flow_control, self._stop_timeout,
            extra={"subscriptions": sorted(self._routes),
                   "namespaces": {n: lane.namespace for n, lane in runtime.lanes.items()}},
        )

    def _log_stopped(self) -> None:
        counts = {outcome.value: n for outcome, n in self.stats.outcomes.items() if n}
        logger.info("stopped: %s", counts or "no messages", extra={"outcomes": counts})


def _name_of(function: Callable[..., Any]) -> str:
    while isinstance(function, functools.partial):
        function = function.func
    module = getattr(function, "__module__", None) or ""
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{module}.{name}" if module else name


__all__ = ["Subscriber"]
