"""A Kafka subscription's figures: its exact backlog, what is out, the oldest unacked age.

Per partition, the backlog is the end offset (the last stable offset a ``read_committed``
consumer reads up to) less the committed offset, less what is settled above that: from the
state of this adapter's own consumer where it owns the partition (fresher than the group's last
commit), from the commit metadata otherwise. A partition without a commit counts from its
earliest retained offset (``auto.offset.reset=earliest``). Offsets that hold no record
(transaction markers) count as backlog until a consumer passes them.

``in_flight`` is known when this adapter's consumers own every partition (what they have out),
or when there is no backlog (0); otherwise another group member's deliveries count too, which
no broker call tells: unknown. ``oldest_unacked_age`` is known when the oldest unsettled record
of every partition with a backlog is in this adapter's hands, and unknown otherwise (reading
another member's would cost a fetch per partition).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from reliable_sub.adapters._kafka_admin import Admin, Settings
from reliable_sub.adapters._kafka_consumer import PartitionFigures
from reliable_sub.adapters._kafka_messages import publish_time
from reliable_sub.adapters._kafka_offsets import decode, settled_between
from reliable_sub.ports import SubscriptionStats


async def figures_of(admin: Admin, subscription: str, settings: Settings,
                     local: Sequence[dict[int, PartitionFigures]]) -> SubscriptionStats:
    """The figures of ``subscription`` (``local``: the figures of this adapter's consumers)."""
    topic = settings.topic
    partitions = await admin.partitions(topic) or []
    committed = await admin.group_offsets(subscription, topic)
    ends = await admin.offsets(topic, partitions)
    uncommitted = [p for p in partitions if p not in committed]
    earliest = await admin.offsets(topic, uncommitted, latest=False) if uncommitted else {}
    owned: dict[int, PartitionFigures] = {}
    for figures in local:
        owned.update({p: f for p, f in figures.items() if f.mark >= 0})
    backlog = in_flight = 0
    oldest: float | None = None
    age_known = True
    for partition in partitions:
        end = ends.get(partition, 0)
        mine = owned.get(partition)
        if mine is not None:
            mark, runs = mine.mark, mine.runs
            in_flight += mine.held
        else:
            mark, metadata = committed.get(partition, (earliest.get(partition, 0), None))
            runs = decode(metadata)
        waiting = max(0, end - mark - settled_between(mark, runs, end))
        backlog += waiting
        if not waiting:
            continue
        stamp = None if mine is None or mine.oldest is None else publish_time(mine.oldest)
        if stamp is None:
            age_known = False
        elif oldest is None or stamp.timestamp() < oldest:
            oldest = stamp.timestamp()
    age = None if not age_known or oldest is None else max(0.0, time.time() - oldest)
    known = not backlog or all(p in owned for p in partitions)
    return SubscriptionStats(backlog, in_flight if known else None, age, settings.ack_deadline)


__all__ = ["figures_of"]
