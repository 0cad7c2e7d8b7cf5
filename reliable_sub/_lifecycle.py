"""The lifecycle every long-running part shares: the Subscriber and the outbox relay.

``start``/``stop`` run it on a background thread; ``run`` blocks until SIGINT or SIGTERM;
``serve``/``shutdown`` run it inside your event loop; ``with`` and ``async with`` wrap the two.
A stop is graceful (the part gets ``timeout`` seconds to finish its work), a second stop forces
it, and a stopped part can be started again.

A subclass says what a run is with three hooks: :meth:`Service._open` (start working; raise to
refuse the start), :meth:`Service._close` (finish within a timeout, or at once when forced) and
:meth:`Service._log_stopped`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

from .errors import ConfigurationError

ServiceT = TypeVar("ServiceT", bound="Service")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Service:
    """start/stop, run, serve/shutdown and the ``with`` forms over a subclass's open and close.

    Args:
        stop_timeout: real seconds a stop that names no timeout gives the work under way.
        logger: where the lifecycle is logged (the subclass's module logger).
    """

    def __init__(self, *, stop_timeout: float, logger: logging.Logger) -> None:
        if not isinstance(stop_timeout, int | float) or not stop_timeout >= 0:
            raise ConfigurationError(
                f"{self._name}.stop_timeout must be in [0, inf), got {stop_timeout!r}"
            )
        self._stop_timeout = float(stop_timeout)
        self._logger = logger
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_requested: asyncio.Event | None = None
        self._force: asyncio.Event | None = None
        self._closed: asyncio.Event | None = None
        self._timeout = self._stop_timeout
        self._done = threading.Event()
        self._serving: asyncio.Task[None] | None = None
        self._is_running = False

    @property
    def _name(self) -> str:
        return type(self).__name__

    # -- what a run is (subclasses) --------------------------------------------------------

    async def _open(self) -> None:
        """Start working inside the running loop; raise (after cleaning up) to refuse."""
        raise NotImplementedError

    async def _close(self, timeout: float, force: asyncio.Event) -> None:
        """Stop working: finish what is under way within ``timeout`` seconds, or as soon as
        ``force`` is set; then release the run's connections."""
        raise NotImplementedError

    def _log_stopped(self) -> None:
        """Log what the run did, once it has stopped."""

    # -- state -------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True between a successful start and the end of a stop."""
        return self._is_running

    @property
    def stopping(self) -> bool:
        """True from a stop request until the stop has finished."""
        stop = self._stop_requested
        return stop is not None and stop.is_set()

    # -- the ways to run it -----------------------------------------------------------------

    def start(self) -> None:
        """Run in a background thread; returns once the work has begun (or raises why not)."""
        if self._loop is not None or (self._thread is not None and self._thread.is_alive()):
            raise RuntimeError(f"{self._name} is already running")
        started = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            try:
                asyncio.run(self._serve(started.set))
            except BaseException as error:
                failure.append(error)
                if started.is_set():
                    self._logger.exception("%s background thread failed", self._name)
            finally:
                started.set()

        self._done.clear()
        self._thread = threading.Thread(target=main, name="reliable-sub", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]

    def stop(self, timeout: float | None = None) -> None:
        """Stop gracefully from any thread but the service's own loop: the work under way gets
        ``timeout`` real seconds (default: ``stop_timeout``). A second ``stop()`` while one is
        under way forces it: nothing more is waited for."""
        loop = self._loop
        if loop is None:
            self._join_thread()
            return
        if _running_loop() is loop:
            raise RuntimeError(
                f"{self._name}.stop() blocks; inside its event loop use: await "
                f"{self._usual_name}.shutdown(timeout)"
            )
        with contextlib.suppress(RuntimeError):  # a closed loop: the run is over already
            loop.call_soon_threadsafe(self._request_stop, timeout)
        self._done.wait()
        self._join_thread()

    async def shutdown(self, timeout: float | None = None) -> None:
        """The same as :meth:`stop`, awaited from inside the service's event loop."""
        closed = self._closed
        if closed is None:
            return
        self._request_stop(timeout)
        await closed.wait()

    def run(self) -> None:
        """Block until SIGINT or SIGTERM (or :meth:`stop` from another thread), then stop.

        The first signal stops gracefully (see :meth:`stop`); a second one forces the stop.
        """

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # no loop running here: run() makes its own
        else:
            raise RuntimeError(
                f"{type(self).__name__}.run() blocks and makes its own event loop, and this "
                f"thread already runs one: inside async code, await {self._usual_name}.serve() "
                "(or start it as a task)")

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for sig in STOP_SIGNALS:
                try:
                    loop.add_signal_handler(sig, self._on_signal, sig)
                except (NotImplementedError, RuntimeError, ValueError):
                    self._logger.debug("cannot install a handler for %s outside the main "
                                       "thread", sig)
            try:
                await self.serve()
            finally:
                for sig in STOP_SIGNALS:
                    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                        loop.remove_signal_handler(sig)

        asyncio.run(main())

    async def serve(self) -> None:
        """Run inside the current event loop until stopped (or cancelled, which also stops)."""
        await self._serve(None)

    def __enter__(self: ServiceT) -> ServiceT:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self: ServiceT) -> ServiceT:
        loop = asyncio.get_running_loop()
        started: asyncio.Future[None] = loop.create_future()

        def on_started() -> None:
            if not started.done():
                started.set_result(None)

        task = loop.create_task(self._serve(on_started), name=f"reliable-sub {self._name}")
        await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            task.result()  # raises why it could not start
        self._serving = task
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        task, self._serving = self._serving, None
        await self.shutdown()
        if task is not None:
            await task

    # -- the run -----------------------------------------------------------------------------

    def _on_signal(self, sig: signal.Signals) -> None:
        self._logger.info("received %s", sig.name)
        self._request_stop(None)

    def _request_stop(self, timeout: float | None) -> None:
        stop, force = self._stop_requested, self._force
        if stop is None or force is None:
            return
        if stop.is_set():
            if not force.is_set():
                self._logger.warning("second stop request: forcing the stop (%s)",
                                     self._forced_stop_gives_up)
                force.set()
            return
        self._timeout = self._stop_timeout if timeout is None else timeout
        self._logger.info("stop requested; waiting up to %gs for %s (stop again to force)",
                          self._timeout, self._work_under_way)
        stop.set()

    # What users usually call an instance, for error messages.
    _usual_name = "service"
    # What a graceful stop waits for, and what a forced one gives up, for the log.
    _work_under_way = "the work under way"
    _forced_stop_gives_up = "the work under way is abandoned"

    async def _serve(self, on_started: Callable[[], None] | None) -> None:
        if self._loop is not None:
            raise RuntimeError(f"{self._name} is already running")
        self._loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        self._force = asyncio.Event()
        self._closed = asyncio.Event()
        self._timeout = self._stop_timeout
        self._done.clear()
        try:
            await self._open()
            self._is_running = True
            if on_started is not None:
                on_started()
            try:
                await self._stop_requested.wait()
            except asyncio.CancelledError:
                # cancelling serve() stops gracefully
                await self._close(self._stop_timeout, self._force)
                raise
            await self._close(self._timeout, self._force)
            self._log_stopped()
        finally:
            self._is_running = False
            self._closed.set()
            self._loop = None
            self._stop_requested = self._force = self._closed = None
            self._done.set()

    def _join_thread(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


__all__ = ["Service"]
