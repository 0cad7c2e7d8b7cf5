"""One event loop's NATS connection for the JetStream adapter: made on first use, replaced when
dead (see :mod:`._nats_liveness`), and checked after empty fetches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from reliable_sub.adapters._nats_liveness import Retirer, reader_stopped
from reliable_sub.adapters._nats_urls import servers_of

logger = logging.getLogger("reliable_sub.adapters.nats_jetstream")

# Seconds to reach the server before a call gives up (nats-py would otherwise retry for minutes).
CONNECT_TIMEOUT = 5.0
# Seconds a JetStream API call, a publish's PubAck or a flush may take.
REQUEST_TIMEOUT = 5.0
FLUSH_TIMEOUT = 5  # nats-py takes whole seconds
# After an empty fetch, a connection not heard from for this long (seconds) is checked with a
# PING: about one round trip a second while idle.
LIVENESS_INTERVAL = 1.0


@dataclass(eq=False)
class Connection:
    """One event loop's connection, made on first use."""

    url: str
    name: str
    client: NatsClient | None = None
    js: JetStreamContext | None = None
    fetching: dict[str, asyncio.Lock] = field(default_factory=dict)
    kv: KeyValue | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closing: bool = False
    erring: bool = False
    last_error: Exception | None = None  # the last one error_cb reported (the first connect's)
    # the client found dead (a flush got no PONG) and why; replaced on next use
    dead: tuple[NatsClient, str] | None = None
    retirer: Retirer = field(default_factory=Retirer)
    heard_at: float = 0.0  # the loop time the server last answered (see check_alive)

    async def jetstream(self) -> JetStreamContext:
        if self.js is None or (self.client is not None and self._unusable(self.client)):
            async with self.lock:
                client = self.client
                if client is not None and client.is_closed:
                    # closed for good (the server closed it, or reconnecting gave up): anew
                    logger.warning("NATS connection to %s was closed; connecting again",
                                   self.url)
                    self.client, self.js, self.kv = None, None, None
                elif client is not None and (reason := self._why_dead(client)):
                    # open by nats-py's account, but nothing it is sent is read: anew
                    self.retirer.retire(client, self.url, reason)
                    self.client, self.js, self.kv, self.dead = None, None, None, None
                if self.js is None:
                    self.client = await _connect(self)
                    self.js = self.client.jetstream(timeout=REQUEST_TIMEOUT)
        return self.js

    async def nats(self) -> NatsClient:
        await self.jetstream()
        assert self.client is not None
        return self.client

    def _unusable(self, client: NatsClient) -> bool:
        return client.is_closed or self._why_dead(client) is not None

    def _why_dead(self, client: NatsClient) -> str | None:
        if self.dead is not None and self.dead[0] is client:
            return self.dead[1]
        if reader_stopped(client):
            return "its read loop ended"
        return None

    def mark_dead(self, client: NatsClient, reason: str) -> None:
        """Count ``client`` as dead: the next use connects anew."""
        if client is self.client:
            self.dead = (client, reason)

    def heard(self) -> None:
        """The server answered just now (a fetch brought messages)."""
        self.heard_at = asyncio.get_running_loop().time()

    async def check_alive(self) -> None:
        """After an empty fetch: unless the server was heard from lately, a PING and its PONG.
        An empty fetch proves nothing: through a connection that stalls (nothing moves,
        nothing is closed) every fetch is empty, and without this the receives alternated
        with failures counted as successes, so health never told the stall."""
        self.raise_if_dead()
        client = self.client
        if client is None or asyncio.get_running_loop().time() - self.heard_at < (
                LIVENESS_INTERVAL):
            return
        await self.flush(client)
        self.heard()

    def raise_if_dead(self) -> None:
        """Raise ConnectionError if this connection's client is known dead (an empty fetch
        from it is a failure, not "nothing came")."""
        client = self.client
        reason = None if client is None else self._why_dead(client)
        if reason is not None:
            raise ConnectionError(f"NATS connection to {self.url} is dead ({reason}); the "
                                  "next call connects again")

    async def flush(self, client: NatsClient) -> None:
        """One PING and its PONG: when it returns, the server has what was written before.
        No PONG within FLUSH_TIMEOUT: the connection is dead (ConnectionError); its
        replacement is made on next use."""
        try:
            await client.flush(timeout=FLUSH_TIMEOUT)
        except nats.errors.FlushTimeoutError as error:
            reason = f"no PONG within {FLUSH_TIMEOUT}s"
            self.mark_dead(client, reason)
            raise ConnectionError(f"NATS connection to {self.url} is dead ({reason}); the "
                                  "next call connects again") from error
        # with its read loop gone, nats-py's flush returns without a PING: nothing is confirmed
        if reader_stopped(client):
            self.mark_dead(client, "its read loop ended")
            self.raise_if_dead()

    @contextlib.asynccontextmanager
    async def pull(self, durable: str, stream: str
                   ) -> AsyncIterator[JetStreamContext.PullSubscription]:
        """A pull subscription on a fresh inbox for one fetch, unsubscribed after it: a message
        the server sends after the fetch returned (the server's pull request can outlive the
        client's by a trip, and a cancelled fetch's lives on) reaches no one and comes back
        after AckWait. Kept in the inbox, it would be handed to a later fetch with a lease
        that had long been running."""
        js = await self.jetstream()
        pull = await js.pull_subscribe_bind(durable=durable, stream=stream)
        try:
            yield pull
        finally:
            with contextlib.suppress(nats.errors.Error):
                await pull.unsubscribe()

    def fetch_lock(self, subscription: str) -> asyncio.Lock:
        # one fetch at a time per subscription on this connection, so that a nak without delay
        # can go between two fetches (see nack)
        return self.fetching.setdefault(subscription, asyncio.Lock())

    async def close(self) -> None:
        self.closing = True
        client, self.client, self.js, self.kv = self.client, None, None, None
        if client is not None and not client.is_closed:
            try:
                await asyncio.wait_for(client.close(), REQUEST_TIMEOUT)
            except (asyncio.TimeoutError, nats.errors.Error):
                logger.warning("closing the NATS connection to %s timed out", self.url)
        await self.retirer.wait()


async def _connect(connection: Connection) -> NatsClient:
    url = connection.url
    made: list[NatsClient] = []

    def retired() -> bool:  # closed by the adapter, or replaced as dead: nothing to report
        return connection.closing or (bool(made) and made[0] is not connection.client)

    async def on_error(error: Exception) -> None:
        # once per outage at WARNING: a reconnect attempt fails every half second
        level = logging.DEBUG if retired() or connection.erring else logging.WARNING
        connection.erring = True
        connection.last_error = error
        logger.log(level, "NATS connection to %s: %r", url, error)

    async def on_disconnect() -> None:
        if not retired():
            logger.warning("NATS connection to %s lost; reconnecting", url)

    async def on_reconnect() -> None:
        connection.erring = False
        logger.info("NATS connection to %s is back", url)

    try:
        client = await asyncio.wait_for(
            nats.connect(servers_of(url), name=connection.name,
                         connect_timeout=CONNECT_TIMEOUT / 2,
                         allow_reconnect=True, max_reconnect_attempts=-1,
                         reconnect_time_wait=0.5, error_cb=on_error,
                         disconnected_cb=on_disconnect, reconnected_cb=on_reconnect),
            CONNECT_TIMEOUT)
    except (asyncio.TimeoutError, OSError, nats.errors.Error) as error:
        # the client retries a refused connection until the timeout: what it met says more
        seen = connection.last_error or error
        raise ConnectionError(
            f"cannot reach NATS at {url} within {CONNECT_TIMEOUT:g}s: {seen}"
            if str(seen) else f"cannot reach NATS at {url} within {CONNECT_TIMEOUT:g}s "
            f"({type(seen).__name__})") from error
    made.append(client)
    connection.erring = False  # the next outage is reported again
    return client
