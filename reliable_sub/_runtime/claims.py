"""The one owner of the claim lifecycle: claim -> (refresh) -> renew -> complete | release.

* **claim**: the keys of a received batch in one store call, each under a fresh fencing token;
* **refresh**: a delivery that waited to start until its claim was nearly gone re-claims it
  under the same token before its handler runs (claims are renewed only while handlers run);
* **renew**: the lease manager renews the claims of running handlers, and of finished ones
  until their result is recorded (:meth:`LeaseManager.tick`);
* **complete** or **release**: the settler writes them with the broker's ack or nack; every one
  is conditional on the token, so a lapsed claim never overwrites a peer's.

It also counts handler failures per message: in the dedup store's record when there is a store
(shared by every consumer and kept across restarts), in this process's memory otherwise. Every
call to the store goes through this class: the lease manager renews and the settler completes
and releases through it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..dedup import Claimed, ClaimResult, Completion, DedupKey, DedupStore
from ..dedup._epochs import EpochCache
from ..ports import DedupEpochs
from .inflight import InFlight


def _unreachable(error: BaseException) -> bool:
    """A client's error for a store it could not reach (refused, reset, no route): an OSError,
    Redis's ConnectionError, or a database driver's connection failure."""
    kinds = {kind.__name__ for kind in type(error).__mro__}
    if isinstance(error, OSError) or "ConnectionError" in kinds:
        return True
    return bool(kinds & {"OperationalError", "InterfaceError"}) and "connect" in str(error)


# Without a store, failure counts are kept for this many recent messages per Subscriber.
FAILURE_MEMORY = 100_000
# A claim call gets as long as the claims it takes last (the first lease), but at least this
# long (seconds): a store whose connection hangs fails the call, and the batch is redelivered.
MIN_STORE_CALL_BOUND = 1.0
# The claim call's name in health reports.
CLAIM_CALL = "claiming in the dedup store"


class Claims:
    """Claims, failure counts, completions and releases for one Subscriber run.

    Args:
        store: the dedup store, or None (no claims; failures counted in memory).
        retention: seconds completed records and failure counts are kept (``dedup_ttl``).
    """

    def __init__(self, store: DedupStore | None, retention: float = 0.0) -> None:
        self.store = store
        self.retention = retention
        self._epochs = (EpochCache(store) if store is not None and isinstance(store, DedupEpochs)
                        else None)
        # without a store: the failures counted here, by (namespace, message id); read by the
        # other stages directly on the hot path (no call when it is empty)
        self.failure_counts: OrderedDict[tuple[str, str], int] = OrderedDict()

    async def reach(self, namespaces: Sequence[str], timeout: float) -> None:
        """Read the current epoch of each namespace (the first claims' read, done now) within
        ``timeout`` seconds: a store that cannot be reached fails the start, as a broker does,
        instead of failing every message later. A store without epochs is not asked."""
        if self._epochs is None:
            return
        epochs = self._epochs
        try:
            await asyncio.wait_for(asyncio.gather(*(epochs.namespace(n) for n in namespaces)),
                                   timeout)
        except asyncio.TimeoutError:
            raise ConnectionError(
                f"the dedup store {self.store!r} did not answer within {timeout:g}s at start; "
                "check its URL and that it runs (a Subscriber starts only when its broker and "
                "its store answer; after the start, outages are retried and healthy() reports "
                "them)") from None
        except Exception as error:
            if not _unreachable(error):
                raise  # its own words say more (a table missing, credentials refused)
            first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            raise ConnectionError(
                f"the dedup store {self.store!r} cannot be reached at start: {first}; check "
                "its URL and that it runs") from error

    @staticmethod
    def key_of(namespace: str, item: InFlight[Any]) -> DedupKey:
        return DedupKey(namespace, item.delivery.message.idempotency_key)

    async def claim(
        self, namespace: str, items: Sequence[InFlight[Any]], ttl: float
    ) -> list[ClaimResult]:
        """Claim the keys of ``items`` in one call; a Claimed result is kept on its item.

        With a store that keeps epochs, the keys are claimed in the namespace of the current
        epoch (see :mod:`reliable_sub.dedup._epochs`)."""
        assert self.store is not None
        if self._epochs is not None:
            namespace = await self._epochs.namespace(namespace)
        keys = [DedupKey(namespace, item.delivery.message.idempotency_key) for item in items]
        results = await self.store.claim_many(keys, ttl)
        for item, result in zip(items, results, strict=True):
            if isinstance(result, Claimed):
                item.claim = result
                item.failures = result.failures
        return results

    async def refresh(self, item: InFlight[Any], ttl: float) -> ClaimResult:
        """Re-claim ``item``'s key under its own token (it waited long to start)."""
        assert self.store is not None and item.claim is not None
        [result] = await self.store.claim_many([item.claim.key], ttl, [item.claim.token])
        if isinstance(result, Claimed):
            item.claim = result
            item.failures = result.failures
        else:
            item.claim = None
        return result

    async def renew(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        """Extend running handlers' claims (the lease manager's tick); returns those lost."""
        assert self.store is not None
        return await self.store.renew(claims, lease_ttl)

    async def complete_many(self, completions: Sequence[Completion]) -> list[Claimed]:
        """Record results before their acks (the settler); returns the refused claims."""
        assert self.store is not None
        return await self.store.complete_many(completions, self.retention)

    async def release_many(self, claims: Sequence[Claimed]) -> None:
        """End claims before their nacks (the settler), keeping failure counts."""
        assert self.store is not None
        await self.store.release_many(claims, self.retention)

    def failures_without_store(self, namespace: str, item: InFlight[Any]) -> int:
        """The failures this process counted for ``item``'s message (no store)."""
        return self.failure_counts.get((namespace, item.delivery.message.id), 0)

    def record_failure(self, namespace: str, item: InFlight[Any]) -> int:
        """Count one more handler failure of ``item``'s message; returns the new count.

        With a store the count travels in the claim (renewals and the release write it);
        without one it is remembered here.
        """
        item.failures += 1
        if item.claim is not None:
            item.claim = dataclasses.replace(item.claim, failures=item.failures)
        elif self.store is None:
            key = (namespace, item.delivery.message.id)
            self.failure_counts[key] = item.failures
            self.failure_counts.move_to_end(key)
            if len(self.failure_counts) > FAILURE_MEMORY:
                self.failure_counts.popitem(last=False)
        return item.failures

    def set_failures(self, namespace: str, item: InFlight[Any], failures: int) -> None:
        """Record that ``item``'s message has failed ``failures`` times (one more, usually)."""
        while item.failures < failures:
            self.record_failure(namespace, item)

    def forget(self, namespace: str, item: InFlight[Any]) -> None:
        """The message is done with (acked or dead-lettered): drop its in-memory count."""
        if self.store is None and self.failure_counts:
            self.failure_counts.pop((namespace, item.delivery.message.id), None)

    def completion(self, item: InFlight[Any], result_json: str) -> Completion | None:
        """What to record for ``item`` when its handler succeeded (None without a claim)."""
        return Completion(item.claim, result_json) if item.claim is not None else None

    def drop(self, item: InFlight[Any]) -> None:
        """End ``item``'s claim with nothing to write: its completion committed with its
        handler's transaction, or a peer took the key over."""
        item.claim, item.claim_active = None, False

    def release(self, item: InFlight[Any]) -> Claimed | None:
        """The claim to release for ``item`` (with its failure count), dropping it from the
        item so it is released once."""
        claim, item.claim = item.claim, None
        item.claim_active = False
        return claim

    def release_dead_lettered(self, item: InFlight[Any]) -> Claimed | None:
        """The claim to release for a dead-lettered ``item``: with no failures, so its record
        goes (the dead-letter copy carries the count) and a replay from the dead-letter queue,
        under the same idempotency key, starts with fresh attempts."""
        claim = self.release(item)
        return dataclasses.replace(claim, failures=0) if claim is not None else None
