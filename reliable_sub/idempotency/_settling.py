"""Claims an ``@idempotent`` call settles even when its caller stops waiting.

A caller may give up at any await of a call: an ``asyncio.wait_for`` around it (an HTTP client's
timeout, the natural case for a client that retries), a cancelled task, or in a sync caller an
exception raised by a signal handler (a signal-based timeout, ``KeyboardInterrupt``). Once the
function has returned, its result is a fact: giving up while it is being recorded must neither
lose the record (a retry would run the function again) nor leave the claim held until its lease
lapses (a retry would find the key in progress meanwhile). Nor may a caller cancelled during its
claim call leave behind a claim nobody holds.

So an async caller awaits its store calls as they are, at no cost (no task, no turn of the event
loop), and a cancellation that interrupts one makes it again in a task of its own: from a fresh
connection if the client library dropped the one the cancellation found in flight (redis-py
does), which is harmless, since completing or releasing a claim twice under its token is; a
claim call the caller left is followed by a release of the claim it may have made under the
caller's token. A store whose calls must not be cut short in flight (``cancel_safe_calls =
False``: SqlDedupStore) has them run in a task of their own that the caller awaits through
``asyncio.shield``, and that is left to finish. A sync caller interrupted by an exception leaves
its store calls running, or makes them again, on the background loop. Until that work is done,
its key is *settling* in this process, and a later call of the function with that key first
waits for it (up to ``wait_timeout`` real seconds), so it replays the recorded result rather than
running the function again or finding the key in progress.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ._background_loop import BACKGROUND

# The name this module's records always had (it was public): logging set-ups name it.
logger = logging.getLogger("reliable_sub.idempotency.settling")

T = TypeVar("T")
# What settles a key: a task in the caller's event loop, or (for a sync caller) a future this
# module resolves when the work it started on the background loop ends.
_Work = asyncio.Future[Any] | concurrent.futures.Future[None]


class Settling:
    """The keys of one decorated function whose claims are being settled in the background."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._pending: dict[str, set[_Work]] = {}  # also holds the tasks (loops hold weakly)

    def has(self, key: str) -> bool:
        """Whether ``key`` may be settling (cheap: no lock, for every call's fast path)."""
        return key in self._pending

    def track(self, key: str, work: asyncio.Future[Any]) -> None:
        """Count ``key`` as settling until ``work`` (a task in the running loop) ends."""
        if work.done():
            return
        self._add(key, work)
        work.add_done_callback(lambda done: self._end(key, done, done.cancelled()))

    def redo(self, key: str, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in a task of its own, counting ``key`` as settling until it ends: what
        an async caller cancelled in a store call leaves to be done (call it from the except
        clause, in the caller's loop)."""
        self.track(key, asyncio.ensure_future(work))

    def on_background(
        self, key: str, work: Coroutine[Any, Any, T], store: object
    ) -> concurrent.futures.Future[T]:
        """Start ``work`` on the background loop (for a sync caller), counting ``key`` as
        settling from now until it ends."""
        pending: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._add(key, pending)

        async def tracked() -> T:
            cancelled = True
            try:
                result = await work
                cancelled = False
                return result
            except Exception:
                cancelled = False
                raise
            finally:
                self._end(key, pending, cancelled)

        running = tracked()
        try:
            return BACKGROUND.submit(running, store)
        except BaseException as error:
            # Not started; or interrupted just as it started, and then only a call made before
            # it ends may not wait for it.
            self._end(key, pending, False)
            if isinstance(error, Exception):  # the loop refused it: it never runs
                running.close()
                work.close()
            raise

    def ask_on_background(
        self, key: str, question: Coroutine[Any, Any, T],
        unwanted: Callable[[T], Coroutine[Any, Any, None]], store: object,
    ) -> T:
        """The answer of ``question``, run on the background loop. A caller interrupted while
        it waits leaves the question to be answered there, and ``unwanted`` to be run on the
        answer (later calls with ``key`` wait for both)."""
        answer: concurrent.futures.Future[T] = concurrent.futures.Future()

        async def asking() -> None:
            if answer.cancelled():  # the caller left before the question was asked
                question.close()
                return
            try:
                result = await question
            except BaseException as error:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    answer.set_exception(error)
                if not isinstance(error, Exception):
                    raise
                return
            try:
                answer.set_result(result)
            except concurrent.futures.InvalidStateError:  # the caller left meanwhile
                await unwanted(result)

        try:
            self.on_background(key, asking(), store)
            return answer.result()
        except BaseException:
            if not answer.cancel() and answer.exception() is None:  # answered, but not taken
                self.on_background(key, unwanted(answer.result()), store)
            raise

    def _add(self, key: str, work: _Work) -> None:
        with self._lock:
            self._pending.setdefault(key, set()).add(work)

    def _end(self, key: str, work: _Work, cancelled: bool) -> None:
        if cancelled:
            logger.warning(
                "@idempotent %s: settling the claim of idempotency key %r was cancelled (its "
                "event loop closed?); a later call with this key may run the function again "
                "once the claim lapses (lease_ttl)", self._name, key,
            )
        with self._lock:
            works = self._pending.get(key)
            if works is not None:
                works.discard(work)
                if not works:
                    del self._pending[key]
        if isinstance(work, concurrent.futures.Future):
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                work.set_result(None)

    def _ends(self, key: str) -> list[concurrent.futures.Future[Any]]:
        """Futures that end with the work settling ``key`` now, safe to wait on from any
        thread."""
        with self._lock:
            works = list(self._pending.get(key, ()))
        ends: list[concurrent.futures.Future[Any]] = []
        for work in works:
            end = work if isinstance(work, concurrent.futures.Future) else _ended(work)
            if end is None:  # a task whose loop closed: it never ends
                self._end(key, work, True)
            else:
                ends.append(end)
        return ends

    async def wait(self, key: str, timeout: float) -> None:
        """Wait until ``key`` is settled in this process (at most ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while (ends := self._ends(key)) and (left := deadline - time.monotonic()) > 0:
            # asyncio.wait never cancels what it waits for, even when cancelled itself
            await asyncio.wait([asyncio.wrap_future(end) for end in ends], timeout=left)

    def wait_sync(self, key: str, timeout: float) -> None:
        """:meth:`wait`, blocking the calling thread."""
        deadline = time.monotonic() + timeout
        while (ends := self._ends(key)) and (left := deadline - time.monotonic()) > 0:
            concurrent.futures.wait(ends, timeout=left)


def _ended(task: asyncio.Future[Any]) -> concurrent.futures.Future[None] | None:
    """A future set when ``task`` (of any thread's loop) is done; None if it never will be."""
    end: concurrent.futures.Future[None] = concurrent.futures.Future()

    def ended(_: object) -> None:
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            end.set_result(None)

    try:  # add_done_callback belongs to the task's loop thread
        task.get_loop().call_soon_threadsafe(task.add_done_callback, ended)
    except RuntimeError:  # its loop is closed
        return None
    return end
