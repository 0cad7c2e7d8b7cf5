"""The conformance harness of the Kafka adapter (a module of its own: ``harness.py`` holds the
others and is at its size limit)."""

from __future__ import annotations

import uuid

from reliable_sub.clock import SystemClock
from reliable_sub.ports import Adapter
from reliable_sub.testing.cleanup import delete_kafka_names
from reliable_sub.testing.harness import Features, Harness


def kafka_harness(bootstrap: str, ack_deadline: float = 2.0) -> Harness:
    """A real Kafka cluster at ``bootstrap``. Real time, as on NATS; two partitions per topic
    (two consumers of one subscription both get work). Eager rebalancing: librdkafka sends a
    JoinGroup at most once a second, so under cooperative-sticky (two rounds) a consumer that
    joins gets its partitions a second or more later, after the suite's 40-message sharing
    test is over; the cooperative default has its own tests (tests/test_kafka_rebalance.py).
    Heartbeats every 100 ms (a statistics timer wakes librdkafka's main thread that often; it
    otherwise looks at the heartbeat twice a second), so a rebalance starts at once. No broker
    address for the stall test: a Kafka client connects to the addresses the cluster
    advertises, not through a proxy in front of the bootstrap server. The run's topics and
    groups are deleted afterwards."""
    from reliable_sub.adapters.kafka import KafkaAdapter

    prefix = f"conf-{uuid.uuid4().hex[:10]}"
    fast_groups = {"heartbeat.interval.ms": 100, "session.timeout.ms": 6000,
                   "statistics.interval.ms": 100, "stats_cb": _ignore}

    async def new_adapter() -> Adapter:
        return KafkaAdapter(bootstrap, prefix=prefix, partitions=2, rebalance="eager",
                            revoke_timeout=ack_deadline, consumer_config=fast_groups)

    async def cleanup() -> None:
        await delete_kafka_names(bootstrap, [*harness.names, f"{prefix}-subscriptions",
                                             f"{prefix}-snapshots"])

    harness = Harness(name="kafka", clock=SystemClock(), ack_deadline=ack_deadline, tick=0.1,
                      new_adapter=new_adapter, prefix=prefix, cleanup=cleanup,
                      features=Features(ordering=True, cancel_safe_receive=True,
                                        partition_owned=True))
    return harness


def _ignore(_: str) -> None:
    """librdkafka's statistics, unread."""


__all__ = ["kafka_harness"]
