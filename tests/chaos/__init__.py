"""The fault-injection scenarios (see conftest.py). They run in lanes, one scenario at a
time in each: the Pub/Sub emulator's (its scenarios mostly wait out 10 s ack deadlines) and
everyone else's. Every scenario on PostgreSQL stays in the second lane: its consumer processes
hold pools of connections (bounded by consumer.POOL_BUDGET; unbounded, one scenario held 59),
and two such scenarios beside the other workers' tests went past the server's 100 connections
("too many clients already"). The Redis dedup store's size check starts no consumer process
and mostly waits for Redis's expiry (on a private redis-server): it takes a third lane, beside
the others, instead of adding ~25 s to the second one.

RabbitMQ's scenarios (tests/chaos/test_rabbitmq.py, every name with "rabbitmq" in it) take a
fourth lane. Most of their 70-110 s is waiting on the broker: a private node's boot (7 s) and its
outage, a 15 s stall, delay queues, handlers of seconds; in the second lane, the suite's critical
path, they would add all of it to CI's run, where beside it they add a share of two CPUs. Their
worlds already run side by side where they mostly wait, so the lane is three tests, one after
the other."""

from __future__ import annotations

PUBSUB_LANE, OTHER_LANE, STORES_LANE = "chaos-pubsub", "chaos", "chaos-stores"
RABBITMQ_LANE = "chaos-rabbitmq"
_WAITING_CHECKS = ("test_a_store_full_of_redis_dedup_records_empties_by_expiry",)


def lane_of(nodeid: str) -> str:
    """The lane of the chaos scenario ``nodeid``."""
    _, _, name = nodeid.partition("::")
    if name in _WAITING_CHECKS:
        return STORES_LANE
    if "rabbitmq" in name:
        return RABBITMQ_LANE
    on_the_emulator = "pubsub" in name or "emulator" in name
    return PUBSUB_LANE if on_the_emulator and "sql" not in name else OTHER_LANE
