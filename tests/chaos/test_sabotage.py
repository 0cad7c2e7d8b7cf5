"""The kill storm catches a consumer that loses messages: its assertions can fail.

The consumers run with ``sabotage="ack-on-receive"``: their adapter acks each delivery as it
arrives, before the handler ran (at-most-once delivery, the bug the library exists to prevent).
Under the same kill storm as ``test_processes``, what was in flight at each kill is gone: the
count must report lost messages.
"""

from __future__ import annotations

import functools
import random

from tests.chaos import report
from tests.chaos.scenario import final_count, running_world, under_load
from tests.chaos.test_processes import KILL_INTERVAL

SABOTAGE_HANDLER_MS = (100.0, 300.0)


async def test_the_kill_storm_finds_the_messages_an_early_ack_loses() -> None:
    rng = random.Random("sabotage")
    # Handlers of 100-300 ms: about 30 messages in flight per consumer at any moment, each of
    # which a kill loses (with 0-50 ms, a kill lost 4 on average, and once, under a full CI
    # run, none at all).
    async with running_world("redis", "none", sabotage="ack-on-receive",
                             handler_ms=SABOTAGE_HANDLER_MS) as (world, fleet, adapter):
        kill_one = functools.partial(fleet.kill_and_respawn_one, rng)
        seconds = await under_load(world, fleet, adapter, kill_one, rng, KILL_INTERVAL,
                                   until_all_handled=False)
        count = await final_count(world)
    report.record(report.Row("sabotage: ack on receive, kill storm (must lose)", "redis",
                             "none", count, faults=f"{fleet.kills} kills", seconds=seconds))
    assert fleet.kills_landed >= 3, f"{fleet.kills_landed} of {fleet.kills} kills hit a process"
    assert count.lost > 0, (f"an ack before the handler must lose messages under kills: {count};"
                            f" consumers' output:\n{fleet.output()}")
