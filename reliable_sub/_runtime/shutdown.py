"""Shutdown: how one run stops, gracefully within a timeout, or forced.

::

    stop receiving and starting handlers ─► give back what has not started
       ▼
    let receive calls in flight return (what they bring is given straight back), then cancel
       ▼
    wait for running handlers until the deadline; then cancel async ones (a thread cannot be:
       a graceful stop waits for it, a second signal forces) ─► "stopped"
       ▼
    flush every queued ack and nack (at least FLUSH_GRACE) ─► stop the loops, the threads,
       release the adapter's and the store's connections
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable

from ..dedup import Claimed
from ..outcome import Outcome
from .decisions import cancel
from .flow import FlowGate
from .inflight import CancelReason, Stage
from .lanes import Config, Item, Lane, RunState, SettleCall, close_gates
from .settler import Settler
from .supervisor import Supervisor
from .watchdog import LoopWatchdog
from .workers import WorkerThreads

logger = logging.getLogger("reliable_sub.subscriber")

# After a stop cancels the async handlers still running at its deadline, each gets this long
# (real seconds) to end; one that swallows the cancellation is then left behind, logged.
CANCEL_GRACE = 5.0
# Receive calls still in flight when a stop begins get this long beyond receive_timeout to
# return before they are cancelled (and a cancelled call this long to end).
RECEIVE_GRACE = 1.0
# Queued acks and nacks get at least this long (real seconds) after the handlers are done,
# even when the stop timeout has already passed.
FLUSH_GRACE = 5.0


class Shutdown:
    """Stops one run: built by its :meth:`~reliable_sub._runtime.pipeline.Runtime.close`.

    Args:
        config, state: the run's configuration and switches (flipped here).
        lanes: the run's lanes (their receive calls, and deliveries queued behind a key).
        flow, supervisor, settler, workers, watchdog: the parts stopped here.
        settle: :meth:`~reliable_sub._runtime.decisions.Decisions.settle`.
        release: the claim to release for a delivery given back (:meth:`Claims.release`).
    """

    def __init__(
        self,
        config: Config,
        state: RunState,
        lanes: Iterable[Lane],
        flow: FlowGate,
        supervisor: Supervisor,
        settler: Settler,
        workers: WorkerThreads,
        watchdog: LoopWatchdog | None,
        *,
        settle: SettleCall,
        release: Callable[[Item], Claimed | None],
    ) -> None:
        self._config = config
        self._state = state
        self._lanes = list(lanes)
        self._flow = flow
        self._supervisor = supervisor
        self._settler = settler
        self._workers = workers
        self._watchdog = watchdog
        self._settle = settle
        self._release = release

    async def close(self, timeout: float, force: asyncio.Event) -> None:
        """Stop: receive no more, give back what has not started, let running handlers finish
        within ``timeout`` real seconds, settle, and release the adapter and store."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        state, supervisor, settler = self._state, self._supervisor, self._settler
        state.receiving = state.accepting = False
        running = [i for i in state.items if i.stage is Stage.RUNNING]
        logger.info(
            "stopping: %d handlers running, %d deliveries not started; waiting up to %gs",
            len(running), sum(1 for i in state.items if i.stage is Stage.WAITING), timeout,
            extra={"running": len(running), "timeout": timeout},
        )
        close_gates(self._flow, self._lanes)
        if self._config.adapter.capabilities.cancel_safe_receive:
            self._cancel_receive_calls()
        # Messages queued behind a running one of their ordering key stay queued: they go back
        # when it is settled (Dispatcher.key_decided), so no peer runs them before it finished.
        for item in list(state.items):
            if item.stage is Stage.WAITING:
                cancel(item, CancelReason.STOP)
        # A receive call cancelled in flight may have taken messages at the broker that then
        # wait out their ack deadline; so where that can happen the calls in flight may return
        # (within receive_timeout), and what they bring is given straight back.
        receivers = [f"receive loop of {lane.route.subscription!r}" for lane in self._lanes]
        patience = min(deadline, loop.time() + self._config.receive_timeout + RECEIVE_GRACE)
        await supervisor.wait(receivers, max(0.0, patience - loop.time()))
        self._cancel_receive_calls()
        await supervisor.wait(receivers, RECEIVE_GRACE)
        await supervisor.stop(*receivers)
        await self._wait_for_handlers(deadline, force)
        if state.side_tasks:
            await wait_until(set(state.side_tasks), max(deadline, loop.time() + FLUSH_GRACE),
                             force)
        flush = max(deadline, loop.time() + FLUSH_GRACE)
        if force.is_set():
            settler.give_up_now()
        forcing = loop.create_task(_on_force(force, settler.give_up_now))
        try:
            await settler.drain(flush)
        finally:
            forcing.cancel()
        logger.info("drained: every delivery of this run is settled")
        await supervisor.stop()
        if self._watchdog is not None:
            self._watchdog.stop()
        self._workers.shutdown()
        await release_connections(self._config)

    def _cancel_receive_calls(self) -> None:
        for lane in self._lanes:
            if lane.receive_call is not None:
                lane.receive_call.cancel()

    async def _wait_for_handlers(self, deadline: float, force: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        items = self._state.items

        def unfinished() -> set[asyncio.Task[None]]:
            return {i.task for i in items if i.task is not None and not i.task.done()}

        await wait_until(unfinished(), deadline, force)
        stubborn = [i for i in items
                    if i.task is not None and not i.task.done() and i.stage is Stage.RUNNING]
        for item in stubborn:
            if item.lane.route.is_async:
                cancel(item, CancelReason.STOP)
        threads = [i for i in stubborn if not i.lane.route.is_async]
        if threads and not force.is_set():
            logger.warning(
                "%d sync handlers are still running at the stop deadline; a thread cannot be "
                "interrupted, so the stop waits for them (their leases and claims stay renewed, "
                "their results are recorded and acked); stop again (a second SIGINT/SIGTERM) "
                "to force", len(threads),
                extra={"message_ids": [i.message_id for i in threads[:20]]},
            )
            await wait_until({i.task for i in threads if i.task is not None}, math.inf, force)
        if force.is_set():
            for item in items:
                if item.stage is Stage.RUNNING and item.task is not None:
                    cancel(item, CancelReason.STOP)
        pending = unfinished()
        if pending:
            grace = loop.time() + CANCEL_GRACE
            _, pending = await asyncio.wait(pending, timeout=max(0.0, grace - loop.time()))
        for task in pending:
            logger.error("a handler ignored its cancellation for %gs; leaving it behind (task "
                         "%r)", CANCEL_GRACE, task.get_name())
        for item in list(items):
            if item.task in pending and item.stage is not Stage.SETTLING:
                self._settle(item, Outcome.STOPPED, ack=False)
        for lane in self._lanes:  # behind a handler left running (a forced stop)
            queues, lane.keys = lane.keys, {}
            for queue in queues.values():
                for item in queue:
                    self._settle(item, Outcome.STOPPED, ack=False, release=self._release(item))


async def release_connections(config: Config) -> None:
    """The adapter's and store's connections belong to this run's loop: release them."""
    for name, resource in (("adapter", config.adapter), ("dedup store", config.dedup)):
        if resource is None:
            continue
        try:
            await resource.close()
        except Exception:
            logger.warning("closing the %s failed", name, exc_info=True)


async def wait_until(tasks: set[asyncio.Task[None]], deadline: float,
                     force: asyncio.Event) -> None:
    """Wait for ``tasks`` until the loop clock reaches ``deadline`` or ``force`` is set."""
    if not tasks or force.is_set():
        return
    loop = asyncio.get_running_loop()
    forced = loop.create_task(force.wait())
    try:
        timeout = None if deadline == math.inf else max(0.0, deadline - loop.time())
        pending = set(tasks)
        while pending and not forced.done():
            done, _ = await asyncio.wait(pending | {forced}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                return
            pending -= done
            if timeout is not None:
                timeout = max(0.0, deadline - loop.time())
    finally:
        forced.cancel()


async def _on_force(force: asyncio.Event, action: Callable[[], None]) -> None:
    await force.wait()
    action()
