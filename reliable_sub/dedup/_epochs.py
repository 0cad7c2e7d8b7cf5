"""Dedup epochs: how a replay makes already processed messages run again.

A store with the :class:`~reliable_sub.ports.DedupEpochs` capability keeps an epoch number per
namespace. The Subscriber claims a subscription's keys in :func:`epoch_namespace` of the current
epoch, so when an operator starts a new epoch (``reliable_sub.replay.seek(...,
mode="reprocess")``) the records of earlier epochs no longer match and every message delivered
from then on runs again.

Consumers read the epoch at most :data:`EPOCH_CHECK_INTERVAL` seconds before each claim (one
store read per interval and subscription, not one per message). A replay therefore starts the
new epoch, waits :data:`EPOCH_SETTLE` seconds, and only then seeks: every claim of a replayed
message is made after a read that began after the new epoch was written.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..ports import DedupEpochs

# Seconds a consumer may claim on an epoch it read earlier.
EPOCH_CHECK_INTERVAL = 1.0
# Seconds a replay waits between starting an epoch and seeking: the interval, and a margin for
# a read in flight when the epoch changed.
EPOCH_SETTLE = 2 * EPOCH_CHECK_INTERVAL


def epoch_namespace(namespace: str, epoch: int) -> str:
    """The namespace records of ``namespace`` are kept under in ``epoch`` (epoch 0: itself, so
    records written before any replay keep matching)."""
    return namespace if epoch == 0 else f"{namespace}~epoch-{epoch}"


class EpochCache:
    """The current epoch of each namespace, read from the store at most every ``interval``.

    A read's age is counted from when it was *sent*, so a claim never uses an epoch read before
    a change it could have missed by more than ``interval``.
    """

    def __init__(
        self,
        store: DedupEpochs,
        interval: float = EPOCH_CHECK_INTERVAL,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._interval = interval
        self._monotonic = monotonic
        self._read: dict[str, tuple[float, int]] = {}

    async def namespace(self, base: str) -> str:
        """The namespace to claim ``base``'s keys in now."""
        now = self._monotonic()
        known = self._read.get(base)
        if known is None or now - known[0] >= self._interval:
            epoch = await self._store.epoch(base)
            known = self._read[base] = (now, epoch)
        return epoch_namespace(base, known[1])
