"""``nack(delay)`` on RabbitMQ: each delivery's copy into a delay queue of its subscription
(``_rabbitmq_topology``), confirmed, then the delivery acked.

A copy the broker could not route (its delay queue deleted since this link declared it) is
confirmed all the same: aio-pika hands back the returned message instead of raising. Its
delivery is not acked but given back at once, and the queue forgotten, so the next delayed nack
declares it again. A copy that failed gives every delivery of the call back at once.
"""

from __future__ import annotations

import asyncio
import logging

import aiormq.abc

from reliable_sub.adapters._rabbitmq_link import Consumer, Link
from reliable_sub.adapters._rabbitmq_messages import delayed_copy
from reliable_sub.adapters._rabbitmq_topology import Topology

logger = logging.getLogger("reliable_sub.adapters.rabbitmq")


async def hold_back(topology: Topology, link: Link, timeout: float, subscription: str,
                    consumer: Consumer, tags: list[int], attempts: dict[str, int],
                    delay: float) -> None:
    """Hold ``consumer``'s deliveries ``tags`` back for ``delay`` seconds; ``attempts``: each
    delivery's attempt by ack id."""
    known = link.delay_queues
    try:
        queue = await topology.delay_queue(subscription, delay, known)
        unrouted = await _copied_then_acked(link, timeout, consumer, queue, tags, attempts)
    except Exception as error:  # a copy is not confirmed: give them all back at once
        logger.warning("holding %d deliveries of %r back for %gs failed (%s); given back at "
                       "once", len(tags), subscription, delay, error)
        await consumer.requeue(t for t in tags if t in consumer.held)
        return
    if unrouted:
        known.discard(queue)
        logger.warning("delay queue %r of %r does not exist (any more): %d deliveries given "
                       "back at once; it is declared again on the next delayed nack", queue,
                       subscription, len(unrouted))
        await consumer.requeue(t for t in unrouted if t in consumer.held)


async def _copied_then_acked(link: Link, timeout: float, consumer: Consumer, queue: str,
                             tags: list[int], attempts: dict[str, int]) -> list[int]:
    """Each delivery's copy into ``queue``, then the deliveries acked whose copies the broker
    routed; returns the others' tags (still held)."""
    channel = await link.publishing(timeout)
    copies = [delayed_copy(consumer.held[tag].message,
                           attempts.get(f"{consumer.generation}.{tag}", 1))
              for tag in tags]
    results = await asyncio.gather(*(channel.default_exchange.publish(copy, routing_key=queue)
                                     for copy in copies))
    unrouted = [tag for tag, result in zip(tags, results, strict=True)
                if isinstance(result, aiormq.abc.DeliveredMessage)]
    await consumer.ack([tag for tag in tags if tag not in unrouted])
    return unrouted
