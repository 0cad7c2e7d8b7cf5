"""One received delivery from receipt until the broker confirmed its ack or nack.

A single object per delivery, shared by the dispatcher (which runs it), the lease manager (which
keeps its ack deadline and dedup claim alive) and the settler (which acks or nacks it): the
fields of all three live here so a delivery costs one allocation, not three.

It is generic in its ``lane`` (the route it came in on, during one run): the stages that read the
lane name its type, :data:`reliable_sub._runtime.lanes.Item`; the lease manager, the settler and the
claims never read it, so this module needs nothing of theirs (no import cycle).
"""

from __future__ import annotations

import asyncio
import enum
import math
from typing import Any, Generic, TypeVar

from ..dedup import Claimed
from ..message import Delivery

LaneT = TypeVar("LaneT")


class Stage(enum.IntEnum):
    """Where a delivery is in its life."""

    WAITING = 0
    """Received, not started: waiting for its ordering key, a worker thread or byte budget."""
    RUNNING = 1
    """Its handler runs."""
    SETTLING = 2
    """Decided (ack or nack); the store write and broker call are not confirmed yet."""
    DONE = 3
    """Settled; nothing of it is kept."""


# The stages as module constants: the delivery path reads them for every message (see members.py)
WAITING, RUNNING, SETTLING, DONE = Stage.WAITING, Stage.RUNNING, Stage.SETTLING, Stage.DONE


class CancelReason(str, enum.Enum):
    """Why the Subscriber cancelled a delivery's task (a handler's own CancelledError has none)."""

    STOP = "stop"
    """The Subscriber is stopping: give the message back at once."""
    TIMEOUT = "timeout"
    """The handler ran past max_lease_duration: a failed attempt."""
    EXPIRED = "expired"
    """It waited to start until max_lease_duration: give it back, unstarted."""


class InFlight(Generic[LaneT]):
    """A delivery in flight, with its lease, its dedup claim and its task, from ``lane``."""

    __slots__ = (
        "cancel_reason",
        "claim",
        "claim_active",
        "claim_deadline",
        "claim_length",
        "claim_refresh_at",
        "deadline",
        "delivery",
        "duration",
        "error",
        "expires_at",
        "failures",
        "held",
        "lane",
        "leased",
        "length",
        "not_before",
        "renew_after",
        "span",
        "stage",
        "started_at",
        "task",
        "thread_running",
    )

    def __init__(self, delivery: Delivery, lane: LaneT) -> None:
        self.delivery = delivery
        self.lane = lane
        self.stage = WAITING
        self.claim: Claimed | None = None
        self.failures = 0  # handler failures recorded for this message, this one included
        self.error: BaseException | None = None  # what the last attempt failed with
        self.duration: float | None = None  # how long the handler ran
        self.task: asyncio.Task[None] | None = None
        self.cancel_reason: CancelReason | None = None
        self.thread_running = False
        self.span: Any = None  # its telemetry span, while telemetry is on
        # the broker lease
        self.leased = False
        self.held = True
        self.deadline = 0.0
        self.length = 0.0
        self.expires_at = math.inf
        self.not_before = -math.inf  # after a failed broker or store call: retry from then
        self.started_at: float | None = None
        # the dedup claim: renewed only while the handler runs and until the result is recorded
        self.claim_active = False
        self.claim_deadline = math.inf
        self.claim_length = 0.0
        self.claim_refresh_at = math.inf  # until its handler starts: when to retake the claim
        self.renew_after = -math.inf  # inf while a renewal is in flight; after a failed one:
        # retry from then (apart from not_before: a store's trouble never delays the broker's)

    @property
    def message_id(self) -> str:
        return self.delivery.message.id

    def __repr__(self) -> str:
        return f"<InFlight {self.delivery.message.id} {self.stage.name}>"


def cancel_requested() -> bool:
    """Whether the current task was asked to cancel (as opposed to a handler raising
    CancelledError by itself); Python 3.10 cannot tell, and then only our own reasons count."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False
