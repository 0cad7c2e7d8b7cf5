"""RedisDedupStore: the idempotent-consumer store on Redis, shared by every consumer process.

Each :class:`~reliable_sub.dedup.DedupKey` ``(namespace, key)`` is one Redis string::

    <prefix>:{<namespace>}:<key>

* ``{<namespace>}`` is a Redis Cluster hash tag: every key of one subscription lives in one
  slot (the Subscriber calls the batch methods with the keys of one subscription's batch). The
  namespace appears as it is when it is printable ASCII without spaces or braces and at most
  ``READABLE_LIMIT`` characters; otherwise (and for a namespace that is literally ``_`` or
  starts with ``h:``) as ``h:`` + the SHA-256 hex of its UTF-8 bytes. The empty namespace is
  written ``_``.
* ``<key>`` is the idempotency key as it is when it is printable ASCII without spaces, at most
  ``READABLE_LIMIT`` characters and not starting with ``h:``; otherwise ``h:`` + its SHA-256 hex.

The namespace cannot contain a brace and the key part follows the tag, so distinct keys never
share a record, and ordinary keys stay readable in ``redis-cli``. The value says the state::

    p:<token>|<failures>   claimed under fencing token <token>; PX = the claim's lease
    f:<failures>           released after <failures> failed attempts; PX = retention
    c:<json>               completed; <json> is the handler's result; PX = retention

A missing key is new (never seen, or its lease or retention ran out). Results are JSON text,
never pickle. Every method is one Lua script call (registered with ``register_script``, so it is
reloaded after a Redis restart) and one round trip per batch. Fencing tokens are made before the
call, so a command that redis-py retries after a dropped connection finds its own claim and
reports it Claimed rather than InProgress.

The batch methods have blocking twins (``claim_many_sync`` ..., the
:class:`~reliable_sub.ports.SyncDedupStore` capability): the same scripts, arguments and replies
on the blocking ``redis.Redis`` client, from any thread, without an event loop. Sync
``@idempotent`` functions use them.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
import re
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeVar

from .._loops import PerLoop
from .._results import checked_result_json
from ..errors import ConfigurationError, MissingExtraError
from ..policy import check_seconds
from ..ports import Claimed, ClaimResult, Completed, Completion, DedupKey, InProgress
from ._store_base import SingleKeyMethods, TokenSource, check_owner

try:
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.commands.core import AsyncScript, Script
except ImportError as error:  # the redis extra is not installed
    raise MissingExtraError("RedisDedupStore", "redis", "redis") from error


from .._redis_clients import (
    AsyncClient,
    RedisClients,
    SyncClient,
    lua_source,
    script,
    slot_groups,
    sync_script,
)

# The name this module's records always had (it was public): logging set-ups name it.
logger = logging.getLogger("reliable_sub.idempotency.redis_store")

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "reliable-sub:dedup"
# Keys and namespaces up to this many characters are stored readably; longer ones are hashed
# (64 hex digits) so one Redis key stays small whatever a publisher puts in its attribute.
READABLE_LIMIT = 100
# Connect and read timeouts of a client created from a URL: a claim is one short script, so a
# Redis that does not answer within this is treated as down and the batch is redelivered later,
# rather than the receive loop hanging on a dead socket.
SOCKET_TIMEOUT = 5.0
# Connections of a client created from a URL: plenty for the Subscriber's few batch calls at a
# time plus handlers' own claims. Beyond it a caller waits for a free connection ...
MAX_CONNECTIONS = 50
# ... for at most this long: every command ends within SOCKET_TIMEOUT, so a longer wait means
# Redis is down and the call fails like any other Redis error.
CONNECTION_WAIT = 2 * SOCKET_TIMEOUT

_HASHED = "h:"
_EMPTY_NAMESPACE = "_"
# What may appear as it is: printable ASCII without space ('!' to '~') ...
_READABLE_PART = re.compile(rf"[!-~]{{1,{READABLE_LIMIT}}}")
# ... and, inside the hash tag, also without braces, which would end or confuse the tag.
_READABLE_NAMESPACE = re.compile(rf"[!-z|~]{{1,{READABLE_LIMIT}}}")

# Claim states the claim script reports, one (state, a, b) triple per key.
_STATE_CLAIMED = 0
_STATE_COMPLETED = 1
_STATE_IN_PROGRESS = 2

# The scripts live in lua/ beside this module, each opening with what its KEYS and ARGV are.
# COMPLETE_LUA defines complete(key, token, value, ttl_ms); the Redis Streams adapter's fast path
# runs it in the same script call as a batch's XACK.
COMPLETE_LUA = lua_source(__package__, "parse", "complete")
_CLAIM_SCRIPT = lua_source(__package__, "parse", "dedup_claim")

_RENEW_SCRIPT = lua_source(__package__, "parse", "dedup_renew")
_RELEASE_SCRIPT = lua_source(__package__, "parse", "dedup_release")

_COMPLETE_SCRIPT = COMPLETE_LUA + lua_source(__package__, "dedup_complete")


class RedisDedupStore(SingleKeyMethods):
    """A dedup store on Redis: one record per key, shared by every consumer.

    Args:
        url_or_client: a Redis URL (clients are made per event loop, with a blocking pool of
            ``MAX_CONNECTIONS``, ``SOCKET_TIMEOUT`` and reconnect retries), or a
            ``redis.asyncio.Redis`` client you own (closing the store only releases its
            connections).
        prefix: the first part of every Redis key this store writes; no braces.
        owner: readable prefix of this store's fencing tokens, such as the service's name
            (default: a short random one); see
            :func:`~reliable_sub.dedup.check_owner`.
        sync_client: the ``redis.Redis`` client of the blocking twins (``claim_many_sync`` ...)
            on the same server (default: one built from the URL, or from the given client's
            host, port, database and credentials -- pass one for TLS or a fake server).
    """

    def __init__(
        self,
        url_or_client: str | aioredis.Redis | AsyncRedisCluster = DEFAULT_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        owner: str | None = None,
        sync_client: SyncClient | None = None,
    ) -> None:
        if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix:
            raise ConfigurationError(
                f"RedisDedupStore.prefix must be a non-empty str without braces (they would "
                f"move the cluster hash tag), got {prefix!r}"
            )
        self._tokens = TokenSource(check_owner(owner, "RedisDedupStore"))
        self.owner = self._tokens.owner
        self.clients = RedisClients(
            url_or_client,
            owner="RedisDedupStore",
            blocking_pool=True,
            pool_options={
                "max_connections": MAX_CONNECTIONS,
                "timeout": CONNECTION_WAIT,
                "socket_timeout": SOCKET_TIMEOUT,
                "socket_connect_timeout": SOCKET_TIMEOUT,
            },
            sync_client=sync_client,
        )
        self.prefix = prefix
        self._cluster_calls: PerLoop[asyncio.Semaphore] = PerLoop(
            lambda: asyncio.Semaphore(MAX_CONNECTIONS))
        # Scripts are bound to no client: each call names the running loop's client.
        self._claim_script = script(_CLAIM_SCRIPT)
        self._renew_script = script(_RENEW_SCRIPT)
        self._release_script = script(_RELEASE_SCRIPT)
        self._complete_script = script(_COMPLETE_SCRIPT)
        self._claim_script_sync = sync_script(_CLAIM_SCRIPT)
        self._renew_script_sync = sync_script(_RENEW_SCRIPT)
        self._release_script_sync = sync_script(_RELEASE_SCRIPT)
        self._complete_script_sync = sync_script(_COMPLETE_SCRIPT)

    def __repr__(self) -> str:
        return f"RedisDedupStore(prefix={self.prefix!r}, owner={self.owner!r})"

    @property
    def client(self) -> AsyncClient:
        """The ``redis.asyncio.Redis`` client of the running event loop."""
        return self.clients.get()

    @property
    def sync_client(self) -> SyncClient:
        """The blocking ``redis.Redis`` client of the ``*_sync`` methods."""
        return self.clients.sync

    async def close(self) -> None:
        """Release this loop's connections; the store reconnects on next use."""
        await self.clients.close()

    def close_sync(self) -> None:
        """Release the blocking client's connections (the store keeps none other outside a
        loop)."""
        self.clients.close_sync()

    def redis_key(self, key: DedupKey) -> str:
        """The Redis key that holds the record of ``key`` (see the module docstring)."""
        namespace, idempotency_key = key
        return f"{self.prefix}:{{{_namespace_tag(namespace)}}}:{_key_part(idempotency_key)}"

    def epoch_key(self, namespace: str) -> str:
        """The Redis key that holds ``namespace``'s epoch: in the hash slot of its records."""
        return f"{self.prefix}:epoch:{{{_namespace_tag(namespace)}}}"

    # -- epochs (the DedupEpochs capability) -----------------------------------------------

    async def epoch(self, namespace: str) -> int:
        """The current epoch of ``namespace`` (0 if it never had one)."""
        value = await self.client.get(self.epoch_key(namespace))
        return int(value) if value is not None else 0

    async def next_epoch(self, namespace: str) -> int:
        """Start the next epoch of ``namespace`` (INCR; kept without expiry)."""
        return int(await self.client.incr(self.epoch_key(namespace)))

    # -- the DedupStore protocol ----------------------------------------------------------------

    async def claim_many(
        self,
        keys: Sequence[DedupKey],
        lease_ttl: float,
        tokens: Sequence[str] | None = None,
    ) -> list[ClaimResult]:
        if not keys:
            return []
        redis_keys, args, chosen = self._claim_arguments(keys, lease_ttl, tokens)
        replies = await self._calls(self._claim_script, redis_keys, args, 1)
        return self._claim_results(keys, chosen, _triples(replies, len(keys)))

    async def renew(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        if not claims:
            return []
        keys, args = self._held_arguments(claims, _milliseconds("lease_ttl", lease_ttl))
        lost = _positions(await self._calls(self._renew_script, keys, args, 2))
        return _at_positions(claims, lost)

    async def complete_many(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        if not completions:
            return []
        keys, args = self.completion_records(completions, ttl)
        refused = _positions(await self._calls(self._complete_script, keys, args, 2))
        return [c.claim for c in _at_positions(completions, refused)]

    async def release_many(self, claims: Sequence[Claimed], retention: float) -> None:
        if not claims:
            return
        keys, args = self._held_arguments(claims, _retention_milliseconds(retention))
        await self._calls(self._release_script, keys, args, 2)

    # -- the blocking twins (SyncDedupStore): same arguments, scripts and replies --------------

    def claim_many_sync(
        self,
        keys: Sequence[DedupKey],
        lease_ttl: float,
        tokens: Sequence[str] | None = None,
    ) -> list[ClaimResult]:
        """Blocking twin of :meth:`claim_many`."""
        if not keys:
            return []
        redis_keys, args, chosen = self._claim_arguments(keys, lease_ttl, tokens)
        replies = self._calls_sync(self._claim_script_sync, redis_keys, args, 1)
        return self._claim_results(keys, chosen, _triples(replies, len(keys)))

    def renew_sync(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        """Blocking twin of :meth:`renew`."""
        if not claims:
            return []
        keys, args = self._held_arguments(claims, _milliseconds("lease_ttl", lease_ttl))
        lost = _positions(self._calls_sync(self._renew_script_sync, keys, args, 2))
        return _at_positions(claims, lost)

    def complete_many_sync(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        """Blocking twin of :meth:`complete_many`."""
        if not completions:
            return []
        keys, args = self.completion_records(completions, ttl)
        refused = _positions(self._calls_sync(self._complete_script_sync, keys, args, 2))
        return [c.claim for c in _at_positions(completions, refused)]

    def release_many_sync(self, claims: Sequence[Claimed], retention: float) -> None:
        """Blocking twin of :meth:`release_many`."""
        if not claims:
            return
        keys, args = self._held_arguments(claims, _retention_milliseconds(retention))
        self._calls_sync(self._release_script_sync, keys, args, 2)

    # -- one script call per batch; per hash slot on a cluster ----------------------------------

    def _split(self, keys: list[str], args: list[Any], width: int) -> list[_Call]:
        """The script calls for ``keys`` and ``args`` (one header value, then ``width`` values
        per key): one, or on a cluster one per hash slot, each with the batch positions of its
        keys."""
        if not self.clients.cluster:
            return [_Call(list(range(len(keys))), keys, args)]
        calls = []
        for positions in slot_groups(keys):
            slot_args = [args[0]]
            for position in positions:
                slot_args += args[1 + position * width : 1 + (position + 1) * width]
            calls.append(_Call(positions, [keys[p] for p in positions], slot_args))
        return calls

    async def _calls(
        self, run: AsyncScript, keys: list[str], args: list[Any], width: int
    ) -> list[tuple[list[int], Any]]:
        """Each call's batch positions and reply; a cluster's calls go at once."""
        calls = self._split(keys, args, width)
        client = self.client
        if not self.clients.cluster:
            reply = await run(keys=calls[0].keys, args=calls[0].args, client=client)
            return [(calls[0].positions, reply)]
        # A cluster client has no blocking pool: past max_connections to a node it raises.
        # This waits for a free one instead, as the single-server pool does.
        in_flight = self._cluster_calls.get()

        async def call_one(call: _Call) -> Any:
            async with in_flight:
                return await run(keys=call.keys, args=call.args, client=client)

        replies = await asyncio.gather(*(call_one(call) for call in calls))
        return [(call.positions, reply) for call, reply in zip(calls, replies, strict=True)]

    def _calls_sync(
        self, run: Script, keys: list[str], args: list[Any], width: int
    ) -> list[tuple[list[int], Any]]:
        """Blocking twin of :meth:`_calls` (a cluster's calls one after the other)."""
        client = self.clients.sync
        return [(call.positions, run(keys=call.keys, args=call.args, client=client))
                for call in self._split(keys, args, width)]

    # -- what both share: script arguments and replies -----------------------------------------

    def _claim_arguments(
        self, keys: Sequence[DedupKey], lease_ttl: float, tokens: Sequence[str] | None
    ) -> tuple[list[str], list[Any], list[str]]:
        """The claim script's KEYS and ARGV (the lease in ms, then a token per key), and the
        tokens: the given ones, or fresh ones."""
        lease = _milliseconds("lease_ttl", lease_ttl)
        chosen = list(tokens) if tokens else [self._tokens.next() for _ in keys]
        return [self.redis_key(key) for key in keys], [lease, *chosen], chosen

    def _claim_results(
        self, keys: Sequence[DedupKey], chosen: Sequence[str], reply: Sequence[Any]
    ) -> list[ClaimResult]:
        """The claim script's reply, one (state, detail, failures) triple per key, as results."""
        results: list[ClaimResult] = []
        for index, key in enumerate(keys):
            state = int(reply[3 * index])
            detail, failures = reply[3 * index + 1], int(reply[3 * index + 2])
            if state == _STATE_CLAIMED:
                results.append(Claimed(key, chosen[index], failures))
            elif state == _STATE_COMPLETED:
                results.append(Completed(_text(detail), key))
            else:
                results.append(InProgress(self._remaining(key, int(detail)), failures))
        return results

    def _held_arguments(
        self, claims: Sequence[Claimed], milliseconds: int
    ) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of the renew and release scripts: ``milliseconds`` (the lease, or the
        retention), then each claim's token and failure count."""
        args: list[Any] = [milliseconds]
        for claim in claims:
            args += (claim.token, claim.failures)
        return [self.redis_key(c.key) for c in claims], args

    def completion_records(
        self, completions: Sequence[Completion], ttl: float
    ) -> tuple[list[str], list[Any]]:
        """The KEYS and ARGV of ``COMPLETE_LUA`` calls for ``completions``: the keys, then the
        TTL in ms followed by a (token, value) pair per key. For the Redis Streams adapter's
        fast path, which writes completions in the same script call as the batch's XACK."""
        args: list[Any] = [_milliseconds("ttl", ttl)]
        for claim, result_json in completions:
            args += (claim.token, b"c:" + checked_result_json(result_json).encode())
        return [self.redis_key(c.claim.key) for c in completions], args

    def same_server(self, clients: RedisClients) -> bool:
        """True when ``clients`` talk to the same Redis server and database as this store."""
        return self.clients.same_server(clients)

    def _remaining(self, key: DedupKey, pttl: int) -> float:
        if pttl >= 0:
            return pttl / 1000.0
        # Only a write by something other than this store leaves a record without expiry.
        logger.warning(
            "dedup record %r (Redis key %r) is in progress without an expiry; it stays "
            "claimed until someone deletes it", key, self.redis_key(key),
        )
        return math.inf


def _milliseconds(name: str, seconds: float) -> int:
    """``seconds`` as whole milliseconds for PX (at least 1)."""
    return max(1, round(check_seconds("RedisDedupStore", name, seconds) * 1000))


def _retention_milliseconds(retention: float) -> int:
    """The release script's retention: whole ms (0, forgotten at once, for none or infinite)."""
    return max(0, round(retention * 1000)) if retention < math.inf else 0


_Item = TypeVar("_Item")


class _Call(NamedTuple):
    positions: list[int]  # of its keys in the batch
    keys: list[str]
    args: list[Any]


def _triples(replies: list[tuple[list[int], Any]], count: int) -> list[Any]:
    """The claim script's replies (a triple per key) as one reply in batch order."""
    merged: list[Any] = [None] * (3 * count)
    for positions, reply in replies:
        for index, position in enumerate(positions):
            merged[3 * position : 3 * position + 3] = reply[3 * index : 3 * index + 3]
    return merged


def _positions(replies: list[tuple[list[int], Any]]) -> list[int]:
    """The 1-based positions the calls returned, as 1-based positions in the batch."""
    return [positions[int(found) - 1] + 1 for positions, reply in replies for found in reply]


def _at_positions(items: Sequence[_Item], positions: Sequence[Any]) -> list[_Item]:
    """The ``items`` at the 1-based ``positions`` a script returned."""
    return [items[int(position) - 1] for position in positions]


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _hashed(text: str) -> str:
    return _HASHED + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _key_part(idempotency_key: str) -> str:
    if _READABLE_PART.fullmatch(idempotency_key) and not idempotency_key.startswith(_HASHED):
        return idempotency_key
    return _hashed(idempotency_key)


@functools.lru_cache(maxsize=1024)  # a handful of namespaces, asked for on every key
def _namespace_tag(namespace: str) -> str:
    if not namespace:
        return _EMPTY_NAMESPACE
    if (
        _READABLE_NAMESPACE.fullmatch(namespace)
        and namespace != _EMPTY_NAMESPACE
        and not namespace.startswith(_HASHED)
    ):
        return namespace
    return _hashed(namespace)


__all__ = ["COMPLETE_LUA", "RedisDedupStore"]
