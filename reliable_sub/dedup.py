"""Idempotent-consumer dedup stores: duplicates of a completed message have no effect.

A store answers one question atomically per message: ``claim(key)`` returns

* :class:`Claimed` -- nobody handled this key; the caller now holds a claim for ``lease_ttl``
  seconds (renewed by the lease manager while the handler runs);
* :class:`Completed` -- it was handled; ``result`` is what the handler returned (JSON);
* :class:`InProgress` -- a live peer holds a claim; leave the message, it comes back later.

Keys are scoped by subscription (or an explicit namespace) before they reach a store, so two
subscriptions never share a record. Results are stored as JSON, never pickle. A store instance is
one owner: it renews and releases only claims it took.

Stores: :class:`MemoryDedupStore` (this process) and ``RedisDedupStore`` (shared by every
consumer; needs ``pip install "reliable-sub[redis]"``). ``from reliable_sub.dedup import
RedisDedupStore`` loads it on first use, so importing this module never imports redis.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .clock import Clock, SystemClock
from .errors import ResultNotSerializableError

if TYPE_CHECKING:  # for type checkers only: at runtime __getattr__ imports it on first use
    from .dedup_redis import RedisDedupStore as RedisDedupStore

# Expired records are swept every this many operations, so memory stays bounded without a timer.
_SWEEP_EVERY = 4096


@dataclass(frozen=True, slots=True)
class Claimed:
    """The caller holds the claim and should run the handler."""


@dataclass(frozen=True, slots=True)
class Completed:
    """The key was handled before; ``result`` is the handler's stored (JSON) return value."""

    result: Any = None


@dataclass(frozen=True, slots=True)
class InProgress:
    """A live peer holds the claim; ``expires_in`` seconds remain on it unless renewed."""

    expires_in: float = 0.0


ClaimResult = Claimed | Completed | InProgress


@runtime_checkable
class DedupStore(Protocol):
    """The idempotent-consumer store contract.

    The Subscriber uses the batch methods (one round trip per received batch and per batch of
    acks); the single-key methods are for handlers and scripts.
    """

    async def claim(self, key: str, lease_ttl: float) -> ClaimResult:
        """Atomically claim ``key`` for ``lease_ttl`` seconds, or report why not."""
        ...

    async def claim_many(self, keys: Sequence[str], lease_ttl: float) -> list[ClaimResult]:
        """:meth:`claim` for each key, in order, in one round trip."""
        ...

    async def complete(self, key: str, result: Any, ttl: float) -> None:
        """Record ``key`` as handled with a JSON-serializable ``result``, kept ``ttl`` seconds."""
        ...

    async def complete_many(self, results: Sequence[tuple[str, str]], ttl: float) -> None:
        """Record each ``(key, result_json)`` as handled, kept ``ttl`` seconds, in one round trip.

        ``result_json`` is already JSON text (see :func:`encode_result`).
        """
        ...

    async def release(self, key: str) -> bool:
        """Drop this owner's claim on ``key`` so a retry can run; False if it was not ours."""
        ...

    async def renew(self, keys: Sequence[str], lease_ttl: float) -> list[str]:
        """Extend this owner's claims to ``lease_ttl`` from now; returns the keys no longer ours."""
        ...


def scoped_key(namespace: str, key: str) -> str:
    """The store key for idempotency ``key`` within ``namespace`` (a subscription by default)."""
    return f"{namespace}\x1f{key}"


_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
CLAIMED = Claimed()


def encode_result(result: Any) -> str:
    """``result`` as JSON text, or :class:`ResultNotSerializableError` naming its type."""
    if result is None:
        return "null"
    try:
        return _ENCODER.encode(result)
    except (TypeError, ValueError) as error:
        raise ResultNotSerializableError(
            f"handler result of type {type(result).__name__} cannot be stored as JSON "
            f"({error}); return None, a str, number, bool, list or dict"
        ) from error


# A record is (owner, expires_at, result_json): owner None once completed. Plain tuples, not
# objects, because a store holds records for days and the garbage collector walks every object.
_Record = tuple[str | None, float, str | None]


class MemoryDedupStore:
    """A dedup store in this process's memory: for tests, examples and single-process consumers.

    Args:
        clock: time source for claim leases and retention (default: the system clock).
        owner: this store's owner token (default: a fresh random one).
    """

    def __init__(self, *, clock: Clock | None = None, owner: str | None = None) -> None:
        self._clock: Clock = clock or SystemClock()
        self.owner = owner or uuid.uuid4().hex
        self._records: dict[str, _Record] = {}
        self._lock = threading.Lock()
        self._operations = 0

    def __len__(self) -> int:
        with self._lock:
            now = self._clock.now()
            return sum(1 for record in self._records.values() if record[1] > now)

    async def claim(self, key: str, lease_ttl: float) -> ClaimResult:
        return self.claim_sync(key, lease_ttl)

    async def claim_many(self, keys: Sequence[str], lease_ttl: float) -> list[ClaimResult]:
        with self._lock:
            now = self._clock.now()
            return [self._claim(key, lease_ttl, now) for key in keys]

    def claim_sync(self, key: str, lease_ttl: float) -> ClaimResult:
        """Blocking twin of :meth:`claim`."""
        with self._lock:
            return self._claim(key, lease_ttl, self._clock.now())

    def _claim(self, key: str, lease_ttl: float, now: float) -> ClaimResult:
        self._operations += 1
        if self._operations % _SWEEP_EVERY == 0:
            self._sweep(now)
        record = self._records.get(key)
        if record is not None and record[1] > now:
            owner, expires_at, result_json = record
            if owner is None:
                return Completed(json.loads(result_json) if result_json else None)
            return InProgress(expires_at - now)
        self._records[key] = (self.owner, now + lease_ttl, None)
        return CLAIMED

    async def complete(self, key: str, result: Any, ttl: float) -> None:
        await self.complete_many([(key, encode_result(result))], ttl)

    async def complete_many(self, results: Sequence[tuple[str, str]], ttl: float) -> None:
        with self._lock:
            expires_at = self._clock.now() + ttl
            records = self._records
            for key, result_json in results:
                records[key] = (None, expires_at, result_json)

    async def release(self, key: str) -> bool:
        with self._lock:
            record = self._records.get(key)
            if record is None or record[0] != self.owner or record[1] <= self._clock.now():
                return False
            del self._records[key]
            return True

    async def renew(self, keys: Sequence[str], lease_ttl: float) -> list[str]:
        lost: list[str] = []
        with self._lock:
            now = self._clock.now()
            expires_at = now + lease_ttl
            for key in keys:
                record = self._records.get(key)
                if record is None or record[0] != self.owner or record[1] <= now:
                    lost.append(key)
                else:
                    self._records[key] = (record[0], expires_at, None)
        return lost

    def _sweep(self, now: float) -> None:
        expired = [key for key, record in self._records.items() if record[1] <= now]
        for key in expired:
            del self._records[key]


def __getattr__(name: str) -> Any:
    """Import optional stores on first use, so the core never imports their client libraries.

    Without the redis extra, ``RedisDedupStore`` raises :class:`MissingExtraError` naming the
    ``pip install`` to run.
    """
    if name == "RedisDedupStore":
        from .dedup_redis import RedisDedupStore

        return RedisDedupStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
