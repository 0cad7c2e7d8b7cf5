"""Apache Kafka: a topic is a topic, a subscription a consumer group on it; acks become commits.

Client. librdkafka through confluent-kafka (measured against aiokafka on this project's
machines: ``benchmarks/kafka_clients_spike.py``): cooperative-sticky rebalancing, rebalance
callbacks the poll waits for, commit metadata read back, and a faster producer.

Layout. Subscription ``billing`` on topic ``orders`` is the consumer group ``billing``
subscribed to ``orders``. Its settings (topic, ack deadline, ordering) are a record in the
compacted topic ``{prefix}-subscriptions`` (``_kafka_admin``), so every consumer agrees on them
and ``subscription_topic`` works from the name alone. ``ensure_subscription`` creates the topic
when missing and commits the group's start (the end of each partition: a new subscription gets
what is published from then on, as on the other brokers; ``start="earliest"`` for all that is
retained).

Acks. Kafka has no per-message ack and no ack deadline. Each subscription has a consumer whose
poll loop runs on a thread of its own (``_kafka_consumer``); the adapter keeps each delivery's
deadline and hands it out again when it lapses. An ack settles one record; per partition the
adapter commits the lowest offset not settled and, in the commit metadata, what is settled above
it and how often each unsettled record was delivered (``_kafka_offsets``). A nack keeps the
record (its offset uncommitted) and hands it out again when its delay is over, without holding
up the partition's other keys (``_kafka_records``). ``delivery_attempt`` is the deliveries
counted so, kept in the group's commit metadata across restarts and rebalances.

Messages (``_kafka_messages``): the message id is ``topic/partition/offset``; the ordering key is
the record key; attributes are headers. Publishing (``_kafka_publishing``) uses an idempotent
producer with ``acks=all``, one per event loop (the blocking twins have their own, on the
adapter's background loop).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from reliable_sub._loops import PerLoop
from reliable_sub.errors import (
    ConfigurationError,
    MissingExtraError,
    UnknownSubscriptionError,
    UnknownTopicError,
)
from reliable_sub.idempotency._background_loop import BackgroundLoop
from reliable_sub.message import Delivery, Message
from reliable_sub.ports import (
    Capabilities,
    Outgoing,
    Payload,
    SubscriptionStats,
    checked_message,
)
from reliable_sub.telemetry.publishing import InstrumentedPublishing

try:
    import confluent_kafka  # noqa: F401

    from reliable_sub.adapters._kafka_admin import Admin, Settings
    from reliable_sub.adapters._kafka_figures import figures_of
    from reliable_sub.adapters._kafka_messages import outgoing
    from reliable_sub.adapters._kafka_options import (
        check_adapter_options,
        check_name,
        seconds,
        subscription_options,
    )
    from reliable_sub.adapters._kafka_publishing import (
        ProducerLink,
        producer_config_of,
        publish_each,
    )
    from reliable_sub.adapters._kafka_receiving import JOIN_TIMEOUT, Consumers, consumer_config_of
    from reliable_sub.adapters._kafka_records import KEY
    from reliable_sub.adapters._kafka_seeking import SeekableKafka, Seeking, SeekRefusedError
    from reliable_sub.adapters._kafka_transactions import (
        StaleDeliveryError,
        hold,
        output_of,
        transactional_config,
    )
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise MissingExtraError("KafkaAdapter", "kafka", "confluent-kafka") from error

T = TypeVar("T")
# librdkafka's own log lines (connections, rebalances), as Python log records.
CLIENT_LOGGER = logging.getLogger("reliable_sub.adapters.kafka.client")

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_PREFIX = "reliable-sub"
DEFAULT_ACK_DEADLINE = 30.0
# Records of a partition waiting for a receive before it is paused. At 1,000 a backlog drain
# paused every partition again and again, and librdkafka refetched what each pause dropped:
# (c) of benchmarks/kafka.py drained 9,720 records/s; at 10,000, with librdkafka's prefetch as
# deep, 45,055 (medians of three alternated runs).
DEFAULT_BUFFER = 10_000

CAPABILITIES = Capabilities(
    min_ack_deadline=0.0,
    max_ack_deadline=math.inf,  # kept by the adapter: any length
    native_dead_letter=False,
    native_retry_backoff=False,
    exactly_once=False,  # an ack is committed a moment later, unconfirmed
    seek=True,  # the partitions this adapter's consumers own, or a group with no member
    ordering=True,  # the Subscriber runs one message per record key at a time
    delivery_attempt_exact=True,  # kept in the group's commit metadata
    refuses_stale_acks=True,
    cancel_safe_receive=True,  # records are taken from memory with no await in between
    messaging_system="kafka",
    partition_owned=True,  # a partition's records go to its owner in the group, and only it
)


class KafkaAdapter(SeekableKafka, InstrumentedPublishing):
    """Consume from and publish to Apache Kafka (see the module's docstring for the mapping;
    seek and snapshots: :class:`~reliable_sub.adapters._kafka_seeking.SeekableKafka`).

    Args:
        bootstrap: ``host:port[,host:port...]``, the client's ``bootstrap.servers``.
        prefix: the settings topic's prefix (``{prefix}-subscriptions``) and this adapter's
            dedup namespaces'.
        client_id: the clients' ``client.id`` (what the brokers' logs and quotas name).
        partitions: partitions of the topics this adapter creates (None: the broker's
            ``num.partitions``); ``ensure_subscription(partitions=...)`` chooses per topic.
        replication_factor: replicas of the topics it creates (None: the broker's default).
        rebalance: ``"cooperative"`` (cooperative-sticky: a rebalance moves only the partitions
            that change owner) or ``"eager"`` (every member gives everything back first).
        revoke_timeout: seconds a revoked partition's deliveries out get to be settled before
            it is let go (their dedup claims then keep the new owner from running them twice).
        buffer: records of one partition fetched and not yet received before the partition is
            paused (resumed at half); librdkafka's prefetch (``queued.min.messages``) is as
            deep, unless ``consumer_config`` sets it.
        commit_interval: seconds between a partition's commits while its state changes.
        publish_timeout: seconds a publish may wait for the brokers' acknowledgement.
        config: librdkafka settings for every client (``security.protocol``, ``sasl.*`` ...).
        consumer_config, producer_config: librdkafka settings for the consumers or producers
            only (``session.timeout.ms``, ``linger.ms`` ...), over the adapter's own.
        transactional_id: turns on Kafka transactions for every subscription this adapter
            consumes: what handlers publish with :meth:`publish_in_transaction` commits with
            the consumed offsets, in one transaction per commit (the producer's id is
            ``{transactional_id}.{subscription}``; give each process its own, stable across its
            restarts: a pod's name).
    """

    def __init__(self, bootstrap: str = DEFAULT_BOOTSTRAP, *, prefix: str = DEFAULT_PREFIX,
                 client_id: str = "reliable-sub", partitions: int | None = None,
                 replication_factor: int | None = None, rebalance: str = "cooperative",
                 revoke_timeout: float = 10.0, buffer: int = DEFAULT_BUFFER,
                 commit_interval: float = 0.1, publish_timeout: float = 30.0,
                 config: dict[str, Any] | None = None,
                 consumer_config: dict[str, Any] | None = None,
                 producer_config: dict[str, Any] | None = None,
                 transactional_id: str | None = None) -> None:
        check_adapter_options(bootstrap, rebalance, partitions, replication_factor, buffer,
                              transactional_id)
        self._transactional_id = transactional_id
        self.bootstrap = bootstrap
        self._prefix = check_name("prefix", prefix)
        self._client_id = client_id
        self._partitions = partitions
        self._replication = replication_factor
        self._revoke_timeout = seconds("KafkaAdapter.revoke_timeout", revoke_timeout, -1e-9)
        self._buffer = buffer
        self._commit_interval = seconds("KafkaAdapter.commit_interval", commit_interval)
        self._publish_timeout = seconds("KafkaAdapter.publish_timeout", publish_timeout)
        base = {"bootstrap.servers": bootstrap, "client.id": client_id,
                "logger": CLIENT_LOGGER, **(config or {})}
        self._base = base
        self._consumer_config, self._eager = consumer_config_of(base, rebalance,
                                                                consumer_config or {}, buffer)
        self._producer_config = producer_config_of(base, self._publish_timeout,
                                                   producer_config or {})
        self._admin = Admin(base, f"{self._prefix}-subscriptions")
        self._seeking = Seeking(self._admin, f"{self._prefix}-snapshots", self._publish_raw)
        self._consumers = Consumers(
            self._consumer_config, bootstrap, revoke_timeout=self._revoke_timeout,
            buffer=buffer, commit_interval=self._commit_interval, eager=self._eager,
            transactions=None if transactional_id is None else transactional_config(
                self._producer_config, transactional_id))
        self._producers: PerLoop[ProducerLink] = PerLoop(
            lambda: ProducerLink(self._producer_config, self._publish_timeout))
        self._background = BackgroundLoop()
        self._subscriptions: dict[str, Settings] = {}
        self._topics: set[str] = set()  # known to exist

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def connection_attributes(self) -> dict[str, str | int]:
        """The first bootstrap server and the client id, for spans."""
        host, _, port = self.bootstrap.split(",")[0].strip().rpartition(":")
        found: dict[str, str | int] = {"messaging.client.id": self._client_id}
        if host:
            found["server.address"] = host.strip("[]")
        if port.isdigit():
            found["server.port"] = int(port)
        return found

    def _run_blocking(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self._background.run(coroutine, store=self)

    # -- administration ---------------------------------------------------------------------

    async def ensure_subscription(self, topic: str, subscription: str, *,
                                  ack_deadline: float = DEFAULT_ACK_DEADLINE,
                                  ordering: bool | str = KEY, partitions: int | None = None,
                                  replication_factor: int | None = None, start: str = "latest",
                                  topic_config: dict[str, str] | None = None,
                                  **options: Any) -> None:
        """Create ``topic`` if missing and record the consumer group ``subscription`` on it
        (idempotent; the settings recorded first are kept).

        Args:
            ack_deadline: seconds a delivery may stay unacked before it is handed out again
                (kept by the adapter; Kafka has no deadline of its own).
            ordering: ``"key"`` (or True): records of one key in order, one at a time, keys in
                parallel; ``"partition"``: one record of a partition at a time; ``"none"`` (or
                False): no order, and messages carry no ordering key.
            partitions, replication_factor, topic_config: for the topic if it is created.
            start: ``"latest"``: what is published from now on; ``"earliest"``: also what the
                topic retains.
            **options: ``retain_acked_messages`` is accepted for portability (Kafka retains
                everything for the topic's retention, acked or not).
        """
        deadline, mode = subscription_options(topic, subscription, ack_deadline, ordering,
                                              start, options)
        await self._ensure_topic(topic, partitions, replication_factor, topic_config)
        recorded = await self._admin.record_settings(
            subscription, Settings(topic, deadline, mode), self._publish_raw)
        if recorded.topic != topic:
            raise ConfigurationError(
                f"subscription {subscription!r} already exists on topic {recorded.topic!r}, "
                f"not {topic!r}; a subscription (consumer group) belongs to one topic: choose "
                "another name")
        if start == "latest":
            await self._admin.start_at_end(subscription, topic)
        self._subscriptions[subscription] = recorded

    def ensure_subscription_sync(self, topic: str, subscription: str, **options: Any) -> None:
        """Blocking twin of :meth:`ensure_subscription`."""
        self._run_blocking(self.ensure_subscription(topic, subscription, **options))

    async def _ensure_topic(self, topic: str, partitions: int | None = None,
                            replication_factor: int | None = None,
                            config: dict[str, str] | None = None) -> None:
        if topic in self._topics:
            return
        if await self._admin.partitions(topic) is None:
            await self._admin.create_topic(
                topic, partitions or self._partitions, replication_factor or self._replication,
                config)
        self._topics.add(topic)

    async def ensure_topic(self, topic: str) -> None:
        """Create ``topic`` if missing (with the adapter's ``partitions`` and
        ``replication_factor``)."""
        await self._ensure_topic(check_name("topic", topic))

    def ensure_topic_sync(self, topic: str) -> None:
        """Blocking twin of :meth:`ensure_topic`."""
        self._run_blocking(self.ensure_topic(topic))

    async def topic_exists(self, topic: str) -> bool:
        """Whether ``topic`` exists (never creates it)."""
        found = await self._admin.partitions(check_name("topic", topic)) is not None
        if found:
            self._topics.add(topic)
        return found

    def dedup_namespace(self, subscription: str) -> str:
        """``kafka:<prefix>:<group>``: message ids (``topic/partition/offset``) are unique
        within a subscription's one topic."""
        return f"kafka:{self._prefix}:{subscription}"

    async def subscription_ack_deadline(self, subscription: str) -> float:
        return (await self._subscription(subscription)).ack_deadline

    async def subscription_topic(self, subscription: str) -> str:
        return (await self._subscription(subscription)).topic

    async def _subscription(self, name: str) -> Settings:
        found = self._subscriptions.get(name)
        if found is None:
            found = (await self._admin.read_settings()).get(name)
            if found is None:
                raise UnknownSubscriptionError(
                    f"subscription {name!r} does not exist; create it with ensure_subscription")
            self._subscriptions[name] = found
        return found

    async def subscription_stats(self, subscription: str) -> SubscriptionStats:
        """The exact backlog (per partition: the end offset less the committed one and what is
        settled above it), what this adapter's consumers have out, and the oldest unacked
        message's age where this adapter holds it (else unknown)."""
        settings = await self._subscription(subscription)
        local = [c.figures() for c in self._consumers.all_of(subscription)]
        return await figures_of(self._admin, subscription, settings, local)

    # -- publishing --------------------------------------------------------------------------

    async def publish(self, topic: str, data: Payload, attributes: dict[str, str] | None = None,
                      ordering_key: str | None = None) -> str:
        with self._publishing.send(topic, attributes) as attributes:
            payload, checked = checked_message(data, attributes)
            await self._known(topic)
            key, headers = outgoing(checked, ordering_key)
            return await self._producers.get().publish(topic, payload, key, headers)

    async def _publish_raw(self, topic: str, key: bytes, value: bytes | None) -> str:
        return await self._producers.get().publish(topic, value, key, [])

    async def _known(self, topic: str) -> None:
        check_name("topic", topic)
        if topic not in self._topics and not await self.topic_exists(topic):
            raise UnknownTopicError(f"topic {topic!r} does not exist; create it with "
                                    "ensure_topic or ensure_subscription")

    async def publish_many(self, messages: Sequence[Outgoing]) -> list[str | Exception]:
        """Publish ``messages`` in one go (sent in order, so one key's keep theirs), their
        delivery reports awaited together; returns each one's message id or its error."""
        began = time.perf_counter()
        results = await publish_each(self._producers.get(), messages, self._known)
        self._publishing.sent_many(messages, results, began)
        return results

    async def publish_in_transaction(self, message: Message, topic: str, data: Payload,
                                     attributes: dict[str, str] | None = None,
                                     ordering_key: str | None = None) -> None:
        """Publish a record in the Kafka transaction that commits ``message``'s offset: it is
        kept with the delivery and produced, with the offset, when the message is acked; a
        ``read_committed`` reader sees it exactly once. Dropped if the handler fails (the next
        attempt publishes its own). Needs ``KafkaAdapter(transactional_id=...)``.

        Raises:
            ConfigurationError: transactions are off.
            UnknownTopicError, InvalidMessageError: the record could never be produced (so it
                fails this attempt, not the transaction).
            StaleDeliveryError: ``message`` is not held by this adapter now (its lease ended,
                or its partition went to another member).
        """
        if self._transactional_id is None:
            raise ConfigurationError(
                "publish_in_transaction needs Kafka transactions: "
                "KafkaAdapter(..., transactional_id='<this process's stable name>')")
        payload, checked = checked_message(data, attributes)
        await self._known(topic)
        key, headers = outgoing(checked, ordering_key)
        hold(self._consumers.all_of(message.subscription or ""), message,
             output_of(topic, payload, key, headers, self._producer_config))

    def publish_in_transaction_sync(self, message: Message, topic: str, data: Payload,
                                    attributes: dict[str, str] | None = None,
                                    ordering_key: str | None = None) -> None:
        """Blocking twin of :meth:`publish_in_transaction`, for sync handlers."""
        self._run_blocking(self.publish_in_transaction(message, topic, data, attributes,
                                                       ordering_key))

    def publish_sync(self, topic: str, data: Payload, attributes: dict[str, str] | None = None,
                     ordering_key: str | None = None) -> str:
        """Blocking twin of :meth:`publish` (on this adapter's background loop and producer)."""
        return self._run_blocking(self.publish(topic, data, attributes, ordering_key))

    # -- consuming ---------------------------------------------------------------------------

    async def receive(self, subscription: str, max_messages: int, timeout: float
                      ) -> list[Delivery]:
        """Up to ``max_messages`` records within ``timeout`` seconds (a first receive of a
        subscription first waits, up to ``JOIN_TIMEOUT``, for the group to assign partitions)."""
        settings = await self._subscription(subscription)
        return await self._consumers.receive(subscription, settings, max_messages, timeout)

    async def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        return self._consumers.ack(deliveries)

    async def nack(self, deliveries: Sequence[Delivery], delay: float = 0.0) -> None:
        self._consumers.nack(deliveries, delay)

    async def extend(self, deliveries: Sequence[Delivery], seconds: float) -> list[Delivery]:
        return self._consumers.extend(deliveries, seconds)

    async def close(self) -> None:
        """Commit and leave the groups of this loop's consumers, and flush its producer;
        everything opens again on next use."""
        await self._consumers.close()
        link = self._producers.pop()
        if link is not None:
            await asyncio.to_thread(link.close, self._publish_timeout)

    def close_sync(self) -> None:
        """Flush and drop the blocking twins' producer (on the adapter's background loop)."""
        self._background.run(self.close())


__all__ = ["CAPABILITIES", "DEFAULT_BOOTSTRAP", "JOIN_TIMEOUT", "KafkaAdapter", "SeekRefusedError",
           "StaleDeliveryError"]
