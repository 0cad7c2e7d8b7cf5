"""The broker goes away under load (scenario 3 of the chaos suite), on a private redis-server.

The same load as the other scenarios (5,000 messages over 10 s in the report run, 2,500 over 6 s
in the suite: scenario.FULL_SIZE; 3 consumer processes, the Redis
dedup store on the shared Redis, effects counted there); 3 s in, the broker:

* **pause**: is frozen with SIGSTOP for 10 s, then resumed with SIGCONT;
* **down**: is SIGKILLed, stays down for 10 s, and is started again **without persistence**:
  the stream, its group and every entry are gone. What was published before and not yet
  handled is lost with the broker's data; nothing published after it may be. It runs a second
  time with the dedup store on the broker's own server, whose records go with it (and whose
  scripts, acks and completions in one, must load again);
* **client kill**: drops every client connection (``CLIENT KILL TYPE normal``);

and on Pub/Sub, the emulator is killed, stays down for 10 s and is started again (empty: the
test then creates the topic and subscription again, as a deployment would).

The load is held while the broker is away. Each run reports the consumers' CPU time during the
outage (they must wait, not spin) and the recovery time: from the broker's return to the first
effect of a message published after it.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from reliable_sub.ports import Adapter
from reliable_sub.testing import services
from tests.chaos import report
from tests.chaos.fleet import Count, Fleet, Load, World
from tests.chaos.scenario import (
    FaultRun,
    Outage,
    final_count,
    one_fault,
    running_world,
)
from tests.redis_processes import RedisServer

OUTAGE_SECONDS = 10.0
# CPU seconds the three consumers may use together while the broker is away (10 s): waiting
# costs next to nothing (0.02-0.6 s measured); a retry loop without backoff would use most of a
# CPU each, tens of seconds together.
CPU_BUDGET = 2.0


@pytest.fixture
def broker(private_redis: RedisServer) -> RedisServer:
    """The broker: a private redis-server (tests/chaos/conftest.py)."""
    return private_redis


async def test_a_paused_broker(broker: RedisServer) -> None:
    async with running_world("redis", "redis", broker_url=broker.url) as (world, fleet, adapter):

        async def pause(load: Load) -> Outage:
            assert broker.process is not None
            await load.hold()
            cpu = fleet.cpu_seconds()
            broker.process.send_signal(signal.SIGSTOP)
            await asyncio.sleep(OUTAGE_SECONDS)  # the outage's length
            cpu = fleet.cpu_seconds() - cpu
            broker.process.send_signal(signal.SIGCONT)
            back = time.monotonic()
            load.release()
            return Outage(cpu, back, OUTAGE_SECONDS)

        run = await one_fault(world, fleet, adapter, pause)
        count = await final_count(world)
    _record("broker paused (SIGSTOP 10 s)", count, run)
    assert count.lost == 0, count
    assert run.outage.cpu_seconds < CPU_BUDGET, run


@pytest.mark.parametrize("dedup_on_broker", [False, True], ids=["dedup-apart", "dedup-on-broker"])
async def test_a_broker_restarted_without_persistence(
    broker: RedisServer, dedup_on_broker: bool
) -> None:
    """With the dedup store on the broker's own server (one Redis, acks and completions in one
    script), its records go with the broker's data, and the scripts must load again."""
    async with running_world("redis", "redis", broker_url=broker.url,
                             dedup_on_broker=dedup_on_broker) as (world, fleet, adapter):
        count, run, lost_after = await down_then_back_empty(
            world, fleet, adapter, stop=lambda: asyncio.to_thread(broker.kill),
            start=lambda: asyncio.to_thread(broker.start))  # no stream, no group
    where = ", dedup store on it" if dedup_on_broker else ""
    _record(f"broker down 10 s, restarted empty{where}", count, run,
            faults=f"{count.lost} lost with the broker's data, {lost_after} after it")
    assert lost_after == 0, "nothing published after the restart may be lost"
    assert run.outage.cpu_seconds < CPU_BUDGET, run


async def test_the_emulator_killed_and_restarted() -> None:
    async with running_world("pubsub", "redis") as (world, fleet, adapter):

        async def start() -> None:
            await asyncio.to_thread(services.start_emulator_again)  # empty
            # what an operator's deployment does: the topic and subscription again
            await world.set_up_broker(adapter)

        count, run, lost_after = await down_then_back_empty(
            world, fleet, adapter, stop=lambda: asyncio.to_thread(services.kill_emulator),
            start=start)
    _record("emulator down 10 s, restarted empty", count, run, adapter="pubsub",
            faults=f"{count.lost} lost with the emulator's state, {lost_after} after it")
    assert lost_after == 0, "nothing published after the restart may be lost"
    assert run.outage.cpu_seconds < CPU_BUDGET, run


async def down_then_back_empty(
    world: World, fleet: Fleet, adapter: Adapter, *, stop: Callable[[], Awaitable[object]],
    start: Callable[[], Awaitable[object]],
) -> tuple[Count, FaultRun, int]:
    """The broker stopped for OUTAGE_SECONDS under load, then started empty: the count, the
    run, and how many messages published after it came back were lost (must be none)."""

    async def down(load: Load) -> Outage:
        await load.hold()
        cpu = fleet.cpu_seconds()
        await stop()
        await asyncio.sleep(OUTAGE_SECONDS)  # the outage's length
        cpu = fleet.cpu_seconds() - cpu
        await start()
        back = time.monotonic()
        load.release()
        return Outage(cpu, back, OUTAGE_SECONDS)

    run = await one_fault(world, fleet, adapter, down, loses_earlier=True)
    effects = await world.effects()
    lost_after = sum(1 for n in range(run.published_before, world.messages)
                     if not effects.get(n))
    return Count.of(world.messages, effects), run, lost_after


async def test_client_connections_killed(broker: RedisServer) -> None:
    async with running_world("redis", "redis", broker_url=broker.url) as (world, fleet, adapter):

        async def client_kill(load: Load) -> Outage:
            admin = aioredis.Redis.from_url(broker.url)
            try:
                killed = await admin.execute_command("CLIENT", "KILL", "TYPE", "normal",
                                                     "SKIPME", "yes")
            finally:
                await admin.aclose()
            assert int(killed) >= 3, "each consumer's connections"
            return Outage(0.0, time.monotonic(), 0.0)

        run = await one_fault(world, fleet, adapter, client_kill)
        count = await final_count(world)
    _record("client connections killed", count, run)
    assert count.lost == 0, count


def _record(scenario: str, count: Count, run: FaultRun, faults: str = "",
            adapter: str = "redis") -> None:
    outage = run.outage
    report.record(report.Row(
        scenario, adapter, "redis", count, faults=faults or scenario.split(" (")[0],
        recovery=f"{run.recovery:.2f} s",
        cpu_during_outage=f"{outage.cpu_seconds:.2f} s in {outage.seconds:.0f} s"
        if outage.seconds else "—",
        seconds=run.seconds))
