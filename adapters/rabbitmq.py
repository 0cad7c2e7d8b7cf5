"""RabbitMQ: a topic is a fanout exchange, a subscription a durable quorum queue bound to it.

Layout. Topic ``orders`` is the durable ``fanout`` exchange ``orders``: every queue bound to it
gets every message, as every subscription of a topic does. Subscription ``billing`` is the
durable quorum queue ``billing`` (``x-queue-type: quorum``), bound to it. Its settings (topic,
ack deadline) are kept by the broker, so every consumer agrees on them and
``subscription_topic`` works from the name alone: as one message in the classic queue
``{prefix}.settings.{subscription}`` (at most one message; a second publish is refused, so the
first settings recorded are kept), read with ``basic.get`` and given back.

Publishing, on a connection of its own, waits for the broker's confirm; ``publish_many``
publishes its messages with their confirms in flight together (``_rabbitmq_publishing``;
``_rabbitmq_messages`` for how a message is written and read).

Consuming. Each subscription has a channel with ``basic.qos(prefetch)`` and a
``basic.consume``; ``receive`` hands out what the broker pushed. RabbitMQ has no ack deadline,
so this adapter keeps it (``_rabbitmq_consumer``): a delivery not acked or extended within it is
rejected with requeue and delivered again, with ``x-delivery-count`` one higher. The prefetch is
what the subscription's handler can take at once (``set_prefetch``).

Delays. A nack with a delay publishes a copy of the message (same id, body and headers, and the
count of its deliveries so far) to a *delay queue* of the subscription, which dead-letters it
back when its length ends (rounded up by at most 41%; ``_rabbitmq_topology``,
``_rabbitmq_delays``), then acks the delivery. The delay survives a crash of the consumer; a
crash between the copy's confirm and the ack leaves both: the dedup store sees a duplicate.
Acks of deliveries whose channel is gone or whose lease ran out are refused without being sent
(``refuses_stale_acks``). The broker closes a channel whose delivery stays unacked past its
``consumer_timeout`` (30 minutes by default): keep ``LeasePolicy.max_lease_duration`` under it.

Figures. AMQP tells a queue's ready messages only: a subscription's backlog and what is in
flight are unknown unless ``management_url`` names the management plugin's HTTP API
(``_rabbitmq_management``; the oldest message's age stays unknown).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from reliable_sub._loops import PerLoop
from reliable_sub.entries import read_each
from reliable_sub.errors import (
    ConfigurationError,
    MissingExtraError,
    UnknownSubscriptionError,
    UnknownTopicError,
)
from reliable_sub.idempotency._background_loop import BackgroundLoop
from reliable_sub.message import Delivery
from reliable_sub.ports import Capabilities, Outgoing, Payload, SubscriptionStats, checked_message
from reliable_sub.telemetry.publishing import InstrumentedPublishing

try:
    import aio_pika
    import aio_pika.exceptions
    from aio_pika.abc import AbstractIncomingMessage
    from aiormq.exceptions import ChannelNotFoundEntity

    from reliable_sub.adapters._rabbitmq_consumer import Consumer, held_tags
    from reliable_sub.adapters._rabbitmq_delays import hold_back
    from reliable_sub.adapters._rabbitmq_link import Link, problems_of
    from reliable_sub.adapters._rabbitmq_management import DEFAULT_TIMEOUT, ManagementAPI, Unlisted
    from reliable_sub.adapters._rabbitmq_messages import incoming, outgoing, unreadable
    from reliable_sub.adapters._rabbitmq_publishing import send
    from reliable_sub.adapters._rabbitmq_topology import (
        SETTINGS_WAIT,
        Settings,
        Topology,
        check_name,
        check_subscription,
    )
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise MissingExtraError("RabbitMQAdapter", "rabbitmq", "aio-pika") from error

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_ACK_DEADLINE = 30.0
DEFAULT_PREFIX = "reliable-sub"
DEFAULT_PREFETCH = 100
# RabbitMQ's default consumer_timeout: a delivery unacked this long closes its channel.
DEFAULT_CONSUMER_TIMEOUT = 1800.0
CONNECT_TIMEOUT = 5.0

CAPABILITIES = Capabilities(
    min_ack_deadline=0.0,
    max_ack_deadline=DEFAULT_CONSUMER_TIMEOUT,
    native_dead_letter=False,
    native_retry_backoff=False,
    exactly_once=False,
    seek=False,
    ordering=False,
    delivery_attempt_exact=True,  # the quorum queue's x-delivery-count
    refuses_stale_acks=True,
    cancel_safe_receive=False,
    messaging_system="rabbitmq",
    max_lease_duration=DEFAULT_CONSUMER_TIMEOUT,
)


class RabbitMQAdapter(InstrumentedPublishing):
    """Consume from and publish to RabbitMQ (see the module's docstring for the layout).

    Args:
        url: the broker, ``amqp://user:password@host:port/vhost`` (``amqps://`` for TLS).
        prefix: prefix of the queues that keep subscription settings, and of this adapter's
            dedup namespaces.
        prefetch: the consumer channels' ``basic.qos`` prefetch count (deliveries pushed and
            not yet acked, per subscription) until a Subscriber sets its flow-control window
            (``set_prefetch``): for ``receive`` called by your own code.
        name: the connection name the broker shows (``rabbitmqctl list_connections name``).
        consumer_timeout: the broker's ``consumer_timeout`` in seconds (RabbitMQ's default:
            30 minutes): a Subscriber warns at start when its ``max_lease_duration`` is not
            under it.
        management_url: the management plugin's HTTP API, ``http://user:password@host:15672/``
            (without credentials: the AMQP URL's), where ``subscription_stats`` and the
            backlog gauges read a subscription's backlog and in-flight count. None: unknown.
        management_timeout: seconds a reading of the management API may take; past it, or
            with the API down, the figures are unknown and the consumer goes on.
    """

    def __init__(self, url: str = DEFAULT_URL, *, prefix: str = DEFAULT_PREFIX,
                 prefetch: int = DEFAULT_PREFETCH, name: str = "reliable-sub",
                 consumer_timeout: float = DEFAULT_CONSUMER_TIMEOUT,
                 management_url: str | None = None,
                 management_timeout: float = DEFAULT_TIMEOUT) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("amqp", "amqps"):
            raise ConfigurationError(
                f"RabbitMQAdapter needs an amqp:// or amqps:// URL, got {url!r}")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 1:
            raise ConfigurationError(
                f"RabbitMQAdapter.prefetch must be an int >= 1, got {prefetch!r}")
        if not (isinstance(consumer_timeout, int | float) and consumer_timeout > 0):
            raise ConfigurationError(f"RabbitMQAdapter.consumer_timeout must be seconds > 0, "
                                     f"got {consumer_timeout!r}")
        self.url = url
        self._capabilities = dataclasses.replace(
            CAPABILITIES, max_ack_deadline=float(consumer_timeout),
            max_lease_duration=float(consumer_timeout))
        self._prefix = check_name("prefix", prefix)
        self._management = None if management_url is None else ManagementAPI(
            management_url, url, self._prefix, management_timeout)
        self._name = name
        self._links: PerLoop[Link] = PerLoop(lambda: Link(url, name))
        self._default_prefetch = prefetch
        self._prefetch: dict[str, int] = {}
        self._background = BackgroundLoop()
        self._topology = Topology(self._prefix,
                                  lambda: self._links.get().connected(CONNECT_TIMEOUT))
        self._subscriptions: dict[str, Settings] = {}
        self.stats = {"refused_as_stale": 0, "malformed": 0, "expired": 0,
                      "consumers_cancelled": 0}

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def problems(self) -> list[str]:
        """What goes wrong that no call of the Subscriber's fails on: a publishing connection
        the broker blocked (a memory or disk alarm: publishes, delayed nacks and dead letters
        wait), delayed nacks that fail (and give back at once)."""
        return problems_of(self._links.values())

    def consuming(self, subscription: str) -> bool:
        """Whether this loop's consumer of ``subscription`` consumes (not paused, cancelled)."""
        consumer = self._links.get().consumers.get(subscription)
        return consumer is not None and consumer.alive and consumer.consumer_tag is not None

    def connection_attributes(self) -> dict[str, str | int]:
        """The broker's host and port from the URL, and the connection's name, for spans."""
        parts = urlsplit(self.url)
        found: dict[str, str | int] = {"messaging.client.id": self._name}
        if parts.hostname:
            found["server.address"] = parts.hostname
        found["server.port"] = parts.port or (5671 if parts.scheme == "amqps" else 5672)
        return found

    def _run_blocking(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self._background.run(coroutine, store=self)

    # -- administration -------------------------------------------------------------------

    async def ensure_subscription(self, topic: str, subscription: str, *,
                                  ack_deadline: float | None = None,
                                  delivery_limit: int | None = None,
                                  queue_arguments: dict[str, Any] | None = None,
                                  **options: Any) -> None:
        """Declare the exchange of ``topic`` and the quorum queue ``subscription`` bound to it
        (idempotent; the settings recorded first are kept).

        Args:
            ack_deadline: seconds a delivery may stay unacked before it is given back (kept by
                the adapter; RabbitMQ has no deadline of its own). Default: 30 for a new
                subscription; an existing one keeps the deadline it was made with (another
                one asked for is warned about).
            delivery_limit: the queue's ``x-delivery-limit`` (default: none). The Subscriber
                dead-letters after ``DeadLetterPolicy.max_delivery_attempts`` itself; a limit
                above that is a backstop: past it the broker drops the message (or moves it to
                the queue's own dead-letter exchange, if ``queue_arguments`` names one).
            queue_arguments: more arguments for the queue (``x-max-length``...).
            **options: ``retain_acked_messages`` is accepted for portability; a queue
                deletes what is acked.
        """
        options.pop("retain_acked_messages", None)
        if options:
            raise ConfigurationError(
                f"RabbitMQAdapter.ensure_subscription got unknown options {sorted(options)}; "
                "allowed: ack_deadline, delivery_limit, queue_arguments, retain_acked_messages")
        check_name("topic", topic)
        check_subscription(self._prefix, subscription)
        asked = ack_deadline
        ack_deadline = DEFAULT_ACK_DEADLINE if ack_deadline is None else ack_deadline
        if not (isinstance(ack_deadline, int | float) and ack_deadline > 0
                and math.isfinite(ack_deadline)):
            raise ConfigurationError(
                f"ensure_subscription: ack_deadline must be in (0, inf), got {ack_deadline!r}")
        if delivery_limit is not None and (not isinstance(delivery_limit, int)
                                           or delivery_limit < 1):
            raise ConfigurationError(
                f"ensure_subscription: delivery_limit must be an int >= 1, got "
                f"{delivery_limit!r}")
        await self.ensure_topic(topic)
        recorded = await self._topology.record(subscription, Settings(topic, ack_deadline),
                                               asked_deadline=asked)
        arguments: dict[str, Any] = {"x-queue-type": "quorum", **(queue_arguments or {})}
        if delivery_limit is not None:
            arguments["x-delivery-limit"] = delivery_limit
        await self._topology.declare_queue(subscription, topic, arguments)
        self._subscriptions[subscription] = recorded

    def ensure_subscription_sync(self, topic: str, subscription: str, **options: Any) -> None:
        """Blocking twin of :meth:`ensure_subscription`."""
        self._run_blocking(self.ensure_subscription(topic, subscription, **options))

    async def ensure_topic(self, topic: str) -> None:
        """Declare the durable fanout exchange ``topic`` (an exchange of another type by that
        name is refused)."""
        check_name("topic", topic)
        async with self._topology.channel() as channel:
            try:
                await channel.declare_exchange(topic, aio_pika.ExchangeType.FANOUT, durable=True)
            except aio_pika.exceptions.ChannelPreconditionFailed as error:
                raise ConfigurationError(
                    f"exchange {topic!r} exists but is not a durable fanout exchange: "
                    f"{error}") from None
        self._links.get().topics.add(topic)

    def ensure_topic_sync(self, topic: str) -> None:
        """Blocking twin of :meth:`ensure_topic`."""
        self._run_blocking(self.ensure_topic(topic))

    async def topic_exists(self, topic: str) -> bool:
        """Whether the exchange ``topic`` exists."""
        check_name("topic", topic)
        async with self._topology.channel() as channel:
            try:
                await channel.get_exchange(topic, ensure=True)
            except ChannelNotFoundEntity:
                return False
        return True

    def dedup_namespace(self, subscription: str) -> str:
        """``rabbitmq:<prefix>:<queue>``: a queue belongs to one topic, and message ids are
        unique only within what one publisher sent."""
        return f"rabbitmq:{self._prefix}:{subscription}"

    async def subscription_ack_deadline(self, subscription: str) -> float:
        return (await self._subscription(subscription)).ack_deadline

    async def subscription_topic(self, subscription: str) -> str:
        return (await self._subscription(subscription)).topic

    async def _subscription(self, name: str) -> Settings:
        found = self._subscriptions.get(name)
        if found is None:
            check_subscription(self._prefix, name)
            found = await self._topology.read(name, wait=SETTINGS_WAIT)
            if found is None:
                raise UnknownSubscriptionError(
                    f"subscription {name!r} does not exist; create it with ensure_subscription")
            self._subscriptions[name] = found
        return found

    async def subscription_stats(self, subscription: str) -> SubscriptionStats:
        """The ack deadline; the backlog and what is in flight from the management API
        (``management_url``), else unknown (``unknown_because`` says why when the API failed):
        AMQP tells a queue's *ready* messages only, and a consumer's prefetch makes most of a
        backlog unacked rather than ready. The oldest age is unknown (quorum queues)."""
        deadline = (await self._subscription(subscription)).ack_deadline
        management, unlisted = self._management, False
        if management is not None:
            try:
                figures = await management.figures(subscription)
            except Unlisted:
                unlisted = True
            else:
                if figures is not None:  # None: the API did not answer (logged)
                    return SubscriptionStats(figures.backlog, figures.in_flight, None, deadline)
        await self._topology.check_queue(subscription)  # its ready count alone: no backlog
        if management is not None and unlisted:
            management.warn_unlisted(subscription)
        why = None if management is None or unlisted else management.failing  # None: no API
        return SubscriptionStats(None, None, None, deadline, unknown_because=why)

    # -- publishing ------------------------------------------------------------------------

    async def publish(self, topic: str, data: Payload, attributes: dict[str, str] | None = None,
                      ordering_key: str | None = None) -> str:
        with self._publishing.send(topic, attributes) as attributes:
            payload, checked = checked_message(data, attributes)
            return await self._publish(topic, outgoing(payload, checked, ordering_key))

    async def publish_routed(self, topic: str, data: bytes,
                             attributes: dict[str, str] | None = None) -> str:
        """Publish as :meth:`publish` does, with ``mandatory``: ``UnroutableError`` when the
        exchange has no queue bound (the broker returned the message; nothing was kept). Dead
        letters go this way."""
        with self._publishing.send(topic, attributes) as attributes:
            payload, checked = checked_message(data, attributes)
            return await self._publish(topic, outgoing(payload, checked, None), routed=True)

    async def _publish(self, topic: str, message: aio_pika.Message, routed: bool = False) -> str:
        check_name("topic", topic)
        link = self._links.get()
        if topic not in link.topics:  # checked on a channel of its own: a NOT_FOUND closes it
            if not await self.topic_exists(topic):
                raise UnknownTopicError(
                    f"topic {topic!r} does not exist; create it with ensure_topic or "
                    "ensure_subscription")
            link.topics.add(topic)
        return await send(link, topic, message, routed, CONNECT_TIMEOUT)

    async def publish_many(self, messages: Sequence[Outgoing]) -> list[str | Exception]:
        """Publish ``messages`` on one channel, their confirms in flight together; returns
        each one's message id or the error that refused it."""
        async def one(message: Outgoing) -> str:
            payload, checked = checked_message(message.data, message.attributes)
            return await self._publish(message.topic,
                                       outgoing(payload, checked, message.ordering_key))

        began = time.perf_counter()
        results = await asyncio.gather(*(one(m) for m in messages), return_exceptions=True)
        sent = [r if isinstance(r, str | Exception) else Exception(repr(r)) for r in results]
        self._publishing.sent_many(messages, sent, began)
        return sent

    def publish_sync(self, topic: str, data: Payload, attributes: dict[str, str] | None = None,
                     ordering_key: str | None = None) -> str:
        """Blocking twin of :meth:`publish` (runs it on this adapter's background loop)."""
        return self._run_blocking(self.publish(topic, data, attributes, ordering_key))

    # -- consuming -------------------------------------------------------------------------

    def set_prefetch(self, subscription: str, messages: int) -> None:
        """The prefetch of ``subscription``'s consumer from now on (a Subscriber sets its
        flow-control window, ``FlowControl.max_messages``, when it starts)."""
        if not isinstance(messages, int) or isinstance(messages, bool) or messages < 1:
            raise ConfigurationError(f"set_prefetch: messages must be an int >= 1, got "
                                     f"{messages!r}")
        self._prefetch[subscription] = messages

    async def _consumer(self, subscription: str, settings: Settings) -> Consumer:
        prefetch = self._prefetch.get(subscription, self._default_prefetch)
        try:
            return await self._links.get().consumer(subscription, CONNECT_TIMEOUT, prefetch,
                                                    settings.ack_deadline, self.stats)
        except ChannelNotFoundEntity:
            raise UnknownSubscriptionError(
                f"queue {subscription!r} does not exist; create it with ensure_subscription"
            ) from None

    async def receive(self, subscription: str, max_messages: int, timeout: float
                      ) -> list[Delivery]:
        if max_messages < 1:
            raise ConfigurationError(f"receive: max_messages must be >= 1, got {max_messages}")
        settings = await self._subscription(subscription)
        loop = asyncio.get_running_loop()
        asked_at = loop.time()
        give_up = asked_at + max(0.0, timeout)
        while True:
            consumer = await self._consumer(subscription, settings)
            taken = consumer.take(max_messages, settings.ack_deadline, asked_at)
            if taken:
                return read_each(
                    taken, functools.partial(self._delivery, consumer, subscription),
                    functools.partial(self._unreadable, consumer, subscription))
            remaining = give_up - loop.time()
            if remaining <= 0:  # nothing came: is the connection alive? (it may stall)
                await self._links.get().check_alive(consumer)
                return []
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(consumer.arrived.wait(), remaining)
            await consumer.gather(max_messages)

    def _delivery(self, consumer: Consumer, subscription: str,
                  raw: AbstractIncomingMessage) -> Delivery:
        message, problem = incoming(raw, subscription)
        ack_id = f"{consumer.generation}.{raw.delivery_tag}"
        if problem is not None:
            self.stats["malformed"] += 1
            logger.warning("message %s of queue %r cannot be read as a message: %s", message.id,
                           subscription, problem)
        return Delivery(message, ack_id, malformed=problem)

    def _unreadable(self, consumer: Consumer, subscription: str,
                    raw: AbstractIncomingMessage, problem: str) -> Delivery:
        self.stats["malformed"] += 1
        return Delivery(unreadable(raw, subscription), f"{consumer.generation}.{raw.delivery_tag}",
                        malformed=problem)

    def _live(self, deliveries: Sequence[Delivery]
              ) -> tuple[dict[str, tuple[Consumer, list[int]]], list[Delivery]]:
        live, stale = held_tags(self._links.get().consumers, deliveries)
        if stale:
            self.stats["refused_as_stale"] += len(stale)
        return live, stale

    async def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        live, stale = self._live(deliveries)
        for consumer, tags in live.values():
            await consumer.ack(tags)
        return stale

    async def nack(self, deliveries: Sequence[Delivery], delay: float = 0.0) -> None:
        live, _ = self._live(deliveries)
        attempts = {d.ack_id: d.message.delivery_attempt for d in deliveries}
        for subscription, (consumer, tags) in live.items():
            if delay <= 0:
                await consumer.requeue(tags)
            else:
                await hold_back(self._topology, self._links.get(), CONNECT_TIMEOUT,
                                subscription, consumer, tags, attempts, delay)

    async def extend(self, deliveries: Sequence[Delivery], seconds: float) -> list[Delivery]:
        live, stale = self._live(deliveries)
        for consumer, tags in live.values():
            for tag in tags:
                consumer.extend(tag, seconds)
        return stale

    async def close(self) -> None:
        """Close this loop's connection (what its consumers held goes back to the queues);
        reconnects on next use."""
        link = self._links.pop()
        if link is not None:
            await link.close()

    def close_sync(self) -> None:
        """Close the blocking twins' connection (on the adapter's background loop)."""
        self._background.run(self.close())



__all__ = ["CAPABILITIES", "DEFAULT_URL", "RabbitMQAdapter"]
