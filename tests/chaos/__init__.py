"""The fault-injection scenarios (see conftest.py). They run in two lanes, one scenario at a
time in each: the Pub/Sub emulator's (its scenarios mostly wait out 10 s ack deadlines) and
everyone else's. Every scenario on PostgreSQL stays in the second lane: its consumer processes
hold pools of connections (bounded by consumer.POOL_BUDGET; unbounded, one scenario held 59),
and two such scenarios beside the other workers' tests went past the server's 100 connections
("too many clients already"). Some scenarios on Redis alone join the emulator's lane so that the
two take about as long (a run on 2026-11-27, alone: 549 s and 189 s before, ~370 s each after):
the longer lane is the end of the suite's run."""

from __future__ import annotations

PUBSUB_LANE, OTHER_LANE = "chaos-pubsub", "chaos"

# Scenarios that touch no PostgreSQL, run in the emulator's lane to balance the two.
_BESIDE_THE_EMULATOR = (
    "test_load_and_memory.py::test_a_drained_consumer_holds_nothing_per_message",
    "test_load_and_memory.py::test_a_store_full_of_redis_dedup_records_empties_by_expiry",
    "test_broker_faults.py::test_a_paused_broker",
    "test_broker_faults.py::test_a_broker_restarted_without_persistence",
)


def lane_of(nodeid: str) -> str:
    """The lane of the chaos scenario ``nodeid``."""
    _, _, name = nodeid.partition("::")
    if "sql" in name:
        return OTHER_LANE
    on_the_emulator = "pubsub" in name or "emulator" in name
    beside = any(scenario in nodeid for scenario in _BESIDE_THE_EMULATOR)
    return PUBSUB_LANE if on_the_emulator or beside else OTHER_LANE
