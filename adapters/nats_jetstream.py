"""NATS JetStream: a topic is a stream, a subscription is a durable pull consumer on it.

Layout. Topic ``orders`` is the stream ``orders`` (dots become ``_`` in the stream name, which
may not hold them) capturing the subject ``orders``; subscription ``billing`` is the durable pull
consumer ``billing`` of that stream (explicit ack, ``AckWait`` = the ack deadline, filtered to
the topic's subject). Streams keep messages under the default limits policy until their limits
(``stream_options``) remove them; acking does not delete. Subscription settings (topic, ack
deadline) are kept in the JetStream key-value bucket ``{prefix}-subscriptions``, so every
consumer agrees on them and ``subscription_topic`` works from the name alone.

A message carries its attributes as one JSON header (``Reliable-Sub-Attributes``: a header can
hold neither every attribute name nor a value with a line break) and its ordering key as a JSON
string in ``Reliable-Sub-Ordering-Key``. Plain headers from other publishers are read as
attributes too, and their ``Nats-Msg-Id`` as ``nats-msg-id`` (adapters/_nats_headers.py).
The message id is the stream sequence, ``delivery_attempt`` the server's delivery count
(``num_delivered``), the publish time the time the stream stored the message.

Leasing. ``extend`` sends in-progress acks (``+WPI``), which restart the consumer's ``AckWait``:
an extension is limited to the ack deadline, as on Redis. ``nack(delay)`` is a ``-NAK`` with
that delay. Acks, naks and in-progress acks carry no reply: each batch is sent in one write and
confirmed received by one PING (a flush), so a batch costs one round trip whatever its size.

Stale acks. The server matches an ack by stream sequence, not by delivery, and reports nothing,
so it would let a stale ack settle the delivery a peer now holds. The adapter refuses, without
sending, an ack, nack or extend of a delivery whose lease it knows has run out (it dates the
lease from when the fetch returned, less a margin for the trip from the server). It cannot see
a redelivery the server made earlier than that; ``capabilities.refuses_stale_acks`` is False.

Publishing sets ``Nats-Msg-Id`` from the ``idempotency-key`` attribute (with the dead-letter
copy's id on a replay of a dead letter, which must not be dropped as a retry), so the stream
drops a producer's retry that comes within its duplicate window (``duplicate_window``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import urlsplit

from reliable_sub._loops import PerLoop
from reliable_sub.adapters._nats_headers import (
    ATTRIBUTES_HEADER,
    MSG_ID_HEADER,
    ORDERING_KEY_HEADER,
    read_headers,
)
from reliable_sub.adapters._nats_urls import servers_of
from reliable_sub.dead_letters import REPLAYED_FROM_ATTRIBUTE
from reliable_sub.entries import read_each
from reliable_sub.errors import (
    ConfigurationError,
    InvalidMessageError,
    MissingExtraError,
    UnknownSubscriptionError,
    UnknownTopicError,
)
from reliable_sub.idempotency._background_loop import BackgroundLoop
from reliable_sub.message import IDEMPOTENCY_KEY_ATTRIBUTE, Delivery, Message
from reliable_sub.ports import (
    Capabilities,
    Outgoing,
    Payload,
    SubscriptionStats,
    checked_message,
)
from reliable_sub.telemetry.publishing import InstrumentedPublishing

try:
    import nats
    import nats.errors
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext
    from nats.js.api import (
        AckPolicy,
        ConsumerConfig,
        DeliverPolicy,
        KeyValueConfig,
        StorageType,
        StreamConfig,
    )
    from nats.js.errors import BadRequestError, KeyWrongLastSequenceError, NotFoundError
    from nats.js.kv import KeyValue

    from reliable_sub.adapters._nats_connection import Connection
    from reliable_sub.adapters._nats_replies import delivery_fields
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise MissingExtraError("NatsJetStreamAdapter", "nats", "nats-py") from error

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_URL = "nats://127.0.0.1:4222"
DEFAULT_ACK_DEADLINE = 30.0
DEFAULT_PREFIX = "reliable-sub"
# JetStream's own default; how long the stream remembers a Nats-Msg-Id.
DEFAULT_DUPLICATE_WINDOW = 120.0
EXPECTED_STREAM_HEADER = "Nats-Expected-Stream"
# A longer idempotency key is sent in Nats-Msg-Id as its SHA-256 (the header is kept per message
# for the duplicate window).
MAX_PLAIN_MSG_ID = 128
# A fetch needs a positive timeout; a receive with timeout 0 waits this long at most.
MIN_FETCH_TIMEOUT = 0.01
# Every nak carries at least this delay (seconds); see nack.
MIN_NAK_DELAY = 0.001
# After an empty fetch, check at most this often (seconds) that the consumer still exists.
CONSUMER_CHECK_INTERVAL = 5.0
# The local lease ends this much before the ack deadline, for the trip from the server.
STALE_MARGIN_FRACTION = 0.05
STALE_MARGIN_MAX = 0.5
_ACK, _NAK, _PROGRESS = b"+ACK", b"-NAK", b"+WPI"
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
_SUBJECT_TOKEN = re.compile(r"^[^\s.*>]+$")

CAPABILITIES = Capabilities(
    min_ack_deadline=0.0,
    max_ack_deadline=math.inf,
    native_dead_letter=False,
    native_retry_backoff=False,
    exactly_once=False,
    seek=False,
    ordering=False,
    delivery_attempt_exact=True,
    refuses_stale_acks=False,
    extension_limited_to_ack_deadline=True,
    messaging_system="nats",
)


@dataclass(eq=False)
class _Subscription:
    name: str
    topic: str
    ack_deadline: float
    max_ack_pending: int | None = None
    max_deliver: int | None = None
    next_check: float = 0.0

    @property
    def stream(self) -> str:
        return stream_name(self.topic)

    @property
    def lease_length(self) -> float:
        margin = min(STALE_MARGIN_MAX, self.ack_deadline * STALE_MARGIN_FRACTION)
        return self.ack_deadline - margin


def stream_name(topic: str) -> str:
    """The stream of ``topic``: the topic with dots as ``_`` (stream names cannot hold dots)."""
    return topic.replace(".", "_")


def _check_topic(topic: str) -> str:
    if not isinstance(topic, str) or not topic or not all(
            _SUBJECT_TOKEN.match(token) for token in topic.split(".")):
        raise ConfigurationError(
            f"NATS topic {topic!r} must be a subject without wildcards or spaces "
            "(dot-separated tokens such as 'orders' or 'orders.created')")
    if not _NAME.match(stream_name(topic)):
        raise ConfigurationError(
            f"NATS topic {topic!r} must be made of letters, digits, '-', '_' and '.' (its "
            "stream's name is the topic with dots as '_')")
    return topic


def _check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigurationError(
            f"NATS {kind} name {name!r} must be made of letters, digits, '-' and '_'")
    return name


class NatsJetStreamAdapter(InstrumentedPublishing):
    """NATS JetStream streams and durable pull consumers behind the Adapter contract.

    Args:
        url: the server (``nats://host:port``, ``tls://``, ``ws://`` or ``wss://``; several
            comma-separated for a cluster; another scheme is a ConfigurationError at once). A
            connection is made per event loop on first use; it reconnects on its own after the
            server restarts.
        prefix: prefix of the key-value bucket that keeps subscription settings, and of this
            adapter's dedup namespaces.
        duplicate_window: seconds a stream this adapter creates remembers a ``Nats-Msg-Id``.
        deduplicate_publishes: set ``Nats-Msg-Id`` from the idempotency key (default). False
            leaves every copy to the consumers' dedup store (the conformance suite does, to
            count the copies that store catches).
        stream_options: more ``StreamConfig`` fields for the streams this adapter creates
            (``max_age``, ``max_bytes``, ``num_replicas``...; seconds for durations).
        name: the connection name the server shows (``nats server report connections``).
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        duplicate_window: float = DEFAULT_DUPLICATE_WINDOW,
        deduplicate_publishes: bool = True,
        stream_options: dict[str, Any] | None = None,
        name: str = "reliable-sub",
    ) -> None:
        servers_of(url)  # a URL it cannot serve fails here, not at the first call
        self.url = url
        self._prefix = _check_name("prefix", prefix)
        if not duplicate_window >= 0:
            raise ConfigurationError(
                f"NatsJetStreamAdapter.duplicate_window must be >= 0, got {duplicate_window!r}")
        self._duplicate_window = duplicate_window
        self._deduplicate_publishes = deduplicate_publishes
        self._stream_options = dict(stream_options or {})
        if {"name", "subjects"} & set(self._stream_options):
            raise ConfigurationError(
                "NatsJetStreamAdapter.stream_options may not set name or subjects: they come "
                "from the topic")
        unknown = set(self._stream_options) - set(StreamConfig.__dataclass_fields__)
        if unknown:
            raise ConfigurationError(
                f"NatsJetStreamAdapter.stream_options has unknown StreamConfig fields "
                f"{sorted(unknown)}")
        self._bucket = f"{prefix}-subscriptions"
        self._name = name
        self._connections: PerLoop[Connection] = PerLoop(lambda: Connection(url, name))
        self._background = BackgroundLoop()
        self._subscriptions: dict[str, _Subscription] = {}
        # this process's deliveries still leased: ack id -> the loop time the lease ends
        self._leases: dict[str, float] = {}
        self._next_prune = 0.0
        self.stats = {"refused_as_stale": 0, "malformed": 0, "duplicate_publishes": 0}

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def connection_attributes(self) -> dict[str, str | int]:
        """The first server of the URL and the connection's name, for spans."""
        server = servers_of(self.url)[0]
        first = urlsplit(server if "://" in server else f"nats://{server}")
        found: dict[str, str | int] = {"messaging.client.id": self._name}
        if first.hostname:
            found["server.address"] = first.hostname
        if first.port:
            found["server.port"] = first.port
        return found

    def _run_blocking(self, coroutine: Coroutine[Any, Any, T]) -> T:
        # for a blocking twin, on the background loop; the loop closes this adapter's
        # connection there at exit (a script need not call close_sync)
        return self._background.run(coroutine, store=self)

    # -- administration -------------------------------------------------------------------

    async def _js(self) -> JetStreamContext:
        return await self._connections.get().jetstream()

    async def _settings_bucket(self) -> KeyValue:
        connection = self._connections.get()
        if connection.kv is None:
            js = await connection.jetstream()
            try:
                connection.kv = await js.key_value(self._bucket)
            except nats.js.errors.BucketNotFoundError:
                connection.kv = await js.create_key_value(
                    KeyValueConfig(bucket=self._bucket, history=1, storage=StorageType.FILE))
        return connection.kv

    async def ensure_subscription(
        self,
        topic: str,
        subscription: str,
        *,
        ack_deadline: float = DEFAULT_ACK_DEADLINE,
        start: str = "new",
        max_ack_pending: int | None = None,
        max_deliver: int | None = None,
        **options: Any,
    ) -> None:
        """Create the stream of ``topic`` and the durable pull consumer ``subscription``
        (idempotent; the settings recorded first are kept).

        Args:
            ack_deadline: the consumer's ``AckWait`` in seconds.
            start: ``"new"`` to deliver messages published from now on, ``"all"`` for what the
                stream holds too.
            max_ack_pending: the consumer's ``MaxAckPending`` (deliveries out and not acked,
                over all its consumers; the server's default is 1,000). Keep it above the sum
                of the Subscribers' ``FlowControl.max_messages`` or they wait on each other.
            max_deliver: the consumer's ``MaxDeliver`` (default: unlimited). The Subscriber
                dead-letters after ``DeadLetterPolicy.max_delivery_attempts`` itself; a
                ``max_deliver`` above that is a backstop: past it the server stops delivering
                the message (it stays in the stream) and publishes an advisory on
                ``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>``.
            **options: ``retain_acked_messages`` is accepted for portability; a stream keeps
                acked messages until its limits remove them.
        """
        options.pop("retain_acked_messages", None)
        if options:
            raise ConfigurationError(
                f"NatsJetStreamAdapter.ensure_subscription got unknown options "
                f"{sorted(options)}; allowed: ack_deadline, start, max_ack_pending, "
                "max_deliver, retain_acked_messages")
        _check_topic(topic)
        _check_name("subscription", subscription)
        if not (ack_deadline > 0 and math.isfinite(ack_deadline)):
            raise ConfigurationError(
                f"ensure_subscription: ack_deadline must be in (0, inf), got {ack_deadline!r}")
        if start not in ("new", "all"):
            raise ConfigurationError(
                f"ensure_subscription: start must be 'new' or 'all', got {start!r}")
        for option, value in (("max_ack_pending", max_ack_pending),
                              ("max_deliver", max_deliver)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigurationError(
                    f"ensure_subscription: {option} must be an int >= 1, got {value!r}")
        bucket = await self._settings_bucket()
        settings = json.dumps({"topic": topic, "ack_deadline": ack_deadline,
                               "max_ack_pending": max_ack_pending,
                               "max_deliver": max_deliver}).encode()
        with contextlib.suppress(KeyWrongLastSequenceError):  # recorded before: kept
            await bucket.create(subscription, settings)
        recorded = json.loads((await bucket.get(subscription)).value or b"{}")
        if recorded.get("topic") != topic:
            raise ConfigurationError(
                f"subscription {subscription!r} already exists on topic "
                f"{recorded.get('topic')!r}, not {topic!r}; a subscription (durable consumer) "
                "name belongs to one topic: choose another name")
        await self.ensure_topic(topic)
        sub = _subscription_of(subscription, recorded)
        await self._ensure_consumer(sub, start)
        self._subscriptions[subscription] = sub

    async def _ensure_consumer(self, sub: _Subscription, start: str) -> bool:
        """Create the consumer unless it exists; True if it was created."""
        js = await self._js()
        try:
            await js.consumer_info(sub.stream, sub.name)
            return False
        except NotFoundError:
            pass
        config = ConsumerConfig(
            durable_name=sub.name, ack_policy=AckPolicy.EXPLICIT, ack_wait=sub.ack_deadline,
            deliver_policy=DeliverPolicy.NEW if start == "new" else DeliverPolicy.ALL,
            filter_subject=sub.topic, max_deliver=sub.max_deliver or -1,
            max_ack_pending=sub.max_ack_pending)
        await js.add_consumer(sub.stream, config)
        return True

    async def _recreate_if_gone(self, sub: _Subscription) -> None:
        """After an empty fetch, now and then: a consumer (or stream) deleted by hand, or lost
        with a server's disk, is created again from the recorded settings. A fetch from a
        missing consumer just comes back empty: without this, the Subscriber would wait for
        ever. The consumer starts at the beginning of the stream (what it holds may never have
        been delivered; what was, the dedup store catches)."""
        now = asyncio.get_running_loop().time()
        if now < sub.next_check:
            return
        sub.next_check = now + CONSUMER_CHECK_INTERVAL
        await self.ensure_topic(sub.topic)
        if await self._ensure_consumer(sub, "all"):
            logger.warning("consumer %r of stream %r was gone (deleted, or the server lost its "
                           "store); created it again from the start of the stream", sub.name,
                           sub.stream)

    def ensure_subscription_sync(self, topic: str, subscription: str, **options: Any) -> None:
        """Blocking twin of :meth:`ensure_subscription`."""
        self._run_blocking(self.ensure_subscription(topic, subscription, **options))

    def ensure_topic_sync(self, topic: str) -> None:
        """Blocking twin of :meth:`ensure_topic`."""
        self._run_blocking(self.ensure_topic(topic))

    async def ensure_topic(self, topic: str) -> None:
        """Create the stream of ``topic`` if it does not exist (a stream you made, capturing
        the topic's subject, is used as it is)."""
        _check_topic(topic)
        js = await self._js()
        name = stream_name(topic)
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            config = StreamConfig(name=name, subjects=[topic], storage=StorageType.FILE,
                                  duplicate_window=self._duplicate_window,
                                  **self._stream_options)
            try:
                await js.add_stream(config)
                return
            except BadRequestError as error:  # made meanwhile with another config, or refused
                if error.err_code != 10058:
                    raise ConfigurationError(
                        f"cannot create stream {name!r} for topic {topic!r}: {error}") from error
                info = await js.stream_info(name)
        if topic not in (info.config.subjects or []):
            raise ConfigurationError(
                f"stream {name!r} exists but does not capture subject {topic!r} (its subjects: "
                f"{info.config.subjects}); topic names that differ only in '.' and '_' share "
                "a stream name")

    async def topic_exists(self, topic: str) -> bool:
        """Whether the stream of ``topic`` exists."""
        _check_topic(topic)
        try:
            await (await self._js()).stream_info(stream_name(topic))
        except NotFoundError:
            return False
        return True

    def dedup_namespace(self, subscription: str) -> str:
        """``nats:<prefix>:<consumer>``: a consumer name belongs to one stream per prefix (see
        ``ensure_subscription``), and stream sequences are unique only within a stream."""
        return f"nats:{self._prefix}:{subscription}"

    async def subscription_ack_deadline(self, subscription: str) -> float:
        return (await self._subscription(subscription)).ack_deadline

    async def subscription_topic(self, subscription: str) -> str:
        return (await self._subscription(subscription)).topic

    async def _subscription(self, name: str) -> _Subscription:
        sub = self._subscriptions.get(name)
        if sub is not None:
            return sub
        bucket = await self._settings_bucket()
        try:
            entry = await bucket.get(name)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            raise UnknownSubscriptionError(
                f"subscription {name!r} does not exist; create it with ensure_subscription"
            ) from None
        sub = self._subscriptions[name] = _subscription_of(name, json.loads(entry.value or b"{}"))
        return sub

    async def subscription_stats(self, subscription: str) -> SubscriptionStats:
        """From the consumer's info: what it has not delivered (``num_pending``) and what is
        delivered and not acked (``num_ack_pending``); the oldest unacked message is the first
        stored after the ack floor."""
        sub = await self._subscription(subscription)
        js = await self._js()
        try:
            info = await js.consumer_info(sub.stream, sub.name)
        except NotFoundError:
            raise UnknownSubscriptionError(
                f"consumer {sub.name!r} is gone from stream {sub.stream!r}") from None
        in_flight = info.num_ack_pending or 0
        backlog = (info.num_pending or 0) + in_flight
        age = None
        if backlog:
            floor = (info.ack_floor.stream_seq if info.ack_floor else None) or 0
            try:
                oldest = await js.get_msg(sub.stream, seq=floor + 1, next=True,
                                          subject=sub.topic)
            except NotFoundError:
                oldest = None
            if oldest is not None and oldest.time is not None:
                stored = oldest.time
                age = max(0.0, (datetime.now(stored.tzinfo) - stored).total_seconds())
        return SubscriptionStats(backlog, in_flight, age, sub.ack_deadline)

    # -- publishing ------------------------------------------------------------------------

    def _headers(
        self, data: Payload, attributes: dict[str, str] | None, ordering_key: str | None
    ) -> tuple[bytes, dict[str, str]]:
        payload, checked = checked_message(data, attributes)
        headers: dict[str, str] = {}
        if checked:
            headers[ATTRIBUTES_HEADER] = json.dumps(checked, separators=(",", ":"))
        if ordering_key:
            headers[ORDERING_KEY_HEADER] = json.dumps(ordering_key)  # ASCII, one line
        msg_id = _msg_id(checked) if self._deduplicate_publishes else None
        if msg_id is not None:
            headers[MSG_ID_HEADER] = msg_id
        return payload, headers

    async def publish(
        self,
        topic: str,
        data: Payload,
        attributes: dict[str, str] | None = None,
        ordering_key: str | None = None,
    ) -> str:
        with self._publishing.send(topic, attributes) as attributes:
            payload, headers = self._headers(data, attributes, ordering_key)
            return await self._publish(topic, payload, headers)

    async def _publish(self, topic: str, payload: bytes, headers: dict[str, str]) -> str:
        _check_topic(topic)
        connection = self._connections.get()
        js = await connection.jetstream()
        # the stream the topic must land in (the server refuses the message otherwise)
        headers = {**headers, EXPECTED_STREAM_HEADER: stream_name(topic)}
        _check_size(payload, headers, (await connection.nats()).max_payload)
        try:
            ack = await js.publish(topic, payload, headers=headers)
        except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
            raise UnknownTopicError(
                f"topic {topic!r} has no stream; create it with ensure_topic or "
                "ensure_subscription") from None
        if ack.duplicate:
            self.stats["duplicate_publishes"] += 1
            logger.debug("publish to %r dropped as a duplicate of message %d (Nats-Msg-Id %r)",
                         topic, ack.seq, headers.get(MSG_ID_HEADER))
        return str(ack.seq)

    async def publish_many(self, messages: Sequence[Outgoing]) -> list[str | Exception]:
        """Publish ``messages`` concurrently on one connection (their PubAcks come back
        pipelined); written in the order given. Returns each one's stream sequence or the
        error that refused it."""

        async def one(message: Outgoing) -> str:
            payload, headers = self._headers(message.data, message.attributes,
                                             message.ordering_key)
            return await self._publish(message.topic, payload, headers)

        started = time.perf_counter()
        results = await asyncio.gather(*(one(m) for m in messages), return_exceptions=True)
        sent = [r if isinstance(r, str | Exception) else Exception(repr(r)) for r in results]
        self._publishing.sent_many(messages, sent, started)
        return sent

    def publish_sync(
        self,
        topic: str,
        data: Payload,
        attributes: dict[str, str] | None = None,
        ordering_key: str | None = None,
    ) -> str:
        """Blocking twin of :meth:`publish` (runs it on this adapter's background loop)."""
        return self._run_blocking(self.publish(topic, data, attributes, ordering_key))

    # -- consuming -------------------------------------------------------------------------

    async def receive(
        self, subscription: str, max_messages: int, timeout: float
    ) -> list[Delivery]:
        if max_messages < 1:
            raise ConfigurationError(f"receive: max_messages must be >= 1, got {max_messages}")
        sub = await self._subscription(subscription)
        connection = self._connections.get()
        async with connection.fetch_lock(sub.name), connection.pull(sub.name, sub.stream) as pull:
            try:
                msgs = await pull.fetch(max_messages, timeout=max(MIN_FETCH_TIMEOUT, timeout))
            except asyncio.TimeoutError:  # nats.errors.TimeoutError: nothing came
                msgs = []
        if not msgs:
            await connection.check_alive()
            await self._recreate_if_gone(sub)
            return []
        connection.heard()
        now = asyncio.get_running_loop().time()
        self._prune(now)
        deliveries = read_each(msgs, functools.partial(self._delivery, sub),
                               functools.partial(self._unreadable, sub))
        leases, until = self._leases, now + sub.lease_length
        for delivery in deliveries:
            leases[delivery.ack_id] = until
        return deliveries

    def _delivery(self, sub: _Subscription, msg: Msg) -> Delivery:
        message_id, delivered, stored_at = delivery_fields(msg.reply)
        # a publish without attributes has no headers: nothing else to read
        attributes, ordering_key, problem = (read_headers(msg.headers) if msg.headers
                                             else ({}, None, None))
        message = Message.received(message_id, msg.data, attributes, delivered, stored_at,
                                   ordering_key, sub.name)
        if problem is not None:
            return self._malformed(sub, message, msg.reply, problem)
        return Delivery(message, msg.reply)

    def _unreadable(self, sub: _Subscription, msg: Msg, problem: str) -> Delivery:
        """The delivery of a message whose parse raised ``problem``: its data, without its
        headers."""
        metadata = msg.metadata
        message = Message(id=str(metadata.sequence.stream), data=msg.data,
                          delivery_attempt=metadata.num_delivered, subscription=sub.name)
        return self._malformed(sub, message, msg.reply, problem)

    def _malformed(self, sub: _Subscription, message: Message, reply: str,
                   problem: str) -> Delivery:
        self.stats["malformed"] += 1
        logger.warning("message %s of stream %r cannot be read as a message: %s", message.id,
                       sub.stream, problem)
        return Delivery(message, reply, malformed=problem)

    def _prune(self, now: float) -> None:
        """Forget leases that ran out long ago (their acks are refused either way)."""
        if now < self._next_prune:
            return
        self._next_prune = now + 10.0
        for ack_id in [a for a, ends in self._leases.items() if ends < now]:
            del self._leases[ack_id]

    def _live(self, deliveries: Sequence[Delivery]) -> tuple[list[Delivery], list[Delivery]]:
        """The deliveries whose lease this process still holds, and the others."""
        now = asyncio.get_running_loop().time()
        live: list[Delivery] = []
        stale: list[Delivery] = []
        for delivery in deliveries:
            ends = self._leases.get(delivery.ack_id)
            (live if ends is not None and ends > now else stale).append(delivery)
        if stale:
            self.stats["refused_as_stale"] += len(stale)
        return live, stale

    async def _send(self, deliveries: Sequence[Delivery], payload: bytes) -> None:
        """``payload`` to each delivery's ack subject in one write, then one PING (flush):
        when it returns, the server has them."""
        if not deliveries:
            return
        connection = self._connections.get()
        client = await connection.nats()
        for delivery in deliveries:
            await client.publish(delivery.ack_id, payload)
        await connection.flush(client)

    async def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        live, stale = self._live(deliveries)
        await self._send(live, _ACK)
        for delivery in live:
            self._leases.pop(delivery.ack_id, None)
        return stale

    async def nack(self, deliveries: Sequence[Delivery], delay: float = 0.0) -> None:
        live, _ = self._live(deliveries)
        if not live:
            return
        # never a plain -NAK: nats-server 2.9 then sometimes skips one message of the batch until
        # AckWait and sends another twice (7 of 30 batches of 3 here; 0 of 40 with a delay)
        payload = _NAK + b" " + json.dumps({"delay": int(max(delay, MIN_NAK_DELAY) * 1e9)}).encode()
        if delay > 0:
            await self._send(live, payload)
        else:
            # Redelivered at once, into this connection's fetch in flight if there is one: a
            # stopping Subscriber would get back what it gives back. Send between fetches, so
            # the messages go to the next fetch of any consumer.
            connection = self._connections.get()
            async with contextlib.AsyncExitStack() as between_fetches:
                for name in sorted({d.message.subscription for d in live}):
                    await between_fetches.enter_async_context(connection.fetch_lock(name))
                await self._send(live, payload)
        for delivery in live:
            self._leases.pop(delivery.ack_id, None)

    async def extend(self, deliveries: Sequence[Delivery], seconds: float) -> list[Delivery]:
        """In-progress acks: each lease restarts at the ack deadline (``seconds`` beyond it
        cannot be had: ``extension_limited_to_ack_deadline``)."""
        live, stale = self._live(deliveries)
        sent_at = asyncio.get_running_loop().time()
        await self._send(live, _PROGRESS)
        for delivery in live:
            sub = self._subscriptions.get(delivery.message.subscription)
            if sub is not None and delivery.ack_id in self._leases:
                self._leases[delivery.ack_id] = sent_at + sub.lease_length
        return stale

    async def close(self) -> None:
        """Close this loop's connection and the background loop's; reconnects on next use."""
        connection = self._connections.pop()
        if connection is not None:
            await connection.close()

    def close_sync(self) -> None:
        """Close the blocking twins' connection (on the adapter's background loop)."""
        self._background.run(self.close())


def _subscription_of(name: str, settings: dict[str, Any]) -> _Subscription:
    return _Subscription(name, settings["topic"], float(settings["ack_deadline"]),
                         settings.get("max_ack_pending"), settings.get("max_deliver"))


# "NATS/1.0\r\n" before the headers and "\r\n" after them
_HEADER_FRAMING = 12


def _check_size(payload: bytes, headers: dict[str, str], max_payload: int) -> None:
    """Refuse, before sending, a message over the server's ``max_payload`` (data and headers
    together): the server would close the connection on it, failing every call in flight."""
    header_bytes = sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items())
    size = len(payload) + (header_bytes + _HEADER_FRAMING if headers else 0)
    if size > max_payload:
        raise InvalidMessageError(
            f"publish: the message is {size} bytes (data and headers), over the NATS server's "
            f"max_payload of {max_payload} bytes; raise max_payload in the server's "
            "configuration, or publish a reference to the data instead")


def _msg_id(attributes: dict[str, str]) -> str | None:
    """The ``Nats-Msg-Id`` of a message with these attributes: its idempotency key, and for a
    replayed dead letter the copy it replays (a replay is a new publish, not a retry). A key a
    header cannot carry as it is (a line break, control or non-ASCII characters, over
    ``MAX_PLAIN_MSG_ID`` bytes) is sent as its SHA-256."""
    key = attributes.get(IDEMPOTENCY_KEY_ATTRIBUTE)
    if not key:
        return None
    replayed_from = attributes.get(REPLAYED_FROM_ATTRIBUTE)
    msg_id = key if not replayed_from else f"{key} replayed-from {replayed_from}"
    if len(msg_id) <= MAX_PLAIN_MSG_ID and msg_id.isascii() and msg_id.isprintable():
        return msg_id
    return "sha256:" + hashlib.sha256(msg_id.encode("utf-8", "surrogatepass")).hexdigest()


__all__ = ["CAPABILITIES", "DEFAULT_URL", "NatsJetStreamAdapter"]
