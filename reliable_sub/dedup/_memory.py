"""The in-process dedup store (what every store shares is in :mod:`._store_base`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from .._results import checked_result_json
from ..clock import Clock, SystemClock
from ..policy import check_seconds
from ..ports import (
    Claimed,
    ClaimResult,
    Completed,
    Completion,
    DedupKey,
    InProgress,
)
from ._store_base import SingleKeyMethods, TokenSource, check_owner

# Expired records are swept every this many operations, so memory stays bounded without a timer.
_SWEEP_EVERY = 4096


# A record: (state, expires_at, token or result JSON, failures). Plain tuples, not objects,
# because a store holds records for days and the garbage collector walks every object.
_CLAIMED, _FAILED, _COMPLETED = 0, 1, 2
_Record = tuple[int, float, str | None, int]


class MemoryDedupStore(SingleKeyMethods):
    """A dedup store in this process's memory: for tests, examples and single-process consumers.

    It also has the blocking twins of a :class:`~reliable_sub.ports.SyncDedupStore`
    (``claim_many_sync`` ...), safe from any thread.

    Args:
        clock: time source for claim leases and retention (default: the system clock).
        owner: readable prefix of this store's fencing tokens, such as the service's name
            (default: a short random one); see :func:`check_owner`.
    """

    def __init__(self, *, clock: Clock | None = None, owner: str | None = None) -> None:
        self._clock: Clock = clock or SystemClock()
        self._tokens = TokenSource(check_owner(owner, "MemoryDedupStore"))
        self.owner = self._tokens.owner
        self._records: dict[DedupKey, _Record] = {}
        self._epochs: dict[str, int] = {}
        self._lock = threading.Lock()
        self._operations = 0

    def __len__(self) -> int:
        with self._lock:
            now = self._clock.now()
            return sum(1 for record in self._records.values() if record[1] > now)

    def __repr__(self) -> str:
        return f"MemoryDedupStore(owner={self.owner!r})"

    # -- claims --------------------------------------------------------------------------------
    #
    # Every state change happens under a threading.Lock and never awaits, so the blocking twins
    # (the SyncDedupStore capability) are the implementation and the async methods return them:
    # both may be called from any thread and event loop, on the same records.

    async def claim_many(
        self,
        keys: Sequence[DedupKey],
        lease_ttl: float,
        tokens: Sequence[str] | None = None,
    ) -> list[ClaimResult]:
        return self.claim_many_sync(keys, lease_ttl, tokens)

    async def renew(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        return self.renew_sync(claims, lease_ttl)

    async def complete_many(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        return self.complete_many_sync(completions, ttl)

    async def release_many(self, claims: Sequence[Claimed], retention: float) -> None:
        self.release_many_sync(claims, retention)

    def claim_many_sync(
        self,
        keys: Sequence[DedupKey],
        lease_ttl: float,
        tokens: Sequence[str] | None = None,
    ) -> list[ClaimResult]:
        """Blocking twin of :meth:`claim_many`."""
        check_seconds("MemoryDedupStore", "lease_ttl", lease_ttl)
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

    def renew_sync(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        """Blocking twin of :meth:`renew`."""
        check_seconds("MemoryDedupStore", "lease_ttl", lease_ttl)
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

    def complete_many_sync(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        """Blocking twin of :meth:`complete_many`."""
        check_seconds("MemoryDedupStore", "ttl", ttl)
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

    def release_many_sync(self, claims: Sequence[Claimed], retention: float) -> None:
        """Blocking twin of :meth:`release_many`."""
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

    # -- epochs (the DedupEpochs capability) -----------------------------------------------

    async def epoch(self, namespace: str) -> int:
        """The current epoch of ``namespace`` (0 if it never had one)."""
        with self._lock:
            return self._epochs.get(namespace, 0)

    async def next_epoch(self, namespace: str) -> int:
        """Start the next epoch of ``namespace``: records of earlier ones no longer match."""
        with self._lock:
            epoch = self._epochs[namespace] = self._epochs.get(namespace, 0) + 1
            return epoch

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


