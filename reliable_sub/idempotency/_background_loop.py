"""The event loop on which sync ``@idempotent`` functions make their store calls.

One daemon thread runs it, shared by every sync ``@idempotent`` function of the process, so the
stores' connections (one client per event loop) are reused from call to call and a sync function
works even when called from inside a running event loop. At exit it closes the stores'
connections, cancels what still runs on it (a client's reader and pinger tasks) and lets it end,
as ``asyncio.run`` does, then stops: a task destroyed pending, or a coroutine finalised after the
loop closed, would print "Task was destroyed but it is pending" or "Event loop is closed" as the
interpreter exits. After a fork it starts afresh.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

from ..ports import DedupStore

# The name this module's records always had (it was public): logging set-ups name it.
logger = logging.getLogger("reliable_sub.idempotency.background_loop")

T = TypeVar("T")

# At exit, closing the background loop's store connections may take this long at most.
EXIT_TIMEOUT = 5.0


class BackgroundLoop:
    """One daemon thread running an event loop, for the store calls of sync functions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._stores: weakref.WeakSet[Any] = weakref.WeakSet()
        self._exit_registered = False

    def _running(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():  # none yet, or forked
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=_serve, args=(loop,), name="reliable-sub-idempotent", daemon=True
                )
                thread.start()
                self._loop, self._thread, self._pid = loop, thread, os.getpid()
                self._stores = weakref.WeakSet()
                if not self._exit_registered:
                    atexit.register(self.shutdown)
                    self._exit_registered = True
            return self._loop

    def run(self, coroutine: Coroutine[Any, Any, T], store: object | None = None) -> T:
        """Run ``coroutine`` on the loop and wait for it (from any other thread); interrupted
        while waiting, cancel it."""
        future = self.submit(coroutine, store)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted while waiting: stop the store call too
            raise

    def submit(
        self, coroutine: Coroutine[Any, Any, T], store: object | None = None
    ) -> concurrent.futures.Future[T]:
        """Start ``coroutine`` on the loop (from any other thread) without waiting for it."""
        loop = self._running()
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError(
                "a sync @idempotent function was called on the background loop's own thread"
            )
        if store is not None:
            with contextlib.suppress(TypeError):  # not weak-referenceable: not closed at exit
                self._stores.add(store)
        return asyncio.run_coroutine_threadsafe(coroutine, loop)

    def close_store(self, store: DedupStore) -> None:
        with self._lock:
            alive = self._loop is not None and self._pid == os.getpid()
        if alive:
            self.run(store.close())
            self._stores.discard(store)

    def shutdown(self) -> None:
        """Close the stores' connections on the loop and stop it (at exit)."""
        with self._lock:
            loop, thread = self._loop, self._thread
            if loop is None or thread is None or self._pid != os.getpid():
                return
            self._loop = self._thread = None
            stores = list(self._stores)

        async def close_all() -> None:
            for store in stores:
                try:
                    await store.close()
                except Exception:
                    logger.debug("closing %r at exit failed", store, exc_info=True)
            await _end_the_rest()

        try:
            asyncio.run_coroutine_threadsafe(close_all(), loop).result(timeout=EXIT_TIMEOUT)
        except Exception:
            logger.debug("closing the stores of sync @idempotent functions failed",
                         exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=EXIT_TIMEOUT)
        if not thread.is_alive():
            loop.close()


async def _end_the_rest() -> None:
    """Cancel every other task of the running loop and wait for them to end; finalise its
    async generators."""
    this = asyncio.current_task()
    rest = [task for task in asyncio.all_tasks() if task is not this]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()


BACKGROUND = BackgroundLoop()
