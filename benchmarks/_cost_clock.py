"""The clock of the cost check: time stands still.

Nothing in a cost-check run may depend on time: a lease tick, a retry wait or a flush timer
that fired would add work that depends on how fast the machine is. ``ManualClock`` gives that
too, but it keeps every sleep (cancelled ones included) in its heap until time moves, which
would show as memory kept per message; here a sleep never ends and keeps nothing. Its functions
are counted like any clock's (a real clock's ``now`` is a Python call too); it is not part of
the harness.
"""

from __future__ import annotations

import asyncio

# The wall-clock reading, for publish times: any fixed instant.
WALL = 1_700_000_000.0


class FrozenClock:
    """A :class:`reliable_sub.clock.Clock` whose time never moves."""

    def now(self) -> float:
        return 0.0

    def wall(self) -> float:
        return WALL

    async def sleep(self, seconds: float) -> None:
        """Return at once for ``seconds <= 0`` (as ``ManualClock`` does); never otherwise."""
        if seconds > 0:
            await asyncio.get_running_loop().create_future()
