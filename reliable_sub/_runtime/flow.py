"""Flow control: how many messages may be in flight, and how many payload bytes may run at once."""

from __future__ import annotations

import asyncio

from ..policy import FlowControl


class FlowGate:
    """Backpressure for one Subscriber (all its subscriptions share it).

    A message is *in flight* from the receive that returned it until the broker confirmed its
    ack or nack; receive asks for no more than the free slots. Its payload bytes count while its
    handler runs.
    """

    def __init__(self, limits: FlowControl) -> None:
        self._limits = limits
        self._in_flight = 0
        self._running_bytes = 0
        self._waiters = 0
        self._changed = asyncio.Event()
        self._closed = False

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def free_slots(self) -> int:
        """Wait until at least one message slot is free; return how many are (0 once closed)."""
        while self._in_flight >= self._limits.max_messages and not self._closed:
            await self._wait()
        return 0 if self._closed else self._limits.max_messages - self._in_flight

    def close(self) -> None:
        """Wake every receive loop waiting for a slot: the Subscriber is stopping."""
        self._closed = True
        self._changed.set()

    def taken(self, count: int) -> None:
        self._in_flight += count

    def settled(self, count: int = 1) -> None:
        self._in_flight -= count
        if self._waiters:
            self._changed.set()

    def try_acquire_bytes(self, size: int) -> bool:
        """Take ``size`` running bytes if that fits now (or nothing else runs)."""
        if self._running_bytes and self._running_bytes + size > self._limits.max_bytes:
            return False
        self._running_bytes += size
        return True

    async def acquire_bytes(self, size: int) -> None:
        """Wait until a handler of ``size`` payload bytes may start (alone, if it is huge)."""
        while not self.try_acquire_bytes(size):
            await self._wait()

    def release_bytes(self, size: int) -> None:
        self._running_bytes -= size
        if self._waiters:
            self._changed.set()

    async def _wait(self) -> None:
        self._changed.clear()
        self._waiters += 1
        try:
            await self._changed.wait()
        finally:
            self._waiters -= 1
