"""``nack(delay)`` on RabbitMQ: each delivery's copy into a delay queue of its subscription
(``_rabbitmq_topology``), confirmed, then the delivery acked.

A copy the broker could not route (its delay queue deleted since this link declared it) is
confirmed all the same: aio-pika hands back the returned message instead of raising. Such a
delivery is not acked: the queue is declared again and the copy published once more, and if
that comes back too the delivery is given back at once. A copy that failed gives every delivery
of the call back at once.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aio_pika
import aiormq.abc
from aio_pika.abc import AbstractChannel

from reliable_sub.adapters._rabbitmq_consumer import Consumer
from reliable_sub.adapters._rabbitmq_link import Link
from reliable_sub.adapters._rabbitmq_messages import delayed_copy
from reliable_sub.adapters._rabbitmq_topology import Topology

logger = logging.getLogger("reliable_sub.adapters.rabbitmq")


async def hold_back(topology: Topology, link: Link, timeout: float, subscription: str,
                    consumer: Consumer, tags: list[int], attempts: dict[str, int],
                    delay: float) -> None:
    """Hold ``consumer``'s deliveries ``tags`` back for ``delay`` seconds; ``attempts``: each
    delivery's attempt by ack id."""
    # the copies are made before any await: a lease that ends meanwhile takes its tag out of
    # ``held`` (and gives the delivery back)
    copies = {tag: delayed_copy(consumer.held[tag].message,
                                attempts.get(f"{consumer.generation}.{tag}", 1))
              for tag in tags if tag in consumer.held}
    try:
        for last_try in (False, True):
            queue = await topology.delay_queue(subscription, delay, link.delay_queues)
            unrouted = await _copied(link, timeout, queue, copies)
            await consumer.ack([tag for tag in copies if tag not in unrouted
                                and tag in consumer.held])
            if not unrouted:
                link.delays_failing.pop(subscription, None)
                return
            link.delay_queues.discard(queue)  # deleted behind this link's back
            copies = {tag: copies[tag] for tag in unrouted}
            logger.warning("delay queue %r of %r does not exist (any more): %d copies routed "
                           "nowhere; %s", queue, subscription, len(unrouted),
                           "given back at once" if last_try else "declaring it again")
    except Exception as error:  # a copy is not confirmed: give them all back at once
        logger.warning("holding %d deliveries of %r back for %gs failed (%s); given back at "
                       "once", len(copies), subscription, delay, error)
        link.delays_failing[subscription] = (f"{type(error).__name__}: {error}"[:300],
                                             time.monotonic())
    await consumer.requeue(t for t in copies if t in consumer.held)


async def _copied(link: Link, timeout: float, queue: str,
                  copies: dict[int, aio_pika.Message]) -> set[int]:
    """Publish ``copies`` into ``queue``, confirmed; the tags of those the broker could not
    route."""
    channel = await link.publishing(timeout)
    results = await asyncio.gather(*(_publish(link, channel, copy, queue)
                                     for copy in copies.values()))
    return {tag for tag, result in zip(copies, results, strict=True)
            if isinstance(result, aiormq.abc.DeliveredMessage)}


async def _publish(link: Link, channel: AbstractChannel, copy: aio_pika.Message,
                   queue: str) -> object:
    """One copy published, confirmed. aiormq matches a returned message to its publish by
    message id, and a copy keeps its message's id: two copies of one message unconfirmed at
    once on the channel (duplicates in one batch, one message nacked on two subscriptions)
    could swap their results, and a lost copy's delivery be acked. So they go one at a time."""
    key = str(copy.message_id)
    while (earlier := link.copying.get(key)) is not None:
        await earlier.wait()
    done = link.copying[key] = asyncio.Event()
    try:
        return await channel.default_exchange.publish(copy, routing_key=queue)
    finally:
        del link.copying[key]
        done.set()
