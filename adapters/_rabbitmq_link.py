"""The RabbitMQ adapter's connections in one event loop.

A :class:`Link` is two AMQP connections: one for consuming (a
:class:`~reliable_sub.adapters._rabbitmq_consumer.Consumer` per subscription, each on a channel
of its own; declares and settings reads go there too) and one for publishing (a channel with
publisher confirms: publishes, delayed copies, dead letters). Apart, as RabbitMQ advises: during
a resource alarm the broker blocks every connection that publishes and stops reading from it, and
acks written on a blocked connection would wait with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection

from reliable_sub.adapters._rabbitmq_consumer import Consumer
from reliable_sub.adapters._rabbitmq_errors import connect_error, quiet_aiormq

# A receive that finds nothing checks the consumer's connection when the broker was not heard
# from for this long (seconds): about one round trip a second while idle.
LIVENESS_INTERVAL = 1.0
# ... and counts it stalled when the check is not answered within this (a local broker answers
# in a millisecond; under the Subscriber's bound on a receive call, twice its timeout + 2 s).
LIVENESS_TIMEOUT = 2.0
# Seconds a stalled connection's close may take before it is left to the garbage collector.
RETIRE_TIMEOUT = 5.0
# Seconds a failed delayed nack is reported for, unless one succeeds before: as long as a
# Subscriber's health remembers a failing call (its default unhealthy_after).
DELAY_FAILURE_REPORTED = 30.0
# What health says while the broker blocks the publishing connection.
BLOCKED = ("the broker blocked the publishing connection (connection.blocked: a memory or disk "
           "alarm); publishes, delayed nacks and dead letters wait until it lifts "
           "(rabbitmq-diagnostics alarms)")

quiet_aiormq()  # aiormq's own connection-failure lines: ours report them (_rabbitmq_errors)


@dataclass
class Link:
    """This event loop's two connections (consuming, publishing), its publishing channel and
    its consumers."""

    url: str
    name: str
    connection: AbstractConnection | None = None
    publisher_connection: AbstractConnection | None = None
    publisher: AbstractChannel | None = None
    consumers: dict[str, Consumer] = field(default_factory=dict)
    topics: set[str] = field(default_factory=set)  # exchanges known to exist
    delay_queues: set[str] = field(default_factory=set)  # declared by this link
    copying: dict[str, asyncio.Event] = field(default_factory=dict)  # see _rabbitmq_delays
    # subscriptions whose last delayed nack failed (given back at once instead): why, and when
    # (time.monotonic())
    delays_failing: dict[str, tuple[str, float]] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _retiring: set[asyncio.Future[None]] = field(default_factory=set)  # stalled, closing

    async def connected(self, timeout: float) -> aio_pika.abc.AbstractConnection:
        """The consuming connection (also for declares and reads of settings)."""
        if self.connection is None or self.connection.is_closed:
            async with self.lock:
                if self.connection is None or self.connection.is_closed:
                    self._drop_consumers()
                    connection = await self._connect(timeout, "")
                    # aio-pika's is_closed tells only a close asked for on this side: a
                    # connection the broker closed, or that dropped, would be kept for ever
                    connection.close_callbacks.add(lambda *_: self._lost(connection))
                    self.connection = connection
        assert self.connection is not None
        return self.connection

    async def _connect(self, timeout: float, role: str) -> aio_pika.abc.AbstractConnection:
        try:
            return await aio_pika.connect(self.url, timeout=timeout, client_properties={
                "connection_name": f"{self.name}{role}"})
        except BaseException as error:
            ours = connect_error(error, self.url, timeout)
            if ours is None:
                raise
            raise ours from error

    async def check_alive(self, consumer: Consumer) -> None:
        """After a receive that found nothing: unless the broker was heard from lately, ask it
        something on the consumer's channel (a ``basic.qos`` of the same prefetch). With no
        answer the connection stalls (nothing moves, nothing is closed: receive would hand out
        nothing for ever, and acks are unanswered writes): it is retired, and the call fails so
        the Subscriber's health tells it."""
        loop = asyncio.get_running_loop()
        if loop.time() - consumer.heard < LIVENESS_INTERVAL or not consumer.alive:
            return
        try:
            await asyncio.wait_for(consumer.channel.set_qos(prefetch_count=consumer.prefetch),
                                   LIVENESS_TIMEOUT)
        except asyncio.TimeoutError:
            connection, self.connection = self.connection, None
            self._drop_consumers()
            if connection is not None:  # closing waits on the stalled socket: in the background
                self._retiring.add(task := asyncio.ensure_future(_close(connection)))
                task.add_done_callback(self._retiring.discard)
            raise ConnectionError(
                f"RabbitMQ did not answer on the consumer channel of {consumer.queue.name!r} "
                f"within {LIVENESS_TIMEOUT:g}s: the connection stalls; connecting again") from None
        consumer.heard = loop.time()

    def _lost(self, connection: aio_pika.abc.AbstractConnection) -> None:
        """``connection`` closed, whoever closed it: the next call connects anew (what its
        channels held, the broker requeued)."""
        if self.connection is connection:
            self._drop_consumers()
            self.connection = None
        if self.publisher_connection is connection:
            self.publisher_connection, self.publisher = None, None

    async def publishing(self, timeout: float) -> AbstractChannel:
        """The publishing channel (publisher confirms), on the publishing connection."""
        if self.publisher is None or self.publisher.is_closed:
            async with self.lock:
                if self.publisher is None or self.publisher.is_closed:
                    connection = self.publisher_connection
                    if connection is None or connection.is_closed:
                        connection = await self._connect(timeout, " (publishing)")
                        connection.close_callbacks.add(
                            lambda *_, c=connection: self._lost(c))
                        self.publisher_connection = connection
                    self.publisher = await connection.channel(publisher_confirms=True)
        return self.publisher

    async def drop_publisher(self, channel: AbstractChannel | None,
                             connection_too: bool) -> None:
        """``channel`` failed under a publish: the next publish opens a new one (and a new
        connection, if ``connection_too``), unless that happened meanwhile."""
        async with self.lock:
            if self.publisher is channel:
                self.publisher = None
            connection = self.publisher_connection
            # the channel's connection (aio-pika keeps it as _connection): another publish may
            # have opened a new channel on it meanwhile, which the broker's close takes too
            if (connection_too and connection is not None
                    and getattr(channel, "_connection", connection) in (connection, None)):
                self.publisher_connection = self.publisher = None
                with contextlib.suppress(Exception):
                    await connection.close()

    @property
    def publishing_blocked(self) -> bool:
        """Whether the broker blocked the publishing connection (``connection.blocked``: a
        memory or disk alarm); publishes wait until it lifts. aiormq keeps this to itself, in
        the event its writer waits on."""
        connection = self.publisher_connection
        transport = None if connection is None else connection.transport
        unblocked = getattr(getattr(transport, "connection", None),
                            "_Connection__connection_unblocked", None)
        return isinstance(unblocked, asyncio.Event) and not unblocked.is_set()

    async def consumer(self, queue: str, timeout: float, prefetch: int,
                       idle_limit: float, stats: dict[str, int]) -> Consumer:
        """The consumer of ``queue`` (a new channel and ``basic.consume`` if it has none, its
        channel closed, or its prefetch is another); resumed if it was paused."""
        found = self.consumers.get(queue)
        if found is not None and found.alive and found.prefetch == prefetch:
            if found.consumer_tag is None:
                await found.resume()
            return found
        if found is not None:
            with contextlib.suppress(Exception):
                await found.flush_acks()
            found.forget()
            with contextlib.suppress(Exception):
                await found.channel.close()  # what it held goes back to the queue
        connection = await self.connected(timeout)
        channel = await connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=prefetch)
        amqp_queue = await channel.get_queue(queue, ensure=True)
        consumer = Consumer(amqp_queue, channel, prefetch, idle_limit, stats)
        channel.close_callbacks.add(lambda *_: consumer.forget())
        await consumer.watch_cancels()
        consumer.consumer_tag = await amqp_queue.consume(consumer.pushed)
        self.consumers[queue] = consumer
        return consumer

    def _drop_consumers(self) -> None:
        for consumer in self.consumers.values():
            consumer.forget()
        self.consumers.clear()

    async def close(self) -> None:
        for consumer in list(self.consumers.values()):
            with contextlib.suppress(Exception):  # a channel gone: the broker requeued them
                await consumer.flush_acks()
                await consumer.give_back_buffer()
        self._drop_consumers()
        connections = (self.connection, self.publisher_connection)
        self.connection = self.publisher_connection = self.publisher = None
        for connection in connections:
            if connection is not None and not connection.is_closed:
                with contextlib.suppress(Exception):
                    await connection.close()


def problems_of(links: list[Link]) -> list[str]:
    """What the adapter's links see going wrong that no call fails on (for health)."""
    found = [BLOCKED] if any(link.publishing_blocked for link in links) else []
    recent = time.monotonic() - DELAY_FAILURE_REPORTED
    found += [f"delayed nacks of {subscription!r} fail ({why}): deliveries are given back at "
              "once instead of after their backoff"
              for link in links for subscription, (why, when) in list(link.delays_failing.items())
              if when >= recent]
    return found


async def _close(connection: aio_pika.abc.AbstractConnection) -> None:
    with contextlib.suppress(Exception):  # a stalled connection may fail to close any way
        await asyncio.wait_for(connection.close(), RETIRE_TIMEOUT)
