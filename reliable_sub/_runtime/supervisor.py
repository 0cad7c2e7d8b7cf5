"""Supervised background tasks: a loop that dies is logged at ERROR and restarted.

The Subscriber's receive loops, lease managers and settler run forever. A bug or an unexpected
exception in one of them must not leave a subscription silently dead while ``running`` says
True: the supervisor logs the failure with its traceback, restarts the loop after a backoff
(``RESTART_WAIT_MIN`` doubling to ``RESTART_WAIT_MAX``), and ``healthy()`` is False until the
restarted loop has run for ``HEALTHY_AFTER`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from .._text import describe_error

logger = logging.getLogger("reliable_sub.subscriber")

RESTART_WAIT_MIN = 0.1
RESTART_WAIT_MAX = 10.0
# A restarted loop counts as healthy again once it has run this long without failing.
HEALTHY_AFTER = 1.0
# A stopped loop still running this long after its cancellation lost it on the way, and is
# cancelled again (see Supervisor.stop). No loop awaits anything once cancelled, so this only
# delays a stop that would otherwise never end.
CANCEL_AGAIN_AFTER = 0.5


class _Supervised:
    __slots__ = ("factory", "failures", "healthy_since", "keep_running", "name", "task")

    def __init__(
        self,
        name: str,
        factory: Callable[[], Coroutine[Any, Any, None]],
        keep_running: Callable[[], bool],
    ) -> None:
        self.name = name
        self.factory = factory
        self.keep_running = keep_running
        self.task: asyncio.Task[None] | None = None
        self.failures = 0
        self.healthy_since = 0.0


class Supervisor:
    """Runs named coroutines forever, restarting any that raises.

    Args:
        sleep: how to wait before a restart (the Subscriber's clock).
        now: the clock's reading, for ``healthy()``.
        owner: what runs the loops, for messages.
        logger: where failures are logged.
    """

    def __init__(
        self, sleep: Callable[[float], Awaitable[None]], now: Callable[[], float], *,
        owner: str = "Subscriber", logger: logging.Logger = logger,
    ) -> None:
        self._sleep = sleep
        self._now = now
        self._owner = owner
        self._logger = logger
        self._children: dict[str, _Supervised] = {}
        self._stopping = False
        self._failures = 0

    def spawn(
        self,
        name: str,
        factory: Callable[[], Coroutine[Any, Any, None]],
        keep_running: Callable[[], bool] = lambda: True,
    ) -> None:
        """Run ``factory()`` under supervision, as task ``name``.

        Returning is fine once ``keep_running()`` is False; before that it is a failure.
        """
        child = _Supervised(name, factory, keep_running)
        self._children[name] = child
        child.task = asyncio.get_running_loop().create_task(self._keep(child), name=name)

    @property
    def failures(self) -> int:
        """How many times supervised loops have failed (and been restarted) so far."""
        return self._failures

    def problems(self) -> list[str]:
        """Names of the loops that are down or restarted too recently, with why."""
        now = self._now()
        found: list[str] = []
        # a copy: healthy() is read from other threads too (probes, the metric reader)
        for child in list(self._children.values()):
            if child.task is None or child.task.done():
                found.append(f"{child.name}: not running")
            elif child.failures and now < child.healthy_since:
                found.append(f"{child.name}: restarted after {child.failures} failure(s)")
        return found

    async def wait(self, names: list[str], timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the named loops to end by themselves."""
        tasks = {c.task for n in names if (c := self._children.get(n)) and c.task is not None}
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    async def stop(self, *names: str) -> None:
        """Cancel the named loops (all when none are named) and wait for them.

        A cancellation can be lost on the way: before Python 3.12, ``asyncio.wait_for``
        returns the result of a call that completed as its caller was cancelled, and carries
        on (redis-py sends every command through it, as other clients do). A loop cancelled
        there runs on, and waiting for it would never end; so one that still runs
        ``CANCEL_AGAIN_AFTER`` seconds after its cancellation is cancelled again, until it
        stops.
        """
        chosen = [self._children[n] for n in names] if names else list(self._children.values())
        if not names:
            self._stopping = True
        for child in chosen:
            if child.task is not None:
                child.task.cancel()
        for child in chosen:
            if child.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await self._until_stopped(child.name, child.task)
            self._children.pop(child.name, None)

    async def _until_stopped(self, name: str, task: asyncio.Task[None]) -> None:
        """Wait for the cancelled ``task`` to end, cancelling it again while it runs on."""
        again = 0
        while True:
            try:
                done, _ = await asyncio.wait({task}, timeout=CANCEL_AGAIN_AFTER)
            except asyncio.CancelledError:
                task.cancel()  # the stop itself is cancelled: as awaiting the task would
                raise
            if done:
                break
            again += 1
            if again == 1:
                self._logger.warning(
                    "%s still runs %gs after it was cancelled (its cancellation was lost on "
                    "the way, e.g. by asyncio.wait_for before Python 3.12); cancelling it "
                    "again", name, CANCEL_AGAIN_AFTER, extra={"loop": name})
            task.cancel()
        await task  # how it ended: cancelled (raises CancelledError), or returned

    async def _keep(self, child: _Supervised) -> None:
        while True:
            try:
                await child.factory()
                if self._stopping or not child.keep_running():
                    return
                raise RuntimeError(f"{child.name} returned while the {self._owner} runs")
            except asyncio.CancelledError:
                raise
            except BaseException as error:  # any escape is a bug: log it and restart
                child.failures += 1
                self._failures += 1
                wait = min(RESTART_WAIT_MAX, RESTART_WAIT_MIN * 2 ** (child.failures - 1))
                self._logger.error(
                    "%s failed (%s); restarting it in %.1fs", child.name,
                    describe_error(error, 500), wait, exc_info=error,
                    extra={"loop": child.name, "failures": child.failures},
                )
                child.healthy_since = self._now() + wait + HEALTHY_AFTER
                await self._sleep(wait)
