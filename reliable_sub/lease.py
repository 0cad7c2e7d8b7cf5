"""The lease manager: keeps every in-flight message's ack deadline ahead of its handler.

How it differs from Pub/Sub's own leaser (which extends *every* leased message on every tick by a
lifetime p99 of whole seconds):

* the extension is a percentile (p99 by default) of a *sliding* histogram of processing time,
  measured from the moment the handler starts, so queueing behind flow control does not inflate
  it and a workload that gets faster is followed within minutes;
* a tick extends only the deliveries that are due (less than ``SAFETY_FRACTION`` of their lease
  left), together with those due soon (``BATCH_FRACTION``), in one batched ``extend`` call;
* dedup claims of running handlers are renewed in the same tick, so a claim never lapses under a
  live handler;
* after ``max_lease_duration`` the message is nacked for redelivery (the claim stays renewed while
  the handler still runs, so the redelivered copy waits instead of running twice);
* an ``extend`` the broker refuses (a stale ack id) drops that delivery from the lease; nothing
  crashes, and the handler's eventual ack is refused harmlessly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .adapters.base import Adapter
from .clock import Clock, sleep_or_event
from .dedup import DedupStore
from .histogram import SlidingHistogram
from .message import Delivery
from .policy import LeasePolicy

logger = logging.getLogger(__name__)

# Extend when less than this fraction of the current lease is left: 2 s of a 10 s deadline, room
# for scheduler jitter and one broker round trip.
SAFETY_FRACTION = 0.2
# A tick also takes leases that would fall due within this further fraction, so deliveries
# received close together share one extend call instead of one call each.
BATCH_FRACTION = 0.2
# After a failed extend call (broker unreachable), try again this fraction of a lease later.
RETRY_FRACTION = 0.05
# The loop never spins faster than this, whatever the leases say (a guard, not a schedule).
MIN_TICK_INTERVAL = 0.01


@dataclass(eq=False, slots=True)
class _Lease:
    delivery: Delivery
    deadline: float
    length: float
    expires_at: float
    held: bool = True
    started_at: float | None = None
    claim_key: str | None = None
    claim_deadline: float = math.inf
    not_before: float = -math.inf  # after a failed broker or store call: retry from then

    def due_at(self) -> float:
        margin = self.length * SAFETY_FRACTION
        due = self.deadline - margin if self.held else math.inf
        if self.claim_key is not None:
            due = min(due, self.claim_deadline - margin)
        return max(due, self.not_before)


@dataclass
class LeaseStats:
    """Counters for benchmarks, tests and metrics."""

    extend_calls: int = 0
    extended_ack_ids: int = 0
    claim_renew_calls: int = 0
    refused: int = 0
    max_lease_nacks: int = 0
    extend_errors: int = 0
    lost_claims: int = 0


class LeaseManager:
    """Leases the deliveries of one subscription.

    Args:
        adapter: the broker the deliveries came from.
        policy: extension bounds, percentile and maximum lease duration.
        clock: the time source (shared with the adapter in tests).
        initial_deadline: the deadline (seconds) a fresh delivery has from the broker.
        dedup: the store whose claims are renewed with the deliveries, if any.
        histogram: processing-time histogram (default: a fresh sliding one).
    """

    def __init__(
        self,
        adapter: Adapter,
        policy: LeasePolicy,
        *,
        clock: Clock,
        initial_deadline: float,
        dedup: DedupStore | None = None,
        histogram: SlidingHistogram | None = None,
    ) -> None:
        self._adapter = adapter
        self._policy = policy
        self._clock = clock
        self._initial_deadline = initial_deadline
        self._dedup = dedup
        self.histogram = histogram or SlidingHistogram(clock)
        self.stats = LeaseStats()
        self._leases: dict[str, _Lease] = {}
        self._wakeup = asyncio.Event()
        self._idle = True
        self._planned_wake = math.inf
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._leases)

    # -- what the Subscriber tells us --------------------------------------------------------

    def add(
        self,
        deliveries: Sequence[Delivery],
        claim_keys: Sequence[str] | None = None,
        claim_ttl: float = 0.0,
    ) -> None:
        """Lease deliveries from the moment their receive call returned (``received_at``).

        ``claim_keys`` (one per delivery) are dedup claims taken for ``claim_ttl`` seconds at
        ``received_at``; they are renewed together with the deliveries.
        """
        initial = self._initial_deadline
        max_lease = self._policy.max_lease_duration
        margin = initial * SAFETY_FRACTION
        leases = self._leases
        earliest_due = math.inf
        for index, delivery in enumerate(deliveries):
            received = delivery.received_at
            lease = _Lease(delivery, received + initial, initial, received + max_lease)
            due = received + initial - margin
            if claim_keys is not None:
                lease.claim_key = claim_keys[index]
                lease.claim_deadline = received + claim_ttl
                due = min(due, lease.claim_deadline - margin)
            leases[delivery.ack_id] = lease
            if due < earliest_due:
                earliest_due = due
        # The loop may be asleep until a later lease falls due (all others were just extended
        # far ahead): wake it when a new one is due first, or it would miss its deadline.
        if (self._idle and leases) or earliest_due < self._planned_wake:
            self._idle = False
            self._planned_wake = earliest_due
            self._wakeup.set()

    def claim_ttl(self) -> float:
        """How long a fresh delivery's dedup claim should last: as long as its first lease."""
        return max(self._initial_deadline, self._policy.min_extension)

    def started(self, delivery: Delivery) -> None:
        """The handler for ``delivery`` starts now: processing time is measured from here."""
        lease = self._leases.get(delivery.ack_id)
        if lease is not None:
            lease.started_at = self._clock.now()

    def finish(self, delivery: Delivery) -> float | None:
        """Stop leasing ``delivery`` and record its processing time; returns it, if measured."""
        lease = self._leases.pop(delivery.ack_id, None)
        if lease is None or lease.started_at is None:
            return None
        now = self._clock.now()
        duration = now - lease.started_at
        self.histogram.add(duration, now)
        return duration

    def drop(self, delivery: Delivery) -> None:
        """Stop leasing ``delivery`` without recording a processing time."""
        self._leases.pop(delivery.ack_id, None)

    def extension(self) -> float:
        """The current extension length: the policy's percentile, clamped to its range."""
        observed = self.histogram.percentile(self._policy.percentile)
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
            self._task = asyncio.get_running_loop().create_task(self._run(), name="lease-manager")

    async def stop(self) -> None:
        """Stop extending; leases still held simply run out at the broker."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

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

    async def tick(self) -> float | None:
        """Extend what is due, renew due claims, release expired leases.

        Returns the clock time of the next due lease (inf when the remaining leases need
        nothing until their handlers finish), or None when nothing is leased.
        """
        now = self._clock.now()
        to_extend: list[_Lease] = []
        to_release: list[_Lease] = []
        claims: list[_Lease] = []
        for lease in self._leases.values():
            if lease.not_before > now:
                continue
            horizon = now + lease.length * (SAFETY_FRACTION + BATCH_FRACTION)
            if lease.held and lease.deadline <= horizon:
                if lease.expires_at <= horizon:
                    to_release.append(lease)
                else:
                    to_extend.append(lease)
            if lease.claim_key is not None and lease.claim_deadline <= horizon:
                claims.append(lease)
        if to_release:
            await self._release(to_release)
        # the percentile sorts the histogram: only worth it when something is due
        extension = self.extension() if (to_extend or claims) else 0.0
        if to_extend:
            await self._extend(to_extend, extension, now)
        if claims and self._dedup is not None:
            await self._renew_claims(claims, extension, now)
        if not self._leases:
            return None
        return min(lease.due_at() for lease in self._leases.values())

    async def _extend(self, leases: list[_Lease], extension: float, now: float) -> None:
        groups: dict[float, list[_Lease]] = {}
        for lease in leases:
            seconds = min(extension, lease.expires_at - now)
            seconds = self._adapter.capabilities.clamp_deadline(seconds)
            groups.setdefault(seconds, []).append(lease)
        for seconds, group in groups.items():
            deliveries = [lease.delivery for lease in group]
            try:
                refused = await self._adapter.extend(deliveries, seconds)
            except Exception:
                self.stats.extend_errors += 1
                logger.warning(
                    "extending %d deliveries failed; retrying shortly", len(group), exc_info=True
                )
                for lease in group:
                    lease.not_before = now + lease.length * RETRY_FRACTION
                continue
            self.stats.extend_calls += 1
            self.stats.extended_ack_ids += len(deliveries)
            refused_ids = {d.ack_id for d in refused}
            for lease in group:
                if lease.delivery.ack_id in refused_ids:
                    self._drop_refused(lease)
                else:
                    lease.deadline = now + seconds
                    lease.length = seconds

    def _drop_refused(self, lease: _Lease) -> None:
        self.stats.refused += 1
        lease.held = False
        logger.info(
            "broker refused to extend message %s (ack id %s is stale); no longer leased",
            lease.delivery.message.id,
            lease.delivery.ack_id,
        )
        if lease.claim_key is None:
            self._leases.pop(lease.delivery.ack_id, None)

    async def _release(self, leases: list[_Lease]) -> None:
        deliveries = [lease.delivery for lease in leases]
        for lease in leases:
            lease.held = False
            if lease.claim_key is None and lease.started_at is None:
                self._leases.pop(lease.delivery.ack_id, None)
        self.stats.max_lease_nacks += len(leases)
        logger.warning(
            "%d deliveries reached max_lease_duration=%gs; nacked for redelivery (their dedup "
            "claims stay renewed while their handlers run)",
            len(leases),
            self._policy.max_lease_duration,
        )
        try:
            await self._adapter.nack(deliveries, 0.0)
        except Exception:
            logger.warning("nack after max_lease_duration failed", exc_info=True)

    async def _renew_claims(self, leases: list[_Lease], extension: float, now: float) -> None:
        assert self._dedup is not None
        keys = [lease.claim_key for lease in leases if lease.claim_key is not None]
        try:
            lost = set(await self._dedup.renew(keys, extension))
        except Exception:
            logger.warning("renewing %d dedup claims failed; retrying shortly", len(keys),
                           exc_info=True)
            for lease in leases:
                lease.not_before = now + lease.length * RETRY_FRACTION
            return
        self.stats.claim_renew_calls += 1
        for lease in leases:
            if lease.claim_key in lost:
                self.stats.lost_claims += 1
                logger.warning(
                    "dedup claim %r of message %s was lost (expired and taken?)",
                    lease.claim_key,
                    lease.delivery.message.id,
                )
                lease.claim_key = None
                lease.claim_deadline = math.inf
                if not lease.held:
                    self._leases.pop(lease.delivery.ack_id, None)
            else:
                lease.claim_deadline = now + extension
