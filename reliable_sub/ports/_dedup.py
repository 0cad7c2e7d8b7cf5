"""The dedup store's contract and its records (see :mod:`reliable_sub.ports`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

from .._results import decode_result


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


@runtime_checkable
class SyncDedupStore(Protocol):
    """An optional capability of a :class:`DedupStore`: blocking twins of its batch methods.

    Each ``*_sync`` method has exactly the semantics and return value of the async method it is
    named after (see :class:`DedupStore`), and sees the same records: a key claimed by one is
    in progress for the other. They block the calling thread for one round trip and may be
    called from any thread, concurrently, with or without a running event loop (they never use
    one). Sync ``@idempotent`` functions call them on the calling thread when the store has
    them (``isinstance(store, SyncDedupStore)``); other stores' calls run on a background loop.
    """

    def claim_many_sync(
        self,
        keys: Sequence[DedupKey],
        lease_ttl: float,
        tokens: Sequence[str] | None = None,
    ) -> list[ClaimResult]:
        """Blocking twin of :meth:`DedupStore.claim_many`."""
        ...

    def renew_sync(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        """Blocking twin of :meth:`DedupStore.renew`; returns the claims no longer held."""
        ...

    def complete_many_sync(
        self, completions: Sequence[Completion], ttl: float
    ) -> list[Claimed]:
        """Blocking twin of :meth:`DedupStore.complete_many`; returns the refused claims."""
        ...

    def release_many_sync(self, claims: Sequence[Claimed], retention: float) -> None:
        """Blocking twin of :meth:`DedupStore.release_many`."""
        ...


@runtime_checkable
class DedupEpochs(Protocol):
    """An optional capability of a :class:`DedupStore`: an epoch number per namespace.

    The Subscriber claims a subscription's keys in the namespace of its current epoch
    (:func:`reliable_sub.dedup._epochs.epoch_namespace`), so records written in an earlier
    epoch no longer match: a replay in mode ``"reprocess"`` starts a new epoch before it seeks.
    Epochs are kept until deleted by hand; a namespace that never had one is in epoch 0.
    """

    async def epoch(self, namespace: str) -> int:
        """The current epoch of ``namespace`` (0 if it never had one)."""
        ...

    async def next_epoch(self, namespace: str) -> int:
        """Start the next epoch of ``namespace`` (atomically) and return its number."""
        ...
