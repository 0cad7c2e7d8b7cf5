"""Kill storms long enough to bound the doubles per kill: the chaos suite's consumers
(``tests/chaos/consumer.py``, 3 processes, handlers 0-50 ms, effects counted outside them) under
a steady load, with a consumer SIGKILLed and restarted every ``interval`` seconds, ``kills``
times; then every message is waited for and the effects counted.

Each kill lands on a consumer that is receiving (printed READY), so a kill always has work to
cut; kills of a process still starting would add kills with nothing in flight and flatter the
rate.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from benchmarks._crash_layouts import LAYOUTS, private_redis
from tests.chaos.fleet import Fleet
from tests.chaos.scenario import CONSUMERS, final_count, running_world, under_load

# Messages per second: the chaos scenarios' load (5,000 over 10 s), but the transactional SQL
# consumers, which commit one PostgreSQL transaction per message, keep up with about 200 here.
RATE = 500.0
RATES = {"sql-transactional": 150.0}


@dataclass
class KillRun:
    layout: str
    rate: float
    kills: int
    messages: int
    lost: int
    doubles: int
    seconds: float

    @property
    def per_thousand(self) -> float:
        return 1000 * self.doubles / self.kills

    @property
    def upper_per_thousand(self) -> float:
        """The one-sided 95% upper bound of doubles per 1,000 kills, doubles taken as a Poisson
        count over the kills."""
        return 1000 * poisson_upper(self.doubles) / self.kills


def poisson_upper(observed: int, confidence: float = 0.95) -> float:
    """The smallest mean whose Poisson chance of ``observed`` or fewer is ``1 - confidence``
    (3.0 for none observed)."""

    def at_most(mean: float) -> float:
        log_term = -mean
        total = math.exp(log_term)
        for k in range(1, observed + 1):
            log_term += math.log(mean) - math.log(k)
            total += math.exp(log_term)
        return total

    low, high = float(observed), float(observed) + 10 * math.sqrt(observed + 1) + 10
    for _ in range(100):
        middle = (low + high) / 2
        if at_most(middle) > 1 - confidence:
            low = middle
        else:
            high = middle
    return high


async def storm(layout_key: str, *, kills: int, interval: tuple[float, float],
                seed: int = 1) -> KillRun:
    """``kills`` kills of ready consumers under load, on ``layout_key``'s store layout."""
    layout = LAYOUTS[layout_key]
    if layout.store_apart:
        with private_redis() as server:
            return await _storm(layout_key, kills, interval, seed, broker_url=server.url)
    return await _storm(layout_key, kills, interval, seed, broker_url="")


async def _storm(layout_key: str, kills: int, interval: tuple[float, float], seed: int,
                 broker_url: str) -> KillRun:
    layout = LAYOUTS[layout_key]
    rng = random.Random(f"crash-kills-{layout_key}-{seed}")
    load_seconds = kills * sum(interval) / 2
    rate = RATES.get(layout_key, RATE)
    messages = int(rate * load_seconds)
    async with running_world("redis", layout.dedup, broker_url=broker_url, messages=messages,
                             load_seconds=load_seconds) as (world, fleet, adapter):

        async def kill_a_ready_one() -> None:
            victim = rng.randrange(CONSUMERS)
            await fleet.wait_ready(victim)
            fleet.kill(victim)
            fleet.spawn(victim)

        seconds = await under_load(world, fleet, adapter, kill_a_ready_one, rng, interval,
                                   min_faults=kills, max_faults=kills)
        count = await final_count(world)
    _check(fleet, kills)
    return KillRun(layout.name, rate, fleet.kills_landed, count.messages, count.lost,
                   count.duplicate_effects, seconds)


def _check(fleet: Fleet, kills: int) -> None:
    if fleet.kills_landed != kills:
        raise AssertionError(f"{kills} kills asked for, {fleet.kills_landed} landed on a "
                             f"running consumer")
