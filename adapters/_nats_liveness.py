"""Telling a dead NATS connection from a live one, and retiring it (for the NATS adapter).

nats-py keeps a connection it believes open until its own stale-connection check fires: two
unanswered PINGs at its ``ping_interval``, minutes by default. A connection that stalls (a
frozen server, a network that holds packets without closing) for longer than a flush's timeout
is worse than that: the flush gives up and cancels its PONG future, and when the late PONG does
arrive, nats-py's read loop dies on the cancelled future (``InvalidStateError``) while
``is_connected`` stays True. Nothing is read from then on: every fetch comes back empty, every
flush "succeeds" without a PING, and the consumer waits for minutes, healthy by every sign.

So the adapter counts a flush that times out as a dead connection, checks before each use that
the client's read loop still runs, and replaces a dead client with a new one. The old client is
closed in the background: closing waits on its socket, which may be the stalled one.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client as NatsClient

logger = logging.getLogger(__name__)

# Seconds a dead client's close may take before it is left to the garbage collector.
RETIRE_TIMEOUT = 5.0


def reader_stopped(client: NatsClient) -> bool:
    """Whether ``client`` claims to be connected although its read loop has ended: nothing it
    is sent (PONGs, messages, API replies) will ever be read."""
    if not client.is_connected:
        return False  # reconnecting or closed: nats-py restarts the read loop itself
    # nats-py has no public sign of it; its read loop task is the one place to look
    reading = getattr(client, "_reading_task", None)
    return isinstance(reading, asyncio.Task) and reading.done()


class Retirer:
    """Closes dead clients in the background, holding their tasks until they are done."""

    def __init__(self) -> None:
        self._closing: set[asyncio.Task[None]] = set()

    def retire(self, client: NatsClient, url: str, reason: str) -> None:
        """Close ``client`` (dead because of ``reason``) without waiting for it."""
        logger.warning("NATS connection to %s is dead (%s); connecting again", url, reason)
        task = asyncio.get_running_loop().create_task(_close(client, url))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def wait(self) -> None:
        """Wait for the closes under way (bounded by RETIRE_TIMEOUT each)."""
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


async def _close(client: NatsClient, url: str) -> None:
    try:
        await asyncio.wait_for(client.close(), RETIRE_TIMEOUT)
    except Exception as error:  # a dead connection may fail to close in any way: it is gone
        logger.debug("closing the dead NATS connection to %s: %r", url, error)
