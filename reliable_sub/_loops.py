"""One value per event loop, for adapters and stores whose asyncio clients belong to a loop.

An asyncio client (redis-py's, gRPC's) is bound to the event loop that opened its connections.
A Subscriber that is stopped and started again runs in a new loop, so an adapter or store keeps
one client per loop, made on first use in that loop. Clients of loops that have since closed are
dropped: their connections went with the loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class PerLoop(Generic[T]):
    """``get()`` returns this loop's value, calling ``factory()`` on first use in each loop.

    Thread-safe: Subscribers in different threads (each with its own loop) may share one owner.
    """

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._values: dict[asyncio.AbstractEventLoop, T] = {}
        self._lock = threading.Lock()

    def get(self) -> T:
        """The value of the running event loop (made now if this loop has none)."""
        loop = asyncio.get_running_loop()
        value = self._values.get(loop)
        if value is not None:
            return value
        with self._lock:
            self._forget_closed()
            value = self._values.get(loop)
            if value is None:
                value = self._values[loop] = self._factory()
            return value

    def peek(self) -> T | None:
        """The running loop's value if it has one (None outside a loop or before first use)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        return self._values.get(loop)

    def pop(self) -> T | None:
        """Remove and return the running loop's value, if any (to close it)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        with self._lock:
            self._forget_closed()
            return self._values.pop(loop, None)

    def values(self) -> list[T]:
        """Every loop's value (of loops not closed), from any thread."""
        with self._lock:
            return [value for loop, value in self._values.items() if not loop.is_closed()]

    def pop_all(self) -> list[tuple[asyncio.AbstractEventLoop, T]]:
        """Remove and return every value with its loop (closed loops' values are dropped)."""
        with self._lock:
            self._forget_closed()
            values = list(self._values.items())
            self._values.clear()
            return values

    def _forget_closed(self) -> None:
        for loop in [loop for loop in self._values if loop.is_closed()]:
            del self._values[loop]
