"""RabbitMQ's process trials under load (the chaos suite's scenarios on a third broker).

The same fleet as on Redis Streams and Pub/Sub (3 consumer processes, flow control 50, handlers
0-50 ms, the Redis dedup store on the shared Redis, effects counted there), on the shared
RabbitMQ node under names of the scenario's own (deleted after), or on a private node where the
node itself is killed. Fewer messages than elsewhere (2,000 over 8 s; the delayed nacks 1,000):
they prove the same points and keep the lane short. Every consumer prints its health four times
a second (``healthy()``, with ``unhealthy_after`` short so that a fault shows within it), and
writes each effect together with a line in an effect log, so that every doubled effect is
traced to the kill that caused it (``evidence``).

* **Kill storm**: a random consumer SIGKILLed and restarted every 2-3 s, with the Redis store
  and without a store (the baseline). Nothing lost; with the store every doubled effect falls
  in a kill's crash window; health True in every sample (a peer's death is no fault of the
  survivors').
* **Rolling deploy**: the consumers stopped with SIGTERM one after the other and restarted:
  nothing lost, nothing doubled, health True throughout.
* **Node killed and restarted** (a private node, its data kept): SIGKILLed 3 s into the load,
  down 5 s and then as long as it takes to boot, the load held meanwhile. Nothing lost (what the
  broker confirmed is on disk), nothing doubled (handlers that finished meanwhile are completed
  in the store; their acks died with the connections, and the redeliveries are duplicates);
  every consumer unhealthy while the node is away, healthy again once it is back; the
  consumers wait without spinning.
* **Connections stalled**: the consumers reach the shared node through a ``TcpProxy``, which
  stalls for 15 s (no byte moves, nothing closed) while the load goes on directly. Nothing lost
  or doubled; every consumer unhealthy from ``unhealthy_after`` (5 s, the issue's) and a
  detection bound into the stall until it ends, healthy again soon after.
* **Delayed nacks across kills**: a handler that fails the first two attempts of every message,
  backoffs of 1-2 s, so that hundreds of messages sit in delay queues while consumers are
  SIGKILLed every 2-3 s. Every message's effect happens (once, but for the crash window), and
  the attempts the handlers saw were counted right (``check_attempts``).
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from reliable_sub.testing.tcp_proxy import TcpProxy
from tests.chaos import report
from tests.chaos.evidence import (
    Health,
    attribute_doubles,
    check_attempts,
    check_health,
    consumers_said,
)
from tests.chaos.fleet import Count, Fleet, Load, World
from tests.chaos.scenario import (
    CONSUMERS,
    FaultRun,
    Outage,
    final_count,
    one_fault,
    running_world,
    side_by_side,
    under_load,
)
from tests.chaos.test_broker_faults import CPU_BUDGET
from tests.chaos.test_processes import DEPLOY_INTERVAL, KILL_INTERVAL
from tests.rabbitmq_processes import RabbitNode

MESSAGES = 2_000
LOAD_SECONDS = 8.0
# Kills 2-3 s apart through the load, then none: a storm that went on until every message was
# handled fed itself on a loaded machine (each restart costs a CPU second or two: 11 kills, 34 s).
KILLS = 4
HEALTH_EVERY = 0.25
UNHEALTHY_AFTER = 3.0
# A doubled effect is in the crash window when the consumer that made it was killed within
# this long after stamping it. The window is milliseconds on an idle machine
# (docs/reliability.md); on this loaded one it was seen up to 0.3 s (a descheduled event loop).
# A double of another cause comes from a consumer never killed, or killed at a random time:
# within 1 s of the effect about one time in eight.
CRASH_WINDOW = 1.0

# The node killed: down this long, then as long as its boot takes (4-7 s here, more loaded).
NODE_DOWN = 5.0
# From the node answering again to every consumer healthy: a receive retry's wait (up to 2 s),
# a connection and a receive; generous for a loaded machine.
RECOVER_WITHIN = 10.0
# From unhealthy_after into an outage to the health sample that must tell it: a refused
# connection fails a receive at once, retried after up to 2 s; and 2 s for a loaded machine
# (seen 1-2.3 s past unhealthy_after).
NODE_TELL_WITHIN = 4.0

STALL = 15.0
STALL_UNHEALTHY_AFTER = 5.0
# Past unhealthy_after, how long health may take to tell a stall. The first call fails about
# 3.5 s in (the prefetched deliveries are handed out, then an empty receive asks the broker,
# after 1 s without a word from it, and waits 2 s for the answer); the next ones hang on a new
# connection until the Subscriber's bound on a receive call (4 s: twice the receive timeout +
# 2 s) fails them. A streak is measured between failed calls' ends, so it reaches
# unhealthy_after only at the first failure past it: up to one bound late. Plus 1 s for a
# loaded machine.
STALL_TELL_WITHIN = 3.5 + 4.0 + 1.0
# The load goes on through the stall (on the test's own connection): a backlog waits.
STALL_LOAD_SECONDS = STALL + 6.0

DELAYED_MESSAGES = 1_000
FAIL_FIRST = 2
DELAY_BACKOFF = (1.0, 2.0)
DELAYED_KILLS = 3

# Long handlers: 1.5-3 ack deadlines (2 s), every one kept by lease extensions and claim
# renewals while consumers die around it; shorter than Redis's and Pub/Sub's 5-15 s, which
# would make this the lane's longest run by half a minute and prove nothing more here (the
# broker gives a dead consumer's deliveries back at once: what waits is the dead claims).
LONG_MESSAGES = 100
LONG_HANDLER_MS = (3_000.0, 6_000.0)
LONG_KILLS = 4


@asynccontextmanager
async def rabbit_world(dedup: str, **options: Any) -> AsyncIterator[tuple[World, Fleet, Any]]:
    """A world on RabbitMQ (the shared node unless ``broker_url``), its consumers sampling
    their health and logging their effects."""
    options = {"messages": MESSAGES, "load_seconds": LOAD_SECONDS,
               "health_every": HEALTH_EVERY, "unhealthy_after": UNHEALTHY_AFTER, "log": True,
               **options}
    async with running_world("rabbitmq", dedup, **options) as ran:
        yield ran


async def test_rabbitmq_kill_storms() -> None:
    """The kill storm with the Redis store and without one, side by side: under the same load,
    their doubles compare."""
    await side_by_side(kill_storm("redis"), kill_storm("none"))


async def kill_storm(dedup: str) -> None:
    rng = random.Random(f"kill-storm-rabbitmq-{dedup}")
    async with rabbit_world(dedup) as (world, fleet, adapter):
        kill_one = functools.partial(fleet.kill_and_respawn_one, rng)
        seconds = await under_load(world, fleet, adapter, kill_one, rng, KILL_INTERVAL,
                                   min_faults=KILLS, max_faults=KILLS)
        count, doubles, health = await evidence(world, fleet)
    record(report.Row("kill storm (SIGKILL every 2-3 s)", "rabbitmq", dedup, count,
                      faults=f"{fleet.kills} kills; {doubles.text()}; {health.text()}",
                      seconds=seconds), fleet)
    assert fleet.kills == KILLS, "the storm must land"
    assert count.lost == 0, count
    if dedup == "redis":
        assert not doubles.outside, doubles.outside


async def delayed_nacks_across_kills() -> None:
    rng = random.Random("delayed-nacks-rabbitmq")
    async with rabbit_world("redis", messages=DELAYED_MESSAGES, fail_first=FAIL_FIRST,
                            backoff=DELAY_BACKOFF) as (world, fleet, adapter):
        assert world.rabbit is not None
        waiting: list[int] = []  # copies in delay queues at each kill

        async def kill_one() -> None:
            assert world.rabbit is not None
            left = await world.rabbit.backlog()
            waiting.append(sum(n for name, n in left.items() if name != world.subscription))
            await fleet.kill_and_respawn_one(rng)

        # the storm stops with the load: the retries of the last messages then run with no
        # kill between them, and their attempts are checked exactly
        seconds = await under_load(world, fleet, adapter, kill_one, rng, KILL_INTERVAL,
                                   max_faults=DELAYED_KILLS)
        count, doubles, health = await evidence(world, fleet)
        with told(fleet):
            attempts = check_attempts(await world.logged("calls"), fleet.killed_at,
                                      world.messages, FAIL_FIRST + 1)
    record(report.Row(
        f"delayed nacks across kills (attempts 1-{FAIL_FIRST} fail, backoff "
        f"{DELAY_BACKOFF[0]:g}-{DELAY_BACKOFF[1]:g} s)", "rabbitmq", "redis", count,
        faults=f"{fleet.kills} kills, {min(waiting)}-{max(waiting)} copies in delay queues at "
               f"each; {attempts.text()}; {doubles.text()}; {health.text()}",
        seconds=seconds), fleet)
    assert fleet.kills == DELAYED_KILLS, "the storm must land"
    assert min(waiting) > 0, "kills must land while copies wait in delay queues"
    assert count.lost == 0, count
    assert not doubles.outside, doubles.outside


async def test_rabbitmq_rolling_deploy_and_delayed_nacks() -> None:
    """The rolling deploy and the delayed nacks' storm, side by side (worlds of their own)."""
    await side_by_side(rolling_deploy(), delayed_nacks_across_kills())


async def rolling_deploy() -> None:
    rng = random.Random("rolling-deploy-rabbitmq")
    async with rabbit_world("redis") as (world, fleet, adapter):
        redeployed: list[int] = []

        async def redeploy_next() -> None:
            number = len(redeployed) % CONSUMERS
            await fleet.terminate(number, within=30)
            await fleet.start(number)
            redeployed.append(number)

        seconds = await under_load(world, fleet, adapter, redeploy_next, rng, DEPLOY_INTERVAL)
        count, doubles, health = await evidence(world, fleet)
    record(report.Row("rolling deploy (SIGTERM, restart)", "rabbitmq", "redis", count,
                      faults=f"{len(redeployed)} restarts; {health.text()}", seconds=seconds),
           fleet)
    assert len(redeployed) >= 3, "the deploy must roll"
    assert count.lost == 0, count
    assert count.duplicate_effects == 0, doubles.outside


async def test_rabbitmq_broker_faults(private_rabbitmq: RabbitNode) -> None:
    """The node killed (a private one) and the consumers' connections stalled (to the shared
    one), side by side: both mostly wait on the broker; and the storm of long handlers beside
    them, whose handlers mostly sleep."""
    await side_by_side(node_killed_and_restarted(private_rabbitmq),
                       consumer_connections_stalled(), long_handler_storm())


async def node_killed_and_restarted(node: RabbitNode) -> None:
    async with rabbit_world("redis", broker_url=node.url) as (world, fleet, adapter):
        # RabbitMQ 3.10 keeps its directory of quorum queues in a dets table written every
        # 3 minutes: a node killed sooner would come back without the queue's server
        await asyncio.to_thread(node.save_queue_registry)
        down: list[float] = []

        async def kill_and_restart(load: Load) -> Outage:
            await load.hold()
            cpu = fleet.cpu_seconds()
            down.append(time.monotonic())
            await asyncio.to_thread(node.kill)
            await asyncio.sleep(NODE_DOWN)  # the outage's length, before the boot's
            await asyncio.to_thread(node.start)  # same ports, same data
            back = time.monotonic()
            cpu = fleet.cpu_seconds() - cpu
            load.release()
            return Outage(cpu, back, back - down[0])

        run = await one_fault(world, fleet, adapter, kill_and_restart)
        count, doubles, health = await evidence(
            world, fleet, [(down[0], run.outage.back_at)], unhealthy_after=UNHEALTHY_AFTER,
            tell_within=NODE_TELL_WITHIN)
    record_fault("broker node killed, restarted (SIGKILL, data kept)", count, run, health, fleet)
    assert count.lost == 0, count
    assert count.duplicate_effects == 0, doubles.outside
    assert run.outage.cpu_seconds < CPU_BUDGET, run
    assert run.recovery < RECOVER_WITHIN, run


async def consumer_connections_stalled() -> None:
    with TcpProxy("127.0.0.1", 5672) as proxy:
        async with rabbit_world("redis", unhealthy_after=STALL_UNHEALTHY_AFTER,
                                load_seconds=STALL_LOAD_SECONDS,
                                consumer_url=f"amqp://guest:guest@127.0.0.1:{proxy.port}/"
                                ) as (world, fleet, adapter):

            async def stall(load: Load) -> Outage:
                cpu = fleet.cpu_seconds()
                began = time.monotonic()
                proxy.stall(STALL)  # resumes by itself
                await asyncio.to_thread(proxy.resumed.wait, STALL + 10)
                assert not proxy.stalled and proxy.resumed_at is not None
                return Outage(fleet.cpu_seconds() - cpu, proxy.resumed_at,
                              proxy.resumed_at - began)

            run = await one_fault(world, fleet, adapter, stall)
            back = run.outage.back_at
            count, doubles, health = await evidence(
                world, fleet, [(back - run.outage.seconds, back)],
                unhealthy_after=STALL_UNHEALTHY_AFTER, tell_within=STALL_TELL_WITHIN)
    record_fault("consumers' connections stalled 15 s (TcpProxy)", count, run, health, fleet)
    assert count.lost == 0, count
    assert count.duplicate_effects == 0, doubles.outside


async def long_handler_storm() -> None:
    rng = random.Random("kill-storm-long-rabbitmq")
    async with rabbit_world("redis", messages=LONG_MESSAGES,
                            handler_ms=LONG_HANDLER_MS) as (world, fleet, adapter):
        kill_one = functools.partial(fleet.kill_and_respawn_one, rng)
        seconds = await under_load(world, fleet, adapter, kill_one, rng, KILL_INTERVAL,
                                   min_faults=LONG_KILLS, max_faults=LONG_KILLS)
        count, doubles, health = await evidence(world, fleet)
    low, high = LONG_HANDLER_MS
    record(report.Row(f"kill storm, handlers {low / 1000:g}-{high / 1000:g} s", "rabbitmq",
                      "redis", count,
                      faults=f"{fleet.kills} kills; {doubles.text()}; {health.text()}",
                      seconds=seconds), fleet)
    assert fleet.kills == LONG_KILLS
    assert count.lost == 0, count
    assert not doubles.outside, doubles.outside


async def evidence(world: World, fleet: Fleet, faults: list[tuple[float, float]] | None = None,
                   **health_bounds: float) -> tuple[Count, Any, Health]:
    """The count, the doubled effects traced to kills, and the consumers' health through the
    scenario (checked: see ``check_health``)."""
    count = await final_count(world)
    doubles = attribute_doubles(await world.logged("log"), fleet.killed_at, CRASH_WINDOW)
    assert doubles.doubled == count.duplicate_effects, (doubles, count)
    with told(fleet):
        health = check_health(fleet.health_samples(), faults or [],
                              recover_within=RECOVER_WITHIN, **health_bounds)
    return count, doubles, health


@contextmanager
def told(fleet: Fleet) -> Iterator[None]:
    """A failing check's message, with what the consumers logged and when each was killed."""
    try:
        yield
    except AssertionError as error:
        raise AssertionError(f"{error}\nthe consumers said (time.monotonic() now "
                             f"{time.monotonic():.2f}):\n"
                             f"{consumers_said(fleet.started, fleet.killed_at)}") from None


def record_fault(scenario: str, count: Count, run: FaultRun, health: Health,
                 fleet: Fleet) -> None:
    outage = run.outage
    duplicates = fleet.outcome_total("duplicate")
    record(report.Row(
        scenario, "rabbitmq", "redis", count,
        faults=f"{outage.seconds:.1f} s; {duplicates} redeliveries caught as duplicates; "
               f"{health.text()}",
        recovery=f"{run.recovery:.2f} s",
        cpu_during_outage=f"{outage.cpu_seconds:.2f} s in {outage.seconds:.0f} s",
        seconds=run.seconds), fleet)


def record(row: report.Row, fleet: Fleet) -> None:
    """Into the report, and printed (with what the fleet did) in the test's output."""
    report.record(row)
    print(f"\n{row.scenario} [{row.dedup}]: {row.count}; {row.faults}; recovery "
          f"{row.recovery}; CPU {row.cpu_during_outage}; {row.seconds:.1f} s; {fleet.starts} "
          f"starts, {fleet.kills_landed} kills landed, {fleet.settle_rounds} settle rounds")
