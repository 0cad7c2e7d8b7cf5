"""A chaos world's objects on a RabbitMQ node, seen from outside the consumers: what is left in
its queues, and their removal.

The world's topic is the fanout exchange ``<name>-orders``, its subscription the quorum queue
``<name>-shipping`` (its settings queue and delay queues named after it, under the world's
prefix, its name). AMQP tells a queue's *ready* messages only (what consumers hold is
invisible without the management plugin), so :meth:`RabbitQueues.backlog` is exact only once
no consumer is connected: the broker has then taken back everything they held.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aio_pika
import aio_pika.exceptions
import aiormq.exceptions

from reliable_sub.adapters._rabbitmq_topology import delay_lengths

# Delay queues a backlog reading looks into: every length up to twice the longest backoff a
# scenario's consumers use (delay lengths round a backoff up by at most 41%); a scenario's
# deferrals and delayed nacks wait no longer.
LONGEST_DELAY = 10.0
# A reading or a removal on a node that is not there (killed, or stalled) gives up after this.
CALL_TIMEOUT = 10.0


class RabbitQueues:
    """The queues of one world on the node at ``url`` (a connection of the test's own)."""

    def __init__(self, url: str, prefix: str, topic: str, subscription: str) -> None:
        self.url = url
        self.topic = topic
        self.subscription = subscription
        self.settings_queue = f"{prefix}.settings.{subscription}"
        self.delay_queues = [f"{prefix}.delay.{subscription}.{ms}" for ms in delay_lengths()]
        self.waited_in = [name for name, ms in zip(self.delay_queues, delay_lengths(),
                                                   strict=True)
                          if ms <= 2000 * LONGEST_DELAY]

    async def backlog(self) -> dict[str, int]:
        """The ready messages of the subscription's queue and of each delay queue that holds
        some (by queue name); only what consumers hold is left out."""
        found: dict[str, int] = {}
        connection = await asyncio.wait_for(aio_pika.connect(self.url), CALL_TIMEOUT)
        try:
            channel = await connection.channel()
            for name in [self.subscription, *self.waited_in]:
                try:
                    queue = await asyncio.wait_for(
                        channel.declare_queue(name, passive=True), CALL_TIMEOUT)
                except aio_pika.exceptions.ChannelNotFoundEntity:
                    channel = await connection.channel()  # the NOT_FOUND closed it
                    continue
                ready = int(queue.declaration_result.message_count or 0)
                if ready:
                    found[name] = ready
        finally:
            await connection.close()
        return found

    async def consumers(self) -> int:
        """How many consumers the subscription's queue has now."""
        connection = await asyncio.wait_for(aio_pika.connect(self.url), CALL_TIMEOUT)
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(self.subscription, passive=True)
            return int(queue.declaration_result.consumer_count or 0)
        finally:
            await connection.close()

    async def delete(self) -> None:
        """Delete the world's queues and exchange (those that do not exist: fine); a node that
        is gone is left alone (a private one is killed with its data)."""
        with contextlib.suppress(OSError, asyncio.TimeoutError, aiormq.exceptions.AMQPError):
            connection: Any = await asyncio.wait_for(aio_pika.connect(self.url), CALL_TIMEOUT)
            try:
                channel = await connection.channel()
                for name in [self.subscription, self.settings_queue, *self.delay_queues]:
                    await asyncio.wait_for(channel.queue_delete(name), CALL_TIMEOUT)
                await channel.exchange_delete(self.topic)
            finally:
                await connection.close()


__all__ = ["RabbitQueues"]
