"""What a broker adapter must do, what it offers, and the message checks every adapter's
publish shares (see :mod:`reliable_sub.ports`)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeAlias, runtime_checkable

from .._bodies import json_payload
from ..message import Delivery
from ._dedup import Claimed, Completion, DedupStore


@dataclass(frozen=True)
class Capabilities:
    """What a broker offers; the conformance suite and the core read it, never the adapter's type.

    Attributes:
        min_ack_deadline: shortest ack deadline (seconds) the broker accepts.
        max_ack_deadline: longest ack deadline (seconds) one extension may set.
        native_dead_letter: the broker can dead-letter by itself.
        native_retry_backoff: the broker can delay redelivery by itself.
        exactly_once: the broker can confirm acks (a failed ack means a redelivery will come).
        seek: the broker can replay retained messages.
        ordering: ordering keys are delivered in order.
        delivery_attempt_exact: ``delivery_attempt`` is kept by the broker (not per process).
        refuses_stale_acks: an ack or extend of a stale ack id (redelivered, nacked, taken over)
            is reported back as refused; Pub/Sub does so only on exactly-once subscriptions.
        extension_limited_to_ack_deadline: an extension can only restart the subscription's ack
            deadline, never set a longer one (Redis Streams: idle time can be reset, not put in
            the future); the lease manager then extends by at most the ack deadline.
        cancel_safe_receive: cancelling a ``receive`` call in flight never leaves a message
            taken at the broker (only the in-memory broker can promise it); otherwise a stop
            lets the calls in flight return, and gives back what they bring.
        messaging_system: the broker's ``messaging.system`` in telemetry (the OpenTelemetry
            conventions' value where they have one: ``gcp_pubsub``, ``kafka``...).
        max_lease_duration: the longest a delivery may stay unacked before the broker takes
            it back whatever the consumer says (RabbitMQ's ``consumer_timeout`` closes the
            channel); a Subscriber warns at start when ``LeasePolicy.max_lease_duration`` is
            not under it.
        fan_out: every subscription of a topic gets each message published to it; False on a
            broker where a topic has one subscription (SQS: a queue), which then refuses a
            second one.
        partition_owned: each message of a subscription belongs to one of its consumers at a
            time (Kafka: the owner of its partition), so a delivery given back comes back to
            that consumer, never to a peer, until the broker moves the partition (a rebalance).
            A consumer whose sync worker threads are all hung then holds its partitions' other
            messages until a thread is free; on the other brokers, peers take them.
    """

    min_ack_deadline: float = 0.0
    max_ack_deadline: float = math.inf
    native_dead_letter: bool = False
    native_retry_backoff: bool = False
    exactly_once: bool = False
    seek: bool = False
    ordering: bool = False
    delivery_attempt_exact: bool = True
    refuses_stale_acks: bool = True
    extension_limited_to_ack_deadline: bool = False
    cancel_safe_receive: bool = False
    messaging_system: str = "unknown"
    max_lease_duration: float = math.inf
    fan_out: bool = True
    partition_owned: bool = False

    def clamp_deadline(self, seconds: float) -> float:
        """``seconds`` limited to the broker's accepted range."""
        return min(self.max_ack_deadline, max(self.min_ack_deadline, seconds))


# What ``publish`` takes as a message's data: bytes, or a pydantic model, a dataclass or a JSON
# value, sent as JSON with ``content-type: application/json`` (see checked_message).
Payload: TypeAlias = object
# The attribute that names the payload's format; JSON payloads get this value.
CONTENT_TYPE = "content-type"
JSON_CONTENT_TYPE = "application/json"
# Attributes that describe the layout of a message read from another producer, which the adapter
# writes again when it publishes one: the Redis adapter's (a field beside ``data``; an entry
# without one). See docs/adapters/redis-streams.md. A dead-letter copy keeps them renamed, as it
# keeps the publisher's attributes named like its own, so the copy is written in the adapter's
# own layout (the dead-letter tools read it as any other); a replay restores them, and so the
# original layout.
REDIS_FIELDS_ATTRIBUTE = "redis-fields"  # a JSON array: the attributes that were fields
REDIS_DATA_FIELD_ATTRIBUTE = "redis-data-field"  # the field that held the data
REDIS_ENTRY_ATTRIBUTE = "redis-entry"  # "json": the data is a JSON object of all the fields
LAYOUT_ATTRIBUTES = (REDIS_FIELDS_ATTRIBUTE, REDIS_DATA_FIELD_ATTRIBUTE, REDIS_ENTRY_ATTRIBUTE)


def checked_message(
    data: Payload, attributes: dict[str, str] | None
) -> tuple[bytes, dict[str, str]]:
    """``data`` as bytes and a copy of ``attributes``, or a TypeError naming what is wrong.
    Data that is not bytes (a pydantic model, a dataclass, a dict, list, number or bool) is
    sent as JSON with ``content-type: application/json`` unless the attributes name another. A
    str or None is refused: text or a JSON string, and a bug or an empty body, look alike.

    Every adapter's ``publish`` checks its arguments with this before anything is sent.
    """
    checked = dict(attributes or {})
    for key, value in checked.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"publish: attributes must map str to str, got {key!r}: {value!r}")
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data), checked
    if data is None or isinstance(data, str):
        raise TypeError(
            f"publish: data must be bytes or a JSON value other than a str or None, got "
            f"{type(data).__name__}; pass text as bytes (text.encode()), a document as a "
            "dict, a list or a model"
        )
    payload = json_payload(data, "publish")
    checked.setdefault(CONTENT_TYPE, JSON_CONTENT_TYPE)
    return payload, checked


def _at_most_one_level(raw: str | bytes) -> bool:
    """Whether the JSON text ``raw`` nests no deeper than one object or array. Checked before
    ``json.loads``, which recurses once per level: on a hostile entry nested 100,000 deep it
    runs at the interpreter's recursion limit, where a finalizer the garbage collector runs
    meanwhile fails too. Two C-speed counts decide almost every entry; brackets inside
    strings (a value such as ``"a[1]"``) take a scan."""
    if isinstance(raw, bytes):
        if raw.count(b"[") + raw.count(b"{") <= 1:
            return True
        text = raw.decode("utf-8", "replace")
    elif raw.count("[") + raw.count("{") <= 1:
        return True
    else:
        text = raw
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > 1:
                return False
        elif char in "]}":
            depth -= 1
    return True


def attributes_from_json(raw: str | bytes | None) -> dict[str, str]:
    """Attributes an adapter stored as one JSON object of strings (a Redis field, a NATS
    header), read back; empty for None or empty. Raises ValueError naming what is wrong, for
    the adapter to deliver the message marked malformed."""
    if not raw:
        return {}
    if not _at_most_one_level(raw):
        raise ValueError("nested: attributes are one JSON object of strings")
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"not JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    for name, item in value.items():
        if not isinstance(item, str):
            raise ValueError(f"attribute {name!r} is a {type(item).__name__}, not a string")
    return value


def names_from_json(raw: str) -> list[str]:
    """Names an adapter stored as one JSON array of strings (the ``redis-fields`` attribute),
    read back. Raises ValueError naming what is wrong."""
    if not _at_most_one_level(raw):
        raise ValueError("nested: names are one JSON array of strings")
    try:
        value = json.loads(raw)
    except ValueError as error:
        raise ValueError(f"not JSON ({error})") from None
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise ValueError("not a JSON array of strings")
    return value


@runtime_checkable
class Consumer(Protocol):
    """The consuming side of a broker, as the Subscriber uses it."""

    @property
    def capabilities(self) -> Capabilities:
        """What this broker supports."""
        ...

    async def receive(
        self, subscription: str, max_messages: int, timeout: float
    ) -> list[Delivery]:
        """Wait up to ``timeout`` seconds for messages; return at most ``max_messages``.

        Returns an empty list when the timeout passes with nothing to deliver.
        """
        ...

    async def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """Acknowledge; returns the deliveries the broker refused (stale ack ids)."""
        ...

    async def nack(self, deliveries: Sequence[Delivery], delay: float = 0.0) -> None:
        """Give the deliveries back for redelivery after ``delay`` seconds (0: at once)."""
        ...

    async def extend(self, deliveries: Sequence[Delivery], seconds: float) -> list[Delivery]:
        """Set each delivery's ack deadline to ``seconds`` from now.

        Returns the deliveries the broker refused (stale ack ids); they are no longer ours.
        """
        ...

    async def subscription_ack_deadline(self, subscription: str) -> float:
        """The deadline (seconds) a fresh delivery of ``subscription`` gets from the broker."""
        ...

    async def subscription_topic(self, subscription: str) -> str:
        """The topic ``subscription`` receives from (raises ``UnknownSubscriptionError``)."""
        ...

    def dedup_namespace(self, subscription: str) -> str:
        """The default dedup namespace of ``subscription``: unique per broker, topic and
        subscription, and the same for every consumer of it (message ids are only unique
        within it)."""
        ...

    async def close(self) -> None:
        """Release the connections of the running event loop and of the blocking twins.

        The adapter stays usable: the next call opens new connections. A Subscriber calls it
        when it stops, because its connections belong to the event loop of that run.
        """
        ...


@runtime_checkable
class Publisher(Protocol):
    """The publishing side of a broker."""

    async def publish(
        self,
        topic: str,
        data: Payload,
        attributes: dict[str, str] | None = None,
        ordering_key: str | None = None,
    ) -> str:
        """Publish one message and return its broker message id."""
        ...

    def publish_sync(
        self,
        topic: str,
        data: Payload,
        attributes: dict[str, str] | None = None,
        ordering_key: str | None = None,
    ) -> str:
        """Blocking twin of :meth:`publish`, safe from any thread while a Subscriber runs."""
        ...

    async def close(self) -> None:
        """Release connections; usable again afterwards (see :meth:`Consumer.close`)."""
        ...


@runtime_checkable
class Admin(Protocol):
    """Creating and checking topics and subscriptions."""

    async def ensure_subscription(self, topic: str, subscription: str, **options: Any) -> None:
        """Create ``topic`` and ``subscription`` if missing; a no-op when both exist.

        A subscription name already used for another topic is refused with a
        ``ConfigurationError`` naming both topics.
        """
        ...

    def ensure_subscription_sync(self, topic: str, subscription: str, **options: Any) -> None:
        """Blocking twin of :meth:`ensure_subscription`."""
        ...

    async def ensure_topic(self, topic: str) -> None:
        """Create ``topic`` if missing (a dead-letter topic, say); a no-op when it exists."""
        ...

    def ensure_topic_sync(self, topic: str) -> None:
        """Blocking twin of :meth:`ensure_topic`."""
        ...

    async def topic_exists(self, topic: str) -> bool:
        """Whether ``topic`` exists (the Subscriber checks its dead-letter topic at start)."""
        ...

    async def close(self) -> None:
        """Release connections; usable again afterwards (see :meth:`Consumer.close`)."""
        ...


@runtime_checkable
class Adapter(Consumer, Publisher, Admin, Protocol):
    """A broker adapter: consuming, publishing and administering, with blocking twins."""

    def close_sync(self) -> None:
        """Release the blocking twins' connections (from any thread, outside a loop)."""
        ...


class Outgoing(NamedTuple):
    """One message to publish: the arguments of :meth:`Publisher.publish`."""

    topic: str
    data: Payload
    attributes: dict[str, str] | None = None
    ordering_key: str | None = None


@runtime_checkable
class BatchPublisher(Protocol):
    """An optional capability: publish a batch of messages in one broker call.

    The outbox relay uses it when the adapter has it (the Redis Streams adapter pipelines the
    batch); otherwise it calls :meth:`Publisher.publish` for each message concurrently (which the
    Pub/Sub client batches by itself).
    """

    async def publish_many(self, messages: Sequence[Outgoing]) -> list[str | Exception]:
        """Publish ``messages``; returns, in their order, each one's message id or the exception
        that refused it (one refused message does not fail the others). Messages of one
        ordering key reach the broker in the order given."""
        ...


@runtime_checkable
class AcksWithCompletions(Protocol):
    """An optional capability: record dedup completions in the same call as the acks.

    The Settler uses it (one round trip instead of two per batch) when ``shares_store`` says the
    adapter can reach the store's records, as the Redis Streams adapter can with a
    ``RedisDedupStore`` on the same Redis server and database.
    """

    def shares_store(self, store: DedupStore) -> bool:
        """True when :meth:`ack_with_completions` can write ``store``'s records."""
        ...

    async def ack_with_completions(
        self,
        deliveries: Sequence[Delivery],
        store: DedupStore,
        completions: Sequence[Completion],
        ttl: float,
    ) -> tuple[list[Delivery], list[Claimed]]:
        """Record ``completions`` (fenced as ``complete_many`` does) and ack ``deliveries``.

        Returns the refused deliveries (stale ack ids) and the refused completions' claims.
        """
        ...
