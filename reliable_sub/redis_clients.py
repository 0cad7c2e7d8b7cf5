"""Redis clients for the Redis Streams adapter and the Redis dedup store (extra ``redis``).

Both take a ``redis://`` URL or a ``redis.asyncio.Redis`` client. From a URL, one client is made
per event loop (a restarted Subscriber runs in a new loop, and redis-py's asyncio connections
belong to the loop that opened them), each retrying a command that met a dropped connection on a
fresh one. A client you pass is used as it is, in every loop; closing releases its connections
(it reconnects on next use) but never closes it for good: it is yours.
"""

from __future__ import annotations

import threading
from importlib import resources
from typing import Any

from .errors import ConfigurationError, MissingExtraError
from .loops import PerLoop

try:
    import redis
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.commands.core import AsyncScript, Script
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from redis.retry import Retry as SyncRetry
except ImportError as error:  # the redis extra is not installed
    raise MissingExtraError("reliable-sub's Redis support", "redis", "redis") from error

# A command that meets a dropped connection is retried on a fresh one this many times, up to
# this many seconds apart; longer outages are the caller's to retry (the Subscriber does).
CONNECT_RETRIES = 3
CONNECT_RETRY_CAP = 1.0


class RedisClients:
    """The asyncio client of the running loop, and a sync client for blocking twins.

    Args:
        url_or_client: a ``redis://`` URL, or a ``redis.asyncio.Redis`` client (bytes replies).
        owner: the class using it, named in errors.
        pool_options: extra ``from_url`` options for clients made from a URL.
        sync_client: the ``redis.Redis`` for blocking calls (default: one from the same
            settings, made on first use).
    """

    def __init__(
        self,
        url_or_client: str | aioredis.Redis,
        *,
        owner: str,
        pool_options: dict[str, Any] | None = None,
        blocking_pool: bool = False,
        sync_client: redis.Redis | None = None,
    ) -> None:
        self._options = dict(pool_options or {})
        self._blocking_pool = blocking_pool
        self._sync = sync_client
        self._sync_lock = threading.Lock()  # blocking twins may first be called from threads
        if isinstance(url_or_client, str):
            self.url: str | None = url_or_client
            self._given: aioredis.Redis | None = None
            parse_url: Any = redis.connection.parse_url
            self.connection_kwargs: dict[str, Any] = dict(parse_url(url_or_client))
        elif isinstance(url_or_client, aioredis.Redis):
            self.url = None
            self._given = url_or_client
            self.connection_kwargs = dict(url_or_client.connection_pool.connection_kwargs)
        else:
            raise ConfigurationError(
                f"{owner} needs a Redis URL or a redis.asyncio.Redis client, got "
                f"{type(url_or_client).__name__}"
            )
        self._clients: PerLoop[aioredis.Redis] = PerLoop(self._make)

    def get(self) -> aioredis.Redis:
        """The asyncio client for the running event loop."""
        return self._given if self._given is not None else self._clients.get()

    @property
    def sync(self) -> redis.Redis:
        """The blocking client (made on first use), retrying dropped connections as the
        asyncio clients do."""
        client = self._sync
        if client is not None:
            return client
        with self._sync_lock:
            if self._sync is None:
                self._sync = self._make_sync()
            return self._sync

    def _make_sync(self) -> redis.Redis:
        retries: dict[str, Any] = {
            "retry": SyncRetry(ExponentialBackoff(cap=CONNECT_RETRY_CAP), CONNECT_RETRIES),
            "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        }
        if self.url is not None:
            return redis.Redis.from_url(
                self.url, decode_responses=False, **retries, **_sync_options(self._options)
            )
        kwargs = self.connection_kwargs
        where: dict[str, Any] = (
            {"unix_socket_path": kwargs["path"]} if kwargs.get("path")
            else {"host": kwargs.get("host", "localhost"), "port": kwargs.get("port", 6379)}
        )
        return redis.Redis(
            db=kwargs.get("db", 0), username=kwargs.get("username"),
            password=kwargs.get("password"), **retries, **where,
        )

    def same_server(self, other: RedisClients) -> bool:
        """True when both talk to the same Redis server and database."""
        fields = ("host", "port", "db", "path")
        mine, theirs = self.connection_kwargs, other.connection_kwargs
        if self._given is not None and self._given is other._given:
            return True
        return all(mine.get(name) == theirs.get(name) for name in fields)

    async def close(self) -> None:
        """Release the running loop's connections (a later call reconnects)."""
        if self._given is not None:
            await self._given.connection_pool.disconnect()
        else:
            client = self._clients.pop()
            if client is not None:
                await client.aclose()
        self.close_sync()

    def close_sync(self) -> None:
        """Release the blocking client's connections (a later call reconnects)."""
        with self._sync_lock:
            client = self._sync
            if client is not None and self.url is not None:
                self._sync = None
        if client is not None:
            client.close()

    def _make(self) -> aioredis.Redis:
        assert self.url is not None
        options: dict[str, Any] = {
            "decode_responses": False,
            "retry": Retry(ExponentialBackoff(cap=CONNECT_RETRY_CAP), CONNECT_RETRIES),
            "retry_on_error": [RedisConnectionError, RedisTimeoutError],
            **self._options,
        }
        if self._blocking_pool:
            pool = aioredis.BlockingConnectionPool.from_url(self.url, **options)
            return aioredis.Redis.from_pool(pool)
        return aioredis.Redis.from_url(self.url, **options)


def lua_source(package: str | None, *names: str) -> str:
    """The Lua files ``lua/<name>.lua`` of ``package`` (package data), joined in order."""
    assert package is not None, "call it with a module's __package__"
    folder = resources.files(package).joinpath("lua")
    return "".join(folder.joinpath(f"{name}.lua").read_text(encoding="utf-8") for name in names)


def script(source: str) -> AsyncScript:
    """A Lua script bound to no client: call it with ``client=`` the running loop's client
    (it is loaded on that server on first use, and again after a restart flushed it)."""
    unbound: Any = None
    return AsyncScript(unbound, source.encode())


def sync_script(source: str) -> Script:
    """The blocking twin of :func:`script`: call it with ``client=`` a ``redis.Redis`` (it is
    loaded on that server on first use, and again after a restart flushed it)."""
    unbound: Any = None
    return Script(unbound, source.encode())


def _sync_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options that a sync client understands the same way."""
    keep = ("socket_timeout", "socket_connect_timeout")
    return {name: value for name, value in options.items() if name in keep}


__all__ = [
    "CONNECT_RETRIES",
    "CONNECT_RETRY_CAP",
    "RedisClients",
    "lua_source",
    "script",
    "sync_script",
]
