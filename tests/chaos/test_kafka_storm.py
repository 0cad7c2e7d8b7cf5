"""Kafka rebalance storms with real consumer processes (#45): three consumers in one group on a
12-partition topic, joining, leaving, SIGTERMed and SIGKILLed while messages flow, effects
counted outside the consumers (``tests/chaos/consumer.py``).

Each fault, drawn at random: a SIGKILL (the process is started again at once; its partitions
move when its session times out, 6 s), a SIGTERM and restart (a deploy: a graceful stop commits
and leaves the group), or a SIGTERM without a restart (a member leaves; it joins again at the
next fault that is not a leave). Every one of them is a rebalance.

* SQL transactional path: every effect exactly once, none lost;
* Redis dedup store: none lost; duplicate effects only from kills between an effect and its
  completion record (the Redis store's crash window, see docs/reliability.md), counted;
* no dedup store: none lost; the duplicates (a kill, or a lease that lapsed, redelivers what
  ran) are counted and reported.

By default 3,000 messages over 8 s and at least 6 faults, with the SQL path and without a
store, to keep the chaos lane short; with ``RELIABLE_SUB_KAFKA_STORM=full`` the issue's size:
20,000 messages over 40 s and 30 faults, with the Redis store too.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.chaos import report
from tests.chaos.fleet import Fleet
from tests.chaos.scenario import (
    CONSUMERS,
    STOP_TIMEOUT,
    drain,
    final_count,
    running_world,
    under_load,
)
from tests.kafka_processes import KafkaBroker

pytest.importorskip("confluent_kafka", reason='the Kafka tests need "reliable-sub[kafka]"')

FULL = os.environ.get("RELIABLE_SUB_KAFKA_STORM") == "full"
MESSAGES, LOAD_SECONDS, FAULTS = (20_000, 40.0, 30) if FULL else (3_000, 8.0, 6)
FAULT_INTERVAL = (1.0, 2.0)
STORMS = [("kafka", "sql"), ("kafka", "none")] + ([("kafka", "redis")] if FULL else [])


class Storm:
    """The faults of one run, drawn by ``rng``, and what they were."""

    def __init__(self, fleet: Fleet, rng: random.Random) -> None:
        self.fleet, self.rng = fleet, rng
        self.away: int | None = None  # the member that left, to join at the next fault
        self.kinds = {"kill": 0, "deploy": 0, "leave": 0, "join": 0}

    async def __call__(self) -> None:
        fleet = self.fleet
        if self.away is not None:
            await fleet.start(self.away)
            self.kinds["join"] += 1
            self.away = None
        kind = self.rng.choice(["kill", "kill", "deploy", "leave"])
        number = self.rng.randrange(fleet.size)
        self.kinds[kind] += 1
        if kind == "kill":
            fleet.kill(number)
            fleet.spawn(number)  # as a supervisor restarts it, without waiting
        elif kind == "deploy":
            await fleet.terminate(number, within=30)
            await fleet.start(number)
        else:
            await fleet.terminate(number, within=30)
            self.away = number

    async def rejoin(self) -> None:
        if self.away is not None:
            await self.fleet.start(self.away)
            self.away = None


@pytest.mark.parametrize(("adapter_kind", "dedup"), STORMS)
async def test_rebalance_storm(kafka_broker: KafkaBroker, adapter_kind: str,
                               dedup: str) -> None:
    rng = random.Random(f"kafka-storm-{dedup}-{MESSAGES}")
    async with running_world(adapter_kind, dedup, broker_url=kafka_broker.bootstrap,
                             messages=MESSAGES, load_seconds=LOAD_SECONDS
                             ) as (world, fleet, adapter):
        storm = Storm(fleet, rng)

        async def fault() -> None:
            await storm()

        seconds = await under_load(world, fleet, adapter, fault, rng, FAULT_INTERVAL,
                                   min_faults=FAULTS, settle=False)
        await storm.rejoin()
        await drain(world, adapter)
        await fleet.terminate_all(within=STOP_TIMEOUT + 10)
        count = await final_count(world)
    faults = ", ".join(f"{n} {kind}s" for kind, n in storm.kinds.items() if n)
    report.record(report.Row(f"rebalance storm, {CONSUMERS} members, 12 partitions",
                             adapter_kind, dedup, count, faults=faults, seconds=seconds))
    assert sum(storm.kinds.values()) - storm.kinds["join"] >= FAULTS, storm.kinds
    assert count.lost == 0, count
    if dedup == "sql":
        assert count.duplicate_effects == 0, count
    print(f"kafka storm {dedup}: {count} after {faults} in {seconds:.0f}s")
