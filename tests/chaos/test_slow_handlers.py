"""Handlers that outlast the ack deadline (scenario 5 of the chaos suite): the lease manager's
value in one table.

150 messages published at once to 3 consumer processes without a dedup store, handlers about
twice the ack deadline (Redis Streams: 3-4 s against 2 s; Pub/Sub: 12-14 s against 10 s, its
shortest). With the lease manager on, every running delivery's deadline is extended before it
passes: no message is redelivered, so no effect repeats. With it effectively off (extensions
that do nothing), each message is redelivered while its handler still runs and the copy runs
again, and so on: the broker refuses (Redis) or ignores (the emulator) the acks of copies whose
deadline passed, so the messages are never settled. That run is watched for one more handler
time after every message ran once; the duplicate effects count the redeliveries that ran.

The two runs of one adapter go side by side, in worlds of their own: their handlers sleep, and
one after the other they would add most of a minute to the suite.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.chaos import report
from tests.chaos.scenario import final_count, running_world, side_by_side, under_load

SLOW_MESSAGES = 150
HANDLER_MS = {"redis": (3_000.0, 4_000.0), "pubsub": (12_000.0, 14_000.0)}


async def slow_handlers(adapter_kind: str, lease: str) -> None:
    async with running_world(
        adapter_kind, "none", messages=SLOW_MESSAGES, load_seconds=1.0,
        handler_ms=HANDLER_MS[adapter_kind], max_messages=100,
        sabotage="no-extend" if lease == "off" else None,
    ) as (world, fleet, adapter):

        async def nothing() -> None:
            return None

        low, high = HANDLER_MS[adapter_kind]
        seconds = await under_load(world, fleet, adapter, nothing, random.Random(0),
                                   (0.5, 0.5), min_faults=0, settle=lease == "on")
        unsettled = ""
        if lease == "off":
            await asyncio.sleep(high / 1000)  # the window redeliveries are counted in
            seconds += high / 1000
            if adapter_kind == "redis":
                unsettled = f"; {await world.redis_backlog()} still unacked at the end"
        count = await final_count(world)
    report.record(report.Row(
        f"slow handlers, lease manager {lease}", adapter_kind, "none", count,
        faults=f"handlers {low / 1000:g}-{high / 1000:g} s, ack deadline "
               f"{world.ack_deadline:g} s{unsettled}", seconds=seconds))
    assert count.lost == 0, f"lease manager {lease}: {count}"
    if lease == "on":
        assert count.duplicate_effects == 0, f"the lease must prevent redeliveries: {count}"
    else:
        assert count.duplicate_effects > 0, f"without extensions they must come back: {count}"


@pytest.mark.parametrize("adapter_kind", ["redis", "pubsub"])
async def test_slow_handlers(adapter_kind: str) -> None:
    await side_by_side(*(slow_handlers(adapter_kind, lease) for lease in ("on", "off")))
