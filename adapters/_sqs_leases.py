"""The receipt handles this process holds, and how long: what lets the SQS adapter refuse a
stale ack on its own side.

AWS deletes a message on a ``DeleteMessage`` with an old receipt handle (the message "may or may
not be deleted"), so a consumer that acked after its visibility timeout ran out, while a peer
ran the message again, would delete the peer's delivery under it. The adapter keeps, per
receipt handle it handed out, when its lease ends: an ack, nack or extend of a handle whose
lease ran out, or that this process received again since (a newer handle of the same message),
is refused without a call. A lease is dated from the receive: from when the call was made, or
from when its reply came less a margin for the trip (a long poll hands a message out when it
arrives), whichever is later; each extension from when its call was made (SQS counts a new
timeout from the call). Every date is this process's monotonic clock.

SQS also refuses a visibility timeout that would end more than 12 hours after the receive: each
lease keeps that cap, and extensions and delayed nacks are cut to it.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from reliable_sub.message import Delivery

# SQS's longest visibility timeout, and the cap on a message's from its receive (12 hours).
MAX_VISIBILITY = 43_200
# A lease dated from a receive's reply ends this much earlier (a fraction of the timeout, at
# most STALE_MARGIN_MAX seconds): the trip from the server.
STALE_MARGIN_FRACTION = 0.05
STALE_MARGIN_MAX = 0.5
# Handles recently deleted: an ack retried after a reply was lost is no refusal.
DELETED_MEMORY = 10_000
# Leases that ran out are forgotten at most this often (seconds).
PRUNE_INTERVAL = 10.0


@dataclass(slots=True, eq=False)
class Lease:
    """One receipt handle's lease."""

    queue_url: str
    message_id: str
    ends: float  # monotonic seconds
    cap: float  # the receive's 12-hour cap, monotonic seconds


def margin(visibility: float) -> float:
    return min(STALE_MARGIN_MAX, visibility * STALE_MARGIN_FRACTION)


class Leases:
    """The handles this process holds (shared by every event loop of one adapter)."""

    def __init__(self) -> None:
        self._held: dict[str, Lease] = {}
        self._newest: dict[tuple[str, str], str] = {}  # (queue, message id) -> handle
        self._deleted: OrderedDict[str, None] = OrderedDict()
        self._next_prune = 0.0

    def received(self, queue_url: str, message_id: str, handle: str, asked_at: float,
                 returned_at: float, visibility: float) -> None:
        """A receive whose call was made at ``asked_at`` returned ``handle`` at
        ``returned_at``, hidden for ``visibility`` seconds."""
        start = max(asked_at, returned_at - margin(visibility))
        previous = self._newest.get((queue_url, message_id))
        if previous is not None and previous != handle:
            self._held.pop(previous, None)  # received again: that delivery is stale
        self._newest[(queue_url, message_id)] = handle
        self._held[handle] = Lease(queue_url, message_id, start + visibility,
                                   asked_at + MAX_VISIBILITY - margin(MAX_VISIBILITY))
        self._prune(returned_at)

    def split(self, deliveries: list[Delivery] | tuple[Delivery, ...], now: float
              ) -> tuple[list[tuple[Delivery, Lease]], list[Delivery], list[Delivery]]:
        """The deliveries still leased (with their lease), those deleted already, the stale."""
        live: list[tuple[Delivery, Lease]] = []
        deleted: list[Delivery] = []
        stale: list[Delivery] = []
        for delivery in deliveries:
            lease = self._held.get(delivery.ack_id)
            if lease is not None and lease.ends > now:
                live.append((delivery, lease))
            elif delivery.ack_id in self._deleted:
                deleted.append(delivery)
            else:
                stale.append(delivery)
        return live, deleted, stale

    @staticmethod
    def allowed(lease: Lease, seconds: float, now: float) -> int:
        """Whole seconds of visibility to ask for (``seconds`` rounded up: never shorter than
        asked), cut to the receive's 12-hour cap; 0 when the cap leaves none."""
        room = math.floor(lease.cap - now)
        return max(0, min(math.ceil(max(0.0, seconds)), room, MAX_VISIBILITY))

    def extended(self, handle: str, sent_at: float, seconds: int) -> None:
        lease = self._held.get(handle)
        if lease is not None:
            lease.ends = max(lease.ends, sent_at + seconds)

    def drop(self, handle: str) -> None:
        """The handle is no longer ours (given back, refused)."""
        lease = self._held.pop(handle, None)
        if lease is not None and self._newest.get((lease.queue_url, lease.message_id)) == handle:
            del self._newest[(lease.queue_url, lease.message_id)]

    def deleted(self, handle: str) -> None:
        self.drop(handle)
        self._deleted[handle] = None
        if len(self._deleted) > DELETED_MEMORY:
            self._deleted.popitem(last=False)

    def _prune(self, now: float) -> None:
        if now < self._next_prune:
            return
        self._next_prune = now + PRUNE_INTERVAL
        for handle in [h for h, lease in list(self._held.items()) if lease.ends < now]:
            self.drop(handle)

    def __len__(self) -> int:
        return len(self._held)


def monotonic() -> float:
    return time.monotonic()
