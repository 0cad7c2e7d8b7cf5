"""RedisDedupStore: the idempotent-consumer store on Redis, shared by every consumer process.

Each store key (``namespace + "\\x1f" + idempotency_key``, see :func:`~reliable_sub.dedup.
scoped_key`) is one Redis string::

    <prefix>:{<namespace>}:<part>

* ``{<namespace>}`` is a Redis Cluster hash tag: every key of one subscription lives in one
  slot. On a single Redis a script may touch keys of any slots; on a cluster all keys of one
  call must share a slot, which holds for the Subscriber because it calls ``claim_many`` and
  ``renew`` with the keys of one subscription's batch (a caller mixing namespaces in one call
  would get CROSSSLOT there). The namespace appears as it is when it is
  printable ASCII without spaces or braces and at most ``READABLE_LIMIT`` characters; otherwise
  (and for a namespace that is literally ``_`` or starts with ``h:``) as ``h:`` + the SHA-256 hex
  of its UTF-8 bytes. A key without ``"\\x1f"`` has the empty namespace, written ``_``: ``"k"``
  and ``"\\x1fk"`` are the same record.
* ``<part>`` is the idempotency key as it is when it is printable ASCII without spaces, at most
  ``READABLE_LIMIT`` characters and not starting with ``h:``; otherwise ``h:`` + the SHA-256 hex
  of its UTF-8 bytes. Any key string (long, binary-ish, unicode, with spaces) is safe, distinct
  store keys never share a record, and ordinary keys stay readable in ``redis-cli``.

The value says the state::

    p:<owner>      in progress, claimed by the store whose owner token is <owner>; PX = lease
    c:<json>       completed; <json> is the handler's result as JSON text; PX = retention

A missing key is new (never seen, or its lease or retention ran out). Results are JSON text,
never pickle. Claiming, releasing and renewing are Lua scripts (registered with
``register_script``, so they are reloaded after a Redis restart); completing is a SET with PX.
Every batch method is one round trip.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import re
import uuid
from collections.abc import Sequence
from typing import Any

from .dedup import CLAIMED, ClaimResult, Completed, InProgress, encode_result
from .errors import ConfigurationError, MissingExtraError

try:
    import redis.asyncio as aioredis
    from redis.commands.core import AsyncScript
except ImportError as error:  # the redis extra is not installed
    raise MissingExtraError("RedisDedupStore", "redis", "redis") from error

logger = logging.getLogger(__name__)

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "reliable-sub:dedup"
# Keys and namespaces up to this many characters are stored readably; longer ones are hashed
# (64 hex digits) so one Redis key stays small whatever a publisher puts in its attribute.
READABLE_LIMIT = 100
# Connect and read timeouts of a client created from a URL: a claim is one short script, so a
# Redis that does not answer within this is treated as down and the batch is redelivered later,
# rather than the receive loop hanging on a dead socket (older redis-py had no default timeout).
SOCKET_TIMEOUT = 5.0
# Connections of a client created from a URL: plenty for the Subscriber's few batch calls at a
# time plus handlers' own claims. Beyond it a caller waits for a free connection (redis-py's
# default pool instead fails with "Too many connections" past 100 concurrent commands) ...
MAX_CONNECTIONS = 50
# ... for at most this long: every command ends within SOCKET_TIMEOUT, so a longer wait means
# Redis is down and the call fails like any other Redis error.
CONNECTION_WAIT = 2 * SOCKET_TIMEOUT

# Value layout (see the module docstring).
_IN_PROGRESS = b"p:"
_COMPLETED = b"c:"
_HASHED = "h:"
_EMPTY_NAMESPACE = "_"
_SEPARATOR = "\x1f"
# What may appear as it is: printable ASCII without space ('!' to '~') ...
_READABLE_PART = re.compile(rf"[!-~]{{1,{READABLE_LIMIT}}}")
# ... and, inside the hash tag, also without braces, which would end or confuse the tag.
_READABLE_NAMESPACE = re.compile(rf"[!-z|~]{{1,{READABLE_LIMIT}}}")

# Claim states the claim script reports, one (state, detail) pair per key.
_STATE_CLAIMED = 0
_STATE_COMPLETED = 1
_STATE_IN_PROGRESS = 2

# KEYS: the records to claim. ARGV[1]: this owner's in-progress value; ARGV[2]: lease in ms.
# Per key, in order, a pair: 0, '' (claimed now) | 1, result JSON | 2, PTTL in ms.
_CLAIM_SCRIPT = """
local reply = {}
for i, key in ipairs(KEYS) do
  local value = redis.call('GET', key)
  if not value then
    redis.call('SET', key, ARGV[1], 'PX', ARGV[2])
    reply[2 * i - 1] = 0
    reply[2 * i] = ''
  elseif string.sub(value, 1, 2) == 'c:' then
    reply[2 * i - 1] = 1
    reply[2 * i] = string.sub(value, 3)
  else
    reply[2 * i - 1] = 2
    reply[2 * i] = redis.call('PTTL', key)
  end
end
return reply
"""

# KEYS[1]: the record. ARGV[1]: this owner's in-progress value. 1 if deleted, else 0.
_RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS: the records. ARGV[1]: this owner's in-progress value; ARGV[2]: lease in ms.
# Extends the claims this owner holds; returns the 1-based positions of the others.
_RENEW_SCRIPT = """
local lost = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('PEXPIRE', key, ARGV[2])
  else
    lost[#lost + 1] = i
  end
end
return lost
"""


class RedisDedupStore:
    """A dedup store on Redis: one record per idempotency key, shared by every consumer.

    Args:
        url_or_client: a Redis URL (a client is created with ``decode_responses=False``, a
            blocking pool of ``MAX_CONNECTIONS`` and ``SOCKET_TIMEOUT``, and closed by
            :meth:`aclose`), or a ``redis.asyncio.Redis`` client the caller owns and closes.
        prefix: the first part of every Redis key this store writes; no braces.
        owner: this store's owner token (default: a fresh random one). Stores with the same
            owner may renew and release each other's claims; give each process its own.

    Like any ``redis.asyncio`` client, the store belongs to the event loop that first uses it
    (the Subscriber's); to use Redis from another loop as well, create a second store.
    """

    def __init__(
        self,
        url_or_client: str | aioredis.Redis = DEFAULT_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        owner: str | None = None,
    ) -> None:
        if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix:
            raise ConfigurationError(
                f"RedisDedupStore.prefix must be a non-empty str without braces (they would "
                f"move the cluster hash tag), got {prefix!r}"
            )
        if owner is not None and (not isinstance(owner, str) or not owner):
            raise ConfigurationError(
                f"RedisDedupStore.owner must be a non-empty str or None, got {owner!r}"
            )
        if isinstance(url_or_client, str):
            pool = aioredis.BlockingConnectionPool.from_url(
                url_or_client,
                max_connections=MAX_CONNECTIONS,
                timeout=CONNECTION_WAIT,
                decode_responses=False,
                socket_timeout=SOCKET_TIMEOUT,
                socket_connect_timeout=SOCKET_TIMEOUT,
            )
            client = aioredis.Redis.from_pool(pool)
            self._owns_client = True
        elif isinstance(url_or_client, aioredis.Redis):
            client = url_or_client
            self._owns_client = False
        else:
            raise ConfigurationError(
                "RedisDedupStore needs a Redis URL or a redis.asyncio.Redis client, got "
                f"{type(url_or_client).__name__}"
            )
        self._client = client
        self.prefix = prefix
        self.owner = owner or uuid.uuid4().hex
        self._claim_value = _IN_PROGRESS + self.owner.encode("utf-8", "surrogatepass")
        self._claim_script: AsyncScript = client.register_script(_CLAIM_SCRIPT)
        self._release_script: AsyncScript = client.register_script(_RELEASE_SCRIPT)
        self._renew_script: AsyncScript = client.register_script(_RENEW_SCRIPT)

    def __repr__(self) -> str:
        return f"RedisDedupStore(prefix={self.prefix!r}, owner={self.owner!r})"

    @property
    def client(self) -> aioredis.Redis:
        """The ``redis.asyncio.Redis`` client this store talks through."""
        return self._client

    async def aclose(self) -> None:
        """Close the client if this store created it from a URL (a passed client stays open)."""
        if self._owns_client:
            await self._client.aclose()

    def redis_key(self, key: str) -> str:
        """The Redis key that holds the record of store ``key`` (see the module docstring)."""
        namespace, separator, idempotency_key = key.partition(_SEPARATOR)
        if not separator:
            namespace, idempotency_key = "", key
        return f"{self.prefix}:{{{_namespace_tag(namespace)}}}:{_key_part(idempotency_key)}"

    # -- the DedupStore protocol ----------------------------------------------------------------

    async def claim(self, key: str, lease_ttl: float) -> ClaimResult:
        """Atomically claim ``key`` for ``lease_ttl`` seconds, or report why not."""
        return (await self.claim_many([key], lease_ttl))[0]

    async def claim_many(self, keys: Sequence[str], lease_ttl: float) -> list[ClaimResult]:
        """:meth:`claim` for each key, in order, in one script call (one round trip).

        A key repeated in ``keys`` is claimed once; its later positions report InProgress.
        """
        if not keys:
            return []
        lease = _milliseconds("lease_ttl", lease_ttl)
        reply = await self._claim_script(
            keys=[self.redis_key(key) for key in keys], args=[self._claim_value, lease]
        )
        results: list[ClaimResult] = []
        for index in range(len(keys)):
            state, detail = int(reply[2 * index]), reply[2 * index + 1]
            if state == _STATE_CLAIMED:
                results.append(CLAIMED)
            elif state == _STATE_COMPLETED:
                results.append(Completed(_decode_result(detail)))
            else:
                results.append(InProgress(self._remaining(keys[index], int(detail))))
        return results

    async def complete(self, key: str, result: Any, ttl: float) -> None:
        """Record ``key`` as handled with a JSON-serializable ``result``, kept ``ttl`` seconds.

        Raises :class:`~reliable_sub.errors.ResultNotSerializableError` (and stores nothing)
        when ``result`` is not JSON-serializable.
        """
        await self.complete_many([(key, encode_result(result))], ttl)

    async def complete_many(self, results: Sequence[tuple[str, str]], ttl: float) -> None:
        """Record each ``(key, result_json)`` as handled, kept ``ttl`` seconds, in one round trip.

        A completion is a fact, so it replaces whatever the key held (even a peer's claim).
        """
        if not results:
            return
        retention = _milliseconds("ttl", ttl)
        async with self._client.pipeline(transaction=False) as pipe:
            for key, result_json in results:
                pipe.set(self.redis_key(key), _COMPLETED + result_json.encode(), px=retention)
            await pipe.execute()

    def completion_records(
        self, results: Sequence[tuple[str, str]], ttl: float
    ) -> tuple[list[str], list[bytes], int]:
        """The Redis keys, values and TTL (ms) that :meth:`complete_many` would write.

        For the Redis Streams adapter's fast path, which writes them in the same script call
        as the batch's XACK when stream and store share a Redis.
        """
        keys = [self.redis_key(key) for key, _ in results]
        values = [_COMPLETED + result_json.encode() for _, result_json in results]
        return keys, values, _milliseconds("ttl", ttl)

    def same_server(self, client: aioredis.Redis) -> bool:
        """True when ``client`` talks to the same Redis server and database as this store."""
        mine = self._client.connection_pool.connection_kwargs
        theirs = client.connection_pool.connection_kwargs
        fields = ("host", "port", "db", "path")
        return all(mine.get(name) == theirs.get(name) for name in fields)

    async def release(self, key: str) -> bool:
        """Delete this owner's claim on ``key`` so a retry can run; False if it was not ours."""
        deleted = await self._release_script(
            keys=[self.redis_key(key)], args=[self._claim_value]
        )
        return bool(deleted)

    async def renew(self, keys: Sequence[str], lease_ttl: float) -> list[str]:
        """Extend this owner's claims to ``lease_ttl`` from now in one script call.

        Returns the keys that are no longer ours (expired, taken by a peer, or completed); they
        are left untouched.
        """
        if not keys:
            return []
        lease = _milliseconds("lease_ttl", lease_ttl)
        lost = await self._renew_script(
            keys=[self.redis_key(key) for key in keys], args=[self._claim_value, lease]
        )
        lost_keys = [keys[int(position) - 1] for position in lost]
        if lost_keys:
            logger.debug("%d of %d dedup claims are no longer ours", len(lost_keys), len(keys))
        return lost_keys

    def _remaining(self, key: str, pttl: int) -> float:
        if pttl >= 0:
            return pttl / 1000.0
        # Only a write by something other than this store leaves a record without expiry.
        logger.warning(
            "dedup record %r (Redis key %r) is in progress without an expiry; it stays "
            "claimed until someone deletes it",
            key,
            self.redis_key(key),
        )
        return math.inf


def _milliseconds(name: str, seconds: float) -> int:
    """``seconds`` as whole milliseconds for PX / PEXPIRE (at least 1)."""
    if not isinstance(seconds, int | float) or not 0 < seconds < math.inf:
        raise ConfigurationError(f"RedisDedupStore: {name} must be in (0, inf), got {seconds!r}")
    return max(1, round(seconds * 1000))


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


def _decode_result(detail: bytes | str) -> Any:
    text = detail.decode() if isinstance(detail, bytes) else detail
    return json.loads(text) if text else None


__all__ = ["RedisDedupStore"]
