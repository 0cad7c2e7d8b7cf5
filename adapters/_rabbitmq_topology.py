"""What the RabbitMQ adapter keeps at the broker beside the exchanges and queues it serves:
each subscription's settings, and its delay queues.

Settings (topic, ack deadline) are one JSON message in the classic queue
``{prefix}.settings.{subscription}`` (``x-max-length: 1`` with ``x-overflow: reject-publish``:
a second publish is refused, so the settings recorded first are kept). AMQP cannot read a
queue's arguments or bindings; a message can be read with ``basic.get`` and given back.

A delay queue ``{prefix}.delay.{subscription}.{ms}`` holds copies of nacked messages for ``ms``
(``x-message-ttl``), then dead-letters them to the subscription's queue through the default
exchange. One length per queue keeps each queue first-in first-out: a short delay never waits
behind a long one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aio_pika
import aio_pika.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.exceptions import ChannelNotFoundEntity

from reliable_sub.errors import ConfigurationError, UnknownSubscriptionError

logger = logging.getLogger("reliable_sub.adapters.rabbitmq")

# How long a reader waits for the settings message another reader holds for a moment.
SETTINGS_WAIT = 2.0
# Delay queues: lengths from 0.1 s, each the square root of two longer than the last.
_FIRST_DELAY_MS = 100
# What an exchange or queue name may hold: the characters the AMQP client (pamqp) sends, at
# most the 255 bytes of an AMQP short string.
_NAME = re.compile(r"^[a-zA-Z0-9_.:@#,/+ -]{1,255}$")
_MAX_NAME_BYTES = 255
# The delay-queue suffix a subscription's name must leave room for: ".<ms>", 12 digits (delays of
# up to 31 years; the longest stepped length is about 20 hours, longer delays are their own ms).
_LONGEST_DELAY_SUFFIX = len(".") + 12


def check_name(kind: str, name: str) -> str:
    """``name`` if it may name an exchange or queue, else a ConfigurationError."""
    if not isinstance(name, str) or not _NAME.match(name) or name.startswith("amq."):
        raise ConfigurationError(
            f"a RabbitMQ {kind} name must be 1-255 letters, digits, spaces or any of - _ . : @ "
            f"# , / + (what an AMQP client sends) and not start with 'amq.' (reserved by the "
            f"broker), got {name!r}")
    return name


def check_subscription(prefix: str, subscription: str) -> str:
    """``subscription`` if it and the queues named after it (its settings and delay queues,
    ``{prefix}.settings.{name}``, ``{prefix}.delay.{name}.{ms}``) fit AMQP's 255 bytes: with a
    name that just fits, every backoff would fail to declare its delay queue."""
    check_name("subscription", subscription)
    longest = max(len(f"{prefix}.settings.{subscription}"),
                  len(f"{prefix}.delay.{subscription}") + _LONGEST_DELAY_SUFFIX)
    if longest > _MAX_NAME_BYTES:
        room = _MAX_NAME_BYTES - (longest - len(subscription))
        raise ConfigurationError(
            f"RabbitMQ subscription name {subscription[:60]!r}... is {len(subscription)} "
            f"characters; with the prefix {prefix!r} its delay queues' names would pass AMQP's "
            f"{_MAX_NAME_BYTES} bytes: use at most {room} characters (or a shorter prefix)")
    return subscription


@dataclass(frozen=True)
class Settings:
    """A subscription's settings, as recorded at the broker."""

    topic: str
    ack_deadline: float


def delay_bucket(delay: float) -> int:
    """The delay queue length (ms) for ``delay`` seconds: the first at least as long."""
    wanted = max(delay * 1000.0, _FIRST_DELAY_MS)
    step = math.ceil(2 * math.log2(wanted / _FIRST_DELAY_MS) - 1e-9)
    millis = math.ceil(_FIRST_DELAY_MS * 2 ** (step / 2))
    return millis if millis >= wanted else math.ceil(wanted)


def delay_lengths() -> list[int]:
    """Every delay queue length (ms) ``delay_bucket`` gives, up to about 20 hours: what a clean-up
    tries, as AMQP cannot list a subscription's delay queues."""
    return sorted({delay_bucket(_FIRST_DELAY_MS / 1000 * 2 ** (step / 2)) for step in range(40)})


class Topology:
    """Settings and delay queues under one prefix, on connections ``connect`` gives."""

    def __init__(self, prefix: str,
                 connect: Callable[[], Awaitable[AbstractConnection]]) -> None:
        self.prefix = prefix
        self._connect = connect

    @contextlib.asynccontextmanager
    async def channel(self, confirms: bool = False) -> AsyncIterator[AbstractChannel]:
        """A short-lived channel (a refused declare closes it, not a long-lived one)."""
        channel = await (await self._connect()).channel(publisher_confirms=confirms)
        try:
            yield channel
        finally:
            if not channel.is_closed:
                with contextlib.suppress(Exception):
                    await channel.close()

    def settings_queue(self, subscription: str) -> str:
        return f"{self.prefix}.settings.{subscription}"

    async def declare_queue(self, subscription: str, topic: str,
                            arguments: dict[str, Any]) -> None:
        """Declare the durable queue ``subscription`` with ``arguments``, bound to ``topic``."""
        async with self.channel() as channel:
            try:
                queue = await channel.declare_queue(subscription, durable=True,
                                                    arguments=arguments)
            except aio_pika.exceptions.ChannelPreconditionFailed as error:
                raise ConfigurationError(
                    f"queue {subscription!r} exists with other arguments than "
                    f"{sorted(arguments.items())} ({error}); a queue's arguments cannot "
                    "change: delete the queue (its messages with it), or set the limit by a "
                    "policy (rabbitmqctl set_policy ... '{\"delivery-limit\": N}')") from None
            await queue.bind(topic, routing_key="")

    async def record(self, subscription: str, settings: Settings,
                     asked_deadline: float | None = None) -> Settings:
        """Record ``settings`` unless some are; the recorded ones. A subscription belongs to
        one topic (ConfigurationError); its ack deadline is the first recorded (another one
        asked for, ``asked_deadline``, is warned about)."""
        recorded = await self._record(subscription, settings)
        if recorded.topic != settings.topic:
            raise ConfigurationError(
                f"subscription {subscription!r} already exists on topic {recorded.topic!r}, "
                f"not {settings.topic!r}; a subscription (queue) belongs to one topic: choose "
                "another name")
        if asked_deadline is not None and recorded.ack_deadline != asked_deadline:
            logger.warning("subscription %r keeps the ack deadline it was made with, %gs, not "
                           "the %gs asked for (its settings are recorded once: delete the queue "
                           "and %r to change them)", subscription, recorded.ack_deadline,
                           asked_deadline, self.settings_queue(subscription))
        return recorded

    async def _record(self, subscription: str, settings: Settings) -> Settings:
        name = self.settings_queue(subscription)
        async with self.channel() as channel:
            await channel.declare_queue(name, durable=True, arguments={
                "x-max-length": 1, "x-overflow": "reject-publish"})
        found = await self.read(subscription, wait=0.0)
        if found is not None:
            return found
        body = json.dumps({"topic": settings.topic, "ack_deadline": settings.ack_deadline})
        async with self.channel(confirms=True) as channel:
            with contextlib.suppress(aio_pika.exceptions.DeliveryError):  # another was first
                await channel.default_exchange.publish(
                    aio_pika.Message(body.encode(),
                                     delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                    routing_key=name)
        found = await self.read(subscription, wait=SETTINGS_WAIT)
        if found is None:
            raise ConfigurationError(
                f"the settings of subscription {subscription!r} could not be recorded in "
                f"queue {name!r}")
        return found

    async def read(self, subscription: str, wait: float) -> Settings | None:
        """The recorded settings (None: none recorded). The message is taken with
        ``basic.get`` and given back; a reader finding the queue empty while another holds it
        looks again for up to ``wait`` seconds."""
        name = self.settings_queue(subscription)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wait
        async with self.channel() as channel:
            try:
                queue = await channel.get_queue(name, ensure=True)
            except ChannelNotFoundEntity:
                return None
            while True:
                message = await queue.get(no_ack=False, fail=False)
                if message is not None:
                    try:
                        recorded = json.loads(message.body)
                        return Settings(str(recorded["topic"]),
                                        float(recorded["ack_deadline"]))
                    finally:
                        await message.reject(requeue=True)
                if loop.time() >= give_up:
                    return None
                await asyncio.sleep(0.05)

    async def check_queue(self, name: str) -> None:
        """UnknownSubscriptionError unless the queue ``name`` exists (a passive declare)."""
        async with self.channel() as channel:
            try:
                await channel.declare_queue(name, passive=True)
            except ChannelNotFoundEntity:
                raise UnknownSubscriptionError(f"queue {name!r} is gone") from None

    async def delay_queue(self, subscription: str, delay: float, known: set[str]) -> str:
        """The delay queue of ``subscription`` for ``delay`` (rounded up), declared unless in
        ``known`` (then added to it)."""
        millis = delay_bucket(delay)
        name = f"{self.prefix}.delay.{subscription}.{millis}"
        if name not in known:
            async with self.channel() as channel:
                await channel.declare_queue(name, durable=True, arguments={
                    "x-message-ttl": millis, "x-dead-letter-exchange": "",
                    "x-dead-letter-routing-key": subscription})
            known.add(name)
        return name
