"""The test clock drives sleepers on other threads' loops in order, however slow those loops.

A Subscriber started in a thread of its own (``start()``) sleeps on the ManualClock from that
thread's loop. A driver that jumps the clock again before a woken sleeper there has run would
let a later sleeper (the timeout bounding the call that slept) fire in the same turn: the call
then fails with a timeout that no real clock could produce.
"""

from __future__ import annotations

import asyncio
import threading
import time

from reliable_sub.clock import ManualClock, SystemClock, sleep_or_event, within
from reliable_sub.testing.timing import drive_until, pass_time


def _serve_in_thread(clock: ManualClock, results: list[object]) -> tuple[
    threading.Thread, list[asyncio.AbstractEventLoop], threading.Event
]:
    loops: list[asyncio.AbstractEventLoop] = []
    sleeping = threading.Event()

    async def call() -> float:
        sleeping.set()
        # as the memory adapter's receive waits: a task of its own sleeps, a hop deeper than
        # the bound's timer
        await sleep_or_event(clock, asyncio.Event(), 1)
        return clock.now()  # when it ran on: the time it woke at, unless a jump came first

    async def main() -> None:
        loops.append(asyncio.get_running_loop())
        try:
            results.append(await within(clock, call(), 4, "call"))
        except TimeoutError as error:
            results.append(error)

    thread = threading.Thread(target=asyncio.run, args=(main(),))
    thread.start()
    return thread, loops, sleeping


async def _stalled_when_woken(
    clock: ManualClock, results: list[object]
) -> threading.Thread:
    """The call of ``_serve_in_thread``, asleep, on a loop that will be descheduled for
    0.2 s (far past any grace) when its sleeper wakes."""
    thread, loops, sleeping = _serve_in_thread(clock, results)
    await asyncio.to_thread(sleeping.wait, 10)
    await drive_until(SystemClock(), lambda: clock.next_wakeup() == 1, 10, what="both sleepers")
    loops[0].call_soon_threadsafe(time.sleep, 0.2)
    return thread


async def test_drive_until_waits_for_a_stalled_loop_before_the_next_jump() -> None:
    clock = ManualClock()
    results: list[object] = []
    thread = await _stalled_when_woken(clock, results)
    await drive_until(clock, lambda: bool(results), 10, what="the call")
    await asyncio.to_thread(thread.join, 10)
    assert results == [1.0]
    assert clock.now() == 1
    assert not clock.waking()


async def test_pass_time_waits_for_a_stalled_loop_before_the_next_jump() -> None:
    clock = ManualClock()
    results: list[object] = []
    thread = await _stalled_when_woken(clock, results)
    await pass_time(clock, 10)
    await asyncio.to_thread(thread.join, 10)
    assert results == [1.0]


async def test_a_loop_that_is_not_running_never_counts_as_waking() -> None:
    clock = ManualClock()
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    clock._sleepers.append((1.0, 0, future))
    loop.close()
    clock.set(1)
    assert not clock.waking()


def test_a_stopped_loop_with_a_wake_up_pending_never_counts_as_waking() -> None:
    clock = ManualClock()
    loop = asyncio.new_event_loop()
    try:
        future = loop.create_future()
        clock._sleepers.append((1.0, 0, future))
        clock.set(1)  # the wake-up is queued on a loop that is not running
        assert not clock.waking()
        loop.run_until_complete(asyncio.sleep(0))  # it runs once the loop does
        assert future.done()
    finally:
        loop.close()


def test_sleepers_woken_together_on_another_loop_share_one_idle_check() -> None:
    clock = ManualClock()
    checks: list[int] = []

    async def main() -> None:
        idle_there = clock._idle_there

        def counted(loop: asyncio.AbstractEventLoop, turns: int) -> None:
            checks.append(turns)
            idle_there(loop, turns)

        clock._idle_there = counted  # type: ignore[method-assign]
        sleepers = [asyncio.ensure_future(clock.sleep(1)) for _ in range(3)]
        await asyncio.sleep(0)
        setter = threading.Thread(target=clock.set, args=(1,))  # woken from another thread
        setter.start()
        await asyncio.gather(*sleepers)
        await asyncio.to_thread(setter.join)
        for _ in range(10_000):  # until the idle check saw this loop idle (here, on a timer)
            if not clock.waking():
                break
            await asyncio.sleep(0.001)

    asyncio.run(main())
    assert not clock.waking()
    assert len(checks) < 10, f"{len(checks)} idle checks for three sleepers woken at once"
