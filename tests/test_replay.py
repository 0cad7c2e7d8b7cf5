"""reliable_sub.replay.seek's checks, and the epoch cache's window (the suites cover the seeks
themselves on every adapter: reliable_sub/testing/adapter_suite/replay.py)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from reliable_sub import ConfigurationError, MemoryDedupStore
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.dedup._epochs import EPOCH_CHECK_INTERVAL, EpochCache
from reliable_sub.errors import UnknownSubscriptionError
from reliable_sub.ports import Capabilities
from reliable_sub.replay import ReplayMode, seek

NOW = datetime(2026, 11, 24, 12, 0, tzinfo=timezone.utc)


@pytest.fixture
def broker() -> MemoryAdapter:
    broker = MemoryAdapter()
    broker.ensure_subscription_sync("orders", "billing", retain_acked_messages=True)
    return broker


class CannotSeek:
    capabilities = Capabilities()


class StoreWithoutEpochs:
    async def claim_many(self, *args: object) -> list[object]:
        return []


async def test_an_adapter_that_cannot_seek_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="CannotSeek cannot seek"):
        await seek(CannotSeek(), "billing", to=NOW)  # type: ignore[arg-type]


@pytest.mark.parametrize(("target", "complaint"), [
    ({}, "exactly one of"),
    ({"to": NOW, "snapshot": "s"}, "exactly one of"),
    ({"to": datetime(2026, 11, 24)}, "timezone-aware"),
    ({"to": "2026-11-24"}, "timezone-aware"),
    ({"snapshot": ""}, "non-empty name"),
])
async def test_a_target_must_be_one_aware_time_or_one_snapshot(
    broker: MemoryAdapter, target: dict[str, object], complaint: str
) -> None:
    with pytest.raises(ConfigurationError, match=complaint):
        await seek(broker, "billing", **target)  # type: ignore[arg-type]


async def test_an_unknown_mode_names_the_allowed_ones(broker: MemoryAdapter) -> None:
    with pytest.raises(ConfigurationError, match="'skip-processed', 'reprocess'"):
        await seek(broker, "billing", to=NOW, mode="again")


async def test_reprocess_needs_a_store_that_keeps_epochs(broker: MemoryAdapter) -> None:
    with pytest.raises(ConfigurationError, match="keeps epochs"):
        await seek(broker, "billing", to=NOW, mode="reprocess")
    with pytest.raises(ConfigurationError, match="keeps epochs"):
        await seek(broker, "billing", to=NOW, mode="reprocess",
                   dedup=StoreWithoutEpochs())  # type: ignore[arg-type]


async def test_reprocess_of_an_unknown_subscription_changes_no_epoch(
    broker: MemoryAdapter,
) -> None:
    store = MemoryDedupStore()
    with pytest.raises(UnknownSubscriptionError):
        await seek(broker, "nope", to=NOW, mode=ReplayMode.REPROCESS, dedup=store, settle=0)
    assert await store.epoch(broker.dedup_namespace("nope")) == 0


async def test_reprocess_starts_an_epoch_in_the_subscription_s_namespace(
    broker: MemoryAdapter,
) -> None:
    store = MemoryDedupStore()
    result = await seek(broker, "billing", to=NOW, mode="reprocess", dedup=store, settle=0)
    assert (result.mode, result.epoch) == (ReplayMode.REPROCESS, 1)
    assert await store.epoch(broker.dedup_namespace("billing")) == 1
    explicit = await seek(broker, "billing", to=NOW, mode="reprocess", dedup=store,
                          namespace="billing-v2", settle=0)
    assert explicit.epoch == 1 and await store.epoch("billing-v2") == 1


async def test_a_consumer_claims_on_an_epoch_read_at_most_one_interval_ago() -> None:
    store = MemoryDedupStore()
    now = [100.0]
    cache = EpochCache(store, monotonic=lambda: now[0])
    assert await cache.namespace("ns") == "ns"

    await store.next_epoch("ns")
    now[0] += EPOCH_CHECK_INTERVAL / 2
    assert await cache.namespace("ns") == "ns", "within the interval: the epoch read before"
    now[0] += EPOCH_CHECK_INTERVAL / 2
    assert await cache.namespace("ns") == "ns~epoch-1", "one interval on: read again"


async def test_reprocess_to_an_unknown_or_foreign_snapshot_changes_no_epoch(
    broker: MemoryAdapter,
) -> None:
    from reliable_sub.errors import UnknownSnapshotError

    store = MemoryDedupStore()
    broker.ensure_subscription_sync("orders", "shipping")
    await broker.create_snapshot("shipping", "theirs")
    with pytest.raises(UnknownSnapshotError, match="typo"):
        await seek(broker, "billing", snapshot="typo", mode="reprocess", dedup=store, settle=0)
    with pytest.raises(ConfigurationError, match="taken of 'shipping'"):
        await seek(broker, "billing", snapshot="theirs", mode="reprocess", dedup=store,
                   settle=0)
    assert await store.epoch(broker.dedup_namespace("billing")) == 0
