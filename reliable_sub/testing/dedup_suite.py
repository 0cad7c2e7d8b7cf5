"""The dedup-store conformance suite: the store contract, checked the same way on every store.

Write a test class that derives from :class:`DedupStoreSuite` and returns a :class:`StoreHarness`
from ``make_stores``: the store under test, a *peer* (a second instance, another owner, over the
same records, as a second consumer process would have), a short TTL, how to wait until a
record has lapsed, and (``another``) how to make further instances over the same records with a
given owner. Helpers here build harnesses for the memory, Redis and SQL stores.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import pytest_asyncio

from reliable_sub import (
    Claimed,
    Completed,
    Completion,
    DedupKey,
    DedupStore,
    InProgress,
    ManualClock,
    MemoryDedupStore,
    ResultNotSerializableError,
    StoredResultError,
)
from reliable_sub.dedup import encode_result
from reliable_sub.dedup._epochs import epoch_namespace
from reliable_sub.ports import ClaimResult, DedupEpochs
from reliable_sub.testing import dedup_owners
from reliable_sub.testing.dedup_harness import StoreHarness

POLL = 0.01


def memory_stores() -> StoreHarness:
    clock = ManualClock()
    store = MemoryDedupStore(clock=clock, owner="me")

    def another(owner: str) -> DedupStore:
        made = MemoryDedupStore(clock=clock, owner=owner)
        made._records = store._records  # one process's memory, two instances
        made._epochs = store._epochs
        made._lock = store._lock
        return made

    peer = another("peer")

    async def gone(key: DedupKey) -> None:
        clock.advance(1.0)

    async def write_raw(key: DedupKey, text: str) -> None:
        store.write_raw(key, text, 60)

    async def cleanup() -> None:
        pass

    return StoreHarness("memory", store, peer, 0.5, gone, write_raw, cleanup, another=another)


def redis_stores(url: str | None = None, client_factory: Callable[[], object] | None = None,
                  name: str = "redis") -> StoreHarness:

    from reliable_sub.dedup import RedisDedupStore

    prefix = f"test-contract-{uuid.uuid4().hex[:10]}"
    made: list[RedisDedupStore] = []

    def another(owner: str) -> RedisDedupStore:
        source = client_factory() if client_factory else url
        made.append(RedisDedupStore(source, prefix=prefix, owner=owner))  # type: ignore[arg-type]
        return made[-1]

    store, peer = another("me"), another("peer")

    async def gone(key: DedupKey) -> None:
        give_up = time.monotonic() + 5
        while await store.client.exists(store.redis_key(key)):
            assert time.monotonic() < give_up, f"{key} never expired"
            await asyncio.sleep(POLL)

    async def write_raw(key: DedupKey, text: str) -> None:
        await store.client.set(store.redis_key(key), text.encode("utf-8", "surrogatepass"),
                               px=60_000)

    async def cleanup() -> None:
        client = store.client
        keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
        for instance in made:
            await instance.close()

    return StoreHarness(name, store, peer, 0.15, gone, write_raw, cleanup, another=another)


def sql_stores(url: str, name: str = "sql") -> StoreHarness:
    """Two SqlDedupStores over one fresh table on ``url``, on a shared ManualClock."""
    from reliable_sub.dedup import SqlDedupStore

    clock = ManualClock(start=1000.0)
    table = f"test_processed_{uuid.uuid4().hex[:10]}"
    store = SqlDedupStore(url, table=table, owner="me", clock=clock)
    made = [store]

    def another(owner: str) -> SqlDedupStore:
        made.append(SqlDedupStore(store.url, table=table, owner=owner, clock=clock))
        return made[-1]

    peer = another("peer")

    async def gone(key: DedupKey) -> None:
        clock.advance(1.0)

    async def write_raw(key: DedupKey, text: str) -> None:
        await store.write_raw(key, text, 60)

    async def cleanup() -> None:
        async with store.engine.begin() as connection:
            await connection.run_sync(store.metadata.drop_all)
        for instance in made:
            await instance.close()

    return StoreHarness(name, store, peer, 0.5, gone, write_raw, cleanup,
                        prepare=store.create_schema, another=another)


def fakeredis_stores() -> StoreHarness:
    import fakeredis

    server = fakeredis.FakeServer()
    return redis_stores(client_factory=lambda: fakeredis.FakeAsyncRedis(server=server),
                         name="fakeredis")


K = DedupKey("orders", "order-1")


async def test_the_store_satisfies_the_protocol(stores: StoreHarness) -> None:
    assert isinstance(stores.store, DedupStore)


async def test_claim_then_in_progress_then_completed(stores: StoreHarness) -> None:
    claim = await stores.store.claim(K, 30)
    assert isinstance(claim, Claimed) and claim.key == K and claim.failures == 0
    assert claim.token.startswith("me.")
    busy = await stores.peer.claim(K, 30)
    assert isinstance(busy, InProgress) and 0 < busy.expires_in <= 30 and busy.failures == 0

    result = {"charged": 10, "items": [1, "two", None, {"ok": True, "ratio": 0.5}]}
    assert await stores.store.complete(claim, result, ttl=3600) is True
    done = await stores.peer.claim(K, 30)
    assert isinstance(done, Completed) and done.result == result


async def test_claim_many_reports_every_state_in_order(stores: StoreHarness) -> None:
    done, busy = DedupKey("s", "done"), DedupKey("s", "busy")
    new, other = DedupKey("s", "new"), DedupKey("s", "other")
    first = await stores.store.claim(done, 30)
    assert isinstance(first, Claimed)
    await stores.store.complete(first, {"n": 1}, ttl=60)
    assert isinstance(await stores.peer.claim(busy, 30), Claimed)

    results = await stores.store.claim_many([new, done, busy, new, other], 30)
    assert isinstance(results[0], Claimed) and results[0].key == new
    assert isinstance(results[1], Completed) and results[1].result == {"n": 1}
    assert isinstance(results[2], InProgress)
    assert isinstance(results[3], InProgress), "a key repeated in one batch is claimed once"
    assert isinstance(results[4], Claimed)
    assert len({r.token for r in results if isinstance(r, Claimed)}) == 2
    assert await stores.store.claim_many([], 30) == []


async def test_a_lapsed_claim_can_be_taken_and_the_old_holder_is_fenced(
    stores: StoreHarness,
) -> None:
    stale = await stores.store.claim(K, stores.short_ttl)  # a consumer that then stalls
    assert isinstance(stale, Claimed)
    await stores.wait_until_gone(K)
    fresh = await stores.peer.claim(K, 30)
    assert isinstance(fresh, Claimed) and fresh.token != stale.token

    assert await stores.store.renew([stale], 30) == [stale], "a stale renew must not extend"
    assert await stores.store.complete_many([Completion(stale, '"stale"')], 60) == [stale]
    await stores.store.release_many([stale], 60)
    again = await stores.store.claim(K, 30)
    assert isinstance(again, InProgress), "the stale holder changed nothing"

    assert await stores.peer.complete(fresh, "fresh", 60) is True
    result = await stores.store.claim(K, 30)
    assert isinstance(result, Completed) and result.result == "fresh"


async def test_a_lapsed_claim_nobody_took_still_records_its_completion(
    stores: StoreHarness,
) -> None:
    claim = await stores.store.claim(K, stores.short_ttl)
    assert isinstance(claim, Claimed)
    await stores.wait_until_gone(K)
    assert await stores.store.complete(claim, "late but done", 60) is True
    result = await stores.peer.claim(K, 30)
    assert isinstance(result, Completed) and result.result == "late but done"


async def test_a_completed_record_is_never_overwritten(stores: StoreHarness) -> None:
    claim = await stores.store.claim(K, 30)
    assert isinstance(claim, Claimed)
    assert await stores.store.complete(claim, "first", 60) is True
    assert await stores.store.complete(claim, "second", 60) is True, "a fact, recorded already"
    assert await stores.store.renew([claim], 30) == [claim], "a completed record is no claim"
    await stores.store.release(claim, 60)
    result = await stores.peer.claim(K, 30)
    assert isinstance(result, Completed) and result.result == "first"


async def test_failures_survive_release_and_travel_with_renewals(stores: StoreHarness) -> None:
    claim = await stores.store.claim(K, 30)
    assert isinstance(claim, Claimed)
    await stores.store.release(Claimed(K, claim.token, failures=2), retention=60)
    again = await stores.peer.claim(K, 30)
    assert isinstance(again, Claimed) and again.failures == 2, "the count outlives the claim"
    assert await stores.peer.renew([Claimed(K, again.token, failures=3)], 30) == []
    busy = await stores.store.claim(K, 30)
    assert isinstance(busy, InProgress) and busy.failures == 3, "peers see the running count"
    await stores.peer.release(Claimed(K, again.token, failures=0), retention=60)
    fresh = await stores.store.claim(K, 30)
    assert isinstance(fresh, Claimed) and fresh.failures == 0, "no failures: forgotten"


async def test_reclaiming_with_the_same_token_is_idempotent(stores: StoreHarness) -> None:
    [claim] = await stores.store.claim_many([K], 30)
    assert isinstance(claim, Claimed)
    [again] = await stores.store.claim_many([K], 30, [claim.token])
    assert again == claim, "a retried claim call finds its own claim"
    [other] = await stores.store.claim_many([K], 30, ["someone-else.1"])
    assert isinstance(other, InProgress)


async def test_release_and_renew_only_touch_the_holders_claim(stores: StoreHarness) -> None:
    claim = await stores.store.claim(K, 30)
    assert isinstance(claim, Claimed)
    impostor = Claimed(K, "peer.999")
    await stores.peer.release(impostor, 60)
    assert await stores.peer.renew([impostor], 30) == [impostor]
    assert isinstance(await stores.peer.claim(K, 30), InProgress)
    unknown = Claimed(DedupKey("s", "never-claimed"), "me.424242")
    assert await stores.store.renew([claim, unknown], 30) == [unknown]
    assert isinstance(await stores.store.claim(unknown.key, 30), Claimed), "renew never creates"
    await stores.store.release(claim, 60)
    assert isinstance(await stores.peer.claim(K, 30), Claimed)


async def test_an_unreadable_stored_result_never_fails_a_claim(stores: StoreHarness) -> None:
    bad, good = DedupKey("s", "bad"), DedupKey("s", "good")
    await stores.write_raw(bad, "c:not json {")
    results = await stores.store.claim_many([bad, good], 30)
    assert isinstance(results[0], Completed) and isinstance(results[1], Claimed)
    with pytest.raises(StoredResultError, match="not valid JSON"):
        _ = results[0].result


async def test_only_json_text_is_stored_never_pickle(stores: StoreHarness) -> None:
    claim = await stores.store.claim(K, 30)
    assert isinstance(claim, Claimed)
    with pytest.raises(ResultNotSerializableError, match="object"):
        await stores.store.complete(claim, object(), ttl=60)
    with pytest.raises(ResultNotSerializableError):
        await stores.store.complete(claim, float("nan"), ttl=60)
    nested: list[object] = []
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(ResultNotSerializableError, match="nested too deeply"):
        await stores.store.complete(claim, nested, ttl=60)
    with pytest.raises(ResultNotSerializableError, match="not valid JSON"):
        await stores.store.complete_many([Completion(claim, "{oops")], 60)
    assert isinstance(await stores.peer.claim(K, 30), InProgress), "a refused result stores nothing"


async def test_namespaces_and_keys_never_collide(stores: StoreHarness) -> None:
    keys = [
        DedupKey("a\x1fb", "c"), DedupKey("a", "b\x1fc"), DedupKey("a:b", "c"),
        DedupKey("a", "b:c"), DedupKey("", "k"), DedupKey("_", "k"), DedupKey("a}:{b", "x"),
        DedupKey("a", "{b}:x"), DedupKey("n", "x" * 1000), DedupKey("n", "x" * 999 + "y"),
        DedupKey("n", "ünïcødé 🔑"), DedupKey("n", "\x00\x01binary\xff"), DedupKey("n", ""),
    ]
    claims = await stores.store.claim_many(keys, 30)
    assert all(isinstance(c, Claimed) for c in claims), "two keys share a record"
    await stores.store.complete_many(
        [Completion(c, encode_result(i)) for i, c in enumerate(claims) if isinstance(c, Claimed)],
        60,
    )
    results = await stores.peer.claim_many(keys, 30)
    assert [r.result for r in results if isinstance(r, Completed)] == list(range(len(keys)))


async def test_concurrent_claims_have_exactly_one_winner(stores: StoreHarness) -> None:
    results = await asyncio.gather(
        *(store.claim(K, 30) for store in [stores.store, stores.peer] * 100)
    )
    assert sum(isinstance(r, Claimed) for r in results) == 1
    assert sum(isinstance(r, InProgress) for r in results) == 199


async def test_claims_from_many_threads_have_exactly_one_winner(stores: StoreHarness) -> None:
    """Each thread runs its own event loop (as sync callers and worker threads do): eight
    loops contend at once, each with its claims one after another (one connection per loop: a
    SQL store's pools are per loop, and five claims at once in each of eight loops held 40 of
    a PostgreSQL server's connections)."""
    key = DedupKey("threads", uuid.uuid4().hex)

    async def contend(store: DedupStore) -> list[ClaimResult]:
        try:
            return [await store.claim(key, 30) for _ in range(5)]
        finally:
            close = getattr(store, "close", None)
            if close is not None:
                await close()  # this loop's connections

    def in_thread(index: int) -> list[ClaimResult]:
        return asyncio.run(contend(stores.store if index % 2 else stores.peer))

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = [r for rs in await asyncio.to_thread(lambda: list(pool.map(in_thread, range(8))))
                   for r in rs]
    assert sum(isinstance(r, Claimed) for r in results) == 1, results
    assert sum(isinstance(r, InProgress) for r in results) == len(results) - 1


async def test_durations_must_be_positive(stores: StoreHarness) -> None:
    from reliable_sub import ConfigurationError

    with pytest.raises(ConfigurationError, match="lease_ttl"):
        await stores.store.claim(K, 0)
    claim = Claimed(K, "me.1")
    with pytest.raises(ConfigurationError, match="ttl"):
        await stores.store.complete(claim, None, ttl=-1)


async def test_a_new_epoch_leaves_the_records_of_earlier_ones_behind(
    stores: StoreHarness,
) -> None:
    store, peer = stores.store, stores.peer
    if not isinstance(store, DedupEpochs) or not isinstance(peer, DedupEpochs):
        pytest.skip(f"{stores.name} keeps no epochs")
    namespace = f"epochs-{uuid.uuid4().hex}"
    key = DedupKey(namespace, "order-1")
    assert await store.epoch(namespace) == 0
    [claim] = await store.claim_many([key], 30)
    assert isinstance(claim, Claimed)
    assert await store.complete(claim, {"charged": 1}, ttl=60)

    assert await peer.next_epoch(namespace) == 1
    assert await store.epoch(namespace) == 1, "every store instance sees the new epoch"
    assert await store.epoch(f"{namespace}-other") == 0, "other namespaces keep theirs"
    [fresh] = await store.claim_many([DedupKey(epoch_namespace(namespace, 1), "order-1")], 30)
    assert isinstance(fresh, Claimed), "the new epoch's namespace has no record of the key"
    [old] = await store.claim_many([key], 30)
    assert isinstance(old, Completed), "the old epoch's records are left as they were"

    bumps = await asyncio.gather(*(s.next_epoch(namespace) for s in [store, peer] * 5))
    assert sorted(bumps) == list(range(2, 12)), "each next_epoch is atomic"


class DedupStoreSuite:
    """Every dedup-store contract test, run against the stores :meth:`make_stores` returns."""

    pytestmark = [pytest.mark.asyncio]

    def make_stores(self) -> StoreHarness:
        """The store under test and its peer (override)."""
        raise NotImplementedError(f"{type(self).__name__} must define make_stores()")

    @pytest_asyncio.fixture
    async def stores(self) -> AsyncIterator[StoreHarness]:
        harness = self.make_stores()
        if harness.prepare is not None:
            await harness.prepare()
        try:
            yield harness
        finally:
            await harness.cleanup()


for _name, _test in [*globals().items(), *vars(dedup_owners).items()]:
    if _name.startswith("test_") and callable(_test):
        setattr(DedupStoreSuite, _name, staticmethod(_test))


__all__ = [
    "DedupStoreSuite",
    "fakeredis_stores",
    "memory_stores",
    "redis_stores",
    "sql_stores",
    "test_a_completed_record_is_never_overwritten",
    "test_a_lapsed_claim_can_be_taken_and_the_old_holder_is_fenced",
    "test_a_lapsed_claim_nobody_took_still_records_its_completion",
    "test_a_new_epoch_leaves_the_records_of_earlier_ones_behind",
    "test_an_unreadable_stored_result_never_fails_a_claim",
    "test_claim_many_reports_every_state_in_order",
    "test_claim_then_in_progress_then_completed",
    "test_claims_from_many_threads_have_exactly_one_winner",
    "test_concurrent_claims_have_exactly_one_winner",
    "test_durations_must_be_positive",
    "test_failures_survive_release_and_travel_with_renewals",
    "test_namespaces_and_keys_never_collide",
    "test_only_json_text_is_stored_never_pickle",
    "test_reclaiming_with_the_same_token_is_idempotent",
    "test_release_and_renew_only_touch_the_holders_claim",
    "test_the_store_satisfies_the_protocol",
]
