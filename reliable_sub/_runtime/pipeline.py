"""One run of a Subscriber inside one event loop: the stages, built and wired.

The path of one delivery, stage by stage (each a module that takes callbacks, never the run)::

    receiver    receive ─► lease ─► claim (batch) ── completed ─► ack "duplicate"
                                        │  held by a peer ─► nack "deferred" (dead-letter
                                        │                    once it has failed often enough)
                                        ▼ claimed
    dispatcher  its own task: wait for its ordering key, a worker thread, byte budget
                                        ▼ (no handler starts once a stop began)
                the route's chain: your middleware ─► DeadLetterOrBackoff ─► InProcessRetry
                                   ─► handler          (or the handler alone: the fast path)
                                        ▼
    decisions   ack ─► record result + ack                                        "acked"
                redeliver ─► release claim (failures kept) + nack                 "retried"
                dead-lettered ─► release claim + ack                        "dead_lettered"
                                        ▼
    settler     the store write, then the broker call, in batches; once confirmed the
                delivery's lease, claim and flow-control slot are let go (:meth:`_on_settled`)

The lease manager keeps every delivery's ack deadline (and running claim) ahead of it meanwhile,
and :mod:`~reliable_sub._runtime.shutdown` stops the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any, cast

from ..errors import UnknownTopicError
from ..idempotency.transactional import TransactionalStore, transactional_handler
from ..message import Message
from ..middleware.dead_letter import DeadLetterOrBackoff
from ..outcome import DeliveryEvent, Outcome, SubscriberStats
from ..policy import FlowControl, is_default
from ..ports import (
    Capabilities,
    DescribesConnection,
    Inspectable,
    ListsSubscriptions,
    Prefetches,
    PublishesRouted,
    ReportsProblems,
)
from ..telemetry.backlog import BacklogSampler, Sampled
from ..telemetry.consumer import DeliveryTelemetry
from .batches import Batches
from .claims import Claims
from .current import current_claim
from .decisions import Decisions
from .dispatcher import Dispatcher
from .flow import FlowGate
from .health import Health
from .lanes import Config, Item, Lane, Route, RunState, close_gates
from .lease import LeaseManager
from .lease_basics import margin
from .members import ACK_REFUSED, DONE
from .receiver import Receiver
from .settler import Settle, Settler
from .shutdown import Shutdown, release_connections
from .supervisor import Supervisor
from .watchdog import LoopWatchdog
from .workers import WorkerThreads

__all__ = ["Config", "Route", "Runtime", "current_claim"]

logger = logging.getLogger("reliable_sub.subscriber")
# Seconds the start waits for the dedup store's first answer (Claims.reach).
STORE_START_TIMEOUT = 10.0


class Runtime:
    """Receives, runs and settles the messages of every route, until :meth:`close`."""

    def __init__(self, config: Config, routes: list[Route], stats: SubscriberStats) -> None:
        self.config = config
        self.routes = routes
        self.stats = stats
        self.lanes: dict[str, Lane] = {}
        self.state = RunState()
        self.items = self.state.items
        self.claims = Claims(config.dedup, config.dedup_ttl)
        self.flow = FlowGate(config.flow_control)
        self.health = Health(config.clock.now, config.unhealthy_after)
        self.workers = WorkerThreads(config.sync_workers)
        self.settler = Settler(
            config.adapter, claims=self.claims, stats=stats,
            on_settled=self._on_settled, clock=config.clock, health=self.health,
        )
        self.supervisor = Supervisor(config.clock.sleep, config.clock.now)
        self.watchdog: LoopWatchdog | None = None
        self.telemetry: DeliveryTelemetry | None = None  # this run's, if an SDK records

    async def open(self) -> None:
        """Check names, build the stages and lanes, start receiving (raises why not, having
        started nothing)."""
        config, adapter = self.config, self.config.adapter
        for topic in dict.fromkeys(r.dead_letter.topic for r in self.routes if r.dead_letter):
            if not await adapter.topic_exists(topic):
                raise UnknownTopicError(
                    f"dead-letter topic {topic!r} does not exist; create it before "
                    f"starting (adapter.ensure_subscription_sync({topic!r}, "
                    f"{topic + '-sub'!r}): a topic alone may keep nothing)"
                )
            if isinstance(adapter, ListsSubscriptions) and (
                    await adapter.topic_subscriptions(topic) == []):
                logger.warning(
                    "dead-letter topic %r has no subscription: the broker keeps nothing "
                    "published to it, so dead letters %s until one exists "
                    "(adapter.ensure_subscription_sync(%r, %r))", topic,
                    "are redelivered" if isinstance(adapter, PublishesRouted) else "are lost",
                    topic, topic + "-sub")
        telemetry = self.telemetry = config.telemetry.for_run(
            adapter.capabilities.messaging_system, config.rng)
        state, claims, stats, health = self.state, self.claims, self.stats, self.health
        decisions = self._decisions = Decisions(
            config, state, claims, stats, self.workers, telemetry, self.settler.add,
            self.settler.add_many)
        dispatcher = Dispatcher(
            config, state, self.flow, self.workers, claims, stats, health,
            telemetry, settle=decisions.settle, succeeded=decisions.succeeded,
            apply=decisions.apply, claim_lost=decisions.claim_lost,
            cancelled=decisions.cancelled, in_progress_elsewhere=decisions.in_progress_elsewhere,
            defer_delay=decisions.defer_delay,
        )
        decisions.wire_keys(dispatcher.key_decided)
        receiver = Receiver(
            config, state, self.flow, self.workers, claims, stats, health, telemetry,
            dispatch=dispatcher.dispatch, dispatch_many=dispatcher.dispatch_many,
            settle=decisions.settle,
            malformed=decisions.malformed, in_progress_elsewhere=decisions.in_progress_elsewhere,
            defer_delay=decisions.defer_delay,
        )
        connection = self._connection_attributes() if telemetry is not None else {}
        for route in self.routes:
            if isinstance(adapter, Prefetches):  # what the handler can take at once
                adapter.set_prefetch(route.subscription, min(
                    config.flow_control.max_messages,
                    route.max_concurrency or config.flow_control.max_messages))
            _fit_lease_limit(adapter.capabilities, route)
            deadline = await adapter.subscription_ack_deadline(route.subscription)
            route_telemetry = on_extended = None
            if telemetry is not None:
                topic = await adapter.subscription_topic(route.subscription)
                route_telemetry = telemetry.route(route.subscription, topic, deadline,
                                                  connection)
                on_extended = functools.partial(telemetry.extended, route_telemetry)
            lease = LeaseManager(
                adapter, route.lease, clock=config.clock, initial_deadline=deadline,
                dedup=claims if config.dedup is not None else None,
                on_max_lease=decisions.max_lease_reached, on_extended=on_extended,
                health=health, subscription=route.subscription,
            )
            if telemetry is not None and route_telemetry is not None:
                # the deadline deliveries get until one is extended: its line is on the
                # dashboard (and in the alert) for subscriptions whose handlers are quick too
                telemetry.deadline_is(route_telemetry, lease.extension())
            failure = DeadLetterOrBackoff(route.retry, route.dead_letter, adapter, config.rng)
            lane = self.lanes[route.subscription] = Lane(
                route=route,
                namespace=route.namespace or adapter.dedup_namespace(route.subscription),
                lease=lease,
                ordered=adapter.capabilities.ordering,
                call=None if route.batch is not None else dispatcher.chain_of(route, failure),
                handler=self._handler_of(route),
                failure=failure,
                flow=None if route.max_concurrency is None else FlowGate(
                    FlowControl(max_messages=route.max_concurrency)),
                telemetry=route_telemetry,
                receive_name=f"receiving from {route.subscription!r}",
            )
            if route.batch is not None:
                lane.collector = Batches(
                    lane, route.batch, config, state, self.flow, self.workers,
                    refresh_claim=dispatcher.refresh_claim, settle=decisions.settle,
                    succeeded=decisions.succeeded_many, apply=decisions.apply,
                    cancelled=decisions.cancelled, release=claims.release,
                    retried=telemetry.retried if telemetry is not None else None,
                )
        await claims.reach([lane.namespace for lane in self.lanes.values()], STORE_START_TIMEOUT)
        state.receiving = state.accepting = True
        self.supervisor.spawn("settler", self.settler.run)
        for lane in self.lanes.values():
            name = lane.route.subscription
            self.supervisor.spawn(f"lease manager of {name!r}", lane.lease.run)
            self.supervisor.spawn(
                f"receive loop of {name!r}", functools.partial(receiver.loop, lane),
                keep_running=lambda: state.receiving,
            )
        self._sample_backlogs(telemetry)
        if telemetry is not None and telemetry.instruments is not None:
            telemetry.instruments.health.watch(self, {"messaging.system": telemetry.system},
                                               lambda: not self.problems())
        purge = getattr(config.dedup, "purge_expired", None)
        if purge is not None and config.dedup_purge_interval is not None:
            self.supervisor.spawn("dedup purge", functools.partial(
                self._purge_loop, purge, config.dedup_purge_interval))
        if config.loop_lag_warning is not None:
            self.watchdog = LoopWatchdog(
                asyncio.get_running_loop(), config.loop_lag_warning, self._describe_task
            )
            self.watchdog.start()

    def _connection_attributes(self) -> dict[str, str | int]:
        """The adapter's server and client attributes for spans (none if it cannot tell, or
        its answer is not a mapping of names to str or int)."""
        adapter = self.config.adapter
        if not isinstance(adapter, DescribesConnection):
            return {}
        try:
            found = adapter.connection_attributes()
            return {str(name): value for name, value in dict(found).items()
                    if isinstance(value, str | int) and not isinstance(value, bool)}
        except Exception:
            logger.warning("%s.connection_attributes() failed; spans go without them",
                           type(adapter).__name__, exc_info=True)
            return {}

    def _unwatch_health(self) -> None:
        """The health gauge has no point once this run stops."""
        if self.telemetry is not None and self.telemetry.instruments is not None:
            self.telemetry.instruments.health.unwatch(self)

    def _sample_backlogs(self, telemetry: DeliveryTelemetry | None) -> None:
        """With metrics recorded, sample each subscription's backlog at the broker (see
        :mod:`reliable_sub.telemetry.backlog`)."""
        interval = self.config.telemetry.policy.backlog_interval
        adapter = self.config.adapter
        if (telemetry is None or telemetry.instruments is None or interval is None
                or not isinstance(adapter, Inspectable)):
            return
        sampled = [Sampled(lane.route.subscription, lane.telemetry.metric_attributes)
                   for lane in self.lanes.values() if lane.telemetry is not None]
        sampler = BacklogSampler(adapter, telemetry.instruments.backlog, sampled,
                                 self.config.clock, interval)
        self.supervisor.spawn("backlog sampler", sampler.run)

    def _handler_of(self, route: Route) -> Callable[[Message], Any]:
        if not route.transactional:
            return route.handler
        store = cast(TransactionalStore, self.config.dedup)  # checked at registration
        return transactional_handler(
            route.handler, store, retention=self.config.dedup_ttl, is_async=route.is_async,
            claim_of=current_claim, encode=self._decisions.encode,
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

    def problems(self) -> list[str]:
        """What is wrong with this run (empty when healthy): loops being restarted, and calls
        that have kept failing for ``unhealthy_after`` seconds."""
        found = self.supervisor.problems() + self.health.problems()
        adapter = self.config.adapter
        if isinstance(adapter, ReportsProblems):
            try:
                found += adapter.problems()
            except Exception as error:  # a bug of the adapter's: it must not break a probe
                found.append(f"{type(adapter).__name__}.problems() failed: {error!r}")
        return found

    def _on_settled(self, settles: list[Settle], refused: set[str]) -> None:
        """The settler confirmed ``settles`` (the broker refused the acks of ``refused``): let
        each delivery go and report its outcome."""
        items, outcomes = self.items, self.stats.outcomes
        telemetry, config = self.telemetry, self.config
        self.flow.settled(len(settles))
        for settle in settles:
            item: Item = settle.item
            item.stage = DONE
            lane = item.lane
            lane.lease.drop(item)
            items.discard(item)
            if lane.flow is not None:
                lane.flow.settled()
            outcome = (ACK_REFUSED if refused and item.delivery.ack_id in refused
                       else settle.outcome)
            outcomes[outcome] += 1
            if telemetry is not None:
                assert lane.telemetry is not None
                telemetry.settled(lane.telemetry, item, outcome, settle.delay)
            if config.on_outcome is not None or config.on_event is not None:
                self._report(item, outcome, settle.delay)

    def _report(self, item: Item, outcome: Outcome, delay: float) -> None:
        """Tell the user's ``on_outcome`` and ``on_event`` callbacks how ``item`` ended."""
        config = self.config
        message = item.delivery.message
        if config.on_outcome is not None:
            try:
                config.on_outcome(message, outcome)
            except Exception:
                logger.exception("on_outcome callback failed")
        if config.on_event is not None:
            event = DeliveryEvent(message, outcome, message.delivery_attempt, item.failures,
                                  item.error, item.duration, delay)
            try:
                config.on_event(event)
            except Exception:
                logger.exception("on_event callback failed")

    async def close(self, timeout: float, force: asyncio.Event) -> None:
        """Stop: receive no more, give back what has not started, let running handlers finish
        within ``timeout`` real seconds, settle, and release the adapter and store."""
        self._unwatch_health()
        await Shutdown(
            self.config, self.state, self.lanes.values(), self.flow, self.supervisor,
            self.settler, self.workers, self.watchdog, settle=self._decisions.settle,
            release=self.claims.release,
        ).close(timeout, force)

    async def abort(self) -> None:
        """Undo a failed :meth:`open`: stop what it started and release connections."""
        self._unwatch_health()
        self.state.receiving = self.state.accepting = False
        close_gates(self.flow, self.lanes.values())
        await self.supervisor.stop()
        if self.watchdog is not None:
            self.watchdog.stop()
        await release_connections(self.config)

    def _describe_task(self, task: asyncio.Task[Any] | None) -> str | None:
        if task is None:
            return None
        for item in self.items:
            if item.task is task:
                route = item.lane.route
                return (f"handler {route.name} of subscription {route.subscription!r} "
                        f"(message {item.message_id})")
        return None


def _fit_lease_limit(capabilities: Capabilities, route: Route) -> None:
    """Keep the route's leases under what the broker lets a consumer hold: the default
    ``max_lease_duration`` is lowered to just under the limit; a user's own above it is warned
    about."""
    limit, wanted = capabilities.max_lease_duration, route.lease.max_lease_duration
    if wanted < limit:
        return
    if is_default(wanted):
        fitted = limit - margin(limit)  # the lease ends, and is given back, before the broker's
        route.lease = dataclasses.replace(route.lease, max_lease_duration=fitted)
        logger.debug("subscription %r: max_lease_duration %gs (the default, fitted under the "
                     "broker's limit of %gs)", route.subscription, fitted, limit)
    else:
        logger.warning(
            "subscription %r: LeasePolicy.max_lease_duration=%gs is not under the broker's "
            "limit of %gs for an unacked delivery (RabbitMQ: consumer_timeout), past which "
            "it takes the delivery back and closes the consumer's channel; set "
            "LeasePolicy(max_lease_duration=...) below it, or raise the broker's limit (and "
            "tell the adapter)", route.subscription, wanted, limit)
