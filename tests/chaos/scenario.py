"""What the scenarios share: running a fleet under load while faults land, then draining and
counting the effects of every message."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from tests.chaos.fleet import Count, Fleet, Load, World, publish_steadily

# The load: messages published evenly over LOAD_SECONDS, handlers 0-50 ms. The report run
# (RELIABILITY_REPORT=1, docs/reliability.md) takes the 5,000 over 10 s; the suite
# 2,500 over 6 s, with the same faults (under_load waits for min_faults of them): the
# scenarios ran side by side on CI's two cores for ten minutes and more at full size.
FULL_SIZE = bool(os.environ.get("RELIABILITY_REPORT"))
MESSAGES = 5_000 if FULL_SIZE else 2_500
LOAD_SECONDS = 10.0 if FULL_SIZE else 6.0
HANDLER_MS = (0.0, 50.0)
CONSUMERS = 3
MAX_MESSAGES = 50  # flow control per consumer process
STOP_TIMEOUT = 10.0
# Bound on the whole run after the load: every message handled, then drained.
SETTLE_WITHIN = 120.0
# RabbitMQ: rounds of draining and stopping before what is left counts as never settling.
SETTLE_ROUNDS = 5
POLL = 0.2
# Polling for the first effect after an outage: the recovery time's resolution.
RECOVERY_POLL = 0.02


@asynccontextmanager
async def running_world(adapter_kind: str, dedup: str, broker_url: str = "",
                        messages: int = MESSAGES, load_seconds: float = LOAD_SECONDS,
                        dedup_on_broker: bool = False, consumer_url: str = "",
                        **fleet_options: Any) -> AsyncIterator[tuple[World, Fleet, Any]]:
    """A world set up, its fleet started; everything killed and deleted afterwards."""
    world = World(adapter_kind, dedup, broker_url=broker_url, messages=messages,
                  load_seconds=load_seconds, dedup_on_broker=dedup_on_broker,
                  consumer_url=consumer_url)
    adapter = world.adapter()
    await world.set_up(adapter)
    options = {"handler_ms": HANDLER_MS, "max_messages": MAX_MESSAGES,
               "stop_timeout": STOP_TIMEOUT, **fleet_options}
    fleet = Fleet(world, CONSUMERS, **options)
    try:
        await fleet.start_all()
        yield world, fleet, adapter
    finally:
        fleet.kill_all()
        await adapter.close()
        await world.tear_down()


async def side_by_side(*runs: Awaitable[None]) -> None:
    """Run independent worlds at once: the first failure cancels the others (their worlds are
    torn down), then is raised."""
    tasks = [asyncio.ensure_future(run) for run in runs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()  # no-op for the finished ones
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error


async def under_load(
    world: World, fleet: Fleet, adapter: Any, fault: Callable[[], Awaitable[None]],
    rng: random.Random, interval: tuple[float, float], *, until_all_handled: bool = True,
    min_faults: int = 3, max_faults: int | None = None, settle: bool = True,
) -> float:
    """Publish the load while ``fault()`` lands every ``interval`` seconds (a random time in
    it), until every message has had an effect (or, if not ``until_all_handled``, until the
    load is published) and at least ``min_faults`` faults landed (and no more than
    ``max_faults``: after them the run only waits); then (if ``settle``) drain and stop the
    fleet gracefully. Returns the run's seconds."""
    faults = 0
    started = time.monotonic()
    publishing = asyncio.create_task(
        publish_steadily(adapter, world.topic, world.messages, world.load_seconds))
    give_up = started + world.load_seconds + SETTLE_WITHIN
    handled = 0
    try:
        while True:
            # the fault schedule: the consumers work on in their own processes meanwhile
            await asyncio.sleep(rng.uniform(*interval))
            if publishing.done() and faults >= min_faults:
                publishing.result()
                if not until_all_handled:
                    break
                effects = await world.effects()
                now_handled = sum(1 for n in range(world.messages) if effects.get(n, 0))
                if now_handled == world.messages:
                    break
                if now_handled > handled:
                    # progress: a loaded machine (kills landing faster than restarts finish)
                    # only slows the run down; a stuck one fails SETTLE_WITHIN after it stalled
                    handled = now_handled
                    give_up = max(give_up, time.monotonic() + SETTLE_WITHIN)
            if time.monotonic() > give_up:
                effects = await world.effects()
                missing = [n for n in range(world.messages) if not effects.get(n)]
                elapsed = time.monotonic() - started
                raise AssertionError(
                    f"{len(missing)} messages without an effect after {elapsed:.0f}s "
                    f"(first {missing[:10]}); consumers' output:\n{fleet.output()}")
            if max_faults is None or faults < max_faults:
                await fault()
                faults += 1
    finally:
        if not publishing.done():
            publishing.cancel()
    if settle:
        await settle_and_stop(world, fleet, adapter)
    return time.monotonic() - started


@dataclass
class Outage:
    """What a fault did: the consumers' CPU seconds while the broker was away, and when it was
    back."""

    cpu_seconds: float
    back_at: float
    seconds: float


@dataclass
class FaultRun:
    seconds: float
    recovery: float  # from the broker's return to the first effect of a message published after
    outage: Outage
    published_before: int  # messages published before the fault (when it held the load)


async def one_fault(world: World, fleet: Fleet, adapter: Any,
                    fault: Callable[[Load], Awaitable[Outage]], *, after: float = 3.0,
                    loses_earlier: bool = False) -> FaultRun:
    """Publish the load; ``after`` seconds into it, ``fault(load)`` (which holds the load
    while the broker is away); then wait until every message has had an effect (if
    ``loses_earlier``, every one published after the fault held the load: the broker may have
    lost those before), drain and stop the fleet gracefully."""
    started = time.monotonic()
    load = Load()
    publishing = asyncio.create_task(
        publish_steadily(adapter, world.topic, world.messages, world.load_seconds, load))
    try:
        await asyncio.sleep(after)  # where in the load the fault lands
        published_before = load.sent
        outage = await fault(load)
        if load.held_at is not None:
            published_before = load.held_at
        first_after = load.sent
        give_up = time.monotonic() + SETTLE_WITHIN
        while True:
            effects = await world.effects()
            if any(effects.get(n) for n in range(first_after, load.sent)):
                recovery = time.monotonic() - outage.back_at
                break
            if time.monotonic() > give_up:
                raise AssertionError(f"no effect after the broker came back; consumers' "
                                     f"output:\n{fleet.output()}")
            await asyncio.sleep(RECOVERY_POLL)
        first_kept = published_before if loses_earlier else 0
        effects = {}
        while True:
            if publishing.done():
                publishing.result()
                effects = await world.effects()
                if all(effects.get(n) for n in range(first_kept, world.messages)):
                    break
            if time.monotonic() > give_up:
                missing = [n for n in range(first_kept, world.messages) if not effects.get(n)]
                waiting = await adapter.receive(world.subscription, 1000, 2.0)
                raise AssertionError(
                    f"{len(missing)} messages without an effect (first {missing[:10]}, last "
                    f"{missing[-3:]}); the subscription still delivers {len(waiting)} to a "
                    f"new consumer; consumers' output:\n{fleet.output()}")
            await asyncio.sleep(POLL)
    finally:
        if not publishing.done():
            publishing.cancel()
    await settle_and_stop(world, fleet, adapter)
    return FaultRun(time.monotonic() - started, recovery, outage, published_before)


async def settle_and_stop(world: World, fleet: Fleet, adapter: Any = None) -> None:
    """Drain, then stop the fleet gracefully. On RabbitMQ, where what consumers hold is
    invisible, the queues are read again once none is connected (the broker has then taken back
    all they held): anything left there (a deferral in a delay queue, a redelivery in a
    consumer's hands at the first reading) brings the fleet back to handle it, and again."""
    for _ in range(SETTLE_ROUNDS):
        await drain(world, adapter)
        await fleet.terminate_all(within=STOP_TIMEOUT + 10)
        if world.rabbit is None:
            return
        left = await world.rabbit.backlog()
        if not left:
            return
        fleet.settle_rounds += 1
        await fleet.start_all()
    raise AssertionError(f"still left after {SETTLE_ROUNDS} rounds of draining: {left}")


async def drain(world: World, adapter: Any = None) -> None:
    """Wait until nothing is left to deliver: on Redis Streams, nothing pending or undelivered
    in the group; on Kafka, no backlog in the group's commits (``adapter``: the test's own);
    on RabbitMQ, nothing ready in the subscription's queue or its delay queues
    (what the consumers hold is checked by settle_and_stop); on Pub/Sub (no backlog query on the
    emulator), no new effect for an ack deadline and a margin, so a killed consumer's messages
    have come back and been handled."""
    give_up = time.monotonic() + SETTLE_WITHIN
    if world.rabbit is not None:
        while left := await world.rabbit.backlog():
            if time.monotonic() > give_up:
                raise AssertionError(f"still ready after {SETTLE_WITHIN:g}s: {left}")
            await asyncio.sleep(POLL)
        return
    if world.adapter_kind == "redis":
        while await world.redis_backlog():
            if time.monotonic() > give_up:
                raise AssertionError(f"{await world.redis_backlog()} entries still pending")
            await asyncio.sleep(POLL)
        return
    if world.adapter_kind == "kafka":
        while backlog := await world.kafka_backlog(adapter):
            if time.monotonic() > give_up:
                raise AssertionError(f"{backlog} records still not committed as settled")
            await asyncio.sleep(POLL)
        return
    quiet_for = world.ack_deadline + 3.0
    last = sum((await world.effects()).values())
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < quiet_for:
        if time.monotonic() > give_up:
            raise AssertionError("effects kept coming after the load ended")
        await asyncio.sleep(POLL)
        now = sum((await world.effects()).values())
        if now != last:
            last, quiet_since = now, time.monotonic()


async def final_count(world: World) -> Count:
    return Count.of(world.messages, await world.effects())


__all__ = ["CONSUMERS", "MESSAGES", "FaultRun", "Outage", "final_count", "one_fault",
           "running_world", "side_by_side", "under_load"]
