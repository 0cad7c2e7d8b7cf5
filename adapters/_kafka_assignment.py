"""What one Kafka consumer owns, shared by its poll thread and the event loop.

An :class:`Assignment` holds the queues of the partitions assigned (:mod:`._kafka_records`), by
partition and by assignment generation (the first part of every ack id), under one lock. The
event loop's side is here: ``take`` hands records out fairly across partitions, ``settle`` acks,
gives back or extends deliveries still held (any other is stale), ``changed`` waits for the
poll thread to bring something, ``figures`` reads the state for the subscription's figures. The
poll thread (:mod:`._kafka_consumer`) fills the queues and commits what they settled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from reliable_sub.adapters._kafka_offsets import DEFAULT_METADATA_LIMIT, Run
from reliable_sub.adapters._kafka_records import HELD, Entry, PartitionQueue
from reliable_sub.adapters._kafka_transactions import Output
from reliable_sub.message import Delivery


@dataclass(frozen=True)
class ConsumerOptions:
    """How one subscription is consumed (the adapter's options and the recorded settings)."""

    topic: str
    subscription: str
    ack_deadline: float
    ordering: str
    config: dict[str, Any]
    revoke_timeout: float = 10.0
    buffer: int = 1000
    commit_interval: float = 0.1
    metadata_limit: int = DEFAULT_METADATA_LIMIT
    eager: bool = False
    transactions: dict[str, Any] | None = None  # the transactional producer's configuration


@dataclass
class PartitionFigures:
    """One owned partition's state, for the subscription's figures."""

    mark: int
    runs: list[tuple[int, int]]
    held: int
    oldest: Any = None  # the client's message at the mark, if fetched


# A seek's targets: per partition, the offset to move to and what is settled above it.
Targets = dict[int, tuple[int, list[Run]]]


@dataclass
class SeekRequest:
    """A seek for the poll thread: it resolves ``done`` with the partitions it moved."""

    targets: Targets
    done: concurrent.futures.Future[list[int]] = field(default_factory=concurrent.futures.Future)


@dataclass
class _Waiters:
    version: int = 0
    futures: list[asyncio.Future[None]] = field(default_factory=list)


class Assignment:
    """The partitions one consumer owns, their records and the receives waiting on them (see
    the module's docstring); :class:`~._kafka_consumer.SubscriptionConsumer` adds the thread."""

    def __init__(self, options: ConsumerOptions, loop: asyncio.AbstractEventLoop) -> None:
        self.options = options
        self._loop = loop
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._queues: dict[int, PartitionQueue] = {}
        self._generation: dict[int, PartitionQueue] = {}
        self._paused: set[int] = set()
        self._waiters = _Waiters()
        self._asking = 0
        self._last_ask = time.monotonic()
        self._next_commit = 0.0
        self._metadata_limit = options.metadata_limit
        self._turn = 0
        self.joined = False  # assigned, and the new partitions' first fetches answered
        self._priming_until = 0.0
        self.stopping = False
        self.finished = False
        self.failure: Exception | None = None
        self._seeks: list[SeekRequest] = []
        # transactions: the outputs of deliveries out, by (generation, offset, attempt), with
        # their partition; those of acked ones, for the next transaction
        self._outputs: dict[tuple[int, int, int], tuple[int, list[Output]]] = {}
        self._batch: list[tuple[int, Output]] = []

    def hold_output(self, partition: int, offset: int, attempt: int, output: Output) -> bool:
        """Keep ``output`` with the delivery ``attempt`` of ``offset`` while it is held here;
        False if it is not (held by no one, or by another consumer)."""
        with self._lock:
            queue = self._queues.get(partition)
            if queue is None or queue.held_entry(offset, attempt, time.monotonic()) is None:
                return False
            key = (queue.generation, offset, attempt)
            self._outputs.setdefault(key, (partition, []))[1].append(output)
            return True

    def acked(self, queue: PartitionQueue, entry: Entry) -> None:
        """Under the lock: ``entry`` is done; its outputs, if any, join the batch."""
        queue.settle(entry)
        if self._outputs:
            held = self._outputs.pop((queue.generation, entry.offset, entry.attempts), None)
            if held is not None:
                self._batch.extend((held[0], output) for output in held[1])

    def given_back(self, queue: PartitionQueue, entry: Entry, delay: float) -> None:
        """Under the lock: ``entry`` goes back (now or after ``delay``); its outputs are
        dropped."""
        if self._outputs:
            self._outputs.pop((queue.generation, entry.offset, entry.attempts), None)
        queue.give_back(entry, time.monotonic(), delay)

    def _prune_outputs(self) -> None:
        """Under the lock: drop the outputs of deliveries no longer held (leases over,
        partitions gone)."""
        for key in list(self._outputs):
            generation, offset, attempt = key
            queue = self._generation.get(generation)
            entry = None if queue is None else queue.entries.get(offset)
            if entry is None or entry.state != HELD or entry.attempts != attempt:
                del self._outputs[key]

    def seek(self, targets: Targets) -> concurrent.futures.Future[list[int]]:
        """Ask the poll thread to move the partitions of ``targets`` this consumer owns
        (their deliveries out become stale) and commit them there; the future gives the
        partitions moved."""
        request = SeekRequest(targets)
        with self._lock:
            if self.finished:
                request.done.set_exception(ConnectionError(
                    f"the consumer of {self.options.subscription!r} ended before the seek"))
            else:
                self._seeks.append(request)
        return request.done

    def owned(self) -> set[int]:
        """The partitions assigned to this consumer now."""
        with self._lock:
            return set(self._queues)

    # -- the event loop's side ---------------------------------------------------------------

    def take(self, count: int) -> tuple[list[tuple[PartitionQueue, Entry]], int]:
        """Up to ``count`` records handed out now, fairly across partitions, and the change
        count to wait on when there were none."""
        now = time.monotonic()
        taken: list[tuple[PartitionQueue, Entry]] = []
        with self._lock:
            self._last_ask = now
            queues = list(self._queues.values())
            for queue in queues:
                queue.due(now)
            if queues:
                self._turn = (self._turn + 1) % len(queues)
                queues = queues[self._turn:] + queues[:self._turn]
            while len(taken) < count:
                ready = [queue for queue in queues if queue.has_ready]
                if not ready:
                    break
                share = max(1, (count - len(taken)) // len(ready))
                before = len(taken)
                for queue in ready:
                    out: list[Entry] = []
                    queue.take(min(share, count - len(taken)), now, self.options.ack_deadline,
                               out)
                    taken += [(queue, entry) for entry in out]
                if len(taken) == before:
                    break
            return taken, self._waiters.version

    def next_event(self) -> float | None:
        """When a lease ends or a delay is over next (``time.monotonic``)."""
        with self._lock:
            times = [t for q in self._queues.values() if (t := q.next_event()) is not None]
        return min(times) if times else None

    async def changed(self, version: int, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for records, an assignment or an end, unless one came
        since ``version``."""
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._waiters.version != version or self.finished:
                return
            self._waiters.futures.append(future)
            self._asking += 1
        try:
            await asyncio.wait_for(future, max(0.0, timeout))
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                if future in self._waiters.futures:
                    self._waiters.futures.remove(future)
                self._asking -= 1
                self._last_ask = time.monotonic()

    @property
    def version(self) -> int:
        with self._lock:
            return self._waiters.version

    def _wake(self) -> None:
        """Under the lock: wake every receive waiting (from any thread)."""
        self._waiters.version += 1
        futures, self._waiters.futures = self._waiters.futures, []
        for future in futures:
            with contextlib.suppress(RuntimeError):  # its loop closed
                future.get_loop().call_soon_threadsafe(_resolve, future)

    def settle(self, deliveries: Sequence[Delivery], action: Callable[[PartitionQueue, Entry],
                                                                      None]) -> list[Delivery]:
        """``action`` for each delivery still held by this consumer; returns the stale ones."""
        now = time.monotonic()
        stale: list[Delivery] = []
        with self._lock:
            for delivery in deliveries:
                found = self._held(delivery.ack_id, now)
                if found is None:
                    stale.append(delivery)
                else:
                    action(*found)
            self._settled.notify_all()
            self._wake()
        return stale

    def _held(self, ack_id: str, now: float) -> tuple[PartitionQueue, Entry] | None:
        try:
            generation, offset, attempt = map(int, ack_id.split("."))
        except ValueError:
            return None
        queue = self._generation.get(generation)  # revoking ones too: their acks are awaited
        return None if queue is None else self._entry(queue, offset, attempt, now)

    @staticmethod
    def _entry(queue: PartitionQueue, offset: int, attempt: int, now: float
               ) -> tuple[PartitionQueue, Entry] | None:
        entry = queue.held_entry(offset, attempt, now)
        return None if entry is None else (queue, entry)

    def figures(self) -> dict[int, PartitionFigures]:
        """Each owned partition's state now."""
        now = time.monotonic()
        with self._lock:
            found = {}
            for partition, queue in self._queues.items():
                queue.due(now)
                oldest = queue.oldest()
                found[partition] = PartitionFigures(queue.offsets.mark, queue.offsets.runs(),
                                                    queue.held,
                                                    None if oldest is None else oldest.record)
            return found


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


__all__ = ["Assignment", "ConsumerOptions", "PartitionFigures", "SeekRequest", "Targets"]
