"""Replaying a subscription's messages, and what the dedup store does with them.

:func:`seek` moves a subscription back to a time or a snapshot (the adapter's
:class:`~reliable_sub.ports.Seekable` capability) and says, explicitly, what happens to replayed
messages whose effects the dedup store has recorded:

* ``ReplayMode.SKIP_PROCESSED`` (the default): they are skipped as duplicates, so the replay only
  fills gaps -- the messages that were acked without being processed (a bad deploy that acked
  what it should not have), or lost.
* ``ReplayMode.REPROCESS``: the replayed range runs again. The subscription's dedup namespace
  starts a new epoch (:mod:`reliable_sub.dedup._epochs`) before the seek, so records of
  earlier epochs no longer match. Every message delivered after that runs once more, including
  a redelivery of one that was being handled when the replay began.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass
from datetime import datetime

from .dedup._epochs import EPOCH_SETTLE
from .errors import ConfigurationError, UnknownSnapshotError
from .ports import Consumer, DedupEpochs, DedupStore, Seekable

logger = logging.getLogger(__name__)


class ReplayMode(str, enum.Enum):
    """What a replay does with messages the dedup store has recorded as processed."""

    SKIP_PROCESSED = "skip-processed"
    REPROCESS = "reprocess"


@dataclass(frozen=True)
class SeekResult:
    """What :func:`seek` did.

    Attributes:
        subscription: the subscription sought.
        mode: the replay mode.
        epoch: the dedup epoch replayed messages are claimed in (None: the store was not asked).
    """

    subscription: str
    mode: ReplayMode
    epoch: int | None


async def seek(
    adapter: Consumer,
    subscription: str,
    *,
    to: datetime | None = None,
    snapshot: str | None = None,
    mode: ReplayMode | str = ReplayMode.SKIP_PROCESSED,
    dedup: DedupStore | None = None,
    namespace: str | None = None,
    settle: float = EPOCH_SETTLE,
) -> SeekResult:
    """Seek ``subscription`` to a time (timezone-aware) or to a snapshot, in a replay ``mode``.

    Args:
        adapter: an adapter with the seek capability.
        to: messages published before it count as acknowledged, those after as not.
        snapshot: the name of a snapshot taken with ``adapter.create_snapshot``.
        mode: ``"skip-processed"`` (default) or ``"reprocess"`` (see the module docstring).
        dedup: the subscription's dedup store; ``"reprocess"`` needs one that keeps epochs.
        namespace: the dedup namespace the Subscriber uses for ``subscription`` (default:
            ``adapter.dedup_namespace(subscription)``; pass the handler's ``namespace=`` if it
            set one).
        settle: seconds between starting the epoch and seeking, so that running consumers see
            the new epoch before a replayed message reaches them.

    Raises:
        ConfigurationError: the adapter cannot seek, the mode is unknown, both or neither of
            ``to`` and ``snapshot`` are given, ``to`` is naive, or ``"reprocess"`` lacks a
            store that keeps epochs.
        UnknownSubscriptionError, UnknownSnapshotError: a name the broker does not know.
    """
    replay = _mode(mode)
    if not isinstance(adapter, Seekable) or not adapter.capabilities.seek:
        raise ConfigurationError(
            f"{type(adapter).__name__} cannot seek (Capabilities.seek is false)")
    check_target(to, snapshot)
    epoch: int | None = None
    if replay is ReplayMode.REPROCESS:
        if dedup is None or not isinstance(dedup, DedupEpochs):
            raise ConfigurationError(
                'seek(mode="reprocess") needs the dedup store the consumers use, one that keeps '
                f"epochs (MemoryDedupStore, RedisDedupStore, SqlDedupStore); got {dedup!r}")
        # an unknown name must fail before the epoch changes: a new epoch with no replay would
        # let every later redelivery of a processed message run again
        await adapter.subscription_topic(subscription)
        if snapshot is not None:
            await _check_snapshot(adapter, subscription, snapshot)
        epoch = await dedup.next_epoch(namespace or adapter.dedup_namespace(subscription))
        try:
            await asyncio.sleep(settle)
            await adapter.seek(subscription, to=to, snapshot=snapshot)
        except BaseException:
            logger.error(
                "the seek of %r failed after its dedup epoch %d began: records of messages "
                "processed before no longer match, so their redeliveries run again; seek again "
                "to replay what you meant to", subscription, epoch)
            raise
        return SeekResult(subscription, replay, epoch)
    await adapter.seek(subscription, to=to, snapshot=snapshot)
    return SeekResult(subscription, replay, epoch)


async def _check_snapshot(adapter: Seekable, subscription: str, snapshot: str) -> None:
    """Refuse a snapshot the broker does not have, or one taken of another subscription."""
    known = {taken.name: taken for taken in await adapter.list_snapshots()}
    if snapshot not in known:
        raise UnknownSnapshotError(f"snapshot {snapshot!r} does not exist")
    owner = known[snapshot].subscription
    if owner is not None and owner != subscription:
        raise ConfigurationError(
            f"snapshot {snapshot!r} was taken of {owner!r}, not {subscription!r}")


def check_target(to: datetime | None, snapshot: str | None) -> None:
    """Refuse a seek target that is not exactly one aware time or one snapshot name."""
    if (to is None) == (snapshot is None):
        raise ConfigurationError("seek needs exactly one of to= (a time) and snapshot= (a name)")
    if to is not None and (not isinstance(to, datetime) or to.utcoffset() is None):
        raise ConfigurationError(
            f"seek: to= must be a timezone-aware datetime (e.g. datetime.now(timezone.utc)), "
            f"got {to!r}")
    if snapshot is not None and (not isinstance(snapshot, str) or not snapshot):
        raise ConfigurationError(f"seek: snapshot= must be a non-empty name, got {snapshot!r}")


def _mode(mode: ReplayMode | str) -> ReplayMode:
    try:
        return ReplayMode(mode)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in ReplayMode)
        raise ConfigurationError(f"unknown replay mode {mode!r}; allowed: {allowed}") from None


__all__ = ["ReplayMode", "SeekResult", "check_target", "seek"]
