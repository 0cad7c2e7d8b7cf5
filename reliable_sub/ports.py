"""The contracts of the core: what a broker adapter and a dedup store must do.

The core talks to brokers and stores only through these protocols; adapters and stores written
elsewhere (``adapters/``, a third party's package) implement them using public names only.

* :class:`Consumer` -- what the Subscriber needs: receive, ack, nack, extend.
* :class:`Publisher` -- what a publisher (and the outbox relay) needs.
* :class:`Admin` -- creating and checking topics and subscriptions (the CLI's side).
* :class:`Adapter` -- all three: what every broker adapter of this package implements.
* :class:`AcksWithCompletions` -- an optional, typed capability: record dedup completions in the
  same call as the acks.
* :class:`BatchPublisher` -- an optional capability: publish many messages (:class:`Outgoing`)
  in one broker call (the outbox relay's rounds).
* :class:`Capabilities` -- what a broker offers, read by the core and the conformance suite.
* :class:`DedupStore` and its records (:class:`DedupKey`, :class:`Claimed`, :class:`Completed`,
  :class:`InProgress`, :class:`Completion`) -- the idempotent-consumer store.
* :class:`SyncDedupStore` -- an optional capability of a store: blocking twins of its batch
  methods, for callers on threads without an event loop (sync ``@idempotent`` functions).
* :class:`DedupEpochs` -- an optional capability of a store: an epoch per namespace, so a
  replay can run already processed messages again (``reliable_sub.replay``).
* :class:`Seekable` and :class:`Snapshot` -- an optional capability of an adapter: seek a
  subscription to a time or a snapshot, and keep snapshots (``Capabilities.seek``).
* :class:`Inspectable` and :class:`SubscriptionStats` -- an optional capability of an adapter:
  what a subscription holds (the ``reliable-sub stats`` command).

Every method that takes deliveries takes a batch and should cost one broker round trip per batch
where the broker allows it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple, Protocol, TypeAlias, runtime_checkable

from ._bodies import json_payload
from ._results import decode_result
from .message import Delivery


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

    def clamp_deadline(self, seconds: float) -> float:
        """``seconds`` limited to the broker's accepted range."""
        return min(self.max_ack_deadline, max(self.min_ack_deadline, seconds))


# What ``publish`` takes as a message's data: bytes, or a pydantic model, a dataclass or a JSON
# value, sent as JSON with ``content-type: application/json`` (see checked_message).
Payload: TypeAlias = object
# The attribute that names the payload's format; JSON payloads get this value.
CONTENT_TYPE = "content-type"
JSON_CONTENT_TYPE = "application/json"


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


# -- the dedup store ------------------------------------------------------------------------------


class DedupKey(NamedTuple):
    """The record a message maps to: its idempotency ``key`` within ``namespace``.

    The Subscriber's default namespace names the broker, topic and subscription (see
    ``Adapter.dedup_namespace``), so two services never share records by accident.
    """

    namespace: str
    key: str


@dataclass(frozen=True, slots=True)
class Claimed:
    """The caller holds the claim: run the handler.

    Attributes:
        key: the record.
        token: the fencing token of this claim; pass it on to systems you write to if they can
            reject stale writers. Renew, complete and release need it.
        failures: failed handler attempts recorded for this key before this claim.
    """

    key: DedupKey
    token: str
    failures: int = 0


@dataclass(frozen=True, slots=True)
class Completed:
    """The key was handled before; its handler's return value is stored as JSON text."""

    result_json: str | None = "null"
    key: DedupKey | None = field(default=None, compare=False)

    @property
    def result(self) -> Any:
        """The stored result, decoded; :class:`StoredResultError` if it is not valid JSON."""
        return decode_result(self.result_json, self.key)


@dataclass(frozen=True, slots=True)
class InProgress:
    """A peer holds the claim; ``expires_in`` seconds remain on it unless renewed."""

    expires_in: float = 0.0
    failures: int = 0


ClaimResult = Claimed | Completed | InProgress


class Completion(NamedTuple):
    """A completion to record: the claim it ends and the handler's result as JSON text."""

    claim: Claimed
    result_json: str


@runtime_checkable
class DedupStore(Protocol):
    """The idempotent-consumer store contract.

    Batch methods cost one round trip each; the Subscriber uses only them. ``claim``,
    ``complete`` and ``release`` are single-key conveniences for handlers and scripts.
    Every method that ends or extends a claim is conditional on the claim's token.
    """

    async def claim_many(
        self,
        keys: Sequence[DedupKey],
        lease_ttl: float,
        tokens: Sequence[str] | None = None,
    ) -> list[ClaimResult]:
        """Claim each key for ``lease_ttl`` seconds, in order, atomically per key.

        ``tokens`` (one per key) re-claims keys this caller held before: a key still held under
        its token is renewed and reported Claimed. Without them, fresh tokens are made. A key
        repeated in one call is claimed once; its later positions report InProgress.
        """
        ...

    async def renew(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        """Extend each claim to ``lease_ttl`` from now and store its ``failures``; returns the
        claims that are no longer held under their token (left untouched)."""
        ...

    async def complete_many(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        """Record each completion, kept ``ttl`` seconds; returns the claims refused because a
        peer now holds the key under another token (a lapsed claim nobody took is recorded)."""
        ...

    async def release_many(self, claims: Sequence[Claimed], retention: float) -> None:
        """End each claim without a result; a key with ``failures`` keeps that count for
        ``retention`` seconds, one without is forgotten. Claims not held are left alone."""
        ...

    async def claim(self, key: DedupKey, lease_ttl: float) -> ClaimResult:
        """:meth:`claim_many` for one key."""
        ...

    async def complete(self, claim: Claimed, result: Any, ttl: float) -> bool:
        """Record ``claim`` as handled with a JSON-serialisable ``result``; False if refused."""
        ...

    async def release(self, claim: Claimed, retention: float = 0.0) -> None:
        """:meth:`release_many` for one claim."""
        ...

    async def close(self) -> None:
        """Release connections of the running event loop; the store reconnects on next use."""
        ...


@runtime_checkable
class SyncDedupStore(Protocol):
    """An optional capability of a :class:`DedupStore`: blocking twins of its batch methods.

    Each ``*_sync`` method has exactly the semantics and return value of the async method it is
    named after (see :class:`DedupStore`), and sees the same records: a key claimed by one is
    in progress for the other. They block the calling thread for one round trip and may be
    called from any thread, concurrently, with or without a running event loop (they never use
    one). Sync ``@idempotent`` functions call them on the calling thread when the store has
    them (``isinstance(store, SyncDedupStore)``); other stores' calls run on a background loop.
    """

    def claim_many_sync(
        self,
        keys: Sequence[DedupKey],
        lease_ttl: float,
        tokens: Sequence[str] | None = None,
    ) -> list[ClaimResult]:
        """Blocking twin of :meth:`DedupStore.claim_many`."""
        ...

    def renew_sync(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        """Blocking twin of :meth:`DedupStore.renew`; returns the claims no longer held."""
        ...

    def complete_many_sync(
        self, completions: Sequence[Completion], ttl: float
    ) -> list[Claimed]:
        """Blocking twin of :meth:`DedupStore.complete_many`; returns the refused claims."""
        ...

    def release_many_sync(self, claims: Sequence[Claimed], retention: float) -> None:
        """Blocking twin of :meth:`DedupStore.release_many`."""
        ...


@runtime_checkable
class DedupEpochs(Protocol):
    """An optional capability of a :class:`DedupStore`: an epoch number per namespace.

    The Subscriber claims a subscription's keys in the namespace of its current epoch
    (:func:`reliable_sub.dedup._epochs.epoch_namespace`), so records written in an earlier
    epoch no longer match: a replay in mode ``"reprocess"`` starts a new epoch before it seeks.
    Epochs are kept until deleted by hand; a namespace that never had one is in epoch 0.
    """

    async def epoch(self, namespace: str) -> int:
        """The current epoch of ``namespace`` (0 if it never had one)."""
        ...

    async def next_epoch(self, namespace: str) -> int:
        """Start the next epoch of ``namespace`` (atomically) and return its number."""
        ...


# -- seek and snapshots ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """A subscription's acknowledgement state at one moment, to seek back to.

    Attributes:
        name: the snapshot's short name (unique per broker project or key prefix).
        subscription: the subscription it was taken of (None where the broker does not keep
            it: Pub/Sub keeps it in a label when the name fits a label's rules).
        topic: that subscription's topic.
        created: when it was taken (None where the broker does not say).
        expires: when the broker deletes it (None: kept until deleted).
    """

    name: str
    subscription: str | None
    topic: str
    created: datetime | None = None
    expires: datetime | None = None


@runtime_checkable
class Seekable(Protocol):
    """An optional capability of an adapter: replay or purge a subscription's messages.

    ``seek(subscription, to=time)``: messages published before ``time`` count as acknowledged,
    those published at or after it as unacknowledged, so they are delivered again (acked ones
    only where the subscription retains acked messages); a time in the future acknowledges
    everything published so far. ``seek(subscription, snapshot=name)``: the acknowledgement
    state of the snapshot comes back: what was unacknowledged when it was taken, and everything
    published since, is delivered again. Deliveries in flight at a seek become stale (their
    acks may be refused). Operators call it through :func:`reliable_sub.replay.seek`, which
    also decides what the dedup store does with the replayed messages.
    """

    async def seek(
        self, subscription: str, *, to: datetime | None = None, snapshot: str | None = None
    ) -> None:
        """Seek ``subscription`` to a time (timezone-aware) or to a snapshot (exactly one)."""
        ...

    async def create_snapshot(self, subscription: str, name: str) -> Snapshot:
        """Take a snapshot of ``subscription`` named ``name`` (refused if the name is taken)."""
        ...

    async def delete_snapshot(self, name: str) -> None:
        """Delete the snapshot ``name`` (``UnknownSnapshotError`` if there is none)."""
        ...

    async def list_snapshots(self, subscription: str | None = None) -> list[Snapshot]:
        """The snapshots, all or those of one subscription, by name."""
        ...


# -- telemetry ------------------------------------------------------------------------------------


@runtime_checkable
class DescribesConnection(Protocol):
    """An optional capability of an adapter: what its telemetry spans say of its connection."""

    def connection_attributes(self) -> dict[str, str | int]:
        """``server.address``, ``server.port`` and ``messaging.client.id``, those it knows."""
        ...


@runtime_checkable
class InstrumentsPublishes(Protocol):
    """An optional capability of an adapter: its publishes recorded on given providers (our
    adapters have it from :class:`~reliable_sub.telemetry.publishing.InstrumentedPublishing`)."""

    def instrument_publishes(self, tracer_provider: Any = None,
                             meter_provider: Any = None) -> None:
        """Record this adapter's publishes on these providers (None: leave that one)."""
        ...


@runtime_checkable
class Prefetches(Protocol):
    """An optional capability of a broker that pushes deliveries ahead (RabbitMQ): how many of
    a subscription's it may push before they are acked. A Subscriber sets its flow-control
    window (``FlowControl.max_messages``) when it starts, so the broker keeps the rest for
    the subscription's other consumers."""

    def set_prefetch(self, subscription: str, messages: int) -> None:
        """Push at most ``messages`` unacked deliveries of ``subscription`` from now on."""
        ...


# -- inspection -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SubscriptionStats:
    """What a subscription holds now; None where the broker does not say.

    Attributes:
        backlog: messages not yet acked (delivered or not).
        in_flight: messages delivered and not yet acked or given back.
        oldest_unacked_age: seconds since the oldest unacked message was published.
        ack_deadline: the subscription's ack deadline in seconds.
    """

    backlog: int | None
    in_flight: int | None
    oldest_unacked_age: float | None
    ack_deadline: float | None


@runtime_checkable
class Inspectable(Protocol):
    """An optional capability of an adapter: report what a subscription holds."""

    async def subscription_stats(self, subscription: str) -> SubscriptionStats:
        """The subscription's figures now (``UnknownSubscriptionError`` if there is none)."""
        ...


__all__ = [
    "CONTENT_TYPE",
    "JSON_CONTENT_TYPE",
    "AcksWithCompletions",
    "Adapter",
    "Admin",
    "BatchPublisher",
    "Capabilities",
    "ClaimResult",
    "Claimed",
    "Completed",
    "Completion",
    "Consumer",
    "DedupEpochs",
    "DedupKey",
    "DedupStore",
    "DescribesConnection",
    "InProgress",
    "Inspectable",
    "InstrumentsPublishes",
    "Outgoing",
    "Payload",
    "Prefetches",
    "Publisher",
    "Seekable",
    "Snapshot",
    "SubscriptionStats",
    "SyncDedupStore",
    "attributes_from_json",
    "checked_message",
]
