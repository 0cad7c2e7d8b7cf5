"""Tools for a dead-letter queue: list, show, replay and purge dead-lettered messages.

A dead-letter queue is a subscription on the dead-letter topic (``DeadLetterPolicy.topic``):
on Pub/Sub and the memory broker a topic without a subscription keeps nothing, so create one
(``adapter.ensure_subscription(dlq_topic, "orders-dlq-ops")``) before anything is dead-lettered.
Every tool works through the adapter's consumer and publisher calls, so it works the same on
every adapter:

* :meth:`DeadLetterQueue.peek` and :meth:`~DeadLetterQueue.show` receive the messages, hold
  them while reading, and give them back (``nack``) unchanged;
* :meth:`~DeadLetterQueue.replay` publishes each one to the topic of the subscription it came
  from (``original-subscription``), with the publisher's attributes restored and the original
  idempotency key kept and a ``replayed-from`` attribute naming the dead-letter copy, and acks
  the copy only after that publish succeeded;
* :meth:`~DeadLetterQueue.purge` acks them.

A replayed message is a new message with a fresh delivery count; when it was dead-lettered the
Subscriber cleared its failure count in the dedup store, so its handler gets every attempt
again. Nothing else may consume the dead-letter subscription while a tool runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field
from datetime import datetime, timezone

from ._checks import check_methods
from ._text import describe_error
from .errors import ConfigurationError, ReliableSubError
from .message import Delivery
from .middleware.dead_letter import (
    DEAD_LETTER_ATTRIBUTES,
    PUBLISHER_ATTRIBUTE_PREFIX,
    named_like_ours,
)
from .policy import check_seconds
from .ports import Adapter, Outgoing

# Seconds an empty receive waits before a tool concludes the queue has nothing more.
DEFAULT_WAIT = 2.0
BATCH = 500  # messages per receive call
# Receives in a row that bring nothing new before a scan ends. One is not enough: a message given
# back a moment ago (Redis parks it, to be reclaimed on the receiver's next reclaim pass) may
# not be in the first; each receive waits ``wait`` seconds, and the reclaim passes come at most
# a second apart.
QUIET_RECEIVES = 2
# A replayed message names the dead-letter copy it replays: a broker that drops a republished
# idempotency key as a producer's retry (JetStream's Nats-Msg-Id) tells a replay from a retry.
REPLAYED_FROM_ATTRIBUTE = "replayed-from"


class UnknownDeadLetterError(ReliableSubError, LookupError):
    """No message with that id is in the dead-letter queue."""


@dataclass(frozen=True)
class DeadLetter:
    """One dead-lettered message, as the Subscriber recorded it.

    Attributes:
        id: the dead-letter copy's message id (what ``show``, ``replay`` and ``purge`` take).
        data: the payload, unchanged.
        attributes: the publisher's attributes, restored (the ones named like ours back under
            their own names).
        original_message_id, original_subscription: where it was dead-lettered from.
        delivery_attempts, handler_failures: the broker's count and the failed handler runs.
        error_type, error_message: the last error (the message cut to 1000 bytes).
        published: when the copy was published.
        reason: why it was dead-lettered: ``max-delivery-attempts``, ``rejected`` (``Reject``
            or a non-retryable error), ``unreadable``, ``running-too-long`` (empty for copies
            written before the reason was recorded).
    """

    id: str
    data: bytes
    attributes: dict[str, str]
    original_message_id: str
    original_subscription: str
    delivery_attempts: int
    handler_failures: int
    error_type: str
    error_message: str
    published: datetime | None
    reason: str = ""

    @property
    def idempotency_key(self) -> str:
        """The key the original was deduplicated under (its ``idempotency-key`` attribute, or
        its message id): a replay keeps it."""
        return self.attributes.get("idempotency-key") or self.original_message_id

    @classmethod
    def of(cls, delivery: Delivery) -> DeadLetter:
        message = delivery.message
        ours = message.attributes
        return cls(
            id=message.id,
            data=message.data,
            attributes=publisher_attributes(ours),
            original_message_id=ours.get("original-message-id", ""),
            original_subscription=ours.get("original-subscription", ""),
            delivery_attempts=_number(ours.get("delivery-attempts")),
            handler_failures=_number(ours.get("handler-failures")),
            error_type=ours.get("error-type", ""),
            error_message=ours.get("error-message", ""),
            published=message.publish_time,
            reason=ours.get("dead-letter-reason", ""),
        )


@dataclass
class ReplayReport:
    """What a replay did: ids of the copies replayed, of those whose publish failed (they stay
    in the queue) with the error, and of those asked for that the queue does not hold."""

    replayed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)


@dataclass
class PurgeReport:
    """What a purge did: how many copies it acked, and the ids asked for that the queue does
    not hold."""

    purged: int = 0
    missing: list[str] = field(default_factory=list)


Progress = Callable[[int], None]  # called with the number of messages just handled


class DeadLetterQueue:
    """The dead-letter queue behind ``subscription`` (a subscription on the dead-letter topic).

    Args:
        adapter: the broker's adapter.
        subscription: the dead-letter subscription.
        wait: seconds an empty receive waits before the queue counts as drained.
    """

    def __init__(self, adapter: Adapter, subscription: str, *, wait: float = DEFAULT_WAIT) -> None:
        check_methods("DeadLetterQueue(adapter)", adapter,
                      ("receive", "ack", "nack", "publish", "subscription_topic"),
                      "a broker adapter", "pass the adapter the Subscriber uses")
        if not isinstance(subscription, str) or not subscription:
            raise ConfigurationError(
                f"DeadLetterQueue(subscription) must be the name of a subscription on the "
                f"dead-letter topic (a non-empty str), got {subscription!r}"
            )
        self.adapter = adapter
        self.subscription = subscription
        self.wait = check_seconds("DeadLetterQueue", "wait", wait)

    async def peek(self, limit: int = 100) -> list[DeadLetter]:
        """Up to ``limit`` dead letters, oldest first; they stay in the queue."""
        held = await self._take(limit)
        try:
            return sorted((DeadLetter.of(d) for d in held.values()),
                          key=lambda letter: (letter.published is None, letter.published))
        finally:
            await self._give_back(held.values())

    async def show(self, message_id: str) -> DeadLetter:
        """The dead letter whose copy has ``message_id``; it stays in the queue."""
        held = await self._take(None, stop_at=message_id)
        try:
            if message_id not in held:
                raise UnknownDeadLetterError(
                    f"no message {message_id!r} in the dead-letter queue {self.subscription!r}")
            return DeadLetter.of(held[message_id])
        finally:
            await self._give_back(held.values())

    async def replay(
        self,
        ids: Collection[str] | None = None,
        *,
        to_topic: str | None = None,
        on_progress: Progress | None = None,
    ) -> ReplayReport:
        """Publish dead letters (those with ``ids``, or all dead-lettered before the call) back
        to their original topic (or ``to_topic``), then ack each copy whose publish succeeded.

        The topic's every subscription gets the message again: those with a dedup store that
        still holds its record skip it; pass ``to_topic`` to reach one consumer only."""
        report = ReplayReport()
        topics: dict[str, str] = {}
        others: dict[str, Delivery] = {}
        replayed: set[str] = set()
        try:
            async for batch in self._batches(others, ids, report.missing):
                # a copy replayed before whose ack came too late is back: ack it, once more
                done = [d for d in batch if d.message.id in replayed]
                sendable: list[Delivery] = []
                outgoing: list[Outgoing] = []
                for delivery in batch:
                    if delivery.message.id in replayed:
                        continue
                    try:
                        outgoing.append(
                            await self._outgoing(DeadLetter.of(delivery), to_topic, topics))
                        sendable.append(delivery)
                    except ReliableSubError as error:  # no original subscription, or gone
                        report.failed[delivery.message.id] = describe_error(error)
                        others[delivery.message.id] = delivery
                results = await self._publish(outgoing) if outgoing else []
                for delivery, result in zip(sendable, results, strict=True):
                    if isinstance(result, Exception):
                        report.failed[delivery.message.id] = f"{type(result).__name__}: {result}"
                        others[delivery.message.id] = delivery
                    else:
                        replayed.add(delivery.message.id)
                        report.replayed.append(delivery.message.id)
                        done.append(delivery)
                await self.adapter.ack(done)
                if on_progress is not None:
                    on_progress(len(sendable))
        finally:
            await self._give_back(others.values())
        return report

    async def purge(
        self, ids: Collection[str] | None = None, *, on_progress: Progress | None = None
    ) -> PurgeReport:
        """Ack dead letters (those with ``ids``, or all dead-lettered before the call)."""
        report = PurgeReport()
        others: dict[str, Delivery] = {}
        purged: set[str] = set()
        try:
            async for batch in self._batches(others, ids, report.missing):
                await self.adapter.ack(batch)  # a copy seen before is acked once more
                new = {d.message.id for d in batch} - purged
                purged |= new
                report.purged = len(purged)
                if on_progress is not None:
                    on_progress(len(new))
        finally:
            await self._give_back(others.values())
        return report

    # -- internals ---------------------------------------------------------------------------

    async def _receive(self, count: int) -> list[Delivery]:
        return await self.adapter.receive(self.subscription, count, self.wait)

    async def _take(self, limit: int | None, stop_at: str | None = None) -> dict[str, Delivery]:
        """Receive and hold messages by id (a redelivery of one held replaces it), until
        ``QUIET_RECEIVES`` receives in a row bring nothing new (only redeliveries of held ones,
        whose deadline passed while the scan went on): the queue has been seen whole."""
        held: dict[str, Delivery] = {}
        quiet = 0
        while (limit is None or len(held) < limit) and quiet < QUIET_RECEIVES:
            want = BATCH if limit is None else min(BATCH, limit - len(held))
            batch = await self._receive(want)
            new = [delivery for delivery in batch if delivery.message.id not in held]
            held.update((delivery.message.id, delivery) for delivery in batch)
            quiet = 0 if new else quiet + 1
            if stop_at is not None and stop_at in held:
                break
        return held

    async def _batches(
        self, others: dict[str, Delivery], ids: Collection[str] | None, missing: list[str]
    ) -> AsyncIterator[list[Delivery]]:
        """Batches of the wanted deliveries (all, or those with ``ids``: the ones never seen
        go to ``missing``); the rest are held in ``others`` until the end."""
        wanted = None if ids is None else set(ids)
        # Without ids, only what was dead-lettered before the run began: not the copies of
        # replayed messages that fail again (a replay would go round), nor ones nobody has
        # looked at yet. Publish times are the broker's; a clock skew leaves copies in the queue.
        cutoff = datetime.now(timezone.utc) if wanted is None else None
        seen: set[str] = set()
        quiet = 0
        while (wanted is None or not wanted <= seen) and quiet < QUIET_RECEIVES:
            batch = await self._receive(BATCH)
            anything_new = any(d.message.id not in seen and d.message.id not in others
                               for d in batch)
            picked = []
            for delivery in batch:
                message_id = delivery.message.id
                published = delivery.message.publish_time
                if cutoff is not None and published is not None and published > cutoff:
                    others[message_id] = delivery
                elif wanted is None or message_id in wanted:
                    seen.add(message_id)  # seen before: its ack came too late; again
                    picked.append(delivery)
                else:
                    others[message_id] = delivery
            if picked:
                yield picked
            quiet = 0 if anything_new else quiet + 1
        if wanted is not None:
            missing.extend(sorted(wanted - seen))

    async def _outgoing(
        self, letter: DeadLetter, to_topic: str | None, topics: dict[str, str]
    ) -> Outgoing:
        topic = to_topic
        if topic is None:
            source = letter.original_subscription
            if not source:
                raise UnknownDeadLetterError(
                    f"dead letter {letter.id!r} names no original-subscription: pass to_topic")
            if source not in topics:
                topics[source] = await self.adapter.subscription_topic(source)
            topic = topics[source]
        attributes = dict(letter.attributes)
        attributes.setdefault("idempotency-key", letter.idempotency_key)
        attributes[REPLAYED_FROM_ATTRIBUTE] = letter.id
        return Outgoing(topic, letter.data, attributes)

    async def _publish(self, outgoing: list[Outgoing]) -> list[str | Exception]:
        publish_many = getattr(self.adapter, "publish_many", None)
        if publish_many is not None:
            results: list[str | Exception] = await publish_many(outgoing)
            return results
        gathered = await asyncio.gather(
            *(self.adapter.publish(o.topic, o.data, o.attributes, o.ordering_key)
              for o in outgoing), return_exceptions=True)
        return [result if isinstance(result, str | Exception) else Exception(repr(result))
                for result in gathered]

    async def _give_back(self, deliveries: Collection[Delivery]) -> None:
        if deliveries:
            await self.adapter.nack(list(deliveries), 0.0)


def publisher_attributes(attributes: dict[str, str]) -> dict[str, str]:
    """A dead-letter copy's attributes as its publisher set them: ours dropped, and the
    publisher's that were renamed (``publisher-<name>``, one prefix added to each attribute
    named like ours behind any number of prefixes) back under their own names."""
    restored: dict[str, str] = {}
    for name, value in attributes.items():
        if name in DEAD_LETTER_ATTRIBUTES:
            continue
        if name.startswith(PUBLISHER_ATTRIBUTE_PREFIX) and named_like_ours(name):
            name = name[len(PUBLISHER_ATTRIBUTE_PREFIX):]
        restored[name] = value
    return restored


def _number(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0


__all__ = ["DeadLetter", "DeadLetterQueue", "PurgeReport", "ReplayReport",
           "UnknownDeadLetterError", "publisher_attributes"]
