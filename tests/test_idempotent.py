"""@idempotent on sync and async functions, over every dedup store; idempotency keys.

Each store test runs on the in-memory store, Redis, and SqlDedupStore on PostgreSQL and SQLite,
each with a *peer*: a second store over the same records, as another process would have. A sync
function is called on a worker thread (``asyncio.to_thread``), so the test's loop stays free;
its store calls run on that thread with the store's blocking twins (memory, Redis: a
SyncDedupStore, renewed by the shared renewer thread) or on the decorator's background loop
(SQL), the async function's on the test's loop. Nothing waits on a sleep: calls are held on
events, and what takes time is polled with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio

from reliable_sub import (
    Claimed,
    Completed,
    ConfigurationError,
    DedupKey,
    DedupStore,
    IdempotencyInProgressError,
    IdempotencyKeyReuseError,
    InProgress,
    ManualClock,
    MemoryDedupStore,
    ReliableSubError,
    ResultNotSerializableError,
)
from reliable_sub.dedup import Completion, SingleKeyMethods
from reliable_sub.idempotency import (
    IdempotentResult,
    idempotency_key,
    idempotent,
    new_idempotency_key,
)
from reliable_sub.idempotency import _background_loop as background_loop
from reliable_sub.idempotency import _renewer as renewer_module
from reliable_sub.idempotency import keys as keys_module
from reliable_sub.idempotency._renewer import Renewer
from reliable_sub.idempotency.decorator import close_sync_connections
from reliable_sub.ports import ClaimResult, SyncDedupStore
from reliable_sub.testing import redis_stores
from reliable_sub.testing.services import redis_url, sql_url

# Real seconds a test may wait for something that takes milliseconds.
WITHIN = 10.0
# Pacing of loops that watch a store for a while (what they watch is the test, not the pause).
POLL = 0.01
# A lease short enough to lapse within a test, and one a heartbeat keeps (renewed every third:
# a renewal may come up to two thirds of it late, 1 s, before a peer could take the key; at
# 0.2 s the SQLite sync path, renewing through the background loop and aiosqlite's thread,
# once missed that under a full CI run, and at 0.5 s the PostgreSQL async path did once, with
# the chaos scenarios' consumer processes running beside it on the two CPUs).
SHORT_LEASE = 0.1
RENEWED_LEASE = 1.5
LOGGER = "reliable_sub.idempotency.decorator"


# -- stores ------------------------------------------------------------------------------------


class Spy(SingleKeyMethods):
    """A store that passes every call on and remembers what the claims answered."""

    def __init__(self, inner: DedupStore) -> None:
        self.inner = inner
        self.claims: list[ClaimResult] = []
        self.renewals = 0

    async def claim_many(
        self, keys: Sequence[DedupKey], lease_ttl: float, tokens: Sequence[str] | None = None
    ) -> list[ClaimResult]:
        results = await self.inner.claim_many(keys, lease_ttl, tokens)
        self.claims.extend(results)
        return results

    async def renew(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        self.renewals += 1
        return await self.inner.renew(claims, lease_ttl)

    async def complete_many(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        return await self.inner.complete_many(completions, ttl)

    async def release_many(self, claims: Sequence[Claimed], retention: float) -> None:
        await self.inner.release_many(claims, retention)

    async def close(self) -> None:
        await self.inner.close()

    def seen(self, kind: type) -> list[Any]:
        return [c for c in self.claims if isinstance(c, kind)]


class SyncSpy(Spy):
    """A Spy over a store with blocking twins (a SyncDedupStore itself): it passes them on too,
    counting renewals either way and naming the threads that renewed."""

    def __init__(self, inner: DedupStore) -> None:
        super().__init__(inner)
        assert isinstance(inner, SyncDedupStore)
        self.sync_inner: SyncDedupStore = inner
        self.renewed_on: set[str] = set()
        self.sync_calls = 0

    def claim_many_sync(
        self, keys: Sequence[DedupKey], lease_ttl: float, tokens: Sequence[str] | None = None
    ) -> list[ClaimResult]:
        self.sync_calls += 1
        results = self.sync_inner.claim_many_sync(keys, lease_ttl, tokens)
        self.claims.extend(results)
        return results

    def renew_sync(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        self.renewals += 1
        self.renewed_on.add(threading.current_thread().name)
        return self.sync_inner.renew_sync(claims, lease_ttl)

    def complete_many_sync(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        self.sync_calls += 1
        return self.sync_inner.complete_many_sync(completions, ttl)

    def release_many_sync(self, claims: Sequence[Claimed], retention: float) -> None:
        self.sync_calls += 1
        self.sync_inner.release_many_sync(claims, retention)

    def close_sync(self) -> None:
        close_sync = getattr(self.inner, "close_sync", None)
        if close_sync is not None:
            close_sync()


def spy(inner: DedupStore) -> Spy:
    """The Spy of ``inner``: with blocking twins when it has them."""
    return SyncSpy(inner) if isinstance(inner, SyncDedupStore) else Spy(inner)


@dataclass
class Stores:
    name: str
    store: Spy  # what the decorated functions use
    peer: DedupStore  # another owner over the same records


def _memory() -> tuple[DedupStore, DedupStore, Callable[[], Any]]:
    store = MemoryDedupStore(owner="me")
    peer = MemoryDedupStore(owner="peer")
    peer._records = store._records  # one process's memory, two owners
    peer._lock = store._lock

    async def cleanup() -> None:
        pass

    return store, peer, cleanup


def _sql(url: str) -> tuple[DedupStore, DedupStore, Callable[[], Any], Callable[[], Any]]:
    from reliable_sub.dedup import SqlDedupStore

    table = f"test_idempotent_{uuid.uuid4().hex[:10]}"
    store = SqlDedupStore(url, table=table, owner="me")  # the system clock: real leases
    peer = SqlDedupStore(store.url, table=table, owner="peer")

    async def cleanup() -> None:
        async with store.engine.begin() as connection:
            await connection.run_sync(store.metadata.drop_all)
        await store.close()
        await peer.close()

    return store, peer, store.create_schema, cleanup


@pytest_asyncio.fixture(params=["memory", "redis", "postgresql", "mariadb", "sqlite"])
async def stores(request: pytest.FixtureRequest) -> AsyncIterator[Stores]:
    name = request.param
    prepare = None
    if name == "memory":
        store, peer, cleanup = _memory()
    elif name == "redis":
        harness = redis_stores(redis_url())
        store, peer, cleanup = harness.store, harness.peer, harness.cleanup
    else:
        url = sql_url(name)
        store, peer, prepare, cleanup = _sql(url)
    if prepare is not None:
        await prepare()
    spying = spy(store)
    assert isinstance(spying, SyncSpy) == (name in ("memory", "redis")), "which have sync twins"
    try:
        yield Stores(name, spying, peer)
    finally:
        await asyncio.to_thread(close_sync_connections, spying)  # the background loop's
        await cleanup()


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# -- a decorated function the tests count and hold ---------------------------------------------


class Subject:
    """``charge(order, amount=1)``, sync or async, made idempotent on ``order``.

    ``calls`` counts runs of its body; ``hold()`` makes the next runs wait for ``let_go()``;
    ``entered`` is set when a run starts; ``fail_with`` is raised by the next run;
    ``result`` makes the return value.
    """

    def __init__(self, kind: str, store: DedupStore, **options: Any) -> None:
        self.kind = kind
        self.calls = 0
        self.entered = threading.Event()
        self.gate: threading.Event | None = None
        self.fail_with: BaseException | None = None
        self.result: Callable[[str, int], Any] = lambda order, amount: {
            "order": order, "amount": amount, "items": ("a", 1)
        }
        options.setdefault("namespace", f"test-idempotent:{uuid.uuid4().hex}")
        decorate = idempotent(store, key="order", **options)
        if kind == "sync":

            def charge(order: str, amount: int = 1) -> Any:
                self._enter()
                if self.gate is not None:
                    assert self.gate.wait(WITHIN), "the test never let the call go"
                return self._leave(order, amount)

            self.fn: Any = decorate(charge)
        else:

            async def charge_async(order: str, amount: int = 1) -> Any:
                self._enter()
                if self.gate is not None:
                    assert await asyncio.to_thread(self.gate.wait, WITHIN), "never let go"
                return self._leave(order, amount)

            self.fn = decorate(charge_async)
        self.namespace: str = self.fn.namespace

    def _enter(self) -> None:
        self.calls += 1
        self.entered.set()

    def _leave(self, order: str, amount: int) -> Any:
        if self.fail_with is not None:
            error, self.fail_with = self.fail_with, None
            raise error
        return self.result(order, amount)

    def hold(self) -> None:
        self.gate = threading.Event()

    def let_go(self) -> None:
        assert self.gate is not None
        self.gate.set()

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, WITHIN), "the call never started"

    async def call(self, *args: Any, **kwargs: Any) -> IdempotentResult[Any]:
        if self.kind == "sync":
            return await asyncio.to_thread(self.fn.call_with_info, *args, **kwargs)
        result: IdempotentResult[Any] = await self.fn.call_with_info(*args, **kwargs)
        return result

    async def plain(self, *args: Any, **kwargs: Any) -> Any:
        if self.kind == "sync":
            return await asyncio.to_thread(self.fn, *args, **kwargs)
        return await self.fn(*args, **kwargs)

    def start(self, *args: Any, **kwargs: Any) -> asyncio.Task[IdempotentResult[Any]]:
        return asyncio.ensure_future(self.call(*args, **kwargs))

    def record(self, key: str) -> DedupKey:
        return DedupKey(self.namespace, key)


async def poll_until(condition: Callable[[], bool], what: str) -> None:
    give_up = time.monotonic() + WITHIN
    while not condition():
        assert time.monotonic() < give_up, f"timed out waiting until {what}"
        await asyncio.sleep(POLL)


# -- the call lifecycle, on every store, sync and async ----------------------------------------


async def test_the_first_call_runs_and_a_repeat_replays_its_stored_result(
    stores: Stores, kind: str
) -> None:
    subject = Subject(kind, stores.store)
    first = await subject.call("o-1", 5)
    assert first == IdempotentResult({"order": "o-1", "amount": 5, "items": ("a", 1)},
                                     replayed=False, key="o-1")
    again = await subject.call("o-1", 5)
    assert again == IdempotentResult({"order": "o-1", "amount": 5, "items": ["a", 1]},
                                     replayed=True, key="o-1"), "replays are JSON, decoded"
    assert await subject.plain("o-1", 5) == again.value
    assert await subject.plain("o-1", amount=5) == again.value, "bound, not positional"
    assert subject.calls == 1

    assert (await subject.call("o-2")).replayed is False, "another key runs"
    assert await subject.call("o-2", amount=1) == IdempotentResult(
        {"order": "o-2", "amount": 1, "items": ["a", 1]}, replayed=True, key="o-2"
    ), "a default given explicitly is the same payload"
    assert subject.calls == 2

    stored = await stores.peer.claim(subject.record("o-1"), 30)
    assert isinstance(stored, Completed)
    assert stored.result["r"] == again.value
    assert isinstance(stored.result["p"], str) and len(stored.result["p"]) == 64


async def test_a_key_reused_with_other_arguments_is_refused(stores: Stores, kind: str) -> None:
    subject = Subject(kind, stores.store)
    await subject.call("o-1", 1)
    with pytest.raises(IdempotencyKeyReuseError, match=r"'o-1'.*other arguments") as caught:
        await subject.call("o-1", 2)
    assert caught.value.key == "o-1" and isinstance(caught.value, ValueError)
    assert subject.calls == 1

    unchecked = Subject(kind, stores.store, validate_payload=False)
    await unchecked.call("o-1", 1)
    replay = await unchecked.call("o-1", 2)
    assert replay.replayed and replay.value["amount"] == 1, "not validated: replayed as it is"
    assert unchecked.calls == 1


async def test_a_repeat_while_the_first_call_runs_raises_in_progress(
    stores: Stores, kind: str
) -> None:
    subject = Subject(kind, stores.store)
    subject.hold()
    first = subject.start("o-1")
    try:
        await subject.wait_entered()
        with pytest.raises(IdempotencyInProgressError, match=r"'o-1'.*lapses in") as caught:
            await subject.call("o-1")
        assert caught.value.key == "o-1" and 0 < caught.value.expires_in <= 30
    finally:
        subject.let_go()
    assert (await first).replayed is False
    assert (await subject.call("o-1")).replayed is True
    assert subject.calls == 1


async def test_wait_returns_the_running_calls_result(stores: Stores, kind: str) -> None:
    subject = Subject(kind, stores.store, on_in_progress="wait", wait_timeout=WITHIN)
    subject.hold()
    first = subject.start("o-1", 3)
    try:
        await subject.wait_entered()
        second = subject.start("o-1", 3)
        await poll_until(lambda: len(stores.store.seen(InProgress)) >= 1,
                         "the second call saw the first in progress")
        assert not second.done()
    finally:
        subject.let_go()
    done = await first
    waited = await asyncio.wait_for(second, WITHIN)
    assert done.replayed is False and waited.replayed is True
    assert waited.value == {"order": "o-1", "amount": 3, "items": ["a", 1]}
    assert subject.calls == 1


async def test_a_waiting_caller_with_other_arguments_is_refused(
    stores: Stores, kind: str
) -> None:
    subject = Subject(kind, stores.store, on_in_progress="wait", wait_timeout=WITHIN)
    subject.hold()
    first = subject.start("o-1", 3)
    try:
        await subject.wait_entered()
        second = subject.start("o-1", 4)
        await poll_until(lambda: len(stores.store.seen(InProgress)) >= 1, "the second waits")
    finally:
        subject.let_go()
    assert (await first).replayed is False
    with pytest.raises(IdempotencyKeyReuseError):
        await asyncio.wait_for(second, WITHIN)
    assert subject.calls == 1


async def test_a_waiting_caller_runs_the_function_when_the_first_call_fails(
    stores: Stores, kind: str
) -> None:
    subject = Subject(kind, stores.store, on_in_progress="wait", wait_timeout=WITHIN)
    subject.hold()
    subject.fail_with = RuntimeError("first attempt fails")
    first = subject.start("o-1", 3)
    try:
        await subject.wait_entered()
        second = subject.start("o-1", 3)
        await poll_until(lambda: len(stores.store.seen(InProgress)) >= 1, "the second waits")
    finally:
        subject.let_go()
    with pytest.raises(RuntimeError, match="first attempt fails"):
        await first
    took_over = await asyncio.wait_for(second, WITHIN)
    assert took_over.replayed is False and took_over.value["amount"] == 3
    assert subject.calls == 2


async def test_wait_gives_up_after_wait_timeout(stores: Stores, kind: str) -> None:
    subject = Subject(kind, stores.store, on_in_progress="wait", wait_timeout=0.1)
    elsewhere = await stores.peer.claim(subject.record("o-1"), 30)  # a call in another process
    assert isinstance(elsewhere, Claimed)
    started = time.monotonic()
    with pytest.raises(IdempotencyInProgressError, match=r"'o-1'.*after waiting 0.1s"):
        await subject.call("o-1")
    assert time.monotonic() - started >= 0.1
    assert len(stores.store.seen(InProgress)) >= 2, "it polled before giving up"
    assert subject.calls == 0


async def test_an_exception_releases_the_key_so_a_retry_runs(stores: Stores, kind: str) -> None:
    subject = Subject(kind, stores.store)
    error = RuntimeError("card declined")
    subject.fail_with = error
    with pytest.raises(RuntimeError) as caught:
        await subject.call("o-1")
    assert caught.value is error, "the function's own exception, re-raised as it was"
    retry = await subject.call("o-1")
    assert retry.replayed is False and subject.calls == 2
    assert (await subject.call("o-1")).replayed is True


async def test_a_result_json_cannot_hold_fails_the_first_call_and_holds_nothing(
    stores: Stores, kind: str
) -> None:
    subject = Subject(kind, stores.store)
    subject.result = lambda order, amount: {"when": object()}
    with pytest.raises(ResultNotSerializableError, match="object"):
        await subject.call("o-1")
    subject.result = lambda order, amount: "fine"
    retry = await subject.call("o-1")  # on_in_progress="raise": a held key would raise
    assert retry == IdempotentResult("fine", replayed=False, key="o-1")
    assert subject.calls == 2


async def test_a_crashed_callers_claim_lapses_and_the_key_runs_again(
    stores: Stores, kind: str
) -> None:
    namespace = f"test-idempotent:{uuid.uuid4().hex}"
    impatient = Subject(kind, stores.store, namespace=namespace)
    patient = Subject(kind, stores.store, namespace=namespace, on_in_progress="wait",
                      wait_timeout=WITHIN)
    key = DedupKey(namespace, "o-1")
    crashed = await stores.peer.claim(key, WITHIN)  # held long enough for a slow first call
    assert isinstance(crashed, Claimed)
    with pytest.raises(IdempotencyInProgressError):
        await impatient.call("o-1")
    # the crashed caller's last renewal: a short lease, never renewed again
    [shortened] = await stores.peer.claim_many([key], SHORT_LEASE, [crashed.token])
    assert isinstance(shortened, Claimed)
    result = await patient.call("o-1")  # waits until the claim lapses, then runs itself
    assert result.replayed is False and patient.calls == 1
    assert (await impatient.call("o-1")).replayed is True
    assert impatient.calls == 0


async def test_a_long_call_keeps_its_claim_by_renewing_it(stores: Stores, kind: str) -> None:
    subject = Subject(kind, stores.store, lease_ttl=RENEWED_LEASE)
    subject.hold()
    first = subject.start("o-1")
    try:
        await subject.wait_entered()
        watch_until = time.monotonic() + 1.5 * RENEWED_LEASE
        while time.monotonic() < watch_until:  # a peer sees it in progress the whole time
            seen = await stores.peer.claim(subject.record("o-1"), 30)
            assert isinstance(seen, InProgress), f"the running call lost its claim: {seen}"
            await asyncio.sleep(POLL)
        assert stores.store.renewals >= 2
    finally:
        subject.let_go()
    assert (await first).replayed is False
    assert (await subject.call("o-1")).replayed is True
    assert subject.calls == 1


async def test_a_completion_after_the_claim_was_lost_is_refused(
    stores: Stores, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    subject = Subject(kind, stores.store)
    subject.hold()
    first = subject.start("o-1")
    try:
        await subject.wait_entered()
        [claim] = stores.store.seen(Claimed)
        # As if its lease lapsed: the claim ends, and a peer takes the key under its own token.
        await stores.store.inner.release_many([claim], 0.0)
        taken = await stores.peer.claim(subject.record("o-1"), 30)
        assert isinstance(taken, Claimed) and taken.token != claim.token
    finally:
        subject.let_go()
    result = await first
    assert result.replayed is False and result.value["order"] == "o-1", "still returned"
    assert any("lost to another call" in r.getMessage() for r in caplog.records)
    assert isinstance(await stores.store.inner.claim(subject.record("o-1"), 30), InProgress), \
        "the peer still holds the key: the refused completion wrote nothing"

    assert await stores.peer.complete_many([Completion(taken, '{"p":null,"r":"peer"}')], 60) == []
    replay = await subject.call("o-1")
    assert replay == IdempotentResult("peer", replayed=True, key="o-1"), "the peer's record"
    assert subject.calls == 1


async def test_sync_and_async_functions_share_records_across_event_loops(
    stores: Stores,
) -> None:
    namespace = f"test-idempotent:{uuid.uuid4().hex}"
    sync = Subject("sync", stores.store, namespace=namespace)
    in_loop = Subject("async", stores.store, namespace=namespace)
    assert (await sync.call("o-1")).replayed is False  # store calls on the background loop
    assert (await in_loop.call("o-1")).replayed is True  # on the test's loop
    assert (await in_loop.call("o-2")).replayed is False
    assert (await sync.call("o-2")).replayed is True
    assert sync.calls == 1 and in_loop.calls == 1


# -- sync calls on a store with blocking twins: the calling thread and the renewer -------------


@pytest.mark.parametrize("stores", ["memory", "redis"], indirect=True)
async def test_sync_calls_on_a_sync_store_never_use_the_background_loop(
    stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    used: list[object] = []

    def refuse(coroutine: Any, store: object = None) -> Any:
        used.append(coroutine)
        coroutine.close()
        raise AssertionError("a sync call on a SyncDedupStore used the background loop")

    monkeypatch.setattr(background_loop.BACKGROUND, "run", refuse)
    assert isinstance(stores.store, SyncSpy)
    subject = Subject("sync", stores.store, lease_ttl=RENEWED_LEASE, on_in_progress="wait",
                      wait_timeout=WITHIN)
    assert (await subject.call("o-1")).replayed is False  # a claim and a completion
    assert (await subject.call("o-1")).replayed is True  # a claim that replays
    subject.fail_with = RuntimeError("declined")
    with pytest.raises(RuntimeError, match="declined"):
        await subject.call("o-2")  # released
    assert (await subject.call("o-2")).replayed is False

    subject.entered.clear()
    subject.hold()
    first = subject.start("o-3")  # a long call, renewed ...
    try:
        await subject.wait_entered()
        second = subject.start("o-3")  # ... and a caller waiting for it
        await poll_until(lambda: stores.store.renewals >= 2, "two renewals")
        await poll_until(lambda: len(stores.store.seen(InProgress)) >= 2, "the second polls")
    finally:
        subject.let_go()
    assert (await first).replayed is False
    assert (await asyncio.wait_for(second, WITHIN)).replayed is True
    assert stores.store.renewed_on == {"reliable-sub-renewer"}, "one shared renewer thread"
    assert used == [] and subject.calls == 4


@pytest.mark.parametrize("stores", ["memory", "redis"], indirect=True)
async def test_a_sync_call_whose_claim_is_taken_logs_it_and_stores_nothing(
    stores: Stores, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    subject = Subject("sync", stores.store, lease_ttl=RENEWED_LEASE)
    subject.hold()
    first = subject.start("o-1")
    try:
        await subject.wait_entered()
        [claim] = stores.store.seen(Claimed)
        await stores.store.inner.release_many([claim], 0.0)  # as if its lease lapsed ...
        taken = await stores.peer.claim(subject.record("o-1"), 30)  # ... and a peer took it
        assert isinstance(taken, Claimed)
        await poll_until(
            lambda: any("lapsed or was taken over" in r.getMessage() for r in caplog.records),
            "the renewer found the claim lost",
        )
        renewals = stores.store.renewals
    finally:
        subject.let_go()
    result = await first
    assert result.replayed is False and result.value["order"] == "o-1", "still returned"
    assert any("lost to another call" in r.getMessage() for r in caplog.records)
    assert isinstance(await stores.store.inner.claim(subject.record("o-1"), 30), InProgress), \
        "the peer still holds the key: the refused completion wrote nothing"
    assert stores.store.renewals == renewals, "a lost claim is not renewed again"


class RenewalLog:
    """A SyncDedupStore for the renewer alone: it records each renew_sync batch, fails the next
    ``fail`` calls, and reports the claims in ``lost`` as no longer held."""

    def __init__(self) -> None:
        self.batches: list[list[Claimed]] = []
        self.fail = 0
        self.lost: set[Claimed] = set()
        self.leases: set[float] = set()

    def renew_sync(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        self.batches.append(list(claims))
        self.leases.add(lease_ttl)
        if self.fail:
            self.fail -= 1
            raise ConnectionError("the store is down")
        return [claim for claim in claims if claim in self.lost]

    def renewals(self, claim: Claimed) -> int:
        return sum(claim in batch for batch in list(self.batches))

    def claim_many_sync(
        self, keys: Sequence[DedupKey], lease_ttl: float, tokens: Sequence[str] | None = None
    ) -> list[ClaimResult]:
        raise NotImplementedError

    def complete_many_sync(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        raise NotImplementedError

    def release_many_sync(self, claims: Sequence[Claimed], retention: float) -> None:
        raise NotImplementedError


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` (the renewer's thread makes it true) until WITHIN has passed."""
    give_up = time.monotonic() + WITHIN
    while not condition():
        assert time.monotonic() < give_up, f"timed out waiting until {what}"
        time.sleep(POLL)


def a_claim(name: str) -> Claimed:
    return Claimed(DedupKey("renewer", name), f"me.{name}")


# A lease renewed every 20 ms.
FAST_LEASE = 0.06


def test_the_renewer_renews_claims_until_unregistered() -> None:
    renewer, store, lost = Renewer(), RenewalLog(), list[str]()
    a, b = a_claim("a"), a_claim("b")
    ticket_a = renewer.register(store, a, FAST_LEASE, "a", lost.append)
    ticket_b = renewer.register(store, b, FAST_LEASE, "b", lost.append)
    assert len(renewer) == 2
    wait_until(lambda: store.renewals(a) >= 2 and store.renewals(b) >= 2, "renewals")
    assert store.leases == {FAST_LEASE}

    renewer.unregister(ticket_a)
    after = len(store.batches)
    wait_until(lambda: sum(b in batch for batch in store.batches[after:]) >= 3, "b renewed on")
    assert sum(a in batch for batch in store.batches[after:]) <= 1, \
        "after unregister, at most the renewal already in flight"
    assert sum(a in batch for batch in store.batches[after + 1:]) == 0
    renewer.unregister(ticket_b)
    renewer.unregister(ticket_b)  # twice is fine
    assert len(renewer) == 0 and lost == []


def test_claims_due_together_share_one_store_call() -> None:
    renewer, store, other = Renewer(), RenewalLog(), RenewalLog()
    a, b, c = a_claim("a"), a_claim("b"), a_claim("c")
    lease = 1.5  # renewed every 0.5 s, or up to 50 ms early to join a call due now
    tickets = [renewer.register(store, a, lease, "a", lambda key: None),
               renewer.register(other, c, lease, "c", lambda key: None),
               renewer.register(store, b, lease, "b", lambda key: None)]
    wait_until(lambda: len(store.batches) >= 1 and len(other.batches) >= 1, "a renewal")
    assert store.batches[0] == [a, b], "one store, one call"
    assert other.batches[0] == [c], "another store, its own call"
    for ticket in tickets:
        renewer.unregister(ticket)


def test_a_failed_renewal_is_logged_and_tried_again(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=renewer_module.logger.name)
    renewer, store = Renewer(), RenewalLog()
    store.fail = 2
    claim = a_claim("a")
    ticket = renewer.register(store, claim, FAST_LEASE, "a", lambda key: None)
    wait_until(lambda: store.renewals(claim) >= 4, "renewals after two failures")
    failures = [r for r in caplog.records
                if "renewing the claims of 1 sync @idempotent call(s)" in r.getMessage()]
    assert len(failures) == 2 and "'a'" in failures[0].getMessage()
    assert failures[0].exc_info is not None and failures[0].levelno == logging.WARNING
    assert len(renewer) == 1, "a failure keeps the claim registered"
    renewer.unregister(ticket)


def test_a_lost_claim_is_reported_once_and_not_renewed_again() -> None:
    renewer, store, lost = Renewer(), RenewalLog(), list[str]()
    gone, kept = a_claim("gone"), a_claim("kept")
    store.lost = {gone}
    renewer.register(store, gone, FAST_LEASE, "gone", lost.append)
    ticket = renewer.register(store, kept, FAST_LEASE, "kept", lost.append)
    wait_until(lambda: lost == ["gone"], "the loss reported")
    wait_until(lambda: store.renewals(kept) >= 3, "the other claim renewed on")
    assert store.renewals(gone) == 1 and lost == ["gone"]
    assert len(renewer) == 1
    renewer.unregister(ticket)


def test_a_shorter_lease_wakes_the_renewer_early() -> None:
    renewer, store = Renewer(), RenewalLog()
    slow, fast = a_claim("slow"), a_claim("fast")
    renewer.register(store, slow, 600.0, "slow", lambda key: None)  # the thread sleeps 200 s
    waiters = renewer._condition._waiters  # type: ignore[attr-defined]  # CPython's Condition
    wait_until(lambda: len(waiters) == 1, "the renewer sleeps until the slow claim is due")
    ticket = renewer.register(store, fast, FAST_LEASE, "fast", lambda key: None)
    wait_until(lambda: store.renewals(fast) >= 2, "the fast claim renewed")
    assert store.renewals(slow) == 0
    renewer.unregister(ticket)


def test_the_renewer_thread_ends_when_idle_and_starts_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(renewer_module, "IDLE_EXIT", 0.05)
    renewer, store = Renewer(), RenewalLog()
    claim = a_claim("a")
    renewer.unregister(renewer.register(store, claim, FAST_LEASE, "a", lambda key: None))
    thread = renewer._thread
    assert thread is not None
    thread.join(WITHIN)
    assert not thread.is_alive() and renewer._thread is None
    ticket = renewer.register(store, claim, FAST_LEASE, "a", lambda key: None)
    wait_until(lambda: store.renewals(claim) >= 1, "a renewal by a new thread")
    renewer.unregister(ticket)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_renews_its_own_claims_on_its_own_thread() -> None:
    script = (
        "import os, time\n"
        "from reliable_sub.idempotency._renewer import Renewer\n"
        "from reliable_sub.ports import Claimed, DedupKey\n"
        "class Log:\n"
        "    def __init__(self): self.renewed = []\n"
        "    def renew_sync(self, claims, lease):\n"
        "        self.renewed += [c.token for c in claims]; return []\n"
        "def wait(check):\n"
        "    give_up = time.monotonic() + 10\n"
        "    while not check():\n"
        "        assert time.monotonic() < give_up; time.sleep(0.005)\n"
        "renewer, log = Renewer(), Log()\n"
        "renewer.register(log, Claimed(DedupKey('n', 'p'), 'parent'), 0.03, 'p', print)\n"
        "wait(lambda: len(log.renewed) >= 1)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    code = 1\n"
        "    try:\n"
        "        assert len(renewer) == 0, 'the parent claims are not the child s'\n"
        "        mine = Log()\n"
        "        renewer.register(mine, Claimed(DedupKey('n', 'c'), 'child'), 0.03, 'c', print)\n"
        "        wait(lambda: len(mine.renewed) >= 2)\n"
        "        code = 0 if set(mine.renewed) == {'child'} else 2\n"
        "    finally:\n"
        "        os._exit(code)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "wait(lambda: len(log.renewed) >= 3)\n"
        "print(os.waitstatus_to_exitcode(status), set(log.renewed))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=WITHIN * 2)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "{'parent'}"], done.stdout


# -- the decorator itself ------------------------------------------------------------------------


def charge_once(order: str) -> str:
    return f"charged {order}"


async def test_the_default_namespace_names_the_module_and_function() -> None:
    store = MemoryDedupStore()
    function = idempotent(store, key="order")(charge_once)
    assert function.namespace == "idempotent:tests.test_idempotent.charge_once"
    assert function.__name__ == "charge_once" and function.__wrapped__ is charge_once
    with pytest.raises(ConfigurationError, match="namespace="):
        idempotent(store, key=lambda order: order)(lambda order: order)
    named = idempotent(store, key=lambda order: order, namespace="n")(lambda order: order)
    assert named.namespace == "n"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"store": None}, "store is required"),
        ({"store": object()}, "store must be a DedupStore.*object"),
        ({"key": ""}, "key must be"),
        ({"key": 7}, "key must be.*7"),
        ({"ttl": 0}, "ttl must be .* got 0"),
        ({"ttl": float("inf")}, "ttl must be"),
        ({"lease_ttl": -1.0}, "lease_ttl must be .* got -1.0"),
        ({"lease_ttl": "30"}, "lease_ttl must be .* got '30'"),
        ({"wait_timeout": 0.0}, "wait_timeout must be"),
        ({"on_in_progress": "ignore"}, "on_in_progress must be 'raise' or 'wait', got 'ignore'"),
        ({"validate_payload": "yes"}, "validate_payload must be a bool"),
        ({"namespace": ""}, "namespace must be"),
        ({"clock": object()}, "clock must be a Clock"),
    ],
)
def test_bad_settings_are_refused_by_name(options: dict[str, Any], match: str) -> None:
    arguments: dict[str, Any] = {"store": MemoryDedupStore(), "key": "order", **options}
    with pytest.raises(ConfigurationError, match=match):
        idempotent(**arguments)


async def test_the_key_must_name_a_parameter_and_be_a_non_empty_str() -> None:
    store = MemoryDedupStore()
    with pytest.raises(ConfigurationError, match=r"key='order_id' names no parameter.*\['order'"):
        idempotent(store, key="order_id")(charge_once)
    function = idempotent(store, key="order")(charge_once)
    for bad in (17, "", None):
        with pytest.raises(ConfigurationError, match=f"non-empty str, got {bad!r}"):
            function(bad)  # type: ignore[arg-type]
    by_callable = idempotent(store, key=lambda order: order.upper(), namespace="n")(charge_once)
    assert by_callable.call_with_info("o-1").key == "O-1"


def _plain(a: Any, b: Any = 2, c: Any = None) -> None: ...


def _positional_only(a: Any, /, b: Any = 1) -> None: ...


def _variadic(a: Any, *rest: Any, k: Any = 1, **more: Any) -> None: ...


def _keyword_only(a: Any, *, b: Any) -> None: ...


@pytest.mark.parametrize("function", [_plain, _positional_only, _variadic, _keyword_only])
@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((1,), {}), ((1, 5), {}), ((1, 5, 6), {}), ((1, 5, 6, 7), {}), ((), {}),
        ((1,), {"c": 3}), ((), {"c": 3, "a": 1}), ((), {"a": 1, "b": 2}), ((1,), {"a": 1}),
        ((1,), {"zzz": 1}), ((), {"b": 1}), ((1,), {"b": 5, "k": 2}), ((1, 2), {"b": 3}),
    ],
)
def test_arguments_are_bound_as_signature_bind_binds_them(
    function: Callable[..., None], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """The decorator's own binder (for plain signatures) answers as Signature.bind does."""
    import inspect

    core = idempotent(MemoryDedupStore(), key=lambda *a, **k: "k", namespace="n")(
        function
    )._core
    signature = inspect.signature(function)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        with pytest.raises(TypeError) as caught:
            core.arguments(signature, args, kwargs)
        assert str(caught.value) == str(error)
        return
    bound.apply_defaults()
    got = core.arguments(signature, args, kwargs)
    assert list(got.items()) == list(bound.arguments.items()), "the same values, in order"


async def test_a_sync_function_may_be_called_inside_a_running_loop() -> None:
    store = MemoryDedupStore()
    function = idempotent(store, key="order")(charge_once)
    assert function.call_with_info("o-1") == IdempotentResult("charged o-1", False, "o-1")
    assert function.call_with_info("o-1") == IdempotentResult("charged o-1", True, "o-1")


async def test_methods_bind_and_self_is_not_part_of_the_payload() -> None:
    store = MemoryDedupStore()
    runs: list[str] = []

    @dataclass
    class Payments:
        region: str

        @idempotent(store, key="order")
        def charge(self, order: str) -> str:
            runs.append(self.region)
            return f"{order} in {self.region}"

        @idempotent(store, key="order")
        async def refund(self, order: str) -> str:
            runs.append(self.region)
            return f"refunded {order}"

    assert Payments("eu").charge("o-1") == "o-1 in eu"
    again = Payments("us").charge.call_with_info("o-1")
    assert again == IdempotentResult("o-1 in eu", replayed=True, key="o-1")
    assert (await Payments("eu").refund.call_with_info("o-1")).replayed is False
    assert await Payments("us").refund("o-1") == "refunded o-1"
    assert runs == ["eu", "eu"]


async def test_the_payload_fingerprint_ignores_memory_addresses() -> None:
    """A retry from another process passes equal, not identical, objects: same payload."""

    class Session:  # the default repr names a memory address
        pass

    store = MemoryDedupStore()

    @idempotent(store, key="order")
    def ship(order: str, session: Session, notify: Any, tags: frozenset[str]) -> str:
        return order

    def notify_first() -> None: ...

    def notifier() -> Callable[[], None]:
        def notify() -> None: ...

        return notify

    sessions, notifiers = [Session(), Session()], [notifier(), notifier()]  # kept alive: apart
    assert not ship.call_with_info("o-1", sessions[0], notifiers[0], frozenset("ab")).replayed
    assert ship.call_with_info("o-1", sessions[1], notifiers[1], frozenset("ba")).replayed
    with pytest.raises(IdempotencyKeyReuseError):
        ship("o-1", sessions[0], notify_first, frozenset("ab"))
    with pytest.raises(IdempotencyKeyReuseError):
        ship("o-1", sessions[0], notifiers[0], frozenset("abc"))


def test_the_fingerprint_of_a_set_is_the_same_whatever_the_hash_seed() -> None:
    script = (
        "from reliable_sub.idempotency.fingerprint import fingerprint\n"
        "tags = {f'tag-{i}' for i in range(20)}\n"
        "print(repr(tags)); print(fingerprint({'tags': tags}))\n"
    )
    outputs = [
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       check=True, env={**os.environ, "PYTHONHASHSEED": seed},
                       timeout=WITHIN).stdout.splitlines()
        for seed in ("1", "2")
    ]
    assert outputs[0][0] != outputs[1][0], "the seeds should order the set differently"
    assert outputs[0][1] == outputs[1][1]


async def test_a_record_not_written_by_the_decorator_is_reported() -> None:
    from reliable_sub import StoredResultError

    store = MemoryDedupStore()
    function = idempotent(store, key="order")(charge_once)
    store.write_raw(DedupKey(function.namespace, "o-1"), '"plain"', 60)
    with pytest.raises(StoredResultError, match="not written by @idempotent"):
        function("o-1")


async def test_renewals_and_waits_follow_the_given_clock() -> None:
    clock = ManualClock()
    store = Spy(MemoryDedupStore(clock=clock))
    entered, gate = asyncio.Event(), asyncio.Event()

    @idempotent(store, key="order", lease_ttl=30, clock=clock)
    async def slow(order: str) -> str:
        entered.set()
        await gate.wait()
        return order

    running = asyncio.ensure_future(slow("o-1"))
    await asyncio.wait_for(entered.wait(), WITHIN)
    for renewals in range(1, 6):  # 50 virtual seconds: longer than the lease, renewed every 10
        await poll_until(lambda: clock.next_wakeup() is not None, "the heartbeat sleeps")
        clock.advance(10)
        await poll_until(lambda n=renewals: store.renewals >= n, "a renewal")  # type: ignore[misc]
    assert isinstance(await store.inner.claim(DedupKey(slow.namespace, "o-1"), 1), InProgress)
    gate.set()
    assert await running == "o-1"


# -- idempotency keys ------------------------------------------------------------------------------


def test_idempotency_key_is_deterministic_and_stable_across_releases() -> None:
    key = idempotency_key("order-17", 3, b"\x00\xff", uuid.UUID(int=1), namespace="charge")
    assert key == idempotency_key("order-17", 3, b"\x00\xff", uuid.UUID(int=1), namespace="charge")
    namespace, digest = key.split(":")
    assert namespace == "charge" and len(digest) == 64 and int(digest, 16) >= 0
    # A key stored today must be found by the next release: the encoding may never change.
    assert key == "charge:" + GOLDEN_DIGEST


# SHA-256 of the documented encoding: ["reliable-sub/idempotency-key/v1","charge",
# ["s","order-17"],["i","3"],["b","00ff"],["u","000...001"]] (compact JSON).
GOLDEN_DIGEST = "557dea8c2268da0c123cade8c44335e7f42a6188da938670c70257f4fb7facc6"


def test_idempotency_keys_of_different_parts_or_namespaces_never_collide() -> None:
    an_id = uuid.UUID("01890a5d-ac96-774b-bcce-b302099a8057")
    cases: list[tuple[tuple[Any, ...], str]] = [
        (("a", "bc"), "n"), (("ab", "c"), "n"), (("abc",), "n"), (("a", "b", "c"), "n"),
        (("a", ""), "n"), (("a",), "n"), (("",), "n"), (("", ""), "n"),
        (("1",), "n"), ((1,), "n"), ((b"1",), "n"), ((-1,), "n"), ((10**40,), "n"),
        ((an_id,), "n"), ((str(an_id),), "n"), ((an_id.hex,), "n"), ((an_id.bytes,), "n"),
        (('a","b',), "n"), (("a", "b"), "n"), (("ünï", "\ud800"), "n"), (("ünï\ud800",), "n"),
        (("a",), "m"), (("a",), "n:"), (("a",), "n:a"), ((":a",), "n"), (("a",), "N"),
    ]
    keys = [idempotency_key(*parts, namespace=namespace) for parts, namespace in cases]
    assert len(set(keys)) == len(cases)
    for key, (_, namespace) in zip(keys, cases, strict=True):
        assert key.startswith(f"{namespace}:") and len(key) == len(namespace) + 65


@pytest.mark.parametrize("bad", [1.5, None, True, bytearray(b"x"), ["a"], object()])
def test_idempotency_key_refuses_other_types_naming_the_value(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match=f"part 1 .*{type(bad).__name__}") as caught:
        idempotency_key("fine", bad, namespace="n")
    assert repr(bad)[:10] in str(caught.value)


def test_idempotency_key_needs_parts_and_a_namespace() -> None:
    with pytest.raises(ConfigurationError, match="at least one part"):
        idempotency_key(namespace="n")
    for namespace in ("", None, 3):
        with pytest.raises(ConfigurationError, match=f"namespace must be .*{namespace!r}"):
            idempotency_key("a", namespace=namespace)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        idempotency_key("a")  # type: ignore[call-arg]
    assert issubclass(ConfigurationError, ReliableSubError)


# -- new idempotency keys (UUIDv7) -----------------------------------------------------------------


def _timestamp_ms(value: uuid.UUID) -> int:
    return value.int >> 80


@pytest.mark.parametrize("make", [new_idempotency_key, lambda: str(keys_module._uuid7())],
                         ids=["new_idempotency_key", "fallback"])
def test_new_keys_are_uuid7_in_time_order(make: Callable[[], str]) -> None:
    before = time.time_ns() // 1_000_000
    keys = [make() for _ in range(2000)]
    after = time.time_ns() // 1_000_000
    parsed = [uuid.UUID(key) for key in keys]
    assert all(str(p) == k for p, k in zip(parsed, keys, strict=True)), "canonical text form"
    assert {p.version for p in parsed} == {7}
    assert {p.variant for p in parsed} == {uuid.RFC_4122}
    assert all((p.int >> 62) & 0b11 == 0b10 and (p.int >> 76) & 0xF == 7 for p in parsed)
    assert all(before <= _timestamp_ms(p) <= after + 1 for p in parsed)
    assert keys == sorted(keys) and len(set(keys)) == len(keys), "strictly increasing"

    # Across milliseconds, order follows the clock.
    first = uuid.UUID(make())
    give_up = time.monotonic() + WITHIN
    while time.time_ns() // 1_000_000 <= _timestamp_ms(first):
        assert time.monotonic() < give_up
    later = uuid.UUID(make())
    assert _timestamp_ms(later) > _timestamp_ms(first) and str(later) > str(first)


def test_the_fallback_keeps_order_within_one_millisecond(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keys_module, "_last_ms", keys_module._last_ms)  # restored afterwards
    monkeypatch.setattr(keys_module, "_counter", keys_module._counter)
    frozen = (time.time_ns() // 1_000_000 + 60_000) * 1_000_000  # a minute ahead, then stuck
    monkeypatch.setattr(keys_module, "time", SimpleNamespace(time_ns=lambda: frozen))
    made = [keys_module._uuid7() for _ in range(5000)]  # more than the 12-bit counter holds
    assert [str(u) for u in made] == sorted(str(u) for u in made)
    assert len(set(made)) == len(made)
    assert all(u.version == 7 and u.variant == uuid.RFC_4122 for u in made)
    assert _timestamp_ms(made[-1]) > _timestamp_ms(made[0]), "the counter overflowed onward"
    assert _timestamp_ms(made[0]) == frozen // 1_000_000
