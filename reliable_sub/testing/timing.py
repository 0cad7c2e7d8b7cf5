"""Driving time in tests: a ManualClock that jumps ahead only when the event loop is idle.

No sleeps as synchronization. With a ManualClock, ``drive_until`` lets the loop run every ready
callback, then moves the clock to the earliest pending sleeper (a lease tick, a nack delay, a
handler's own ``clock.sleep``), like trio's autojump clock. Virtual hours pass in milliseconds
and the order of events is deterministic.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from reliable_sub.clock import Clock, ManualClock, SystemClock

T = TypeVar("T")

# Upper bound on loop turns while settling; a loop that never goes idle is a bug in the test.
_MAX_SETTLE_TURNS = 10_000
# Wall-clock guard so a broken test fails instead of hanging.
WALL_LIMIT = 30.0
# On a real clock, what a wait allows beyond its budget: a loaded machine (a second test run, a
# CPU burner) stretches receives, handlers and settles to several times their idle duration. A
# wait returns as soon as its condition holds, so this only delays a failure, never a pass.
REAL_WAIT_SLACK = 20.0


# Before the clock jumps, the loop must stay idle this long in real time, so work running in a
# worker thread (a sync handler) can hand its result back first.
THREAD_GRACE = 0.001


async def settle() -> None:
    """Run the loop until no callback is ready, twice around a short real-time grace period."""
    await _settle_once()
    await asyncio.sleep(THREAD_GRACE)
    await _settle_once()


async def _settle_once() -> None:
    loop = asyncio.get_running_loop()
    ready = getattr(loop, "_ready", None)
    for _ in range(_MAX_SETTLE_TURNS):
        await asyncio.sleep(0)
        if ready is not None and not ready:
            # one more turn: callbacks scheduled by the last ones may be pending
            await asyncio.sleep(0)
            if not ready:
                return
        elif ready is None:
            continue
    if ready is None:
        return
    raise AssertionError("event loop never went idle")


async def drive_until(
    clock: Clock,
    predicate: Callable[[], bool],
    within: float,
    *,
    what: str = "condition",
    poll: float = 0.005,
) -> None:
    """Wait until ``predicate()`` holds, allowing ``within`` seconds of ``clock`` time.

    A ManualClock is advanced by jumps to its next sleeper; a real clock is polled, and allowed
    ``REAL_WAIT_SLACK`` seconds more (see there).
    """
    if not isinstance(clock, ManualClock):
        within += REAL_WAIT_SLACK
    # on a real clock the budget itself is wall time; the guard only adds slack
    wall_deadline = time.monotonic() + WALL_LIMIT + (
        0.0 if isinstance(clock, ManualClock) else within
    )
    start = clock.now()
    while True:
        if isinstance(clock, ManualClock):
            await settle()
        if predicate():
            return
        if clock.now() - start > within or time.monotonic() > wall_deadline:
            raise AssertionError(
                f"timed out waiting for {what} after {clock.now() - start:.2f}s of clock time"
            )
        if isinstance(clock, ManualClock):
            if clock.waking():  # a sleeper on another thread's loop is still waking: not a jump
                await asyncio.sleep(THREAD_GRACE)
                continue
            if await _let_real_timer_fire():
                continue  # something runs on real time (a handler's own timeout): not a jump
            wake = clock.next_wakeup()
            if wake is None:
                # nothing sleeps on the clock: something runs outside the loop (a thread); wait
                await asyncio.sleep(poll)
            else:
                clock.set(min(wake, start + within + 1e-6))
        else:
            await asyncio.sleep(poll)


# Before the ManualClock jumps, a real-time timer of the event loop due within this many real
# seconds (an asyncio.timeout in a handler, a stop's deadline) is let fire first.
REAL_TIMER_HORIZON = 0.25


async def _let_real_timer_fire() -> bool:
    """Wait for the loop's next real-time timer if it is due soon; True if there was one."""
    loop = asyncio.get_running_loop()
    scheduled = getattr(loop, "_scheduled", None)
    if not scheduled:
        return False
    due = min(handle.when() for handle in scheduled if not handle.cancelled())
    wait = due - loop.time()
    if wait > REAL_TIMER_HORIZON:
        return False
    await asyncio.sleep(max(0.0, wait))
    return True


async def pass_time(clock: Clock, seconds: float) -> None:
    """Let ``seconds`` of clock time pass, waking every sleeper on the way in order."""
    if not isinstance(clock, ManualClock):
        await asyncio.sleep(seconds)
        return
    target = clock.now() + seconds
    while True:
        await _settle_all(clock)
        wake = clock.next_wakeup()
        if wake is None or wake > target:
            clock.set(target)
            await _settle_all(clock)
            return
        clock.set(wake)


async def _settle_all(clock: ManualClock) -> None:
    """Settle this loop, and wait until sleepers woken on other threads' loops have run."""
    await settle()
    if clock.waking():
        await drive_until(SystemClock(), lambda: not clock.waking(), WALL_LIMIT,
                          what="a sleeper on another thread's loop", poll=THREAD_GRACE)


async def run_driven(clock: Clock, awaitable: Awaitable[T], within: float) -> T:
    """Await ``awaitable`` while driving ``clock`` (needed when it sleeps on a ManualClock)."""
    task = asyncio.ensure_future(awaitable)
    try:
        await drive_until(clock, task.done, within, what="call to finish")
    finally:
        if not task.done():
            task.cancel()
    return task.result()


class LoopStalls:
    """The longest time, in real seconds, the event loop (or the whole process) was kept from
    running: a task asks to be woken every ``interval`` and records how late each wake-up was.

    Leases hold only while the process runs: one kept from the CPU past the lease manager's
    safety margin lets its lease lapse, whatever the library does. A test of leases on a real
    clock can tell that case from a failure of its own with ``longest``. On a ManualClock
    nothing is watched (its time does not pass while the loop is kept from running)."""

    def __init__(self, clock: Clock, interval: float = 0.05) -> None:
        self.interval = interval
        self.longest = 0.0
        self._watched = not isinstance(clock, ManualClock)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopStalls:
        if self._watched:
            self._task = asyncio.get_running_loop().create_task(self._watch())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _watch(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval)
            self.longest = max(self.longest, time.perf_counter() - asked - self.interval)


__all__ = ["REAL_WAIT_SLACK", "LoopStalls", "drive_until", "pass_time", "run_driven", "settle"]
