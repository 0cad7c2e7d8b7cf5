from __future__ import annotations

import asyncio

import pytest

from reliable_sub import Claimed, Completed, InProgress, MemoryDedupStore
from reliable_sub.clock import ManualClock
from reliable_sub.dedup import DedupStore, scoped_key
from reliable_sub.errors import ResultNotSerializableError


def test_memory_store_satisfies_the_protocol() -> None:
    assert isinstance(MemoryDedupStore(), DedupStore)


async def test_claim_complete_and_duplicate() -> None:
    clock = ManualClock()
    store = MemoryDedupStore(clock=clock)
    assert await store.claim("k", 10) == Claimed()
    assert isinstance(await store.claim("k", 10), InProgress)
    await store.complete("k", {"charged": 10, "currency": "EUR"}, ttl=3600)
    assert await store.claim("k", 10) == Completed({"charged": 10, "currency": "EUR"})
    clock.advance(3601)
    assert await store.claim("k", 10) == Claimed(), "retention over: the key is new again"


async def test_an_in_progress_claim_expires_so_a_crashed_handler_can_run_again() -> None:
    clock = ManualClock()
    store = MemoryDedupStore(clock=clock)
    await store.claim("k", 10)
    clock.advance(9)
    result = await store.claim("k", 10)
    assert isinstance(result, InProgress) and result.expires_in == pytest.approx(1)
    clock.advance(1)
    assert await store.claim("k", 10) == Claimed()


async def test_concurrent_claims_have_exactly_one_winner() -> None:
    store = MemoryDedupStore()
    results = await asyncio.gather(*(store.claim("k", 30) for _ in range(200)))
    assert sum(isinstance(r, Claimed) for r in results) == 1

    def claim_in_thread() -> object:
        return store.claim_sync("t", 30)

    threaded = await asyncio.gather(*(asyncio.to_thread(claim_in_thread) for _ in range(50)))
    assert sum(isinstance(r, Claimed) for r in threaded) == 1


async def test_release_and_renew_only_touch_this_owners_claims() -> None:
    clock = ManualClock()
    mine = MemoryDedupStore(clock=clock, owner="me")
    await mine.claim("k", 10)
    other = MemoryDedupStore(clock=clock, owner="peer")
    other._records = mine._records  # two owners over one shared table, as on Redis
    other._lock = mine._lock
    assert await other.release("k") is False
    assert await other.renew(["k"], 100) == ["k"]
    assert await mine.renew(["k", "unknown"], 100) == ["unknown"]
    clock.advance(50)
    assert isinstance(await other.claim("k", 10), InProgress)
    assert await mine.release("k") is True
    assert await other.claim("k", 10) == Claimed()


async def test_results_are_json_never_pickle() -> None:
    store = MemoryDedupStore()
    await store.claim("k", 10)
    with pytest.raises(ResultNotSerializableError, match="object"):
        await store.complete("k", object(), ttl=10)
    with pytest.raises(ResultNotSerializableError):
        await store.complete("k", float("nan"), ttl=10)
    await store.complete("k", [1, "two", None], ttl=10)
    assert store._records["k"][2] == '[1,"two",null]'
    assert await store.claim("k", 10) == Completed([1, "two", None])


async def test_batch_claims_and_completions() -> None:
    store = MemoryDedupStore()
    await store.complete("done", {"n": 1}, ttl=60)
    await store.claim("busy", 30)
    results = await store.claim_many(["new", "done", "busy", "new"], 30)
    assert results[0] == Claimed()
    assert results[1] == Completed({"n": 1})
    assert isinstance(results[2], InProgress) and isinstance(results[3], InProgress)
    await store.complete_many([("new", '"ok"'), ("busy", "null")], ttl=60)
    assert await store.claim_many(["new", "busy"], 30) == [Completed("ok"), Completed(None)]


def test_scoped_keys_keep_subscriptions_apart() -> None:
    assert scoped_key("billing", "42") != scoped_key("shipping", "42")
    assert scoped_key("a", "b:c") != scoped_key("a:b", "c")


def test_expired_records_are_swept() -> None:
    clock = ManualClock()
    store = MemoryDedupStore(clock=clock)
    for i in range(5000):
        store.claim_sync(f"k{i}", 1)
    clock.advance(2)
    for i in range(5000):
        store.claim_sync(f"n{i}", 100)
    assert len(store._records) < 10_000
    assert len(store) == 5000
