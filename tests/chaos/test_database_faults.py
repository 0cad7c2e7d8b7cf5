"""PostgreSQL connections terminated under load (scenario 4 of the chaos suite).

The transactional path on Redis Streams (the handler's effect and its dedup record in one
PostgreSQL transaction); every 2-3 s every database connection of the three consumers is
terminated with ``pg_terminate_backend``: claims, transactions and completions fail mid-way.
Handlers fail and messages are retried; nothing may be lost or doubled.
"""

from __future__ import annotations

import random

from tests.chaos import report
from tests.chaos.scenario import final_count, running_world, under_load

TERMINATE_INTERVAL = (2.0, 3.0)


async def test_database_connections_terminated_on_the_transactional_path() -> None:
    rng = random.Random("pg-terminate")
    terminated: list[int] = []
    async with running_world("redis", "sql") as (world, fleet, adapter):

        async def terminate() -> None:
            terminated.append(world.terminate_database_connections())

        seconds = await under_load(world, fleet, adapter, terminate, rng, TERMINATE_INTERVAL)
        count = await final_count(world)
    retried = fleet.outcome_total("retried")
    report.record(report.Row(
        "PostgreSQL connections terminated every 2-3 s", "redis", "sql", count,
        faults=f"{sum(terminated)} connections in {len(terminated)} rounds; {retried} retries",
        seconds=seconds))
    assert sum(terminated) >= 3 and retried > 0, "the fault must land on handlers"
    assert count.lost == 0, count
    assert count.duplicate_effects == 0, count
