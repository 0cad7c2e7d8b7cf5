"""The crash-window benchmark's own parts: its bound, and that the window it measures is the
one between a handler's return and its durable completion, on the real Redis and PostgreSQL."""

from __future__ import annotations

import pytest

from benchmarks._crash_kills import KillRun, poisson_upper
from benchmarks._crash_window_run import Window, measure
from reliable_sub.testing.services import postgres_url, redis_url


@pytest.mark.parametrize(("observed", "bound"), [(0, 2.996), (1, 4.744), (10, 16.962)])
def test_the_upper_bound_is_poissons(observed: int, bound: float) -> None:
    # the one-sided 95% bounds of a Poisson mean (chi-square tables: chi2(0.95, 2k + 2) / 2)
    assert poisson_upper(observed) == pytest.approx(bound, abs=0.001)


def test_doubles_per_thousand_kills() -> None:
    run = KillRun("x", rate=1.0, kills=400, messages=1, lost=0, doubles=0, seconds=1.0)
    assert run.per_thousand == 0
    assert run.upper_per_thousand == pytest.approx(7.49, abs=0.01)


def test_window_figures() -> None:
    window = Window.of("x", [float(ms) for ms in range(1, 101)], rate=200.0,
                       after_return_ms=[1.0, 3.0])
    assert (window.count, window.p50, window.max, window.mean) == (100, 50.5, 100.0, 50.5)
    assert window.effects_at_risk == pytest.approx(200 * 0.0505)
    assert window.mean_after_return == 2.0


@pytest.mark.parametrize("layout", ["redis-on-broker", "redis-apart", "sql-plain"])
async def test_every_completion_is_timed(layout: str) -> None:
    window = await measure(layout, messages=200, rate=1000.0, redis_url=redis_url(),
                           postgres_url=postgres_url())
    assert window.count == 200  # each message's record seen, none missed or counted twice
    assert 0 < window.p50 <= window.max
    assert 0 < window.mean_after_return < window.mean  # the effect came before the return
