"""Time, injectable: every timer in reliable-sub reads and sleeps through a Clock.

Production code uses :class:`SystemClock`. Tests and simulations use :class:`ManualClock`, whose
time only moves when ``advance`` is called, so a ten-minute ack deadline is tested in milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import sys
import threading
import time
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar, runtime_checkable

from .errors import ConfigurationError

T = TypeVar("T")


@runtime_checkable
class Clock(Protocol):
    """A monotonic time source in float seconds, and a way to sleep on it."""

    def now(self) -> float:
        """Seconds on a monotonic scale; only differences are meaningful."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch, for publish times."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Suspend the calling task for ``seconds`` of this clock's time."""
        ...


class SystemClock:
    """The real clock: ``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class ManualClock:
    """A clock that only moves when told to; safe to advance from any thread.

    Sleepers may live on any event loop: ``advance`` wakes each one on its own loop.
    """

    def __init__(self, start: float = 0.0, wall_offset: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_offset
        self._lock = threading.Lock()
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._sequence = itertools.count()
        # per loop of another thread: sleepers woken there (queued) and how many of them have
        # run (resolved) but not yet until the loop went idle; the one loop checking for idle
        self._waking: dict[asyncio.AbstractEventLoop, tuple[int, int]] = {}
        self._checking: set[asyncio.AbstractEventLoop] = set()

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._wall_offset + self._now

    async def sleep(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if seconds <= 0:
                future.set_result(None)
            else:
                heapq.heappush(self._sleepers, (self._now + seconds, next(self._sequence), future))
        await future

    def next_wakeup(self) -> float | None:
        """The earliest time a sleeper is waiting for, or None when nobody sleeps."""
        with self._lock:
            self._drop_cancelled()
            return self._sleepers[0][0] if self._sleepers else None

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose time has come."""
        if seconds < 0:
            raise ConfigurationError(f"ManualClock.advance: seconds must be >= 0, got {seconds}")
        self.set(self._now + seconds)

    def set(self, when: float) -> None:
        """Move time forward to ``when`` (never backwards) and wake due sleepers."""
        with self._lock:
            self._now = max(self._now, when)
            due: list[asyncio.Future[None]] = []
            while self._sleepers and self._sleepers[0][0] <= self._now:
                due.append(heapq.heappop(self._sleepers)[2])
        for future in due:
            self._wake(future)

    def waking(self) -> bool:
        """True while a sleeper woken on another thread's event loop has not yet run until
        that loop went idle: a driver must not move the clock again before, or a later
        sleeper there (a timeout around the call that slept) could fire in the same turn."""
        with self._lock:
            for loop in [loop for loop in self._waking if not loop.is_running()]:
                # stopped (or closed) before running the wake-up: it may never; forget it
                del self._waking[loop]
                self._checking.discard(loop)
            return bool(self._waking)

    def _drop_cancelled(self) -> None:
        while self._sleepers and self._sleepers[0][2].done():
            heapq.heappop(self._sleepers)

    def _wake(self, future: asyncio.Future[None]) -> None:
        loop = future.get_loop()
        if loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            _resolve(future)
            return
        with self._lock:
            queued, resolved = self._waking.get(loop, (0, 0))
            self._waking[loop] = (queued + 1, resolved)
        try:
            loop.call_soon_threadsafe(self._resolve_there, future, loop)
        except RuntimeError:  # the loop closed meanwhile
            with self._lock:
                self._waking.pop(loop, None)

    def _resolve_there(self, future: asyncio.Future[None], loop: asyncio.AbstractEventLoop) -> None:
        _resolve(future)
        with self._lock:
            queued, resolved = self._waking.get(loop, (0, 0))
            if not queued:
                return  # forgotten while the loop was stopped
            self._waking[loop] = (queued, resolved + 1)
            if loop in self._checking:
                return  # one idle check per loop: its own handle would keep another busy
            self._checking.add(loop)
        loop.call_soon(self._idle_there, loop, 0)

    def _idle_there(self, loop: asyncio.AbstractEventLoop, turns: int) -> None:
        ready = getattr(loop, "_ready", None)
        if ready and turns < _MAX_IDLE_TURNS:
            loop.call_soon(self._idle_there, loop, turns + 1)
            return
        with self._lock:
            self._checking.discard(loop)
            queued, resolved = self._waking.get(loop, (0, 0))
            if queued > resolved:  # a wake-up counted but not yet run here: its turn comes
                self._waking[loop] = (queued - resolved, 0)
            else:
                self._waking.pop(loop, None)


# A woken sleeper's loop is taken as idle after this many turns even if still busy.
_MAX_IDLE_TURNS = 1_000


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def sleep_or_event(clock: Clock, event: asyncio.Event, seconds: float) -> None:
    """Return when ``event`` is set or ``seconds`` of ``clock`` time have passed."""
    if event.is_set():
        return
    if isinstance(clock, SystemClock):
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=max(0.0, seconds))
        return
    sleeper = asyncio.ensure_future(clock.sleep(seconds))
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({sleeper, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        waiter.cancel()


class AbandonedCall(TimeoutError):
    """A call that did not answer within its bound and was left to finish on its own (not
    cancelled: some clients, SQLAlchemy's async drivers among them, do not survive a
    cancellation mid-call). ``call`` is the call still running."""

    def __init__(self, message: str, call: asyncio.Future[Any]) -> None:
        super().__init__(message)
        self.call = call


async def within(
    clock: Clock, awaitable: Awaitable[T], seconds: float, what: str, *, cancel: bool = True
) -> T:
    """``await awaitable`` for at most ``seconds`` of ``clock`` time: a broker or store whose
    connection hangs (rather than refusing) then fails the call, like any other failure,
    instead of holding its caller for ever.

    Past the bound the call is cancelled and a TimeoutError naming ``what`` raised; with
    ``cancel=False`` it is left running and :class:`AbandonedCall` (a TimeoutError) is raised.
    """
    message = f"{what} did not answer within {seconds:g}s"
    if cancel and isinstance(clock, SystemClock) and sys.version_info >= (3, 11):
        timeout = asyncio.timeout(max(0.0, seconds))  # no task of its own: the cheap way
        try:
            async with timeout:
                return await awaitable
        except TimeoutError:
            if timeout.expired():
                raise TimeoutError(message) from None
            raise
    call = asyncio.ensure_future(awaitable)
    timer = None if isinstance(clock, SystemClock) else asyncio.ensure_future(clock.sleep(seconds))
    try:
        await asyncio.wait({call} if timer is None else {call, timer},
                           timeout=max(0.0, seconds) if timer is None else None,
                           return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        call.cancel()
        raise
    finally:
        if timer is not None:
            timer.cancel()
    if call.done():
        return call.result()
    call.add_done_callback(_retrieve)
    if cancel:
        call.cancel()  # not awaited: a call that ignores its cancellation must not hang us too
        raise TimeoutError(message)
    raise AbandonedCall(message, call)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" at garbage collection


__all__ = ["AbandonedCall", "Clock", "ManualClock", "SystemClock", "sleep_or_event", "within"]
