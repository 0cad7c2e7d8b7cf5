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

from reliable_sub.adapters._memory_queue import Entry, Queue
from reliable_sub.clock import Clock, SystemClock, sleep_or_event
from reliable_sub.errors import (
    ConfigurationError,
    SnapshotExistsError,
    UnknownSnapshotError,
    UnknownSubscriptionError,
    UnknownTopicError,
    UnroutableError,
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
class _Snapshot:
    """A subscription's unacked messages when the snapshot was taken, the last message id
    published by then, and the messages published later and acked since (as on Pub/Sub, the
    snapshot keeps them whether or not the subscription retains acked messages): all of them
    are unacked after a seek to it."""

    info: Snapshot
    unacked: list[Entry]
    last_message_id: int
    acked_since: list[Entry] = field(default_factory=list)


class MemoryAdapter(InstrumentedPublishing):
    """An in-process, thread-safe broker with ack deadlines, redelivery, fan-out and ordering.

    Args:
        clock: the time source for deadlines and delays (default: the system clock).
    """

    def __init__(self, *, clock: Clock | None = None) -> None:
        self._clock: Clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._topics: dict[str, list[Queue]] = {}
        self._subscriptions: dict[str, Queue] = {}
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

    async def topic_subscriptions(self, topic: str) -> list[str] | None:
        """The names of ``topic``'s subscriptions."""
        with self._lock:
            return [sub.name for sub in self._topics.get(topic, [])]

    def dedup_namespace(self, subscription: str) -> str:
        """``memory:<this broker instance>:<subscription>``: message ids restart at 1 in
        every MemoryAdapter, so two brokers sharing one dedup store must not share keys."""
        return f"memory:{self.instance}:{subscription}"

    def ensure_subscription_sync(
        self,
        topic: str,
        subscription: str,
        *,
        ack_deadline: float | None = None,
        retain_acked_messages: bool = False,
        message_retention: float = DEFAULT_MESSAGE_RETENTION,
        ordering: bool = False,
        **options: Any,
    ) -> None:
        """Create ``topic`` and ``subscription`` (idempotent).

        Args:
            ack_deadline: seconds a fresh delivery may stay unacked before redelivery (> 0;
                default 10 for a new subscription, an existing one keeps its own: another one
                asked for is warned about).
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
        asked = ack_deadline
        ack_deadline = DEFAULT_ACK_DEADLINE if ack_deadline is None else ack_deadline
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
                existing.check_again(topic, asked)
                return
            state = Queue(
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
        ordering_key: str | None, routed: bool = False,
    ) -> str:
        payload, attrs = checked_message(data, attributes)
        with self._lock:
            subscriptions = self._topics.get(topic)
            if subscriptions is None:
                raise UnknownTopicError(
                    f"topic {topic!r} does not exist; create it with ensure_subscription or "
                    f"ensure_topic (known topics: {sorted(self._topics)})"
                )
            if routed and not subscriptions:
                raise UnroutableError(
                    f"topic {topic!r} has no subscription: the message would be dropped; "
                    f"create one with ensure_subscription({topic!r}, ...)")
            self._last_message_id = next(self._message_ids)
            message_id = str(self._last_message_id)
            published = datetime.fromtimestamp(self._clock.wall(), tz=timezone.utc)
            for sub in subscriptions:
                entry = Entry(message_id, payload, dict(attrs), published, ordering_key or None)
                sub.enqueue(entry)
        return message_id

    async def publish(
        self,
        topic: str,
        data: Payload,
        attributes: dict[str, str] | None = None,
        ordering_key: str | None = None,
    ) -> str:
        return self.publish_sync(topic, data, attributes, ordering_key)

    async def publish_routed(self, topic: str, data: bytes,
                             attributes: dict[str, str] | None = None) -> str:
        """Publish as :meth:`publish` does; ``UnroutableError`` (nothing kept) when ``topic``
        has no subscription."""
        with self._publishing.send(topic, attributes) as attributes:
            return self._publish(topic, data, attributes, None, routed=True)

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
                batch = sub.take(max_messages, now, self._ack_ids, self._sequence)
                if batch or self._closings != closings or now >= give_up_at:
                    return batch
                wake_at = min(give_up_at, sub.next_due())
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
                    sub.prune_acked(now)
                for taken in self._snapshots.values():
                    if (taken.info.subscription == sub.name
                            and int(lease.entry.id) > taken.last_message_id):
                        taken.acked_since.append(lease.entry)
                sub.release_key(lease.entry)
                sub.compact_lease_heap(self._sequence)
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
                    sub.notify()
                else:
                    heapq.heappush(sub.delayed, (available_at, next(self._sequence), lease.entry))
                    sub.notify()  # a waiting receiver must learn of the new due time
                sub.compact_lease_heap(self._sequence)

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
                sub.notify()
                sub.compact_lease_heap(self._sequence)
        return refused

    async def close(self) -> None:
        """Wake waiting receivers (they return empty); messages stay, the broker stays usable."""
        self.close_sync()

    def close_sync(self) -> None:
        with self._lock:
            self._closings += 1
            for sub in self._subscriptions.values():
                sub.notify()

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
            sub.prune_acked(now)
            retained = {entry.id: at for at, entry in sub.acked}
            known = {entry.id: entry for _, entry in sub.acked}
            known.update((entry.id, entry) for entry in sub.unacked())
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
            sub.clear()
            if sub.retain_acked_messages:
                stays_acked = [(retained.get(id_, now), entry) for id_, entry in known.items()
                               if id_ not in again]
                sub.acked = deque(sorted(stays_acked, key=lambda pair: (pair[0], int(pair[1].id))))
            for id_ in sorted(again, key=int):
                sub.enqueue(known[id_])

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
            self._snapshots[name] = _Snapshot(info, sub.unacked(), self._last_message_id)
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
            return self._subscription(subscription).backlog()

    async def subscription_stats(self, subscription: str) -> SubscriptionStats:
        """Backlog, leased messages, the oldest unacked one's age and the ack deadline."""
        with self._lock:
            sub = self._subscription(subscription)
            unacked = sub.unacked()
            oldest = min((entry.publish_time for entry in unacked), default=None)
            age = None if oldest is None else max(0.0, self._clock.wall() - oldest.timestamp())
            return SubscriptionStats(len(unacked), len(sub.leased), age, sub.ack_deadline)

    def retained(self, subscription: str) -> list[Message]:
        """Acked messages still retained by ``subscription`` (retain_acked_messages=True)."""
        with self._lock:
            sub = self._subscription(subscription)
            sub.prune_acked(self._clock.now())
            return [sub.message(entry) for _, entry in sub.acked]

    # -- internals (call with the lock held) ------------------------------------------------

    def _subscription(self, name: str) -> Queue:
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


__all__ = ["CAPABILITIES", "MemoryAdapter"]
