"""Publishing on the RabbitMQ adapter's link: one message, confirmed, on the publishing channel.

aio-pika hands back a message the broker returned (``mandatory``: no queue bound) instead of
raising; a routed publish turns that into ``UnroutableError``. A NOT_FOUND for an exchange closes
the channel under every publish then in flight on it (and a frame that still reaches the closed
channel makes the broker close the whole connection): a publish that failed so for another
exchange's sake is sent again on a new channel, twice at most.
"""

from __future__ import annotations

import re

import aio_pika
import aiormq.abc
from aiormq.exceptions import (
    ChannelInvalidStateError,
    ChannelNotFoundEntity,
    ConnectionChannelError,
)

from reliable_sub.adapters._rabbitmq_link import Link
from reliable_sub.errors import UnknownTopicError, UnroutableError

_NO_EXCHANGE = re.compile(r"no exchange '(.*)' in vhost")


def missing_exchange(error: Exception) -> str | None:
    """The exchange a NOT_FOUND names (``no exchange 'orders' in vhost '/'``), if one."""
    found = _NO_EXCHANGE.search(str(error))
    return found.group(1) if found else None


async def send(link: Link, topic: str, message: aio_pika.Message, routed: bool,
               timeout: float) -> str:
    """Publish ``message`` to the exchange ``topic`` and wait for its confirm; its id.
    ``routed``: ``UnroutableError`` when no queue is bound (nothing was kept)."""
    channel = None
    for last_try in (False, False, True):
        try:
            channel = await link.publishing(timeout)
            exchange = await channel.get_exchange(topic, ensure=False)
            result = await exchange.publish(message, routing_key="", mandatory=routed)
        except ChannelNotFoundEntity as error:
            if missing_exchange(error) == topic:
                link.topics.discard(topic)
                raise UnknownTopicError(
                    f"topic {topic!r} does not exist (any more)") from None
            if last_try:
                raise
            await link.drop_publisher(channel, False)  # as below
            continue
        except (ChannelInvalidStateError, ConnectionChannelError) as error:
            # the publishing channel closed under this publish (another, to an exchange
            # deleted meanwhile, got a NOT_FOUND; the broker closes the whole connection
            # on a frame that reached the closed channel): sent again on a new one
            if last_try:
                raise
            await link.drop_publisher(channel, isinstance(error, ConnectionChannelError))
            continue
        if routed and isinstance(result, aiormq.abc.DeliveredMessage):
            raise UnroutableError(
                f"topic {topic!r} has no queue bound: the broker returned the message "
                f"(create a subscription with ensure_subscription({topic!r}, ...))")
        return str(message.message_id)
    raise AssertionError("unreachable")  # pragma: no cover
