"""Idempotent-consumer dedup stores: duplicates of a completed message have no effect.

A store answers one question atomically per message: ``claim(key)`` returns

* :class:`Claimed` -- nobody handled this key; the caller now holds a claim for ``lease_ttl``
  seconds (renewed by the lease manager while the handler runs);
* :class:`Completed` -- it was handled; ``result`` is what the handler returned (JSON);
* :class:`InProgress` -- a live peer holds a claim; leave the message, it comes back later.

Keys are scoped by subscription (or an explicit namespace) before they reach a store, so two
subscriptions never share a record. Results are stored as JSON, never pickle. A store instance is
one owner: it renews and releases only claims it took.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .clock import Clock, SystemClock
from .errors import ResultNotSerializableError

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
    """The idempotent-consumer store contract."""

    async def claim(self, key: str, lease_ttl: float) -> ClaimResult:
        """Atomically claim ``key`` for ``lease_ttl`` seconds, or report why not."""
        ...

    async def complete(self, key: str, result: Any, ttl: float) -> None:
        """Record ``key`` as handled with a JSON-serializable ``result``, kept ``ttl`` seconds."""
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


def encode_result(result: Any) -> str:
    """``result`` as JSON, or :class:`ResultNotSerializableError` naming its type."""
    try:
        return json.dumps(result, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ResultNotSerializableError(
            f"handler result of type {type(result).__name__} cannot be stored as JSON "
            f"({error}); return None, a str, number, bool, list or dict"
        ) from error


@dataclass(slots=True)
class _Record:
    owner: str | None  # None once completed
    expires_at: float
    result_json: str | None = None


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
            return sum(1 for r in self._records.values() if r.expires_at > now)

    async def claim(self, key: str, lease_ttl: float) -> ClaimResult:
        return self.claim_sync(key, lease_ttl)

    def claim_sync(self, key: str, lease_ttl: float) -> ClaimResult:
        """Blocking twin of :meth:`claim`."""
        with self._lock:
            now = self._clock.now()
            self._maybe_sweep(now)
            record = self._records.get(key)
            if record is not None and record.expires_at > now:
                if record.owner is None:
                    result = json.loads(record.result_json) if record.result_json else None
                    return Completed(result)
                return InProgress(record.expires_at - now)
            self._records[key] = _Record(self.owner, now + lease_ttl)
            return Claimed()

    async def complete(self, key: str, result: Any, ttl: float) -> None:
        encoded = encode_result(result)
        with self._lock:
            self._records[key] = _Record(None, self._clock.now() + ttl, encoded)

    async def release(self, key: str) -> bool:
        with self._lock:
            record = self._records.get(key)
            if record is None or record.owner != self.owner:
                return False
            del self._records[key]
            return True

    async def renew(self, keys: Sequence[str], lease_ttl: float) -> list[str]:
        lost: list[str] = []
        with self._lock:
            now = self._clock.now()
            for key in keys:
                record = self._records.get(key)
                if record is None or record.owner != self.owner:
                    lost.append(key)
                else:
                    record.expires_at = now + lease_ttl
        return lost

    def _maybe_sweep(self, now: float) -> None:
        self._operations += 1
        if self._operations % _SWEEP_EVERY:
            return
        expired = [k for k, r in self._records.items() if r.expires_at <= now]
        for key in expired:
            del self._records[key]
