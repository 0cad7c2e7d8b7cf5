"""Idempotent-consumer dedup stores: duplicates of a completed message have no effect.

A store keeps one record per :class:`DedupKey` (a namespace and an idempotency key, kept apart so
no two pairs can ever name the same record). ``claim_many`` answers atomically, per key:

* :class:`Claimed` -- nobody is handling the key; the caller now holds it for ``lease_ttl``
  seconds under a fresh *fencing token*. Renewing, completing and releasing the claim are all
  conditional on that token, so a caller whose claim lapsed (and was taken by a peer) can never
  overwrite the peer's record;
* :class:`Completed` -- it was handled; the stored result is kept as JSON text and decoded only
  when asked for, so an unreadable record never fails a claim;
* :class:`InProgress` -- a live peer holds a claim.

A record also counts *handler failures* (``failures``): a failed attempt releases its claim but
keeps the count, so the Subscriber can dead-letter after N failures however many consumers,
restarts, deferrals and stops came in between. Results are stored as JSON, never pickle.

Stores: :class:`MemoryDedupStore` (this process) and ``RedisDedupStore`` (shared by every
consumer; needs ``pip install "reliable-sub[redis]"``). ``from reliable_sub.dedup import
RedisDedupStore`` loads it on first use, so importing this module never imports redis.
"""

from __future__ import annotations

import itertools
import json
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from .clock import Clock, SystemClock
from .errors import ConfigurationError, ResultNotSerializableError, StoredResultError

if TYPE_CHECKING:  # for type checkers only: at runtime __getattr__ imports it on first use
    from .dedup_redis import RedisDedupStore as RedisDedupStore

# Expired records are swept every this many operations, so memory stays bounded without a timer.
_SWEEP_EVERY = 4096
# Separates an owner from its claim counter in a fencing token; owners may not contain it, nor
# the "|" that stores use after the token.
_TOKEN_SEPARATOR = "."


class DedupKey(NamedTuple):
    """The record a message maps to: its idempotency ``key`` within ``namespace``.

    The Subscriber's default namespace names the broker, topic and subscription (see
    ``Adapter.dedup_namespace``), so two services never share records by accident.
    """

    namespace: str
    key: str


@dataclass(frozen=True, slots=True)
class Claimed:
    """The caller holds the claim: run the handler.

    Attributes:
        key: the record.
        token: the fencing token of this claim; pass it on to systems you write to if they can
            reject stale writers. Renew, complete and release need it.
        failures: failed handler attempts recorded for this key before this claim.
    """

    key: DedupKey
    token: str
    failures: int = 0


@dataclass(frozen=True, slots=True)
class Completed:
    """The key was handled before; its handler's return value is stored as JSON text."""

    result_json: str | None = "null"
    key: DedupKey | None = field(default=None, compare=False)

    @property
    def result(self) -> Any:
        """The stored result, decoded; :class:`StoredResultError` if it is not valid JSON."""
        return decode_result(self.result_json, self.key)


@dataclass(frozen=True, slots=True)
class InProgress:
    """A peer holds the claim; ``expires_in`` seconds remain on it unless renewed."""

    expires_in: float = 0.0
    failures: int = 0


ClaimResult = Claimed | Completed | InProgress


class Completion(NamedTuple):
    """A completion to record: the claim it ends and the handler's result as JSON text."""

    claim: Claimed
    result_json: str


@runtime_checkable
class DedupStore(Protocol):
    """The idempotent-consumer store contract.

    Batch methods cost one round trip each; the Subscriber uses only them. ``claim``,
    ``complete`` and ``release`` are single-key conveniences for handlers and scripts.
    Every method that ends or extends a claim is conditional on the claim's token.
    """

    async def claim_many(
        self,
        keys: Sequence[DedupKey],
        lease_ttl: float,
        tokens: Sequence[str] | None = None,
    ) -> list[ClaimResult]:
        """Claim each key for ``lease_ttl`` seconds, in order, atomically per key.

        ``tokens`` (one per key) re-claims keys this caller held before: a key still held under
        its token is renewed and reported Claimed. Without them, fresh tokens are made. A key
        repeated in one call is claimed once; its later positions report InProgress.
        """
        ...

    async def renew(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        """Extend each claim to ``lease_ttl`` from now and store its ``failures``; returns the
        claims that are no longer held under their token (left untouched)."""
        ...

    async def complete_many(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        """Record each completion, kept ``ttl`` seconds; returns the claims refused because a
        peer now holds the key under another token (a lapsed claim nobody took is recorded)."""
        ...

    async def release_many(self, claims: Sequence[Claimed], retention: float) -> None:
        """End each claim without a result; a key with ``failures`` keeps that count for
        ``retention`` seconds, one without is forgotten. Claims not held are left alone."""
        ...

    async def claim(self, key: DedupKey, lease_ttl: float) -> ClaimResult:
        """:meth:`claim_many` for one key."""
        ...

    async def complete(self, claim: Claimed, result: Any, ttl: float) -> bool:
        """Record ``claim`` as handled with a JSON-serialisable ``result``; False if refused."""
        ...

    async def release(self, claim: Claimed, retention: float = 0.0) -> None:
        """:meth:`release_many` for one claim."""
        ...

    async def close(self) -> None:
        """Release connections of the running event loop; the store reconnects on next use."""
        ...


_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def encode_result(result: Any) -> str:
    """``result`` as JSON text, or :class:`ResultNotSerializableError` naming its type."""
    if result is None:
        return "null"
    try:
        return _ENCODER.encode(result)
    except (TypeError, ValueError, RecursionError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise ResultNotSerializableError(
            f"handler result of type {type(result).__name__} cannot be stored as JSON "
            f"({reason}); return None, a str, number, bool, list or dict"
        ) from error


def decode_result(result_json: str | None, key: DedupKey | None = None) -> Any:
    """The value of a stored result; :class:`StoredResultError` naming the key if unreadable."""
    if not result_json:
        return None
    try:
        return json.loads(result_json)
    except (ValueError, RecursionError) as error:
        raise StoredResultError(
            f"the stored result of {key!r} is not valid JSON ({error}): {result_json[:80]!r}"
        ) from error


def checked_result_json(result_json: object) -> str:
    """``result_json`` if it is JSON text; a :class:`ResultNotSerializableError` otherwise."""
    if result_json == "null":
        return "null"
    if not isinstance(result_json, str):
        raise ResultNotSerializableError(
            f"a completion's result_json must be JSON text (see encode_result), "
            f"got {type(result_json).__name__}"
        )
    try:
        json.loads(result_json)
    except (ValueError, RecursionError) as error:
        raise ResultNotSerializableError(
            f"a completion's result_json is not valid JSON ({error}): {result_json[:80]!r}"
        ) from error
    return result_json


def check_owner(owner: str | None, where: str) -> str:
    """The owner token prefix to use: ``owner`` once checked, or a fresh random one."""
    if owner is None:
        return uuid.uuid4().hex
    if not isinstance(owner, str) or not owner or any(c in owner for c in "|.{}"):
        raise ConfigurationError(
            f"{where}.owner must be a non-empty str without '|', '.', '{{' or '}}', got {owner!r}"
        )
    return owner


class TokenSource:
    """Fencing tokens: the store's owner, a dot, and a counter (unique per store instance)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self.owner}{_TOKEN_SEPARATOR}{next(self._counter)}"


class SingleKeyMethods:
    """``claim``, ``complete`` and ``release`` of one key, over a store's batch methods."""

    async def claim_many(
        self, keys: Sequence[DedupKey], lease_ttl: float, tokens: Sequence[str] | None = None
    ) -> list[ClaimResult]:
        raise NotImplementedError

    async def complete_many(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        raise NotImplementedError

    async def release_many(self, claims: Sequence[Claimed], retention: float) -> None:
        raise NotImplementedError

    async def claim(self, key: DedupKey, lease_ttl: float) -> ClaimResult:
        """:meth:`claim_many` for one key."""
        return (await self.claim_many([key], lease_ttl))[0]

    async def complete(self, claim: Claimed, result: Any, ttl: float) -> bool:
        """Record ``claim`` as handled with a JSON-serialisable ``result``; False if refused.

        Raises :class:`ResultNotSerializableError` (and stores nothing) for a result JSON
        cannot hold.
        """
        refused = await self.complete_many([Completion(claim, encode_result(result))], ttl)
        return not refused

    async def release(self, claim: Claimed, retention: float = 0.0) -> None:
        """:meth:`release_many` for one claim."""
        await self.release_many([claim], retention)


# A record: (state, expires_at, token or result JSON, failures). Plain tuples, not objects,
# because a store holds records for days and the garbage collector walks every object.
_CLAIMED, _FAILED, _COMPLETED = 0, 1, 2
_Record = tuple[int, float, str | None, int]


class MemoryDedupStore(SingleKeyMethods):
    """A dedup store in this process's memory: for tests, examples and single-process consumers.

    Args:
        clock: time source for claim leases and retention (default: the system clock).
        owner: prefix of this store's fencing tokens (default: a fresh random one).
    """

    def __init__(self, *, clock: Clock | None = None, owner: str | None = None) -> None:
        self._clock: Clock = clock or SystemClock()
        self._tokens = TokenSource(check_owner(owner, "MemoryDedupStore"))
        self.owner = self._tokens.owner
        self._records: dict[DedupKey, _Record] = {}
        self._lock = threading.Lock()
        self._operations = 0

    def __len__(self) -> int:
        with self._lock:
            now = self._clock.now()
            return sum(1 for record in self._records.values() if record[1] > now)

    def __repr__(self) -> str:
        return f"MemoryDedupStore(owner={self.owner!r})"

    # -- claims --------------------------------------------------------------------------------

    async def claim_many(
        self,
        keys: Sequence[DedupKey],
        lease_ttl: float,
        tokens: Sequence[str] | None = None,
    ) -> list[ClaimResult]:
        _check_duration("lease_ttl", lease_ttl)
        with self._lock:
            now = self._clock.now()
            self._operations += len(keys)
            if self._operations >= _SWEEP_EVERY:
                self._operations = 0
                self._sweep(now)
            return [
                self._claim(key, now + lease_ttl, now, tokens[i] if tokens else None)
                for i, key in enumerate(keys)
            ]

    def _claim(
        self, key: DedupKey, expires_at: float, now: float, token: str | None
    ) -> ClaimResult:
        record = self._records.get(key)
        failures = 0
        if record is not None and record[1] > now:
            state, held_until, detail, failures = record
            if state == _COMPLETED:
                return Completed(detail, key)
            if state == _CLAIMED and detail != token:
                return InProgress(held_until - now, failures)
        token = token or self._tokens.next()
        self._records[key] = (_CLAIMED, expires_at, token, failures)
        return Claimed(key, token, failures)

    async def renew(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        _check_duration("lease_ttl", lease_ttl)
        lost: list[Claimed] = []
        with self._lock:
            now = self._clock.now()
            for claim in claims:
                if self._holds(claim, now):
                    self._records[claim.key] = (
                        _CLAIMED, now + lease_ttl, claim.token, claim.failures
                    )
                else:
                    lost.append(claim)
        return lost

    async def complete_many(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        _check_duration("ttl", ttl)
        checked = [checked_result_json(c.result_json) for c in completions]
        refused: list[Claimed] = []
        with self._lock:
            now = self._clock.now()
            for (claim, _), result_json in zip(completions, checked, strict=True):
                record = self._records.get(claim.key)
                if record is not None and record[1] > now:
                    if record[0] == _COMPLETED:
                        continue  # a fact already recorded
                    if record[0] == _CLAIMED and record[2] != claim.token:
                        refused.append(claim)
                        continue
                self._records[claim.key] = (_COMPLETED, now + ttl, result_json, 0)
        return refused

    async def release_many(self, claims: Sequence[Claimed], retention: float) -> None:
        with self._lock:
            now = self._clock.now()
            for claim in claims:
                if not self._holds(claim, now):
                    continue
                if claim.failures > 0 and retention > 0:
                    self._records[claim.key] = (_FAILED, now + retention, None, claim.failures)
                else:
                    del self._records[claim.key]

    def _holds(self, claim: Claimed, now: float) -> bool:
        record = self._records.get(claim.key)
        return (
            record is not None
            and record[0] == _CLAIMED
            and record[2] == claim.token
            and record[1] > now
        )

    # -- lifecycle and inspection --------------------------------------------------------------

    async def close(self) -> None:
        """Nothing to release: records live in this process until it exits."""

    def close_sync(self) -> None:
        """Blocking twin of :meth:`close`."""

    def write_raw(self, key: DedupKey, result_json: str, ttl: float) -> None:
        """Store ``result_json`` unchecked as a completed record (for tests of bad records)."""
        with self._lock:
            self._records[key] = (_COMPLETED, self._clock.now() + ttl, result_json, 0)

    def _sweep(self, now: float) -> None:
        expired = [key for key, record in self._records.items() if record[1] <= now]
        for key in expired:
            del self._records[key]


def _check_duration(name: str, seconds: float) -> None:
    if not isinstance(seconds, int | float) or not 0 < seconds < float("inf"):
        raise ConfigurationError(f"dedup store: {name} must be in (0, inf), got {seconds!r}")


def __getattr__(name: str) -> Any:
    """Import optional stores on first use, so the core never imports their client libraries.

    Without the redis extra, ``RedisDedupStore`` raises :class:`MissingExtraError` naming the
    ``pip install`` to run.
    """
    if name == "RedisDedupStore":
        from .dedup_redis import RedisDedupStore

        return RedisDedupStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
