"""An in-process broker: the reference implementation of the Adapter contract.

Not a mock. It behaves the way Pub/Sub does as a consumer observes it: topics fan out to
subscriptions; each delivery has an ack deadline; a delivery whose deadline passes unacked comes
back with ``delivery_attempt + 1``; ``nack(delay)`` brings it back after the delay; ordering keys
deliver one message per key at a time, in publish order. Time comes from an injectable clock, so
tests move a ten-second deadline with ``ManualClock.advance``.

Thread-safe: one lock guards all state, and no await happens while it is held. ``publish_sync``
and ``ensure_subscription_sync`` may be called from any thread while Subscribers on other threads
or loops receive; waiting receivers are woken on their own loop.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from reliable_sub.clock import Clock, SystemClock, sleep_or_event
from reliable_sub.errors import (
    ConfigurationError,
    SnapshotExistsError,
    UnknownSnapshotError,
    UnknownSubscriptionError,
    UnknownTopicError,
)
from reliable_sub.message import Delivery, Message
from reliable_sub.ports import (
    Capabilities,
    Payload,
    Snapshot,
    SubscriptionStats,
    checked_message,
)
from reliable_sub.replay import check_target
from reliable_sub.telemetry.publishing import InstrumentedPublishing

DEFAULT_ACK_DEADLINE = 10.0
# Stale lease-heap entries tolerated beyond twice the live leases before the heap is rebuilt.
LEASE_HEAP_SLACK = 1024
# How long acked messages are kept when a subscription asks for it (retain_acked_messages=True);
# seven days, Pub/Sub's default. Unacked messages are kept until acked, however long that takes.
DEFAULT_MESSAGE_RETENTION = 7 * 24 * 3600.0

CAPABILITIES = Capabilities(
    min_ack_deadline=0.0,
    max_ack_deadline=float("inf"),
    native_dead_letter=False,
    native_retry_backoff=True,
    exactly_once=True,
    seek=True,
    ordering=True,
    delivery_attempt_exact=True,
    cancel_safe_receive=True,
    messaging_system="memory",
)


@dataclass(eq=False)
class _Entry:
    """One message as stored in one subscription."""

    id: str
    data: bytes
    attributes: dict[str, str]
    publish_time: datetime
    ordering_key: str | None
    attempts: int = 0


@dataclass(eq=False)
class _Snapshot:
    """A subscription's unacked messages when the snapshot was taken, the last message id
    published by then, and the messages published later and acked since (as on Pub/Sub, the
    snapshot keeps them whether or not the subscription retains acked messages): all of them
    are unacked after a seek to it."""

    info: Snapshot
    unacked: list[_Entry]
    last_message_id: int
    acked_since: list[_Entry] = field(default_factory=list)


@dataclass(eq=False)
class _Lease:
    entry: _Entry
    deadline: float


@dataclass(eq=False)
class _Subscription:
    name: str
    topic: str
    ack_deadline: float
    retain_acked_messages: bool
    message_retention: float
    ordering: bool
    ready: deque[_Entry] = field(default_factory=deque)
    delayed: list[tuple[float, int, _Entry]] = field(default_factory=list)
    leased: dict[str, _Lease] = field(default_factory=dict)
    lease_heap: list[tuple[float, int, str]] = field(default_factory=list)
    waiting_by_key: dict[str, deque[_Entry]] = field(default_factory=dict)
    busy_keys: set[str] = field(default_factory=set)
    acked: deque[tuple[float, _Entry]] = field(default_factory=deque)
    waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=set)


class MemoryAdapter(InstrumentedPublishing):
    """An in-process, thread-safe broker with ack deadlines, redelivery, fan-out and ordering.

    Args:
        clock: the time source for deadlines and delays (default: the system clock).
    """

    def __init__(self, *, clock: Clock | None = None) -> None:
        self._clock: Clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._topics: dict[str, list[_Subscription]] = {}
        self._subscriptions: dict[str, _Subscription] = {}
        self._message_ids = itertools.count(1)
        self._last_message_id = 0
        self._snapshots: dict[str, _Snapshot] = {}
        self._ack_ids = itertools.count(1)
        self._sequence = itertools.count()
        self._closings = 0  # close() wakes receivers waiting when it was called
        self.instance = uuid.uuid4().hex[:12]

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    @property
    def clock(self) -> Clock:
        """The clock this broker's deadlines run on."""
        return self._clock

    # -- administration -------------------------------------------------------------------

    def ensure_topic_sync(self, topic: str) -> None:
        """Create ``topic`` if it does not exist."""
        with self._lock:
            self._topics.setdefault(topic, [])

    async def ensure_topic(self, topic: str) -> None:
        """Create ``topic`` if it does not exist."""
        self.ensure_topic_sync(topic)

    async def topic_exists(self, topic: str) -> bool:
        with self._lock:
            return topic in self._topics

    def dedup_namespace(self, subscription: str) -> str:
        """``memory:<this broker instance>:<subscription>``: message ids restart at 1 in
        every MemoryAdapter, so two brokers sharing one dedup store must not share keys."""
        return f"memory:{self.instance}:{subscription}"

    def ensure_subscription_sync(
        self,
        topic: str,
        subscription: str,
        *,
        ack_deadline: float = DEFAULT_ACK_DEADLINE,
        retain_acked_messages: bool = False,
        message_retention: float = DEFAULT_MESSAGE_RETENTION,
        ordering: bool = False,
        **options: Any,
    ) -> None:
        """Create ``topic`` and ``subscription`` (idempotent).

        Args:
            ack_deadline: seconds a fresh delivery may stay unacked before redelivery (> 0).
            retain_acked_messages: keep acked messages for ``message_retention`` seconds.
            message_retention: how long retained acked messages are kept (> 0).
            ordering: deliver messages of one ordering key one at a time, in publish order
                (as Pub/Sub's ``enable_message_ordering``); off, ordering keys are ignored.
        """
        if options:
            raise ConfigurationError(
                f"MemoryAdapter.ensure_subscription got unknown options {sorted(options)}; "
                "allowed: ack_deadline, retain_acked_messages, message_retention, ordering"
            )
        if not ack_deadline > 0:
            raise ConfigurationError(
                f"ensure_subscription: ack_deadline must be in (0, inf), got {ack_deadline!r}"
            )
        if not message_retention > 0:
            raise ConfigurationError(
                "ensure_subscription: message_retention must be in (0, inf), "
                f"got {message_retention!r}"
            )
        with self._lock:
            existing = self._subscriptions.get(subscription)
            if existing is not None:
                if existing.topic != topic:
                    raise ConfigurationError(
                        f"subscription {subscription!r} already exists on topic "
                        f"{existing.topic!r}, not {topic!r}"
                    )
                return
            state = _Subscription(
                name=subscription,
                topic=topic,
                ack_deadline=ack_deadline,
                retain_acked_messages=retain_acked_messages,
                message_retention=message_retention,
                ordering=ordering,
            )
            self._subscriptions[subscription] = state
            self._topics.setdefault(topic, []).append(state)

    async def ensure_subscription(self, topic: str, subscription: str, **options: Any) -> None:
        self.ensure_subscription_sync(topic, subscription, **options)

    async def subscription_ack_deadline(self, subscription: str) -> float:
        with self._lock:
            return self._subscription(subscription).ack_deadline

    async def subscription_topic(self, subscription: str) -> str:
        with self._lock:
            return self._subscription(subscription).topic

    # -- publishing ------------------------------------------------------------------------

    def publish_sync(
        self,
        topic: str,
        data: Payload,
        attributes: dict[str, str] | None = None,
        ordering_key: str | None = None,
    ) -> str:
        with self._publishing.send(topic, attributes) as attributes:
            return self._publish(topic, data, attributes, ordering_key)

    def _publish(
        self, topic: str, data: Payload, attributes: dict[str, str] | None,
        ordering_key: str | None,
    ) -> str:
        payload, attrs = checked_message(data, attributes)
        with self._lock:
            subscriptions = self._topics.get(topic)
            if subscriptions is None:
                raise UnknownTopicError(
                    f"topic {topic!r} does not exist; create it with ensure_subscription or "
                    f"ensure_topic (known topics: {sorted(self._topics)})"
                )
            self._last_message_id = next(self._message_ids)
            message_id = str(self._last_message_id)
            published = datetime.fromtimestamp(self._clock.wall(), tz=timezone.utc)
            for sub in subscriptions:
                entry = _Entry(message_id, payload, dict(attrs), published, ordering_key or None)
                self._enqueue(sub, entry)
        return message_id

    async def publish(
        self,
        topic: str,
        data: Payload,
        attributes: dict[str, str] | None = None,
        ordering_key: str | None = None,
    ) -> str:
        return self.publish_sync(topic, data, attributes, ordering_key)

    # -- consuming -------------------------------------------------------------------------

    async def receive(
        self, subscription: str, max_messages: int, timeout: float
    ) -> list[Delivery]:
        if max_messages < 1:
            raise ConfigurationError(f"receive: max_messages must be >= 1, got {max_messages}")
        give_up_at = self._clock.now() + max(0.0, timeout)
        loop = asyncio.get_running_loop()
        closings = self._closings
        while True:
            event = asyncio.Event()
            with self._lock:
                sub = self._subscription(subscription)
                now = self._clock.now()
                batch = self._take(sub, max_messages, now)
                if batch or self._closings != closings or now >= give_up_at:
                    return batch
                wake_at = min(give_up_at, self._next_due(sub))
                waiter = (loop, event)
                sub.waiters.add(waiter)
            try:
                await sleep_or_event(self._clock, event, wake_at - now)
            finally:
                with self._lock:
                    sub.waiters.discard(waiter)

    async def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        refused: list[Delivery] = []
        with self._lock:
            now = self._clock.now()
            for delivery in deliveries:
                sub = self._subscription(delivery.message.subscription)
                lease = sub.leased.pop(delivery.ack_id, None)
                if lease is None:
                    refused.append(delivery)
                    continue
                if sub.retain_acked_messages:
                    sub.acked.append((now, lease.entry))
                    self._prune_acked(sub, now)
                for taken in self._snapshots.values():
                    if (taken.info.subscription == sub.name
                            and int(lease.entry.id) > taken.last_message_id):
                        taken.acked_since.append(lease.entry)
                self._release_key(sub, lease.entry)
                self._compact_lease_heap(sub)
        return refused

    async def nack(self, deliveries: Sequence[Delivery], delay: float = 0.0) -> None:
        with self._lock:
            available_at = self._clock.now() + max(0.0, delay)
            for delivery in deliveries:
                sub = self._subscription(delivery.message.subscription)
                lease = sub.leased.pop(delivery.ack_id, None)
                if lease is None:
                    continue
                if delay <= 0:
                    sub.ready.appendleft(lease.entry)
                    self._notify(sub)
                else:
                    heapq.heappush(sub.delayed, (available_at, next(self._sequence), lease.entry))
                    self._notify(sub)  # a waiting receiver must learn of the new due time
                self._compact_lease_heap(sub)

    async def extend(self, deliveries: Sequence[Delivery], seconds: float) -> list[Delivery]:
        refused: list[Delivery] = []
        with self._lock:
            deadline = self._clock.now() + max(0.0, seconds)
            for delivery in deliveries:
                sub = self._subscription(delivery.message.subscription)
                lease = sub.leased.get(delivery.ack_id)
                if lease is None:
                    refused.append(delivery)
                    continue
                lease.deadline = deadline
                heapq.heappush(sub.lease_heap, (deadline, next(self._sequence), delivery.ack_id))
                self._notify(sub)
                self._compact_lease_heap(sub)
        return refused

    async def close(self) -> None:
        """Wake waiting receivers (they return empty); messages stay, the broker stays usable."""
        self.close_sync()

    def close_sync(self) -> None:
        with self._lock:
            self._closings += 1
            for sub in self._subscriptions.values():
                self._notify(sub)

    # -- seek and snapshots (the Seekable capability) ------------------------------------------

    async def seek(
        self, subscription: str, *, to: datetime | None = None, snapshot: str | None = None
    ) -> None:
        """Seek ``subscription`` to a time or a snapshot (see :class:`~reliable_sub.ports.
        Seekable`). Acked messages come back only if the subscription retains them
        (``retain_acked_messages=True``); deliveries in flight become stale."""
        check_target(to, snapshot)
        with self._lock:
            sub = self._subscription(subscription)
            now = self._clock.now()
            self._prune_acked(sub, now)
            retained = {entry.id: at for at, entry in sub.acked}
            known = {entry.id: entry for _, entry in sub.acked}
            known.update((entry.id, entry) for entry in self._unacked(sub))
            if to is not None:
                again = {id_ for id_, entry in known.items() if entry.publish_time >= to}
            else:
                taken = self._snapshot(snapshot or "")
                if taken.info.subscription != subscription:
                    raise ConfigurationError(
                        f"snapshot {snapshot!r} was taken of {taken.info.subscription!r}, not "
                        f"{subscription!r}")
                kept = [*taken.unacked, *taken.acked_since]
                known.update((entry.id, entry) for entry in kept)
                again = {id_ for id_ in known if int(id_) > taken.last_message_id}
                again.update(entry.id for entry in kept)
            self._clear(sub)
            if sub.retain_acked_messages:
                stays_acked = [(retained.get(id_, now), entry) for id_, entry in known.items()
                               if id_ not in again]
                sub.acked = deque(sorted(stays_acked, key=lambda pair: (pair[0], int(pair[1].id))))
            for id_ in sorted(again, key=int):
                self._enqueue(sub, known[id_])

    async def create_snapshot(self, subscription: str, name: str) -> Snapshot:
        """Take a snapshot of ``subscription``: its unacked messages now, and everything
        published after."""
        with self._lock:
            sub = self._subscription(subscription)
            if name in self._snapshots:
                raise SnapshotExistsError(f"snapshot {name!r} already exists")
            if not isinstance(name, str) or not name:
                raise ConfigurationError(f"a snapshot needs a non-empty name, got {name!r}")
            created = datetime.fromtimestamp(self._clock.wall(), tz=timezone.utc)
            info = Snapshot(name, subscription, sub.topic, created, None)
            self._snapshots[name] = _Snapshot(info, self._unacked(sub), self._last_message_id)
            return info

    async def delete_snapshot(self, name: str) -> None:
        with self._lock:
            self._snapshot(name)
            del self._snapshots[name]

    async def list_snapshots(self, subscription: str | None = None) -> list[Snapshot]:
        with self._lock:
            return [taken.info for name, taken in sorted(self._snapshots.items())
                    if subscription is None or taken.info.subscription == subscription]

    # -- inspection, for tests and examples ---------------------------------------------------

    def backlog(self, subscription: str) -> int:
        """Messages of ``subscription`` not yet acked (ready, leased, delayed or queued by key)."""
        with self._lock:
            sub = self._subscription(subscription)
            queued = sum(len(q) for q in sub.waiting_by_key.values())
            return len(sub.ready) + len(sub.delayed) + len(sub.leased) + queued

    async def subscription_stats(self, subscription: str) -> SubscriptionStats:
        """Backlog, leased messages, the oldest unacked one's age and the ack deadline."""
        with self._lock:
            sub = self._subscription(subscription)
            unacked = self._unacked(sub)
            oldest = min((entry.publish_time for entry in unacked), default=None)
            age = None if oldest is None else max(0.0, self._clock.wall() - oldest.timestamp())
            return SubscriptionStats(len(unacked), len(sub.leased), age, sub.ack_deadline)

    def retained(self, subscription: str) -> list[Message]:
        """Acked messages still retained by ``subscription`` (retain_acked_messages=True)."""
        with self._lock:
            sub = self._subscription(subscription)
            self._prune_acked(sub, self._clock.now())
            return [self._message(sub, entry) for _, entry in sub.acked]

    # -- internals (call with the lock held) ------------------------------------------------

    def _subscription(self, name: str) -> _Subscription:
        try:
            return self._subscriptions[name]
        except KeyError:
            raise UnknownSubscriptionError(
                f"subscription {name!r} does not exist; known: {sorted(self._subscriptions)}"
            ) from None

    def _snapshot(self, name: str) -> _Snapshot:
        try:
            return self._snapshots[name]
        except KeyError:
            raise UnknownSnapshotError(
                f"snapshot {name!r} does not exist; known: {sorted(self._snapshots)}") from None

    @staticmethod
    def _unacked(sub: _Subscription) -> list[_Entry]:
        """Every message of ``sub`` not yet acked, in publish order."""
        entries = [*sub.ready, *(entry for _, _, entry in sub.delayed),
                   *(lease.entry for lease in sub.leased.values()),
                   *(entry for queue in sub.waiting_by_key.values() for entry in queue)]
        return sorted(entries, key=lambda entry: int(entry.id))

    def _clear(self, sub: _Subscription) -> None:
        """Forget every delivery state of ``sub`` (its leases' ack ids become stale)."""
        sub.ready.clear()
        sub.delayed.clear()
        sub.leased.clear()
        sub.lease_heap.clear()
        sub.waiting_by_key.clear()
        sub.busy_keys.clear()
        sub.acked.clear()
        self._notify(sub)

    def _enqueue(self, sub: _Subscription, entry: _Entry) -> None:
        key = entry.ordering_key
        if key is not None and sub.ordering:
            if key in sub.busy_keys:
                sub.waiting_by_key.setdefault(key, deque()).append(entry)
                return
            sub.busy_keys.add(key)
        sub.ready.append(entry)
        self._notify(sub)

    def _release_key(self, sub: _Subscription, entry: _Entry) -> None:
        """After an ack, let the next message of the same ordering key go."""
        key = entry.ordering_key
        if key is None or not sub.ordering:
            return
        queue = sub.waiting_by_key.get(key)
        if queue:
            sub.ready.append(queue.popleft())
            if not queue:
                del sub.waiting_by_key[key]
            self._notify(sub)
        else:
            sub.busy_keys.discard(key)

    def _compact_lease_heap(self, sub: _Subscription) -> None:
        """Drop the heap entries of leases that ended (acked, nacked) or moved (extended).

        Entries are only popped when their deadline passes; under load, acks and extensions
        leave stale ones much faster, so without this the heap held every delivery of the
        last ack deadline (tens of MB at full speed). Rebuilt when mostly stale: O(1) per
        entry, amortised.
        """
        if len(sub.lease_heap) <= 2 * len(sub.leased) + LEASE_HEAP_SLACK:
            return
        sub.lease_heap = [(lease.deadline, next(self._sequence), ack_id)
                          for ack_id, lease in sub.leased.items()]
        heapq.heapify(sub.lease_heap)

    def _promote(self, sub: _Subscription, now: float) -> None:
        """Move expired leases and elapsed nack delays back to the ready queue."""
        while sub.lease_heap and sub.lease_heap[0][0] <= now:
            deadline, _, ack_id = heapq.heappop(sub.lease_heap)
            lease = sub.leased.get(ack_id)
            if lease is not None and lease.deadline == deadline:
                del sub.leased[ack_id]
                sub.ready.append(lease.entry)
        while sub.delayed and sub.delayed[0][0] <= now:
            sub.ready.append(heapq.heappop(sub.delayed)[2])

    def _take(self, sub: _Subscription, max_messages: int, now: float) -> list[Delivery]:
        self._promote(sub, now)
        batch: list[Delivery] = []
        deadline = now + sub.ack_deadline
        while sub.ready and len(batch) < max_messages:
            entry = sub.ready.popleft()
            entry.attempts += 1
            ack_id = str(next(self._ack_ids))
            sub.leased[ack_id] = _Lease(entry, deadline)
            heapq.heappush(sub.lease_heap, (deadline, next(self._sequence), ack_id))
            batch.append(Delivery(self._message(sub, entry), ack_id, now))
        return batch

    def _message(self, sub: _Subscription, entry: _Entry) -> Message:
        return Message.received(entry.id, entry.data, dict(entry.attributes),
                                max(1, entry.attempts), entry.publish_time, entry.ordering_key,
                                sub.name)

    def _next_due(self, sub: _Subscription) -> float:
        due = float("inf")
        if sub.lease_heap:
            due = sub.lease_heap[0][0]
        if sub.delayed:
            due = min(due, sub.delayed[0][0])
        return due

    def _prune_acked(self, sub: _Subscription, now: float) -> None:
        while sub.acked and sub.acked[0][0] + sub.message_retention <= now:
            sub.acked.popleft()

    def _notify(self, sub: _Subscription) -> None:
        for loop, event in sub.waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)


__all__ = ["CAPABILITIES", "MemoryAdapter"]
