"""What the lease manager and the claim renewal share: when a lease or a dedup claim falls
due, and their counters."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .inflight import InFlight, Stage

# Extend when less than this fraction of the current lease is left: 2 s of a 10 s deadline, room
# for scheduler jitter and one broker round trip.
SAFETY_FRACTION = 0.2
# ... but never with less than this many seconds left (or half the lease, if that is less): 20% of
# a 1-2 s lease is shorter than the event loop's lag on a loaded machine, and a lease that lapses
# hands the message to a peer while its handler runs.
MIN_SAFETY_MARGIN = 1.0
# A tick also takes leases that would fall due within this further fraction, so deliveries
# received close together share one extend call instead of one call each.
BATCH_FRACTION = 0.2
# After a failed extend or renew call (broker or store unreachable), try again this fraction of
# a lease later.
RETRY_FRACTION = 0.05
# An extend or renew call gets until the earliest lease (or claim) in it runs out, but at least
# this long (seconds): past the lease the call is moot; a shorter bound would cut off a broker
# that is merely slow. Then it counts as failed and is tried again shortly.
MIN_CALL_BOUND = 1.0


def margin(length: float) -> float:
    """Seconds before a lease of ``length`` ends at which it is due for extension."""
    return max(length * SAFETY_FRACTION, min(length / 2, MIN_SAFETY_MARGIN))


def due_at(item: InFlight[Any]) -> float:
    """When ``item`` next needs the lease manager: its extension, its report at the maximum
    lease duration, or its claim's renewal, whichever comes first."""
    due = math.inf
    if item.held:
        due = max(item.deadline - margin(item.length), item.not_before)
    if item.held or item.stage < Stage.SETTLING:
        due = min(due, item.expires_at)  # the maximum duration, however far the lease reaches
    if item.claim_active:
        due = min(due, claim_due(item))
    return due


def claim_due(item: InFlight[Any]) -> float:
    """When ``item``'s dedup claim is next due for renewal."""
    return max(item.claim_deadline - margin(item.claim_length), item.renew_after)


@dataclass
class LeaseStats:
    """Counters for benchmarks, tests and metrics."""

    extend_calls: int = 0
    extended_ack_ids: int = 0
    claim_renew_calls: int = 0
    renewed_claims: int = 0
    refused: int = 0
    """Extensions the broker refused while the handler ran or waited: the lease had lapsed."""
    refused_after_settle: int = 0
    """Extensions refused because the delivery's own ack or nack, sent meanwhile, landed first."""
    max_lease_reached: int = 0
    extend_errors: int = 0
    renew_errors: int = 0
    lost_claims: int = 0
