"""The in-process broker's queue of one subscription, and its mechanics.

What ``MemoryAdapter`` keeps per subscription: ready messages, nack delays and lease deadlines on
heaps, the ordering keys in use and the messages waiting behind them, and acked messages kept for
a seek. The adapter holds its one lock around every call.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

from reliable_sub.errors import ConfigurationError
from reliable_sub.message import Delivery, Message

logger = logging.getLogger("reliable_sub.adapters.memory")

# Stale lease-heap entries tolerated beyond twice the live leases before the heap is rebuilt.
LEASE_HEAP_SLACK = 1024


@dataclass(eq=False)
class Entry:
    """One message as stored in one subscription."""

    id: str
    data: bytes
    attributes: dict[str, str]
    publish_time: datetime
    ordering_key: str | None
    attempts: int = 0


@dataclass(eq=False)
class Lease:
    entry: Entry
    deadline: float


@dataclass(eq=False)
class Queue:
    """One subscription's messages and their delivery state: what is ready, delayed, leased
    (with a heap of deadlines), waiting behind its ordering key, or acked and retained. Call
    with the adapter's lock held."""

    name: str
    topic: str
    ack_deadline: float
    retain_acked_messages: bool
    message_retention: float
    ordering: bool
    ready: deque[Entry] = field(default_factory=deque)
    delayed: list[tuple[float, int, Entry]] = field(default_factory=list)
    leased: dict[str, Lease] = field(default_factory=dict)
    lease_heap: list[tuple[float, int, str]] = field(default_factory=list)
    waiting_by_key: dict[str, deque[Entry]] = field(default_factory=dict)
    busy_keys: set[str] = field(default_factory=set)
    acked: deque[tuple[float, Entry]] = field(default_factory=deque)
    waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=set)

    def check_again(self, topic: str, ack_deadline: float | None) -> None:
        """``ensure_subscription`` once more: the same topic (else ConfigurationError); its ack
        deadline stays (another one asked for is warned about)."""
        if topic != self.topic:
            raise ConfigurationError(f"subscription {self.name!r} already exists on topic "
                                     f"{self.topic!r}, not {topic!r}")
        if ack_deadline is not None and ack_deadline != self.ack_deadline:
            logger.warning("subscription %r keeps its ack deadline of %gs, not the %gs asked "
                           "for", self.name, self.ack_deadline, ack_deadline)

    def backlog(self) -> int:
        """Messages not yet acked (ready, leased, delayed or queued by key)."""
        queued = sum(len(queue) for queue in self.waiting_by_key.values())
        return len(self.ready) + len(self.delayed) + len(self.leased) + queued

    def unacked(self) -> list[Entry]:
        """Every message not yet acked, in publish order."""
        entries = [*self.ready, *(entry for _, _, entry in self.delayed),
                   *(lease.entry for lease in self.leased.values()),
                   *(entry for queue in self.waiting_by_key.values() for entry in queue)]
        return sorted(entries, key=lambda entry: int(entry.id))

    def clear(self) -> None:
        """Forget every delivery state (its leases' ack ids become stale)."""
        self.ready.clear()
        self.delayed.clear()
        self.leased.clear()
        self.lease_heap.clear()
        self.waiting_by_key.clear()
        self.busy_keys.clear()
        self.acked.clear()
        self.notify()

    def enqueue(self, entry: Entry) -> None:
        key = entry.ordering_key
        if key is not None and self.ordering:
            if key in self.busy_keys:
                self.waiting_by_key.setdefault(key, deque()).append(entry)
                return
            self.busy_keys.add(key)
        self.ready.append(entry)
        self.notify()

    def release_key(self, entry: Entry) -> None:
        """After an ack, let the next message of the same ordering key go."""
        key = entry.ordering_key
        if key is None or not self.ordering:
            return
        queue = self.waiting_by_key.get(key)
        if queue:
            self.ready.append(queue.popleft())
            if not queue:
                del self.waiting_by_key[key]
            self.notify()
        else:
            self.busy_keys.discard(key)

    def compact_lease_heap(self, sequence: Iterator[int]) -> None:
        """Drop the heap entries of leases that ended (acked, nacked) or moved (extended).

        Entries are only popped when their deadline passes; under load, acks and extensions
        leave stale ones much faster, so without this the heap held every delivery of the
        last ack deadline (tens of MB at full speed). Rebuilt when mostly stale: O(1) per
        entry, amortised.
        """
        if len(self.lease_heap) <= 2 * len(self.leased) + LEASE_HEAP_SLACK:
            return
        self.lease_heap = [(lease.deadline, next(sequence), ack_id)
                           for ack_id, lease in self.leased.items()]
        heapq.heapify(self.lease_heap)

    def promote(self, now: float) -> None:
        """Move expired leases and elapsed nack delays back to the ready queue."""
        while self.lease_heap and self.lease_heap[0][0] <= now:
            deadline, _, ack_id = heapq.heappop(self.lease_heap)
            lease = self.leased.get(ack_id)
            if lease is not None and lease.deadline == deadline:
                del self.leased[ack_id]
                self.ready.append(lease.entry)
        while self.delayed and self.delayed[0][0] <= now:
            self.ready.append(heapq.heappop(self.delayed)[2])

    def take(self, max_messages: int, now: float, ack_ids: Iterator[int],
             sequence: Iterator[int]) -> list[Delivery]:
        self.promote(now)
        batch: list[Delivery] = []
        deadline = now + self.ack_deadline
        while self.ready and len(batch) < max_messages:
            entry = self.ready.popleft()
            entry.attempts += 1
            ack_id = str(next(ack_ids))
            self.leased[ack_id] = Lease(entry, deadline)
            heapq.heappush(self.lease_heap, (deadline, next(sequence), ack_id))
            batch.append(Delivery(self.message(entry), ack_id, now))
        return batch

    def message(self, entry: Entry) -> Message:
        return Message.received(entry.id, entry.data, dict(entry.attributes),
                                max(1, entry.attempts), entry.publish_time, entry.ordering_key,
                                self.name)

    def next_due(self) -> float:
        due = float("inf")
        if self.lease_heap:
            due = self.lease_heap[0][0]
        if self.delayed:
            due = min(due, self.delayed[0][0])
        return due

    def prune_acked(self, now: float) -> None:
        while self.acked and self.acked[0][0] + self.message_retention <= now:
            self.acked.popleft()

    def notify(self) -> None:
        for loop, event in self.waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)
