"""The cost check (#25): exact counts per message of fixed workloads -- Python calls, C calls,
tasks created, broker and store calls, memory blocks -- stay within 10% of the committed
baseline, ``benchmarks/cost_baseline.json``. Counted, not timed: the same code gives the same
counts on any machine. See ``benchmarks/cost.py`` for how, and how to update the baseline."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from benchmarks import cost
from benchmarks._cost_counters import CallCounter, Seams, TaskCounter
from reliable_sub.testing.services import redis_url

BASELINE = cost.load_baseline()


@pytest.mark.parametrize("workload", cost.WORKLOADS)
def test_counts_per_message_stay_within_the_baseline(
    workload: str, request: pytest.FixtureRequest
) -> None:
    if BASELINE["python"] != cost.python_version():
        pytest.skip(
            f"the baseline counts were made with Python {BASELINE['python']}, this is "
            f"{cost.python_version()}: the interpreter's own code (asyncio) is counted too"
        )
    if workload in cost.REDIS_WORKLOADS:
        redis_url()
    bootstrap = None
    if workload in cost.KAFKA_WORKLOADS:  # the run's shared node (tests/conftest.py)
        bootstrap = request.getfixturevalue("kafka_broker").bootstrap
    rows = cost.compare(workload, BASELINE, cost.measure(workload, kafka_bootstrap=bootstrap))
    bad = [row for row in rows if row.verdict != "ok"]
    assert not bad, "\n" + cost.comparison_table(rows) + "\n\n" + cost.advice(bad)


def test_the_baseline_covers_every_workload_and_says_why() -> None:
    assert sorted(BASELINE["workloads"]) == sorted(cost.WORKLOADS)
    assert BASELINE["why"].strip()


# -- the rule --------------------------------------------------------------------------------


def _result(messages: int = 1000, **totals: int) -> dict[str, Any]:
    return {"messages": messages, "in_flight": 100, "totals": totals}


def _verdicts(before: dict[str, Any], after: dict[str, Any]) -> dict[str, str]:
    baseline = {"workloads": {"w": before}}
    return {row.metric.name: row.verdict for row in cost.compare("w", baseline, after)}


def test_a_count_more_than_ten_percent_over_the_baseline_fails() -> None:
    before = _result(calls=50_000, tasks=1_000, held_blocks=2_000)
    after = _result(calls=55_001, tasks=1_100, held_blocks=2_201)  # tasks: +10% exactly
    assert _verdicts(before, after) == {"calls": "GREW", "tasks": "ok", "held_blocks": "GREW"}


def test_a_count_more_than_ten_percent_under_the_baseline_asks_for_an_update() -> None:
    before = _result(calls=50_000, round_trips=20)
    after = _result(calls=44_999, round_trips=19)
    assert _verdicts(before, after) == {"calls": "SHRANK", "round_trips": "ok"}
    rows = cost.compare("w", {"workloads": {"w": before}}, after)
    assert "--write --why" in cost.advice([row for row in rows if row.verdict != "ok"])


def test_counts_that_appear_or_disappear_ask_for_an_update() -> None:
    verdicts = _verdicts(_result(calls=1, tasks=1), _result(calls=1, garbage=3))
    assert verdicts == {"calls": "ok", "tasks": "no longer measured",
                        "garbage": "not in the baseline"}


def test_blocks_left_behind_may_move_by_half_a_block_per_message() -> None:
    before = _result(retained_blocks=-100)  # divided by 2 x 1000 messages: -0.05 per message
    assert _verdicts(before, _result(retained_blocks=800))["retained_blocks"] == "ok"
    assert _verdicts(before, _result(retained_blocks=1000))["retained_blocks"] == "GREW"
    assert _verdicts(before, _result(retained_blocks=-1000))["retained_blocks"] == "ok"


def test_a_repeated_measurement_that_differs_is_reported() -> None:
    runs = [_result(calls=50_000, tasks=1_000), _result(calls=50_000, tasks=1_000)]
    assert cost.spread(runs) == ("identical: {'calls': 50000, 'tasks': 1000}", True)
    runs.append(_result(calls=50_004, tasks=1_002))
    text, steady = cost.spread(runs)
    assert "tasks 1000..1002" in text and "calls 50000..50004" in text
    assert not steady  # two tasks in 1,000 messages are 2% of the 10% the test allows


# -- the counters ----------------------------------------------------------------------------


def _work(times: int) -> None:
    for _ in range(times):
        _callee([])


def _callee(items: list[int]) -> int:
    return len(items)


def test_calls_and_c_calls_are_counted_exactly() -> None:
    def counted(times: int) -> tuple[int, int]:
        counter = CallCounter()
        counter.start()
        _work(times)
        counter.stop()
        calls, c_calls, by_function = counter.counts()
        assert by_function[f"tests/test_cost.py:{_callee.__code__.co_firstlineno} _callee"] \
            == times
        return calls, c_calls

    calls, c_calls = counted(10)
    more_calls, more_c_calls = counted(110)
    assert (more_calls - calls, more_c_calls - c_calls) == (100, 100)  # _callee, len


def test_tasks_are_counted_however_they_are_made() -> None:
    async def main() -> TaskCounter:
        counter = TaskCounter()
        counter.install()
        try:
            counter.counting = True
            await asyncio.gather(*(asyncio.sleep(0) for _ in range(3)))
            await asyncio.create_task(asyncio.sleep(0))
            await asyncio.Task(asyncio.sleep(0), loop=asyncio.get_running_loop())  # no factory
            counter.counting = False
            await asyncio.create_task(asyncio.sleep(0))
            counter.check_installed()
        finally:
            counter.uninstall()
        assert not counter.installed
        with pytest.raises(RuntimeError, match="replaced"):
            counter.check_installed()
        return counter

    counter = asyncio.run(main())
    assert counter.total == 5
    assert counter.created == {"sleep": 5}
    assert "add" not in vars(asyncio.tasks._all_tasks), "the registry is left as it was"


def test_broker_calls_are_counted_and_the_last_ack_is_seen() -> None:
    class Broker:
        async def receive(self, subscription: str, most: int, timeout: float) -> list[int]:
            return list(range(most))

        async def ack(self, deliveries: list[int]) -> list[int]:
            return [d for d in deliveries if d < 0]  # refused

    drained: list[int] = []
    broker = Broker()
    seams = Seams(messages=5, on_drained=lambda: drained.append(seams.acked))
    seams.wrap(broker, ("receive", "ack", "nack"), "adapter")
    assert not hasattr(broker, "nack")  # only methods the class has are wrapped

    async def main() -> None:
        seams.counting = True
        assert await broker.receive("s", 3, 1.0) == [0, 1, 2]
        await broker.ack([0, 1, -1])
        assert drained == []
        await broker.ack([2, 3, 4])
        await broker.ack([5])

    asyncio.run(main())
    assert dict(seams.calls) == {"adapter.receive": 1, "adapter.ack": 3}
    assert (seams.received, seams.acked, drained) == (3, 6, [5])
