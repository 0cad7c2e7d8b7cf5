"""The fault-injection scenarios (see conftest.py). They run in lanes, one scenario at a
time in each, the lanes side by side (one worker each): every scenario starts consumer
processes that load the machine, and in a lane of its own a kind of scenario waits on its own
broker without piling its load on another of its kind.

* ``chaos-pubsub``: the Pub/Sub emulator's (its scenarios mostly wait out 10 s ack deadlines).
* ``chaos-sql``: every scenario on PostgreSQL. Their consumer processes hold pools of
  connections (bounded by consumer.POOL_BUDGET; unbounded, one scenario held 59): kept in one
  lane, two of them never add their pools to the other workers' tests at once. The server
  takes 300 connections (scripts/services.sh); the default 100 was once exceeded ("too many
  clients already").
* ``chaos-redis``: the rest on Redis Streams (kill storms without SQL, broker faults, the
  sabotage check, memory after a drain).
* ``chaos-stores``: the Redis dedup store's size check: it starts no consumer process and
  mostly waits for Redis's expiry (on a private redis-server).
* ``chaos-rabbitmq`` (tests/chaos/test_rabbitmq.py, every name with "rabbitmq" in it): most of
  their 70-110 s is waiting on the broker: a private node's boot (7 s) and its outage, a 15 s
  stall, delay queues, handlers of seconds.
* ``chaos-kafka``: the rebalance storms, each on the run's shared Kafka node (one of them
  on PostgreSQL as well: one such scenario beside the ``chaos-sql`` lane's stays well inside
  the server's connections).

Before the lanes were split this way, one lane held every scenario but the emulator's and
RabbitMQ's: some 680 s of one worker on a loaded run, the suite's critical path."""

from __future__ import annotations

PUBSUB_LANE, SQL_LANE, REDIS_LANE, STORES_LANE = (
    "chaos-pubsub", "chaos-sql", "chaos-redis", "chaos-stores")
RABBITMQ_LANE, KAFKA_LANE = "chaos-rabbitmq", "chaos-kafka"
_WAITING_CHECKS = ("test_a_store_full_of_redis_dedup_records_empties_by_expiry",)
# scenarios on PostgreSQL whose names do not say "sql"
_ON_POSTGRESQL = ("test_kill_storm_with_long_handlers",
                  "test_database_connections_terminated_on_the_transactional_path")


def lane_of(nodeid: str) -> str:
    """The lane of the chaos scenario ``nodeid``."""
    _, _, name = nodeid.partition("::")
    if name in _WAITING_CHECKS:
        return STORES_LANE
    if "rabbitmq" in name:
        return RABBITMQ_LANE
    if "kafka" in name:
        return KAFKA_LANE
    if "sql" in name or name.split("[")[0] in _ON_POSTGRESQL:
        return SQL_LANE
    return PUBSUB_LANE if "pubsub" in name or "emulator" in name else REDIS_LANE
