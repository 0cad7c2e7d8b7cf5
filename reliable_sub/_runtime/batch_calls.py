"""One call of a batch handler, as a Decision: what it returned, or what it raised.

::

    decision(items, bodies) ─► in-process retries (RetryPolicy.retry_on), each with fresh lists
       ▼                       and bodies decoded again
    _decide: the arguments (Messages, or bodies and Messages) ─► _call: awaited, or in a worker
       ▼                                                        thread (a sync handler)
    returned None ─► ack; a BatchResult naming only its messages ─► ack(result); anything
    else, or raised ─► failed (a cancellation of ours goes on: a stop, max_lease_duration)

:class:`~reliable_sub._runtime.batches.Batches` decides what the Decision does to each message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import CoroutineType
from typing import Any

from .._callables import settled_result
from .._text import safe_repr
from ..batches import BatchResult, BatchSpec
from ..clock import Clock
from ..middleware import Decision
from ..middleware.retry import InProcessRetry
from .current import CURRENT_BATCH, BatchClaims
from .inflight import cancel_requested
from .lanes import Item, Lane
from .workers import WorkerThreads


class BatchCalls:
    """Calls one batch handler.

    Args:
        lane: the batch handler's lane.
        spec: its argument types.
        clock: for the waits between in-process retries.
        workers: the sync handlers' threads.
        retried: telemetry's event for an in-process retry of a delivery, or None.
    """

    def __init__(
        self,
        lane: Lane,
        spec: BatchSpec,
        clock: Clock,
        workers: WorkerThreads,
        retried: Callable[[Item, int, BaseException | None], None] | None = None,
    ) -> None:
        self._lane = lane
        self._spec = spec
        self._clock = clock
        self._workers = workers
        self._retried = retried
        self._retries = lane.route.retry.in_process_attempts > 1

    async def decision(self, items: list[Item], bodies: list[Any] | None) -> Decision:
        """The handler's call for ``items`` (again, for transient failures, with in-process
        retries), with ``bodies`` decoded from them (None: it takes Messages)."""
        if not self._retries:
            return await self._decide(items, bodies)
        on_retry = None
        if self._retried is not None:
            retried = self._retried

            def on_retry(attempt: int, error: BaseException | None) -> None:
                for item in items:
                    retried(item, attempt, error)

        attempts = InProcessRetry(self._lane.route.retry, self._clock, on_retry)
        fresh = [bodies]  # the first call's bodies; a retry decodes them again
        return await attempts.run(self._decide_again, items, fresh)

    async def _decide_again(self, items: list[Item], fresh: list[list[Any] | None]) -> Decision:
        bodies, fresh[0] = fresh[0], None
        if bodies is None:
            again = self.fresh_bodies(items)
            if isinstance(again, Decision):
                return again
            bodies = again
        return await self._decide(items, bodies)

    def fresh_bodies(self, items: list[Item]) -> list[Any] | Decision | None:
        """The bodies of ``items`` decoded again (None when the handler takes Messages), or the
        failed Decision of a validator that changed its mind."""
        decode = self._spec.decode
        if decode is None:
            return None
        try:
            return [decode(item.delivery.message.data) for item in items]
        except Exception as error:  # validated before: a validator that changed its mind
            return Decision.failed(error)

    async def _decide(self, items: list[Item], bodies: list[Any] | None) -> Decision:
        """One call of the handler, as a Decision: what it returned, or what it raised."""
        messages = [item.delivery.message for item in items]  # fresh lists for each call
        arguments: tuple[Any, ...]
        if bodies is None:
            arguments = (messages,)
        else:
            arguments = ((list(bodies), messages) if self._spec.takes_messages
                         else (list(bodies),))
        try:
            result = await self._call(items, arguments)
        except BaseException as error:
            if isinstance(error, asyncio.CancelledError) and (
                    cancel_requested() or any(i.cancel_reason is not None for i in items)):
                raise  # ours: a stop or max_lease_duration
            return Decision.failed(error)
        if result is None:
            return Decision.ack(None)
        name = self._lane.route.name
        if not isinstance(result, BatchResult):
            return Decision.failed(TypeError(
                f"batch handler {name} returned {safe_repr(result, 80)}; return None (every "
                "message succeeded) or a BatchResult(failed={message_id: exception}), or "
                "raise to fail them all"))
        unknown = result.failed.keys() - {item.message_id for item in items}
        if unknown:
            return Decision.failed(TypeError(
                f"batch handler {name} returned a BatchResult naming messages not in its "
                f"batch ({', '.join(sorted(unknown)[:5])}); name failed messages by their "
                "Message.id"))
        return Decision.ack(result)

    async def _call(self, items: list[Item], arguments: tuple[Any, ...]) -> Any:
        route = self._lane.route
        handler = self._lane.handler
        claims = CURRENT_BATCH.set(BatchClaims(items))
        try:
            if route.is_async:
                result = handler(*arguments)
                if type(result) is CoroutineType:
                    result = await result
            else:
                future = self._workers.run(handler, *arguments)
                for item in items:
                    item.thread_running = True
                ok, result = await future  # if this task is cancelled, the thread still runs
                for item in items:
                    item.thread_running = False
                if not ok:
                    raise result
            if result is not None:
                result = await settled_result(result, route.name)
            return result
        finally:
            CURRENT_BATCH.reset(claims)


__all__ = ["BatchCalls"]
