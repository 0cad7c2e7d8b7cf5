"""Wakes a relay when rows commit: PostgreSQL ``LISTEN`` on the outbox's channel.

:meth:`Outbox.add` sends ``NOTIFY <table>`` in the writer's transaction; PostgreSQL delivers it
at commit (never on rollback). The listener holds one autocommit connection of its own (psycopg,
outside SQLAlchemy's pool) and sets an event per notification; a lost connection is logged and
reconnected while the relay's poll keeps it working meanwhile.
"""

from __future__ import annotations

import asyncio
import logging

from ..clock import Clock
from .outbox import Outbox

logger = logging.getLogger("reliable_sub.outbox.relay")


class CommitListener:
    """``LISTEN`` for :class:`Outbox` commits; :attr:`listening` is True while it is in place.

    Args:
        outbox: whose channel to listen on (PostgreSQL).
        wake: set on each notification, and once when ``LISTEN`` is (re)established, since
            rows may have committed while it was not.
        clock: for the wait before reconnecting.
        retry_wait: seconds between reconnection attempts.
    """

    def __init__(self, outbox: Outbox, wake: asyncio.Event, clock: Clock,
                 retry_wait: float) -> None:
        self._outbox = outbox
        self._wake = wake
        self._clock = clock
        self._retry_wait = retry_wait
        self.listening = False

    async def run(self) -> None:
        """Listen until cancelled."""
        import psycopg

        conninfo = self._outbox.url.set(drivername="postgresql").render_as_string(
            hide_password=False)
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(conninfo,
                                                                 autocommit=True) as conn:
                    await conn.execute(f'LISTEN "{self._outbox.channel}"')
                    self.listening = True
                    self._wake.set()
                    async for _ in conn.notifies():
                        self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("outbox relay: LISTEN failed; polling meanwhile, reconnecting "
                               "in %gs", self._retry_wait, exc_info=True)
            finally:
                self.listening = False
            await self._clock.sleep(self._retry_wait)


__all__ = ["CommitListener"]
