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
    """Counts of outcomes and of errors the Subscriber recovered from.

    Every counter reads the same way: ``stats["acked"]`` (or ``stats[Outcome.ACKED]``) for an
    outcome, ``stats["store_errors"]`` for an error counter (also ``stats.store_errors``);
    :meth:`as_dict` gives them all at once.
    """

    outcomes: Counter[Outcome] = field(default_factory=Counter)
    handler_errors: int = 0
    receive_errors: int = 0
    ack_errors: int = 0
    store_errors: int = 0
    acks_refused: int = 0
    lost_claims: int = 0
    malformed: int = 0
    rejected: int = 0  # dead-lettered at once: Reject, or a RetryPolicy.non_retryable error
    purged_records: int = 0  # expired dedup records deleted by the periodic purge

    def __getitem__(self, name: Outcome | str) -> int:
        """The count of an outcome (``"acked"``) or of a counter (``"store_errors"``)."""
        if isinstance(name, Outcome):
            return self.outcomes[name]
        if name in _OUTCOME_NAMES:
            return self.outcomes[Outcome(name)]
        if name in _COUNTERS:
            value: int = getattr(self, name)
            return value
        raise KeyError(
            f"{name!r} is neither an outcome nor a counter of SubscriberStats; outcomes: "
            f"{', '.join(sorted(_OUTCOME_NAMES))}; counters: {', '.join(_COUNTERS)}"
        )

    def as_dict(self) -> dict[str, int]:
        """Every outcome and counter by name (outcomes never seen count 0)."""
        counts = {outcome.value: self.outcomes[outcome] for outcome in Outcome}
        counts.update((name, getattr(self, name)) for name in _COUNTERS)
        return counts


_OUTCOME_NAMES = frozenset(outcome.value for outcome in Outcome)
_COUNTERS = tuple(name for name in SubscriberStats.__dataclass_fields__ if name != "outcomes")


__all__ = ["DeliveryEvent", "Outcome", "SubscriberStats"]
