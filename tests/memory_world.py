"""A Subscriber on the in-memory broker with a ManualClock: the set-up unit tests share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from reliable_sub import ManualClock, RetryPolicy, Subscriber, SystemClock
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.testing.timing import drive_until


def setup(**options: Any) -> tuple[ManualClock, MemoryAdapter, Subscriber]:
    """A broker with topic ``orders`` (subscription ``billing``) and topic ``orders-dlq``
    (subscription ``orders-dlq-sub``), and a Subscriber on it (short backoffs unless ``retry``
    is given)."""
    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("orders", "billing")
    broker.ensure_subscription_sync("orders-dlq", "orders-dlq-sub")
    options.setdefault("retry", RetryPolicy(min_backoff=1, max_backoff=2))
    return clock, broker, Subscriber(broker, clock=clock, **options)


async def serving(sub: Subscriber, clock: ManualClock) -> asyncio.Future[None]:
    """``sub.serve()`` as a task, once it runs."""
    task = asyncio.ensure_future(sub.serve())
    await drive_until(clock, lambda: sub.running or task.done(), 1.0)
    return task


async def serve_until(
    sub: Subscriber, until: Callable[[], bool], what: str, within: float = 10.0,
    clock: ManualClock | None = None,
) -> None:
    """Serve ``sub`` until ``until()`` holds (or fail after ``within`` seconds), then shut it
    down: on the real clock, or driving ``clock``."""
    task = asyncio.ensure_future(sub.serve())
    try:
        await drive_until(clock or SystemClock(), until, within, what=what)
    finally:
        await sub.shutdown(timeout=5)
        await task
