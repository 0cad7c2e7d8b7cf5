"""Renewing the dedup claims of running handlers, beside the lease manager's tick.

A claim is renewed from the moment its handler starts until its result is recorded, each on
its own schedule. A renewal never holds up the tick (which keeps broker leases alive): it runs
as a task of its own, bounded on the Subscriber's clock. A renewal past its bound is left to
finish (store clients may not survive a cancellation mid-call), and no other starts until it
ends.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..clock import AbandonedCall, Clock, within
from ..ports import Claimed
from .health import Health
from .inflight import InFlight
from .lease_basics import MIN_CALL_BOUND, RETRY_FRACTION, LeaseStats, claim_due

# The name this module's records always had (it was public): logging set-ups name it.
logger = logging.getLogger("reliable_sub.runtime.claim_renewal")


class ClaimRenewer(Protocol):
    """What renews dedup claims: a DedupStore, or the Subscriber's claim-lifecycle owner."""

    async def renew(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]: ...


class ClaimRenewal:
    """Renews claims for one lease manager; ``schedule`` wakes its tick when one falls due."""

    def __init__(
        self,
        renewer: ClaimRenewer,
        *,
        clock: Clock,
        stats: LeaseStats,
        health: Health,
        call: str,
        schedule: Callable[[float], None],
    ) -> None:
        self._renewer = renewer
        self._clock = clock
        self._stats = stats
        self._health = health
        self._call = call
        self._schedule = schedule
        self._stuck: asyncio.Future[object] | None = None

    def blocked(self) -> bool:
        """True while a renewal past its bound is still running."""
        return self._stuck is not None and not self._stuck.done()

    def postpone(self, items: list[InFlight[Any]], now: float) -> None:
        """Look at ``items`` again shortly (one hung renewal at a time)."""
        for item in items:
            item.renew_after = now + item.claim_length * RETRY_FRACTION

    async def renew(self, items: list[InFlight[Any]], seconds: float, now: float) -> None:
        """Renew the claims of ``items`` for ``seconds`` in one bounded call."""
        for item in items:
            item.renew_after = math.inf  # in flight: the tick does not take them again
        try:
            await self._renew(items, seconds, now)
        finally:
            earliest = math.inf
            for item in items:
                if item.renew_after == math.inf:
                    item.renew_after = -math.inf
                if item.claim_active:
                    earliest = min(earliest, claim_due(item))
            if earliest < math.inf:
                self._schedule(earliest)

    async def _renew(self, items: list[InFlight[Any]], seconds: float, now: float) -> None:
        claims = [item.claim for item in items if item.claim is not None]
        bound = max(MIN_CALL_BOUND, min(item.claim_deadline for item in items) - now)
        try:
            lost = await within(self._clock, self._renewer.renew(claims, seconds), bound,
                                f"renewal of {len(claims)} dedup claims", cancel=False)
        except Exception as error:
            if isinstance(error, AbandonedCall):
                self._stuck = error.call
            self._stats.renew_errors += 1
            self._health.failed(self._call, error)
            self.postpone(items, self._clock.now())
            return
        self._health.ok(self._call)
        self._stats.claim_renew_calls += 1
        self._stats.renewed_claims += len(claims) - len(lost)
        lost_tokens = {claim.token for claim in lost}
        for item in items:
            if item.claim is not None and item.claim.token in lost_tokens:
                self._stats.lost_claims += 1
                item.claim_active = False
                logger.warning(
                    "dedup claim of message %s was lost (it lapsed and a peer took it?); its "
                    "completion will be refused if the peer still holds it", item.message_id,
                    extra={"message_id": item.message_id},
                )
            else:
                item.claim_deadline = now + seconds
                item.claim_length = seconds
