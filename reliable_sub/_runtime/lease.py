"""The lease manager: keeps every in-flight message's ack deadline and dedup claim alive.

How it differs from Pub/Sub's own leaser (which extends *every* leased message on every tick by a
lifetime p99 of whole seconds):

* the extension is a percentile (p99 by default) of a *sliding* histogram of processing time,
  measured from the moment the handler starts, so queueing behind flow control does not inflate
  it and a workload that gets faster is followed within minutes;
* a tick extends only the deliveries that are due (less than ``SAFETY_FRACTION`` of their lease
  left, and never less than ``MIN_SAFETY_MARGIN`` seconds or half a short lease; the margins
  are in :mod:`.lease_basics`), together with those due soon (``BATCH_FRACTION``), in one
  batched ``extend`` call;
* a delivery stays leased until the settler has confirmed its ack or nack, not just until its
  handler returned: a completion being written (or retried) is never left without a lease;
* the dedup claim of a delivery is renewed in the same tick, from the moment its handler starts
  until its result is recorded, each claim on its own schedule (its own length, not the
  broker lease's, sets its safety margin);
* ``max_lease_duration`` after receipt the Subscriber is told (``on_max_lease``): it gives back
  what has not started, cancels an async handler, and counts a sync handler that runs on as a
  failed attempt, once per further ``max_lease_duration``;
* an ``extend`` the broker refuses (a stale ack id) stops the lease of that delivery; nothing
  crashes, and the handler's eventual ack is refused harmlessly.

The tick never waits on anything unbounded, and never on the store: claim renewals and the
``on_max_lease`` report (which may nack, and a nack may wait for the receive path) run beside it
as tasks of their own, and every call has a bound on the Subscriber's clock (a connection that
hangs instead of refusing fails the call, which is retried). So a hung dedup store or a busy
receive path cannot let a running delivery's broker lease lapse -- which would hand the message
to a peer while its handler still runs. A run of failed calls is logged once, when it starts,
and summed up when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from ..clock import Clock, sleep_or_event, within
from ..policy import LeasePolicy
from ..ports import Adapter
from .claim_renewal import ClaimRenewal, ClaimRenewer
from .health import Health
from .histogram import SlidingHistogram
from .inflight import InFlight
from .lease_basics import (
    BATCH_FRACTION,
    MIN_CALL_BOUND,
    RETRY_FRACTION,
    LeaseStats,
    due_at,
    margin,
)
from .members import SETTLING

# The name this module's records always had (it was public): logging set-ups name it.
logger = logging.getLogger("reliable_sub.runtime.lease")

# The loop never spins faster than this, whatever the leases say (a guard, not a schedule).
MIN_TICK_INTERVAL = 0.01
# The names of the calls in the log and in health reports.
EXTEND_CALL = "extending leases of {subscription!r}"
RENEW_CALL = "renewing dedup claims of {subscription!r}"


class LeaseManager:
    """Leases the deliveries of one subscription.

    Args:
        adapter: the broker the deliveries came from.
        policy: extension bounds, percentile and maximum lease duration.
        clock: the time source (shared with the adapter in tests).
        initial_deadline: the deadline (seconds) a fresh delivery has from the broker.
        dedup: what renews the deliveries' dedup claims, if any (a ``DedupStore``; the
            Subscriber passes its claim-lifecycle owner, which calls the store).
        on_max_lease: awaited with the deliveries that reached ``max_lease_duration`` (their
            broker lease is no longer extended).
        on_extended: called with the deliveries an extension call moved, its seconds, and the
            observed percentile it came from (None before anything was observed): telemetry.
        histogram: processing-time histogram (default: a fresh sliding one).
        health: where failed and succeeded calls are reported (default: a log of its own).
        subscription: the subscription's name, for the log.
    """

    def __init__(
        self,
        adapter: Adapter,
        policy: LeasePolicy,
        *,
        clock: Clock,
        initial_deadline: float,
        dedup: ClaimRenewer | None = None,
        on_max_lease: Callable[[list[InFlight[Any]]], Coroutine[Any, Any, None]] | None = None,
        on_extended: Callable[[list[InFlight[Any]], float, float | None], None] | None = None,
        histogram: SlidingHistogram | None = None,
        health: Health | None = None,
        subscription: str = "",
    ) -> None:
        self._adapter = adapter
        self._policy = policy
        self._clock = clock
        self._initial_deadline = initial_deadline
        # A lease reaches this far past max_lease_duration: what is given back or cancelled
        # then settles under it (the margin an extension is sent with).
        self._grace = margin(initial_deadline)
        self._on_max_lease = on_max_lease
        self._on_extended = on_extended
        self.observed: float | None = None  # the percentile the last extension came from
        self.histogram = histogram or SlidingHistogram(clock)
        self.stats = LeaseStats()
        self._leases: set[InFlight[Any]] = set()
        self._wakeup = asyncio.Event()
        self._idle = True
        self._planned_wake = math.inf
        self._task: asyncio.Task[None] | None = None
        self._health = health or Health(clock.now, math.inf)
        self._extend_call = EXTEND_CALL.format(subscription=subscription)
        self._beside: set[asyncio.Task[None]] = set()  # renewals and max-lease reports
        self._renewal = None if dedup is None else ClaimRenewal(
            dedup, clock=clock, stats=self.stats, health=self._health,
            call=RENEW_CALL.format(subscription=subscription), schedule=self._schedule)

    def __len__(self) -> int:
        return len(self._leases)

    # -- what the Subscriber tells us --------------------------------------------------------

    def add(self, items: Sequence[InFlight[Any]], claim_ttl: float = 0.0) -> None:
        """Lease deliveries from the moment their receive call returned (``received_at``).

        Items that are then claimed take their claim for ``claim_ttl`` seconds; it is renewed
        once their handler starts (see :meth:`started`).
        """
        initial = self._initial_deadline
        max_lease = self._policy.max_lease_duration
        first_margin = margin(initial)
        claim_refresh = claim_ttl - margin(claim_ttl)
        earliest = math.inf
        for item in items:
            received = item.delivery.received_at
            item.leased = True
            item.deadline = received + initial
            item.length = initial
            item.expires_at = received + max_lease
            # a claim, if the batch is claimed, is taken just after this (at about received)
            item.claim_deadline = received + claim_ttl
            item.claim_length = claim_ttl
            item.claim_refresh_at = received + claim_refresh
            self._leases.add(item)
            earliest = min(earliest, received + initial - first_margin)
        self._schedule(earliest)

    def claim_ttl(self) -> float:
        """How long a fresh delivery's dedup claim should last: as long as its first lease."""
        return max(self._initial_deadline, self._policy.min_extension)

    def claim_needs_refresh(self, item: InFlight[Any]) -> bool:
        """True when ``item``'s claim (taken at receipt, not renewed while it waited to start)
        has too little time left to start a handler under it."""
        return item.claim_refresh_at <= self._clock.now()

    def claim_taken(self, item: InFlight[Any], ttl: float) -> None:
        """``item``'s claim was (re)taken now for ``ttl`` seconds."""
        item.claim_deadline = self._clock.now() + ttl
        item.claim_length = ttl
        item.claim_refresh_at = item.claim_deadline - margin(ttl)

    def started(self, item: InFlight[Any]) -> None:
        """The handler starts now: time is measured from here and the claim is kept alive."""
        item.started_at = self._clock.now()
        if item.claim is not None and item.leased:
            item.claim_active = True
            self._schedule(item.claim_refresh_at)

    def started_many(self, items: list[InFlight[Any]]) -> None:
        """A batch handler starts now on ``items``: :meth:`started` for each, one clock read."""
        now = self._clock.now()
        due = math.inf
        for item in items:
            item.started_at = now
            if item.claim is not None and item.leased:
                item.claim_active = True
                due = min(due, item.claim_refresh_at)
        if due < math.inf:
            self._schedule(due)

    def finished_many(self, items: list[InFlight[Any]]) -> None:
        """A batch handler returned: each item's duration is the batch's, recorded once."""
        now = self._clock.now()
        duration = None
        for item in items:
            if item.started_at is not None:
                duration = item.duration = now - item.started_at
        if duration is not None:
            self.histogram.add(duration, now)

    def finished(self, item: InFlight[Any]) -> float | None:
        """The handler returned: record its processing time (the lease stays until settled)."""
        if item.started_at is None:
            return None
        now = self._clock.now()
        duration = now - item.started_at
        self.histogram.add(duration, now)
        return duration

    def drop(self, item: InFlight[Any]) -> None:
        """Stop leasing ``item`` (settled, or given up)."""
        self._leases.discard(item)
        item.leased = False
        item.claim_active = False

    def extension(self) -> float:
        """The current extension length: the policy's percentile, clamped to its range."""
        observed = self.observed = self.histogram.percentile(self._policy.percentile)
        seconds = self._initial_deadline if observed is None else observed
        seconds = min(self._policy.max_extension, max(self._policy.min_extension, seconds))
        capabilities = self._adapter.capabilities
        if capabilities.extension_limited_to_ack_deadline:
            seconds = min(seconds, self._initial_deadline)
        return capabilities.clamp_deadline(seconds)

    # -- the loop ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the background task (inside a running event loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="lease-manager")

    async def stop(self) -> None:
        """Stop extending; leases still held simply run out at the broker."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run(self) -> None:
        """Tick whenever a lease falls due, until cancelled (which cancels the renewals and
        reports running beside it)."""
        try:
            await self._run()
        finally:
            for task in list(self._beside):
                task.cancel()

    async def _run(self) -> None:
        while True:
            next_due = await self.tick()
            if next_due is None or math.isinf(next_due):  # nothing to extend or renew
                self._idle = True
                self._planned_wake = math.inf
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._wakeup.clear()
            delay = max(MIN_TICK_INTERVAL, next_due - self._clock.now())
            self._planned_wake = self._clock.now() + delay
            await sleep_or_event(self._clock, self._wakeup, delay)

    def _schedule(self, due: float) -> None:
        # The loop may be asleep until a later lease falls due: wake it when this one is due
        # first, or it would miss its deadline.
        if (self._idle and self._leases) or due < self._planned_wake:
            self._idle = False
            self._planned_wake = due
            self._wakeup.set()

    async def tick(self) -> float | None:
        """Extend what is due, renew due claims, report leases at their maximum duration.

        Only the broker's extensions are awaited (each call bounded); renewals and reports
        are started beside the tick. Returns the clock time of the next due lease (inf when
        the remaining leases need nothing until they settle), or None when nothing is leased.
        """
        now = self._clock.now()
        to_extend: list[InFlight[Any]] = []
        expired: list[InFlight[Any]] = []
        claims: list[InFlight[Any]] = []
        grace = self._grace
        for item in self._leases:
            held = item.held
            if item.expires_at <= now and (held or item.stage < SETTLING):
                # at max_lease_duration (a handler that runs on: another one later); one that
                # waits to start is given back even when the broker refused its lease (a
                # partition taken away): it would wait for a worker, run, and be refused
                expired.append(item)
            elif (held and item.not_before <= now and item.deadline < item.expires_at + grace
                  and item.deadline <= now + margin(item.length) + item.length * BATCH_FRACTION):
                to_extend.append(item)
            if (item.claim_active and item.renew_after <= now
                    and item.claim_deadline <= now + margin(item.claim_length)
                    + item.claim_length * BATCH_FRACTION):
                claims.append(item)
        if expired:
            self._expire(expired)
        # the percentile sorts the histogram: only worth it when something is due
        extension = self.extension() if (to_extend or claims) else 0.0
        renewal = self._renewal
        if claims and renewal is not None:
            if renewal.blocked():  # one hung renewal at a time: look again shortly
                renewal.postpone(claims, now)
            else:
                self._beside_the_tick(
                    renewal.renew(claims, max(extension, self.claim_ttl()), now))
        if to_extend:
            await self._extend(to_extend, extension, now)
        if not self._leases:
            return None
        return min(due_at(item) for item in self._leases)

    def _beside_the_tick(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._beside.add(task)
        task.add_done_callback(self._beside_done)

    def _beside_done(self, task: asyncio.Task[None]) -> None:
        self._beside.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("a lease manager task failed unexpectedly", exc_info=task.exception())

    def _expire(self, items: list[InFlight[Any]]) -> None:
        self.stats.max_lease_reached += len(items)
        for item in items:
            item.held = False
            # a handler that runs on is reported again one max_lease_duration later
            item.expires_at = max(item.expires_at, self._clock.now()) + (
                self._policy.max_lease_duration
            )
        logger.warning(
            "%d deliveries reached max_lease_duration=%gs",
            len(items), self._policy.max_lease_duration,
            extra={"message_ids": [item.message_id for item in items[:20]]},
        )
        if self._on_max_lease is not None:
            # beside the tick: giving back may nack, and a nack may wait for the receive path
            self._beside_the_tick(self._on_max_lease(items))

    async def _extend(self, items: list[InFlight[Any]], extension: float, now: float) -> None:
        groups: dict[float, list[InFlight[Any]]] = {}
        clamp = self._adapter.capabilities.clamp_deadline
        grace = self._grace
        for item in items:
            seconds = clamp(min(extension, item.expires_at + grace - now))
            groups.setdefault(seconds, []).append(item)
        for seconds, group in groups.items():
            deliveries = [item.delivery for item in group]
            bound = max(MIN_CALL_BOUND, min(item.deadline for item in group) - now)
            try:
                refused = await within(self._clock, self._adapter.extend(deliveries, seconds),
                                       bound, f"extend of {len(deliveries)} deliveries")
            except Exception as error:
                self.stats.extend_errors += 1
                self._health.failed(self._extend_call, error)
                retry_at = self._clock.now()
                for item in group:
                    item.not_before = retry_at + item.length * RETRY_FRACTION
                continue
            self._health.ok(self._extend_call)
            self.stats.extend_calls += 1
            self.stats.extended_ack_ids += len(deliveries)
            refused_ids = {d.ack_id for d in refused}
            moved = []
            for item in group:
                if item.delivery.ack_id in refused_ids:
                    if item.stage >= SETTLING:
                        # its own ack or nack landed first (the two calls raced): no lease lapsed
                        item.held = False
                        self.stats.refused_after_settle += 1
                    else:
                        self._refused(item)
                else:
                    item.deadline = now + seconds
                    item.length = seconds
                    moved.append(item)
            if self._on_extended is not None and moved:
                self._on_extended(moved, seconds, self.observed)

    def _refused(self, item: InFlight[Any]) -> None:
        self.stats.refused += 1
        item.held = False
        logger.info(
            "broker refused to extend message %s (ack id %s is stale); no longer leased",
            item.message_id, item.delivery.ack_id,
        )
