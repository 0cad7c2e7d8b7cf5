"""Redis clients for the Redis Streams adapter and the Redis dedup store (extra ``redis``).

Both take a ``redis://`` URL or a ``redis.asyncio.Redis`` client, or for a Redis Cluster a
``redis+cluster://`` URL (any one node) or a ``redis.asyncio.cluster.RedisCluster`` client. From
a URL, one client is made per event loop (a restarted Subscriber runs in a new loop, and
redis-py's asyncio connections belong to the loop that opened them), each retrying a command
that met a dropped connection on a fresh one. A client you pass is used as it is, in every
loop; closing releases its connections (it reconnects on next use) but never closes it for
good: it is yours.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from importlib import resources
from typing import Any

from ._loops import PerLoop
from .errors import ConfigurationError, MissingExtraError

try:
    import redis
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.cluster import ClusterNode as SyncClusterNode
    from redis.cluster import RedisCluster as SyncRedisCluster
    from redis.commands.core import AsyncScript, Script
    from redis.crc import key_slot
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from redis.retry import Retry as SyncRetry
except ImportError as error:  # the redis extra is not installed
    raise MissingExtraError("reliable-sub's Redis support", "redis", "redis") from error

# A command that meets a dropped connection is retried on a fresh one this many times, up to
# this many seconds apart; longer outages are the caller's to retry (the Subscriber does).
CONNECT_RETRIES = 3
CONNECT_RETRY_CAP = 1.0
# A URL of one of these schemes names a Redis Cluster (any node of it).
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
# Every scheme a URL may have: redis-py's (one server) and ours (a cluster).
URL_SCHEMES = ("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES)

AsyncClient = aioredis.Redis | AsyncRedisCluster
SyncClient = redis.Redis | SyncRedisCluster


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
        url_or_client: str | aioredis.Redis | AsyncRedisCluster,
        *,
        owner: str,
        pool_options: dict[str, Any] | None = None,
        blocking_pool: bool = False,
        sync_client: SyncClient | None = None,
    ) -> None:
        self._options = dict(pool_options or {})
        self._blocking_pool = blocking_pool
        self._sync: SyncClient | None = sync_client
        self._sync_lock = threading.Lock()  # blocking twins may first be called from threads
        self.cluster = False
        if isinstance(url_or_client, str):
            _check_scheme(url_or_client, owner)
            self.cluster = url_or_client.startswith(CLUSTER_SCHEMES)
            url = url_or_client.replace("+cluster", "", 1) if self.cluster else url_or_client
            self.seeds: list[tuple[str, int]] = []
            self.url: str | None = url
            self._given: AsyncClient | None = None
            parse_url: Any = redis.connection.parse_url
            try:
                if self.cluster:  # redis+cluster://host:port,host:port/0: several seed nodes
                    self.url, self.seeds = _seed_nodes(url)
                self.connection_kwargs: dict[str, Any] = dict(parse_url(self.url))
            except ValueError as error:  # a port that is not a number, a bad query option...
                raise ConfigurationError(
                    f"{owner} cannot use the Redis URL {_without_password(url_or_client)!r}: "
                    f"{error}") from error
        elif isinstance(url_or_client, aioredis.Redis):
            self.url = None
            self._given = url_or_client
            self.connection_kwargs = dict(url_or_client.connection_pool.connection_kwargs)
        elif isinstance(url_or_client, AsyncRedisCluster):
            self.url, self._given, self.cluster = None, url_or_client, True
            [first, *_] = url_or_client.startup_nodes
            self.connection_kwargs = {"host": first.host, "port": first.port}
        else:
            raise ConfigurationError(
                f"{owner} needs a Redis URL or a redis.asyncio.Redis or RedisCluster client, "
                f"got {type(url_or_client).__name__}"
            )
        self._clients: PerLoop[AsyncClient] = PerLoop(self._make)

    def get(self) -> AsyncClient:
        """The asyncio client for the running event loop."""
        return self._given if self._given is not None else self._clients.get()

    @property
    def sync(self) -> SyncClient:
        """The blocking client (made on first use), retrying dropped connections as the
        asyncio clients do."""
        client = self._sync
        if client is not None:
            return client
        with self._sync_lock:
            if self._sync is None:
                self._sync = self._make_sync()
            return self._sync

    def _make_sync(self) -> SyncClient:
        retries: dict[str, Any] = {
            "retry": SyncRetry(ExponentialBackoff(cap=CONNECT_RETRY_CAP), CONNECT_RETRIES),
            "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        }
        if self.cluster:
            kwargs = self.connection_kwargs
            seeds = self.seeds or [(kwargs.get("host", "localhost"), kwargs.get("port", 6379))]
            return SyncRedisCluster(
                startup_nodes=[_sync_node(host, port) for host, port in seeds],
                decode_responses=False, username=kwargs.get("username"),
                password=kwargs.get("password"), **_sync_options(self._options))
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
        """True when both talk to the same Redis server and database (never on a cluster:
        what one script call touches must share a hash slot there)."""
        if self.cluster or other.cluster:
            return False
        fields = ("host", "port", "db", "path")
        mine, theirs = self.connection_kwargs, other.connection_kwargs
        if self._given is not None and self._given is other._given:
            return True
        return all(mine.get(name) == theirs.get(name) for name in fields)

    async def close(self) -> None:
        """Release the running loop's connections (a later call reconnects)."""
        if isinstance(self._given, AsyncRedisCluster):
            await self._given.aclose()  # it connects again on next use
        elif self._given is not None:
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

    def _make(self) -> AsyncClient:
        assert self.url is not None
        options: dict[str, Any] = {
            "decode_responses": False,
            "retry": Retry(ExponentialBackoff(cap=CONNECT_RETRY_CAP), CONNECT_RETRIES),
            "retry_on_error": [RedisConnectionError, RedisTimeoutError],
            **self._options,
        }
        if self.cluster:  # one pool per node; no blocking pool there
            options.pop("timeout", None)
            if len(self.seeds) > 1:
                kwargs = self.connection_kwargs
                return _Cluster(
                    startup_nodes=[AsyncClusterNode(host, port) for host, port in self.seeds],
                    username=kwargs.get("username"), password=kwargs.get("password"),
                    **options)
            return _Cluster.from_url(self.url, **options)
        if self._blocking_pool:
            pool = aioredis.BlockingConnectionPool.from_url(self.url, **options)
            return aioredis.Redis.from_pool(pool)
        return aioredis.Redis.from_url(self.url, **options)


def lua_source(package: str | None, *names: str) -> str:
    """The Lua files ``lua/<name>.lua`` of ``package`` (package data), joined in order."""
    assert package is not None, "call it with a module's __package__"
    folder = resources.files(package).joinpath("lua")
    return "".join(folder.joinpath(f"{name}.lua").read_text(encoding="utf-8") for name in names)


class _ClusterSafeScript(AsyncScript):
    """EVALSHA (loading the script where the server lacks it), but on a cluster EVAL: there
    the reloads after NOSCRIPT, run by many calls at once on a fresh or promoted node, race
    inside redis-py's cluster client (a connection's writer found None)."""

    async def __call__(self, keys: Any = None, args: Any = None, client: Any = None) -> Any:
        if isinstance(client, AsyncRedisCluster):
            keys, args = list(keys or []), list(args or [])
            return await client.eval(self.script, len(keys), *keys, *args)  # type: ignore[arg-type]
        return await super().__call__(keys, args, client)


class _ClusterSafeSyncScript(Script):
    """The blocking twin of :class:`_ClusterSafeScript`."""

    def __call__(self, keys: Any = None, args: Any = None, client: Any = None) -> Any:
        if isinstance(client, SyncRedisCluster):
            keys, args = list(keys or []), list(args or [])
            return client.eval(self.script, len(keys), *keys, *args)  # type: ignore[arg-type]
        return super().__call__(keys, args, client)


def script(source: str) -> AsyncScript:
    """A Lua script bound to no client: call it with ``client=`` the running loop's client
    (it is loaded on that server on first use, and again after a restart flushed it; on a
    cluster it is sent with each call)."""
    unbound: Any = None
    return _ClusterSafeScript(unbound, source.encode())


def sync_script(source: str) -> Script:
    """The blocking twin of :func:`script`: call it with ``client=`` a ``redis.Redis`` (it is
    loaded on that server on first use, and again after a restart flushed it)."""
    unbound: Any = None
    return _ClusterSafeSyncScript(unbound, source.encode())


class _Cluster(AsyncRedisCluster):
    """A cluster client that finishes learning the topology before any command goes out:
    commands sent while a fresh client initialises could use a node's connection that the
    initialisation was replacing (redis-py 8: a writer found None)."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._initialize:
            await self.initialize()
        return await super().execute_command(*args, **kwargs)

    async def _determine_slot(self, command: str, *args: Any) -> int:
        name = str(command).upper()
        if name == "XREADGROUP":
            # redis-py would ask a node where the keys of a command with movable keys are
            # (COMMAND GETKEYS: a round trip per read); they are the first half after STREAMS
            keys = _stream_keys(args)
            if keys and len({self.keyslot(key) for key in keys}) == 1:
                return self.keyslot(keys[0])
        elif name in ("EVAL", "EVALSHA") and len(args) >= 3 and int(args[1]) > 1:
            # our scripts' keys are grouped by slot before the call (slot_groups); redis-py
            # would hash every key again. A key of another slot is still refused: by the node,
            # with CROSSSLOT.
            return self.keyslot(args[2])
        slot: int = await super()._determine_slot(command, *args)
        return slot


def _stream_keys(args: Sequence[Any]) -> list[Any]:
    """The stream keys of XREADGROUP's arguments (``... STREAMS key... id...``)."""
    for position, arg in enumerate(args):
        word = arg.decode() if isinstance(arg, bytes) else arg
        if isinstance(word, str) and word.upper() == "STREAMS":
            rest = args[position + 1:]
            return list(rest[: len(rest) // 2])
    return []


def _check_scheme(url: str, owner: str) -> None:
    """Refuse a URL of a scheme no Redis client is made from, naming every one that is
    (redis-py's own message leaves out the cluster schemes)."""
    if not url.startswith(URL_SCHEMES):  # redis-py reads schemes in lower case only
        scheme = url.partition("://")[0] if "://" in url else None
        got = f"scheme {scheme + '://'!r}" if scheme is not None else "no scheme"
        raise ConfigurationError(
            f"{owner} needs a Redis URL, got {_without_password(url)!r} ({got}); use "
            "redis://host:port/db (rediss:// for TLS, unix:///path for a socket), or "
            "redis+cluster://host:port (rediss+cluster:// for TLS) for a Redis Cluster")


def _without_password(url: str) -> str:
    """``url`` with the password of its credentials, if any, as ``***``."""
    scheme, separator, rest = url.partition("://")
    credentials, at, hosts = rest.rpartition("@")
    if not (separator and at and ":" in credentials):
        return url
    user = credentials.partition(":")[0]
    return f"{scheme}://{user}:***@{hosts}"


def _sync_node(host: str, port: int) -> Any:
    node: Any = SyncClusterNode  # redis-py leaves its constructor untyped
    return node(host, port)


def _seed_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """``redis://a:1,b:2/0`` as the URL of its first node and every (host, port)."""
    scheme, rest = url.split("://", 1)
    netloc, _, path = rest.partition("/")
    credentials, _, hosts = netloc.rpartition("@")
    seeds = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":")
        seeds.append((name or host, int(port) if name else 6379))
    first = f"{credentials}@{hosts.split(',')[0]}" if credentials else hosts.split(",")[0]
    return f"{scheme}://{first}/{path}", seeds


def slot_groups(keys: Sequence[str]) -> list[list[int]]:
    """The positions of ``keys`` grouped by Redis Cluster hash slot, in order of first
    appearance (one script call per group: a call's keys must share a slot)."""
    groups: dict[int, list[int]] = {}
    for position, key in enumerate(keys):
        groups.setdefault(key_slot(key.encode()), []).append(position)
    return list(groups.values())


def _sync_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options that a sync client understands the same way."""
    keep = ("socket_timeout", "socket_connect_timeout")
    return {name: value for name, value in options.items() if name in keep}


__all__ = [
    "CLUSTER_SCHEMES",
    "CONNECT_RETRIES",
    "CONNECT_RETRY_CAP",
    "URL_SCHEMES",
    "RedisClients",
    "lua_source",
    "script",
    "slot_groups",
    "sync_script",
]
