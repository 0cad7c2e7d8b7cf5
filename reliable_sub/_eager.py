"""Eager start: run a coroutine at once, and give it a Task only if it has to wait.

Most deliveries of a fast handler never wait (the in-memory broker and store answer at once), so
creating, scheduling and stepping an asyncio Task for each costs more than the work itself. This
is Python 3.12's eager task execution, done in a way that also works on 3.10 and 3.11: the
coroutine runs in its own copy of the context until its first suspension, and only then is a Task
created, from that context, to drive the rest.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator
from typing import Any


def start_eagerly(
    loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, None]
) -> asyncio.Task[None] | None:
    """Run ``coroutine`` until it first waits; return the Task that finishes it, or None."""
    context = contextvars.copy_context()
    try:
        yielded = context.run(coroutine.send, None)
    except StopIteration:
        return None
    # Created inside the context, the Task takes a copy of it: the rest of the coroutine sees
    # what its first part set (create_task's context= argument needs Python 3.11).
    return context.run(loop.create_task, _finish(coroutine, yielded))


async def _finish(coroutine: Coroutine[Any, Any, None], yielded: Any) -> None:
    await _Resume(coroutine, yielded)


class _Resume:
    """Awaitable that hands a started coroutine's pending future to the Task driving us."""

    __slots__ = ("_coroutine", "_yielded")

    def __init__(self, coroutine: Coroutine[Any, Any, None], yielded: Any) -> None:
        self._coroutine = coroutine
        self._yielded = yielded

    def __await__(self) -> Generator[Any, Any, None]:
        coroutine, yielded = self._coroutine, self._yielded
        while True:
            try:
                value = yield yielded
            except GeneratorExit:
                coroutine.close()
                raise
            except BaseException as error:  # cancellation and throws go to the coroutine
                try:
                    yielded = coroutine.throw(error)
                except StopIteration:
                    return
            else:
                try:
                    yielded = coroutine.send(value)
                except StopIteration:
                    return
