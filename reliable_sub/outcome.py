"""What became of one delivery, and the counters a Subscriber keeps of it."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

from .message import Message


class Outcome(str, enum.Enum):
    """The end of one delivery attempt."""

    ACKED = "acked"
    """The handler succeeded; its result was recorded and the broker confirmed the ack."""
    DUPLICATE = "duplicate"
    """The dedup store had it as completed; acked without calling the handler."""
    DEFERRED = "deferred"
    """A live peer holds its dedup claim; nacked to come back after the peer is done."""
    RETRY = "retried"
    """The handler (or the dedup claim) failed; nacked for redelivery after a backoff."""
    DEAD_LETTERED = "dead_lettered"
    """Failed ``max_delivery_attempts`` times (or could not be read); published to the
    dead-letter topic, then acked."""
    STOPPED = "stopped"
    """The Subscriber stopped before the handler started or finished; nacked for immediate
    redelivery."""
    REQUEUED = "requeued"
    """Given back without running: an earlier message of its ordering key failed or was
    deferred, or it waited to start until ``max_lease_duration``."""
    ACK_REFUSED = "ack_refused"
    """Settled, but the broker refused the ack (the delivery was stale: redelivered or taken
    over); it comes back, and a dedup store turns it into a duplicate."""

    # Hash as the plain string (as equality already does): Enum's own __hash__ is a Python call,
    # paid on every delivery when outcomes are counted.
    __hash__ = str.__hash__


@dataclass(frozen=True, slots=True)
class DeliveryEvent:
    """How one delivery ended, once the broker confirmed it (for ``on_event``: telemetry,
    metrics, audit).

    Attributes:
        message: the message as the handler saw it.
        outcome: how it ended.
        attempt: the broker's delivery attempt (``message.delivery_attempt``).
        failures: handler failures of this message so far, this attempt's included.
        error: what the handler raised (``retry``, ``dead_lettered``), else None.
        duration: seconds the handler ran (None when no handler ran).
        delay: seconds before the redelivery, for a nack.
    """

    message: Message
    outcome: Outcome
    attempt: int
    failures: int
    error: BaseException | None = None
    duration: float | None = None
    delay: float = 0.0


@dataclass
class SubscriberStats:
    """Counts of outcomes and of errors the Subscriber recovered from."""

    outcomes: Counter[Outcome] = field(default_factory=Counter)
    handler_errors: int = 0
    receive_errors: int = 0
    ack_errors: int = 0
    store_errors: int = 0
    acks_refused: int = 0
    lost_claims: int = 0
    malformed: int = 0
    purged_records: int = 0  # expired dedup records deleted by the periodic purge

    def __getitem__(self, outcome: Outcome | str) -> int:
        return self.outcomes[Outcome(outcome)]
