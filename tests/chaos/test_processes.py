"""Consumer processes killed and redeployed under load (scenarios 1 and 2 of the chaos suite).

**Kill storm**: 5,000 messages published over 10 s (the suite: 2,500 over 6 s, scenario.FULL_SIZE)
to 3 consumer processes (handlers 0-50 ms);
every 2-3 s a random consumer is SIGKILLed and restarted. **Rolling deploy**: the same load,
and the consumers are stopped with SIGTERM one after the other, waited for, and restarted. Effects
are recorded outside the consumers, per message, and counted at the end:

* SQL transactional path: every effect exactly once, none lost (even under kills);
* Redis dedup store: none lost; under kills a few duplicate effects (a kill between the effect
  and the completion record), none under a rolling deploy;
* no dedup: none lost; the duplicates under kills are the baseline dedup is measured against.

**Kill storm, long handlers**: handlers of 5-15 s, many times the ack deadline on Redis (2 s)
and up to one and a half on Pub/Sub (10 s), so every message is kept by lease extensions while
consumers die around it: 150 messages over 10 s, five kills 2-3 s apart (each process then lives
about as long as one handler), then the run waits for every message. The same guarantees. Its
two worlds (Redis Streams with the SQL path, Pub/Sub with the Redis store) run side by side:
their handlers mostly sleep, and one after the other they would add a minute to the suite. The
SQL world takes 60 messages: a transactional handler holds a connection of its pool while it
runs, and the consumers' pools (consumer.POOL_BUDGET) run about 15 at once, so its 150 waited
their turn for a connection and took 130 s, where 60 still keep every connection busy through
the kills.
"""

from __future__ import annotations

import functools
import random

import pytest

from tests.chaos import report
from tests.chaos.scenario import (
    CONSUMERS,
    final_count,
    running_world,
    side_by_side,
    under_load,
)

KILL_INTERVAL = (2.0, 3.0)
# A redeploy itself takes 2-3 s (a graceful stop, then a process start): the next one follows
# 0.5-1 s after it, so about three roll through the 10 s of load.
DEPLOY_INTERVAL = (0.5, 1.0)

# Long handlers: fewer messages (all of them run at once on Pub/Sub; on the SQL path as many as
# the pools allow, see the docstring), a bounded storm so that handlers can finish.
LONG_HANDLER_MS = (5_000.0, 15_000.0)
LONG_KILLS = 5
LONG_HANDLERS = [("redis", "sql", 60), ("pubsub", "redis", 150)]  # adapter, dedup, messages

KILL_STORM = [("redis", "sql"), ("redis", "redis"), ("redis", "none"),
              ("pubsub", "sql"), ("pubsub", "redis"), ("pubsub", "none")]
ROLLING_DEPLOY = [("redis", "redis"), ("redis", "sql"), ("pubsub", "redis")]


@pytest.mark.parametrize(("adapter_kind", "dedup"), KILL_STORM)
async def test_kill_storm(adapter_kind: str, dedup: str) -> None:
    rng = random.Random(f"kill-storm-{adapter_kind}-{dedup}")
    async with running_world(adapter_kind, dedup) as (world, fleet, adapter):
        kill_one = functools.partial(fleet.kill_and_respawn_one, rng)
        seconds = await under_load(world, fleet, adapter, kill_one, rng, KILL_INTERVAL)
        count = await final_count(world)
    report.record(report.Row("kill storm (SIGKILL every 2-3 s)", adapter_kind, dedup, count,
                             faults=f"{fleet.kills} kills", seconds=seconds))
    assert fleet.kills >= 3, "the storm must land"
    assert count.lost == 0, count
    if dedup == "sql":
        assert count.duplicate_effects == 0, count


async def long_handler_storm(adapter_kind: str, dedup: str, messages: int) -> None:
    rng = random.Random(f"kill-storm-long-{adapter_kind}-{dedup}")
    async with running_world(adapter_kind, dedup, messages=messages,
                             handler_ms=LONG_HANDLER_MS) as (world, fleet, adapter):
        kill_one = functools.partial(fleet.kill_and_respawn_one, rng)
        seconds = await under_load(world, fleet, adapter, kill_one, rng, KILL_INTERVAL,
                                   min_faults=LONG_KILLS, max_faults=LONG_KILLS)
        count = await final_count(world)
    report.record(report.Row("kill storm, handlers 5-15 s", adapter_kind, dedup, count,
                             faults=f"{fleet.kills} kills", seconds=seconds))
    where = f"{adapter_kind} with dedup {dedup}"
    assert fleet.kills == LONG_KILLS, where
    assert count.lost == 0, f"{where}: {count}"
    if dedup == "sql":
        assert count.duplicate_effects == 0, f"{where}: {count}"


async def test_kill_storm_with_long_handlers() -> None:
    await side_by_side(*(long_handler_storm(adapter_kind, dedup, messages)
                         for adapter_kind, dedup, messages in LONG_HANDLERS))


@pytest.mark.parametrize(("adapter_kind", "dedup"), ROLLING_DEPLOY)
async def test_rolling_deploy(adapter_kind: str, dedup: str) -> None:
    rng = random.Random(f"rolling-deploy-{adapter_kind}-{dedup}")
    async with running_world(adapter_kind, dedup) as (world, fleet, adapter):
        turn = iter(range(10**6))

        async def redeploy_next() -> None:
            number = next(turn) % CONSUMERS
            await fleet.terminate(number, within=30)
            await fleet.start(number)

        seconds = await under_load(world, fleet, adapter, redeploy_next, rng, DEPLOY_INTERVAL)
        count = await final_count(world)
    report.record(report.Row("rolling deploy (SIGTERM, restart)", adapter_kind, dedup, count,
                             faults=f"{fleet.terms - CONSUMERS} restarts", seconds=seconds))
    assert fleet.terms - CONSUMERS >= 3, "the deploy must roll"
    assert count.lost == 0, count
    assert count.duplicate_effects == 0, count
