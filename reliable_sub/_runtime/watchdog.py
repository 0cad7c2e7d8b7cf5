"""Event-loop lag watchdog: warns when something blocks the Subscriber's event loop.

An async handler that calls blocking code (``time.sleep``, a sync HTTP client, a heavy loop)
stops every other handler, the lease manager and the settler. Leases and dedup claims are then
not renewed, so the broker redelivers and a peer may run the same message again. Nothing in the
loop can notice, because the loop is what is blocked; this thread can. Every ``interval`` it asks
the loop to run a no-op; when the loop has not run it after ``threshold`` seconds, it logs a
WARNING naming the task that holds the loop (the handler and its message), and an INFO line when
the loop is free again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("reliable_sub.subscriber")


class LoopWatchdog:
    """Watches ``loop`` from a daemon thread.

    Args:
        loop: the event loop to watch.
        threshold: real seconds of lag that count as blocked.
        describe: names what a task is doing (a handler and its message), or None.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        threshold: float,
        describe: Callable[[asyncio.Task[object] | None], str | None],
    ) -> None:
        self._loop = loop
        self.threshold = threshold
        self._describe = describe
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.blocked_episodes = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="reliable-sub-watchdog",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        interval = self.threshold / 2
        while not self._stopped.wait(interval):
            answered = threading.Event()
            try:
                self._loop.call_soon_threadsafe(answered.set)
            except RuntimeError:  # the loop has closed
                return
            if answered.wait(self.threshold) or self._stopped.is_set():
                continue
            self.blocked_episodes += 1
            task = asyncio.current_task(self._loop)
            what = self._describe(task) or (f"task {task.get_name()!r}" if task else "unknown")
            began = time.monotonic() - self.threshold
            logger.warning(
                "the event loop has been blocked for more than %.1fs by %s: an async handler "
                "must not block (run blocking code with asyncio.to_thread, or make the handler "
                "a plain def so it runs in a worker thread); leases and dedup claims are not "
                "renewed while the loop is blocked", self.threshold, what,
                extra={"blocked_by": what},
            )
            while not answered.wait(interval):
                if self._stopped.is_set():
                    return
            logger.info("the event loop is free again after %.1fs", time.monotonic() - began)
