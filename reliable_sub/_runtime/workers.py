"""Worker threads for sync handlers, with their slots counted in the event loop.

Why not ``ThreadPoolExecutor``: its queue hides what has not started. A delivery waits for a free
slot *in the event loop* (an ``asyncio.Semaphore``) and is handed to a thread only when one is
idle, so a stop can give back every delivery that has not started, and no handler starts after
the stop began. The threads are daemons: after a forced stop the process can exit while a hung
handler still runs (a graceful stop waits for every running handler instead).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

# The name this module's records always had (it was public): logging set-ups name it.
logger = logging.getLogger("reliable_sub.runtime.workers")

# What a thread hands back: (True, return value) or (False, the exception it raised).
Outcome = tuple[bool, Any]
_Job = tuple[Callable[..., Any], tuple[Any, ...], contextvars.Context, asyncio.Future[Outcome]]


class WorkerThreads:
    """At most ``size`` sync calls at once, each on a daemon thread.

    Args:
        size: threads (and slots).
        name: thread name prefix.
    """

    def __init__(self, size: int, name: str = "reliable-sub") -> None:
        self.size = size
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._slots = asyncio.Semaphore(size)

    async def acquire(self) -> None:
        """Wait for a free slot (in the event loop; cancellable)."""
        await self._slots.acquire()

    def release(self) -> None:
        self._slots.release()

    @property
    def saturated(self) -> bool:
        """True while every slot is taken."""
        return self._slots.locked()

    async def wait_for_a_free_slot(self) -> None:
        """Wait until a slot is free with nobody queued before us (taking none)."""
        await self._slots.acquire()
        self._slots.release()

    def run(self, function: Callable[..., Any], *args: Any) -> asyncio.Future[Outcome]:
        """Call ``function(*args)`` on a thread in a copy of the current context (hold a slot).

        The future never raises: it resolves to ``(True, result)`` or ``(False, error)`` for any
        exception, ``BaseException``s included.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outcome] = loop.create_future()
        with self._lock:
            if self._idle == 0 and len(self._threads) < self.size:
                self._start_thread()
            else:
                self._idle -= 1
        self._jobs.put((function, args, contextvars.copy_context(), future))
        return future

    def shutdown(self) -> None:
        """Let idle threads exit; running calls finish on their own."""
        for _ in self._threads:
            self._jobs.put(None)
        self._threads = []

    def _start_thread(self) -> None:
        thread = threading.Thread(
            target=self._work, name=f"{self._name}-{len(self._threads) + 1}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            function, args, context, future = job
            try:
                outcome: Outcome = (True, context.run(function, *args))
            except BaseException as error:  # every exception is the handler's outcome
                outcome = (False, error)
            _resolve(future, outcome)
            del job, future, outcome
            with self._lock:
                self._idle += 1


def _resolve(future: asyncio.Future[Outcome], outcome: Outcome) -> None:
    def resolve() -> None:
        if not future.done():
            future.set_result(outcome)

    try:
        future.get_loop().call_soon_threadsafe(resolve)
    except RuntimeError:  # the loop has closed: nobody waits for this result any more
        logger.debug("a sync handler finished after its event loop closed")
