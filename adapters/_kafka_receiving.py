"""The Kafka adapter's consuming side: one consumer per subscription and event loop, receive,
and the acks, nacks and extensions that settle what it handed out.

A :class:`Consumers` keeps each loop's :class:`~._kafka_consumer.SubscriptionConsumer` per
subscription, made at the first receive. That receive first waits (up to ``JOIN_TIMEOUT``) for
the group to assign partitions and for their first fetch to answer, so its own timeout counts
from when the consumer can deliver. A consumer that ended (it left the group for want of
receives, or its loop closed) is replaced by the next receive; one that failed raises its error
there once.

An ack id is ``generation.offset.attempt``: the partition's assignment, the record, and which
delivery of it. A delivery whose consumer is gone, whose partition was revoked, or that was
delivered again since, is stale: its ack and extend are refused and its nack ignored.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

from reliable_sub._loops import PerLoop
from reliable_sub.adapters._kafka_admin import Settings
from reliable_sub.adapters._kafka_consumer import ConsumerOptions, SubscriptionConsumer
from reliable_sub.adapters._kafka_messages import incoming, unreadable
from reliable_sub.adapters._kafka_records import NONE, Entry, PartitionQueue
from reliable_sub.entries import read_each
from reliable_sub.errors import ConfigurationError
from reliable_sub.message import Delivery

logger = logging.getLogger("reliable_sub.adapters.kafka")

# Seconds a first receive waits for the group to assign partitions before its own timeout runs.
JOIN_TIMEOUT = 30.0
# Seconds a close waits for a consumer's last commit and its leaving the group.
CLOSE_TIMEOUT = 15.0


def consumer_config_of(base: dict[str, Any], rebalance: str, overrides: dict[str, Any],
                       buffer: int) -> tuple[dict[str, Any], bool]:
    """The consumers' librdkafka settings over the clients' ``base``, and whether rebalances
    are eager (every member gives back everything) rather than incremental."""
    settings = {
        **base,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",  # a partition the group has no commit for
        "partition.assignment.strategy":
            "cooperative-sticky" if rebalance == "cooperative" else "range,roundrobin",
        "fetch.queue.backoff.ms": 10,  # librdkafka's 1 s default idles a busy consumer
        # librdkafka's own prefetch per partition, as deep as the adapter's buffer (its default,
        # 100,000, is dropped and fetched again whenever a full buffer pauses the partition)
        "queued.min.messages": buffer,
        **overrides,
    }
    if settings.get("group.protocol") == "consumer":  # KIP-848: the broker assigns
        settings.pop("partition.assignment.strategy", None)
        return settings, False
    return settings, "cooperative" not in str(settings["partition.assignment.strategy"])


class Consumers:
    """Every loop's consumers of one adapter (see the module's docstring).

    Args:
        config: the consumers' librdkafka settings (without ``group.id``).
        bootstrap: the servers, for error messages.
        options: the other fields of every :class:`ConsumerOptions` (revoke_timeout, ...).
    """

    def __init__(self, config: dict[str, Any], bootstrap: str, **options: Any) -> None:
        self._config = config
        self._bootstrap = bootstrap
        self._options = options
        self._by_loop: PerLoop[dict[str, SubscriptionConsumer]] = PerLoop(dict)

    def of(self, subscription: str, settings: Settings) -> SubscriptionConsumer:
        """This loop's consumer of ``subscription``, made now if it has none (or it ended)."""
        consumers = self._by_loop.get()
        found = consumers.get(subscription)
        if found is not None and found.finished:
            del consumers[subscription]
            if found.failure is not None:
                raise found.failure
            found = None
        if found is None:
            options = ConsumerOptions(
                settings.topic, subscription, settings.ack_deadline, settings.ordering,
                {**self._config, "group.id": subscription}, **self._options)
            found = consumers[subscription] = SubscriptionConsumer(
                options, asyncio.get_running_loop())
        return found

    def all_of(self, subscription: str) -> list[SubscriptionConsumer]:
        """Every loop's running consumer of ``subscription``."""
        return [found for consumers in self._by_loop.values()
                if (found := consumers.get(subscription)) is not None and not found.finished]

    async def receive(self, subscription: str, settings: Settings, max_messages: int,
                      timeout: float) -> list[Delivery]:
        if max_messages < 1:
            raise ConfigurationError(f"receive: max_messages must be >= 1, got {max_messages}")
        consumer = self.of(subscription, settings)
        if not consumer.joined:
            await self._join(consumer)
        give_up = time.monotonic() + max(0.0, timeout)
        while True:
            taken, version = consumer.take(max_messages)
            if taken:
                ordered = settings.ordering != NONE
                return read_each(taken, functools.partial(_delivery, subscription, ordered),
                                 functools.partial(_unreadable, subscription))
            if consumer.finished:  # it left the group, or failed
                consumer = self.of(subscription, settings)
                await self._join(consumer)
                continue
            now = time.monotonic()
            if now >= give_up:
                return []
            wait = give_up - now
            event = consumer.next_event()
            if event is not None:
                wait = min(wait, max(0.0, event - now))
            await consumer.changed(version, wait)

    async def _join(self, consumer: SubscriptionConsumer) -> None:
        give_up = time.monotonic() + JOIN_TIMEOUT
        while not consumer.joined:
            if consumer.finished:
                raise consumer.failure or ConnectionError(
                    f"the consumer of {consumer.options.subscription!r} ended before joining")
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                raise ConnectionError(
                    f"the consumer group {consumer.options.subscription!r} assigned no "
                    f"partitions within {JOIN_TIMEOUT:g}s; is Kafka at {self._bootstrap} "
                    "reachable?")
            await consumer.changed(consumer.version, remaining)

    def _grouped(self, deliveries: Sequence[Delivery]
                 ) -> tuple[list[tuple[SubscriptionConsumer, list[Delivery]]], list[Delivery]]:
        consumers = self._by_loop.peek() or {}
        grouped: dict[str, list[Delivery]] = {}
        stale: list[Delivery] = []
        for delivery in deliveries:
            name = delivery.message.subscription
            if name in consumers:
                grouped.setdefault(name, []).append(delivery)
            else:
                stale.append(delivery)
        return [(consumers[name], found) for name, found in grouped.items()], stale

    def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        groups, stale = self._grouped(deliveries)
        for consumer, found in groups:
            stale += consumer.settle(found, consumer.acked)
        return stale

    def nack(self, deliveries: Sequence[Delivery], delay: float) -> None:
        groups, _ = self._grouped(deliveries)
        for consumer, found in groups:
            consumer.settle(found, functools.partial(consumer.given_back, delay=delay))

    def extend(self, deliveries: Sequence[Delivery], seconds: float) -> list[Delivery]:
        groups, stale = self._grouped(deliveries)
        for consumer, found in groups:
            stale += consumer.settle(found, lambda queue, entry: queue.extend(
                entry, time.monotonic(), seconds))
        return stale

    async def close(self) -> None:
        """Commit and leave the groups of this loop's consumers."""
        consumers = self._by_loop.pop() or {}
        for consumer in consumers.values():
            consumer.stop()
        await asyncio.gather(*(c.wait_closed(CLOSE_TIMEOUT) for c in consumers.values()))


def _delivery(subscription: str, ordered: bool, item: tuple[PartitionQueue, Entry]) -> Delivery:
    queue, entry = item
    message, problem = incoming(entry.record, subscription, entry.attempts, ordered)
    return Delivery(message, f"{queue.generation}.{entry.offset}.{entry.attempts}",
                    malformed=problem)


def _unreadable(subscription: str, item: tuple[PartitionQueue, Entry], problem: str
                ) -> Delivery:
    queue, entry = item
    return Delivery(unreadable(entry.record, subscription, entry.attempts),
                    f"{queue.generation}.{entry.offset}.{entry.attempts}", malformed=problem)


__all__ = ["CLOSE_TIMEOUT", "JOIN_TIMEOUT", "Consumers", "consumer_config_of"]
