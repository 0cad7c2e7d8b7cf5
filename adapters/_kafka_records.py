"""One assigned partition's records on the Kafka adapter, from fetch to settle.

A fetched record is *ready* until a receive hands it out; then *held* until it is acked, given
back (``nack``), or its lease (the subscription's ack deadline, moved by ``extend``) ends. A
record given back with a delay is *delayed* until it is due; given back without one, or when its
lease ended, it is ready again and goes out before anything after it (records go out in offset
order). Its offset stays uncommitted all the while (:mod:`._kafka_offsets` decides what to
commit), so nothing is lost when the consumer stops, crashes or loses the partition.

Ordering, per subscription (``ORDERINGS``):

* ``key`` -- records of one key go out one at a time, in offset order: while one is out (held)
  or given back with a delay, the later ones of its key wait here (they are *parked*), so a retry
  never lets its successors overtake it, while the partition's other keys go on. A successor is
  only handed out once the Subscriber could run it: had it been handed out beside its
  predecessor, the Subscriber would have given it back when that one failed, and every give-back
  of a record no handler ran would count as a delivery.
* ``partition`` -- at most one record of the partition is out at a time: the next goes once the
  previous is settled (a delayed one blocks the partition until it is due and settled).
* ``none`` -- records go out as they come; a delayed one holds back nothing.

Every delivery of a record is one *attempt*: its ack id names the record and the attempt, so an
ack of an earlier delivery (its lease ended and it went out again) is refused as stale.

Nothing here does I/O; the consumer calls it under its lock, from its thread and the loop's.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Hashable
from typing import Any

from reliable_sub.adapters._kafka_offsets import PartitionOffsets

KEY, PARTITION, NONE = "key", "partition", "none"
# Leases of records no longer held (acked, given back, extended) the heap may keep beyond the
# held ones before it is rebuilt: it would otherwise hold one per delivery until its deadline.
LEASE_SLACK = 64
ORDERINGS = (KEY, PARTITION, NONE)
READY, HELD, DELAYED, PARKED = range(4)


class Entry:
    """A fetched record not yet settled."""

    __slots__ = ("attempts", "deadline", "group", "offset", "record", "state")

    def __init__(self, offset: int, record: Any, group: Hashable, attempts: int) -> None:
        self.offset = offset
        self.record = record  # the client's message (opaque here)
        self.group = group  # the ordering key's group (the record key), or None
        self.attempts = attempts  # deliveries so far
        self.deadline = 0.0  # while held: when its lease ends (time.monotonic)
        self.state = READY


class PartitionQueue:
    """The records of one partition, as assigned to one consumer (see the module's docstring).

    Args:
        generation: this assignment's number (part of every ack id it hands out).
        offsets: the partition's settle tracker.
        ordering: one of ``ORDERINGS``.
    """

    def __init__(self, generation: int, offsets: PartitionOffsets, ordering: str) -> None:
        self.generation = generation
        self.offsets = offsets
        self.ordering = ordering
        self.entries: dict[int, Entry] = {}  # every unsettled fetched record, by offset
        self.fresh: deque[Entry] = deque()  # fetched, never handed out, in offset order
        self._returned: list[tuple[int, Entry]] = []  # ready again (heap by offset)
        self._delayed: list[tuple[float, int, Entry]] = []  # given back with a delay (heap)
        self._leases: list[tuple[float, int, int]] = []  # (deadline, offset, attempt), lazily
        # key mode: per key, the offsets of its records out (held) or delayed, which hold back
        # the later ones of the key
        self._blocking_of: dict[Hashable, list[int]] = {}
        self._parked: dict[Hashable, list[tuple[int, Entry]]] = {}
        self.held = 0  # entries in HELD
        self.revoking = False  # being taken away: hand nothing out
        self.primed = False  # its first fetch answered (a record, or the end of the partition)

    # -- fetching -----------------------------------------------------------------------------

    def add(self, entry: Entry) -> None:
        """A fetched record to deliver."""
        self.entries[entry.offset] = entry
        self.fresh.append(entry)

    @property
    def waiting(self) -> int:
        """Records not out: ready, parked or delayed."""
        return len(self.entries) - self.held

    # -- handing out --------------------------------------------------------------------------

    def due(self, now: float) -> None:
        """Leases ended and delays over by ``now``: those records are ready again."""
        leases = self._leases
        while leases and leases[0][0] <= now:
            _, offset, attempt = heapq.heappop(leases)
            entry = self.entries.get(offset)
            if (entry is not None and entry.state == HELD and entry.attempts == attempt
                    and entry.deadline <= now):
                self.held -= 1
                self._unblock(entry)
                self._ready_again(entry)
        delayed = self._delayed
        while delayed and delayed[0][0] <= now:
            _, offset, entry = heapq.heappop(delayed)
            self._unblock(entry)
            self._ready_again(entry)

    def _ready_again(self, entry: Entry) -> None:
        entry.state = READY
        heapq.heappush(self._returned, (entry.offset, entry))

    def _unblock(self, entry: Entry) -> None:
        """Key mode: ``entry`` no longer holds back its key (settled, given back, its lease or
        delay over): the key's parked records behind no other blocking one are ready again."""
        if self.ordering != KEY or entry.group is None:
            return
        offsets = self._blocking_of.get(entry.group)
        if offsets is None:
            return
        index = bisect.bisect_left(offsets, entry.offset)
        if index < len(offsets) and offsets[index] == entry.offset:
            del offsets[index]
        parked = self._parked.get(entry.group)
        if not offsets:
            del self._blocking_of[entry.group]
        if not parked:
            return
        limit = offsets[0] if offsets else None
        keep = [item for item in parked if limit is not None and item[0] > limit]
        for _, waiting in parked[:len(parked) - len(keep)]:
            self._ready_again(waiting)
        if keep:
            self._parked[entry.group] = keep
        else:
            del self._parked[entry.group]

    def take(self, count: int, now: float, lease: float, out: list[Entry]) -> None:
        """Hand out up to ``count`` ready records into ``out``, held for ``lease`` seconds."""
        if self.revoking:
            return
        if self.ordering == PARTITION:
            if self.held or self._delayed:
                return
            count = min(count, 1)
        fresh, returned = self.fresh, self._returned
        taken = 0
        while taken < count and (fresh or returned):
            if returned and (not fresh or returned[0][0] < fresh[0].offset):
                entry = heapq.heappop(returned)[1]
            else:
                entry = fresh.popleft()
            if self.ordering == KEY and self._blocked(entry):
                continue
            entry.state = HELD
            entry.attempts += 1
            entry.deadline = now + lease
            heapq.heappush(self._leases, (entry.deadline, entry.offset, entry.attempts))
            self.held += 1
            if self.ordering == KEY and entry.group is not None:
                bisect.insort(self._blocking_of.setdefault(entry.group, []), entry.offset)
            self.offsets.delivered(entry.offset, entry.attempts)
            out.append(entry)
            taken += 1

    def _blocked(self, entry: Entry) -> bool:
        """Key mode: park ``entry`` if an earlier record of its key is out or delayed."""
        blocking = self._blocking_of.get(entry.group)
        if entry.group is None or not blocking or blocking[0] > entry.offset:
            return False
        entry.state = PARKED
        bisect.insort(self._parked.setdefault(entry.group, []), (entry.offset, entry),
                      key=lambda item: item[0])
        return True

    def next_event(self) -> float | None:
        """When the next lease ends or delay is over (None: nothing pending)."""
        leases = self._leases
        while leases and not self._current(leases[0]):
            heapq.heappop(leases)
        times = [leases[0][0]] if leases else []
        if self._delayed:
            times.append(self._delayed[0][0])
        return min(times) if times else None

    @property
    def has_ready(self) -> bool:
        return bool(self.fresh or self._returned)

    # -- settling -----------------------------------------------------------------------------

    def held_entry(self, offset: int, attempt: int, now: float) -> Entry | None:
        """The held record of this delivery, or None: stale (settled, given back, delivered
        again, or its lease ended -- then it is ready again now)."""
        entry = self.entries.get(offset)
        if entry is None or entry.state != HELD or entry.attempts != attempt:
            return None
        if entry.deadline <= now:
            self.due(now)
            return None
        return entry

    def settle(self, entry: Entry) -> None:
        """Acked: done for good."""
        del self.entries[entry.offset]
        self.held -= 1
        self._unblock(entry)
        self.offsets.settle(entry.offset)
        if len(self._leases) > 2 * self.held + LEASE_SLACK:
            self._compact_leases()

    def _current(self, lease: tuple[float, int, int]) -> bool:
        """Whether ``lease`` is the one of a record held now."""
        deadline, offset, attempt = lease
        entry = self.entries.get(offset)
        return (entry is not None and entry.state == HELD and entry.attempts == attempt
                and entry.deadline == deadline)

    def _compact_leases(self) -> None:
        self._leases = [lease for lease in self._leases if self._current(lease)]
        heapq.heapify(self._leases)

    def give_back(self, entry: Entry, now: float, delay: float) -> None:
        """Nacked: ready again now, or after ``delay`` seconds."""
        self.held -= 1
        if len(self._leases) > 2 * self.held + LEASE_SLACK:
            self._compact_leases()
        if delay <= 0:
            self._unblock(entry)
            self._ready_again(entry)
            return
        entry.state = DELAYED  # it still holds back its key (key mode)
        heapq.heappush(self._delayed, (now + delay, entry.offset, entry))

    def extend(self, entry: Entry, now: float, seconds: float) -> None:
        entry.deadline = now + seconds
        heapq.heappush(self._leases, (entry.deadline, entry.offset, entry.attempts))
        if len(self._leases) > 2 * self.held + LEASE_SLACK:
            self._compact_leases()

    def oldest(self) -> Entry | None:
        """The unsettled record at the mark, if fetched."""
        return self.entries.get(self.offsets.mark)


__all__ = ["KEY", "NONE", "ORDERINGS", "PARTITION", "Entry", "PartitionQueue"]
