"""The blocking twins of the dedup stores (SyncDedupStore): claim_many_sync, renew_sync,
complete_many_sync and release_many_sync, on MemoryDedupStore and RedisDedupStore (real Redis).

They keep the store contract of their async methods (reliable_sub.testing.dedup_suite); these
tests check it on the twins, and that both kinds of method see the same records. Each test gets
the shipped harness: the store, a peer (another owner over the same records) and a way to wait
until a short lease has lapsed (a ManualClock for memory, polling with a deadline for Redis).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pytest
import pytest_asyncio

from reliable_sub import (
    Claimed,
    Completed,
    Completion,
    ConfigurationError,
    DedupKey,
    InProgress,
    ResultNotSerializableError,
)
from reliable_sub.dedup import encode_result
from reliable_sub.ports import ClaimResult, SyncDedupStore
from reliable_sub.testing import StoreHarness, memory_stores, redis_stores
from reliable_sub.testing.services import redis_url

K = DedupKey("orders", "order-1")


class Twins:
    """A harness whose store and peer are also SyncDedupStores."""

    def __init__(self, harness: StoreHarness) -> None:
        assert isinstance(harness.store, SyncDedupStore)
        assert isinstance(harness.peer, SyncDedupStore)
        self.harness = harness
        self.name = harness.name
        self.store: SyncDedupStore = harness.store
        self.peer: SyncDedupStore = harness.peer
        self.short_ttl = harness.short_ttl

    def claim(self, store: SyncDedupStore, key: DedupKey, lease_ttl: float = 30) -> ClaimResult:
        [result] = store.claim_many_sync([key], lease_ttl)
        return result

    def complete(self, store: SyncDedupStore, claim: Claimed, result: Any,
                 ttl: float = 60) -> list[Claimed]:
        return store.complete_many_sync([Completion(claim, encode_result(result))], ttl)


async def _twins(harness: StoreHarness) -> AsyncIterator[Twins]:
    try:
        yield Twins(harness)
    finally:
        for store in (harness.store, harness.peer):
            close_sync = getattr(store, "close_sync", None)
            if close_sync is not None:
                close_sync()
        await harness.cleanup()


@pytest_asyncio.fixture(params=["memory", "redis"])
async def twins(request: pytest.FixtureRequest) -> AsyncIterator[Twins]:
    harness = memory_stores() if request.param == "memory" else redis_stores(redis_url())
    async for made in _twins(harness):
        yield made


@pytest_asyncio.fixture
async def redis_twins() -> AsyncIterator[Twins]:
    async for made in _twins(redis_stores(redis_url())):
        yield made


async def test_claim_then_in_progress_for_a_peer_then_completed(twins: Twins) -> None:
    claim = twins.claim(twins.store, K)
    assert isinstance(claim, Claimed) and claim.key == K and claim.failures == 0
    assert claim.token.startswith("me.")
    busy = twins.claim(twins.peer, K)
    assert isinstance(busy, InProgress) and 0 < busy.expires_in <= 30 and busy.failures == 0

    result = {"charged": 10, "items": [1, "two", None, {"ok": True, "ratio": 0.5}]}
    assert twins.complete(twins.store, claim, result) == []
    done = twins.claim(twins.peer, K)
    assert isinstance(done, Completed) and done.result == result and done.key == K
    assert twins.complete(twins.store, claim, "second") == [], "a fact, recorded already"
    again = twins.claim(twins.store, K)
    assert isinstance(again, Completed) and again.result == result, "never overwritten"


async def test_claim_many_sync_reports_every_state_in_order(twins: Twins) -> None:
    done, busy = DedupKey("s", "done"), DedupKey("s", "busy")
    new, other = DedupKey("s", "new"), DedupKey("s", "other")
    first = twins.claim(twins.store, done)
    assert isinstance(first, Claimed)
    twins.complete(twins.store, first, {"n": 1})
    assert isinstance(twins.claim(twins.peer, busy), Claimed)

    results = twins.store.claim_many_sync([new, done, busy, new, other], 30)
    assert isinstance(results[0], Claimed) and results[0].key == new
    assert isinstance(results[1], Completed) and results[1].result == {"n": 1}
    assert isinstance(results[2], InProgress)
    assert isinstance(results[3], InProgress), "a key repeated in one batch is claimed once"
    assert isinstance(results[4], Claimed)
    assert len({r.token for r in results if isinstance(r, Claimed)}) == 2
    assert twins.store.claim_many_sync([], 30) == []


async def test_reclaiming_with_the_same_token_is_idempotent(twins: Twins) -> None:
    [claim] = twins.store.claim_many_sync([K], 30)
    assert isinstance(claim, Claimed)
    [again] = twins.store.claim_many_sync([K], 30, [claim.token])
    assert again == claim, "a retried claim call finds its own claim"
    [other] = twins.store.claim_many_sync([K], 30, ["someone-else.1"])
    assert isinstance(other, InProgress)


async def test_renew_extends_the_lease_and_keeps_the_failure_count(twins: Twins) -> None:
    timer = DedupKey("s", "lapses")  # claimed with the short lease, unrenewed: a timer
    claim, lapsing = twins.store.claim_many_sync([K, timer], twins.short_ttl)
    assert isinstance(claim, Claimed) and isinstance(lapsing, Claimed)
    assert twins.store.renew_sync([Claimed(K, claim.token, failures=3)], 30) == []
    busy = twins.claim(twins.peer, K)
    assert isinstance(busy, InProgress)
    assert busy.expires_in > 1, "renewed to the new lease, far past the short one"
    assert busy.failures == 3, "peers see the running count"
    await twins.harness.wait_until_gone(timer)  # the short lease has passed
    assert isinstance(twins.claim(twins.peer, timer), Claimed)
    assert isinstance(twins.claim(twins.peer, K), InProgress), "still held"
    assert twins.store.renew_sync([], 30) == []


async def test_renew_reports_the_claims_no_longer_held_and_touches_nothing(
    twins: Twins,
) -> None:
    claim = twins.claim(twins.store, K)
    assert isinstance(claim, Claimed)
    impostor = Claimed(K, "peer.999")
    unknown = Claimed(DedupKey("s", "never-claimed"), "me.424242")
    assert twins.peer.renew_sync([impostor], 30) == [impostor]
    assert twins.store.renew_sync([claim, unknown, impostor], 30) == [unknown, impostor]
    assert isinstance(twins.claim(twins.store, unknown.key), Claimed), "renew never creates"

    twins.complete(twins.store, claim, "done")
    assert twins.store.renew_sync([claim], 30) == [claim], "a completed record is no claim"
    done = twins.claim(twins.peer, K)
    assert isinstance(done, Completed) and done.result == "done"


async def test_release_keeps_failures_for_the_retention_and_forgets_none(twins: Twins) -> None:
    claim = twins.claim(twins.store, K)
    assert isinstance(claim, Claimed)
    twins.store.release_many_sync([Claimed(K, claim.token, failures=2)], 60)
    again = twins.claim(twins.peer, K)
    assert isinstance(again, Claimed) and again.failures == 2, "the count outlives the claim"
    twins.peer.release_many_sync([Claimed(K, again.token, failures=0)], 60)
    fresh = twins.claim(twins.store, K)
    assert isinstance(fresh, Claimed) and fresh.failures == 0, "no failures: forgotten"

    twins.peer.release_many_sync([Claimed(K, "peer.999", failures=5)], 60)
    assert isinstance(twins.claim(twins.peer, K), InProgress), "not the holder: left alone"
    twins.store.release_many_sync([], 60)
    twins.store.release_many_sync([fresh], 60)
    assert isinstance(twins.claim(twins.peer, K), Claimed)


async def test_a_stale_holder_is_fenced_out_of_every_write(twins: Twins) -> None:
    stale = twins.claim(twins.store, K, twins.short_ttl)  # a caller that then stalls
    assert isinstance(stale, Claimed)
    await twins.harness.wait_until_gone(K)
    fresh = twins.claim(twins.peer, K)
    assert isinstance(fresh, Claimed) and fresh.token != stale.token

    assert twins.store.renew_sync([stale], 30) == [stale], "a stale renew must not extend"
    assert twins.complete(twins.store, stale, "stale") == [stale], "its completion is refused"
    twins.store.release_many_sync([stale], 60)
    assert isinstance(twins.claim(twins.store, K), InProgress), "the stale holder changed nothing"

    assert twins.complete(twins.peer, fresh, "fresh") == []
    result = twins.claim(twins.store, K)
    assert isinstance(result, Completed) and result.result == "fresh"


async def test_a_lapsed_claim_nobody_took_still_records_its_completion(twins: Twins) -> None:
    claim = twins.claim(twins.store, K, twins.short_ttl)
    assert isinstance(claim, Claimed)
    await twins.harness.wait_until_gone(K)
    assert twins.complete(twins.store, claim, "late but done") == []
    result = twins.claim(twins.peer, K)
    assert isinstance(result, Completed) and result.result == "late but done"


async def test_only_json_text_is_stored_and_durations_are_checked(twins: Twins) -> None:
    claim = twins.claim(twins.store, K)
    assert isinstance(claim, Claimed)
    with pytest.raises(ResultNotSerializableError, match="not valid JSON"):
        twins.store.complete_many_sync([Completion(claim, "{oops")], 60)
    with pytest.raises(ResultNotSerializableError, match="must be JSON text"):
        twins.store.complete_many_sync([Completion(claim, cast(str, b"[]"))], 60)
    assert isinstance(twins.claim(twins.peer, K), InProgress), "a refused result stores nothing"
    with pytest.raises(ConfigurationError, match="lease_ttl"):
        twins.store.claim_many_sync([K], 0)
    with pytest.raises(ConfigurationError, match="lease_ttl"):
        twins.store.renew_sync([claim], float("inf"))
    with pytest.raises(ConfigurationError, match="ttl"):
        twins.store.complete_many_sync([Completion(claim, "null")], -1)


async def test_sync_and_async_methods_see_each_others_records(twins: Twins) -> None:
    store = twins.harness.store  # the async face of the same store objects
    a, b = DedupKey("mixed", "a"), DedupKey("mixed", "b")

    by_async = await store.claim(a, 30)
    assert isinstance(by_async, Claimed)
    assert isinstance(twins.claim(twins.peer, a), InProgress)
    [same] = twins.store.claim_many_sync([a], 30, [by_async.token])
    assert same == by_async, "the async claim's token re-claims it through the twin"
    assert twins.store.renew_sync([by_async], 30) == []
    assert twins.complete(twins.store, by_async, {"via": "sync"}) == []
    done = await twins.harness.peer.claim(a, 30)
    assert isinstance(done, Completed) and done.result == {"via": "sync"}

    by_sync = twins.claim(twins.store, b)
    assert isinstance(by_sync, Claimed)
    assert isinstance(await twins.harness.peer.claim(b, 30), InProgress)
    assert await store.renew([by_sync], 30) == []
    await store.release_many([Claimed(b, by_sync.token, failures=1)], 60)
    again = twins.claim(twins.peer, b)
    assert isinstance(again, Claimed) and again.failures == 1
    assert await twins.harness.peer.complete(again, "async", 60) is True
    result = twins.claim(twins.store, b)
    assert isinstance(result, Completed) and result.result == "async"


async def test_namespaces_and_keys_never_collide(twins: Twins) -> None:
    keys = [
        DedupKey("a\x1fb", "c"), DedupKey("a", "b\x1fc"), DedupKey("a:b", "c"),
        DedupKey("a", "b:c"), DedupKey("", "k"), DedupKey("_", "k"), DedupKey("a}:{b", "x"),
        DedupKey("n", "x" * 1000), DedupKey("n", "ünïcødé 🔑"), DedupKey("n", ""),
    ]
    claims = twins.store.claim_many_sync(keys, 30)
    assert all(isinstance(c, Claimed) for c in claims), "two keys share a record"
    held = [c for c in claims if isinstance(c, Claimed)]
    assert twins.store.complete_many_sync(
        [Completion(c, encode_result(i)) for i, c in enumerate(held)], 60
    ) == []
    results = twins.peer.claim_many_sync(keys, 30)
    assert [r.result for r in results if isinstance(r, Completed)] == list(range(len(keys)))


async def test_claims_from_many_threads_without_a_loop_have_exactly_one_winner(
    twins: Twins,
) -> None:
    key = DedupKey("threads", uuid.uuid4().hex)
    start = threading.Barrier(8)

    def contend(index: int) -> list[ClaimResult]:
        store = twins.store if index % 2 else twins.peer
        start.wait(10)
        return [r for _ in range(5) for r in store.claim_many_sync([key], 30)]

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = [r for rs in pool.map(contend, range(8)) for r in rs]
    assert sum(isinstance(r, Claimed) for r in results) == 1, results
    assert sum(isinstance(r, InProgress) for r in results) == len(results) - 1


# -- Redis: one round trip per batch, scripts reloaded, dropped connections -------------------


class SyncRoundTrips:
    """Counts writes to sync Redis sockets: one per command, i.e. round trips."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from redis.connection import AbstractConnection

        original: Any = AbstractConnection.send_packed_command
        self.count = 0

        def counting(connection: Any, command: Any, check_health: bool = True) -> None:
            self.count += 1
            original(connection, command, check_health)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)


async def test_every_sync_batch_method_is_one_round_trip(
    redis_twins: Twins, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = redis_twins.store
    warm = DedupKey("s", "warm-up")  # open the connection and load every script
    [claim] = store.claim_many_sync([warm], 30)
    assert isinstance(claim, Claimed)
    store.renew_sync([claim], 30)
    store.release_many_sync([claim], 60)
    [claim] = store.claim_many_sync([warm], 30)
    assert isinstance(claim, Claimed)
    store.complete_many_sync([Completion(claim, "null")], 60)
    trips = SyncRoundTrips(monkeypatch)

    held = cast(Sequence[Claimed], store.claim_many_sync([DedupKey("s", f"k{i}") for i in
                                                          range(5)], 30))
    assert trips.count == 1 and all(isinstance(c, Claimed) for c in held)
    assert store.renew_sync(held, 30) == [] and trips.count == 2
    store.release_many_sync(held[:2], 60)
    assert trips.count == 3
    assert store.complete_many_sync([Completion(c, "[1,2]") for c in held[2:]], 60) == []
    assert trips.count == 4
    assert store.claim_many_sync([], 30) == [] and store.renew_sync([], 30) == []
    assert store.complete_many_sync([], 60) == []
    store.release_many_sync([], 60)
    assert trips.count == 4, "empty batches make no call at all"


async def test_a_forgotten_script_is_reloaded_by_the_sync_twins(redis_twins: Twins) -> None:
    from reliable_sub.dedup import RedisDedupStore

    store = cast(RedisDedupStore, redis_twins.store)
    bogus = "0" * 40  # what EVALSHA meets after a restart (NOSCRIPT), without flushing the cache
    scripts = [store._claim_script_sync, store._renew_script_sync,
               store._release_script_sync, store._complete_script_sync]
    for script in scripts:
        script.sha = bogus
    claim = redis_twins.claim(store, K)
    assert isinstance(claim, Claimed)
    assert store.renew_sync([claim], 30) == []
    assert redis_twins.complete(store, claim, "ok") == []
    store.release_many_sync([claim], 60)
    assert bogus not in {script.sha for script in scripts}


async def test_a_dropped_sync_connection_is_replaced(redis_twins: Twins) -> None:
    import redis

    from reliable_sub.dedup import RedisDedupStore

    store = cast(RedisDedupStore, redis_twins.store)
    first = redis_twins.claim(store, DedupKey("s", "before"))
    assert isinstance(first, Claimed)
    connection_id = store.sync_client.client_id()
    raw = redis.Redis.from_url(redis_url())
    try:
        assert raw.client_kill_filter(_id=str(connection_id)) == 1
    finally:
        raw.close()
    results = store.claim_many_sync([DedupKey("s", "after"), first.key], 30)
    assert isinstance(results[0], Claimed) and isinstance(results[1], InProgress)
    assert store.sync_client.client_id() != connection_id


async def test_a_given_sync_client_is_the_one_the_twins_use() -> None:
    import fakeredis

    from reliable_sub.dedup import RedisDedupStore

    server = fakeredis.FakeServer()
    store = RedisDedupStore(fakeredis.FakeAsyncRedis(server=server), owner="me",
                            sync_client=fakeredis.FakeRedis(server=server))
    claim = await store.claim(K, 30)
    assert isinstance(claim, Claimed)
    [busy] = store.claim_many_sync([K], 30)
    assert isinstance(busy, InProgress), "the same (fake) server as the async client"
    assert store.complete_many_sync([Completion(claim, '"ok"')], 60) == []
    done = await store.claim(K, 30)
    assert isinstance(done, Completed) and done.result == "ok"
