"""@idempotent callers that give up mid-call: a cancelled task or an ``asyncio.wait_for`` timeout
(async), a signal handler's exception (sync). At every await of the claim and completion paths,
a retry with the same key never runs a function that already ran (it replays its result) and
never finds a claim left held until its lease lapses (it runs at once when the function did not
run, or raised).

Stores: memory, Redis, PostgreSQL, SQLite, each behind ``Gated``, which holds one kind of store
call at a chosen point (before or after passing it on) until the test lets it go. Sync functions
run on the main thread (signals reach only it): on the memory and Redis stores their store calls
are the blocking twins on that thread, on the SQL stores they run on the background loop.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import pytest
import pytest_asyncio
import sqlalchemy as sa

from reliable_sub import Claimed, Completed, DedupKey, DedupStore
from reliable_sub.dedup import Completion, SingleKeyMethods
from reliable_sub.idempotency import IdempotentResult, idempotent
from reliable_sub.idempotency._background_loop import BACKGROUND
from reliable_sub.idempotency._settling import Settling
from reliable_sub.idempotency.decorator import close_sync_connections
from reliable_sub.ports import ClaimResult, SyncDedupStore
from reliable_sub.testing import redis_stores
from reliable_sub.testing.services import redis_url, sql_url
from tests.test_idempotent import _memory, _sql

# Real seconds a test may wait for something that takes milliseconds.
WITHIN = 10.0
POLL = 0.01
# The lease of the first call's claim: long, so a claim left held shows as InProgress.
LEASE = 60.0


class Interrupted(BaseException):
    """What a signal handler raises in a sync caller (as KeyboardInterrupt would)."""


@dataclass
class Hold:
    method: str  # "claim_many" or "complete_many"
    where: str  # "before" (the store has not seen the call) or "after" (it has, and answered)
    reached: threading.Event = field(default_factory=threading.Event)
    gate: threading.Event = field(default_factory=threading.Event)
    interrupt: Callable[[], None] | None = None  # called when the hold is reached


class Gated(SingleKeyMethods):
    """A store that passes every call on, holding the first call of ``hold.method`` at
    ``hold.where`` until ``let_go()``."""

    def __init__(self, inner: DedupStore) -> None:
        self.inner = inner
        self.hold: Hold | None = None
        # what the inner store says of itself: @idempotent lets a SqlDedupStore's calls finish
        # when its caller is cancelled (a cut aiosqlite statement leaves the file locked); a
        # wrapper that hid this made the client-timeout test fail under load, when the timeout
        # landed in the claim rather than in the held completion
        self.cancel_safe_calls = getattr(inner, "cancel_safe_calls", True)

    def hold_at(self, method: str, where: str) -> Hold:
        self.hold = Hold(method, where)
        return self.hold

    def let_go(self) -> None:
        if self.hold is not None:
            self.hold.gate.set()

    def _held(self, method: str, where: str) -> Hold | None:
        hold = self.hold
        if hold is None or (hold.method, hold.where) != (method, where) or hold.reached.is_set():
            return None
        hold.reached.set()
        if hold.interrupt is not None:
            hold.interrupt()
        return hold

    async def _pause(self, method: str, where: str) -> None:
        hold = self._held(method, where)
        if hold is not None:
            assert await asyncio.to_thread(hold.gate.wait, WITHIN), "never let go"

    def _pause_sync(self, method: str, where: str) -> None:
        hold = self._held(method, where)
        if hold is not None:
            assert hold.gate.wait(WITHIN), "never let go"

    async def claim_many(
        self, keys: Sequence[DedupKey], lease_ttl: float, tokens: Sequence[str] | None = None
    ) -> list[ClaimResult]:
        await self._pause("claim_many", "before")
        results = await self.inner.claim_many(keys, lease_ttl, tokens)
        await self._pause("claim_many", "after")
        return results

    async def renew(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        return await self.inner.renew(claims, lease_ttl)

    async def complete_many(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        await self._pause("complete_many", "before")
        refused = await self.inner.complete_many(completions, ttl)
        await self._pause("complete_many", "after")
        return refused

    async def release_many(self, claims: Sequence[Claimed], retention: float) -> None:
        await self.inner.release_many(claims, retention)

    async def close(self) -> None:
        await self.inner.close()


class SyncGated(Gated):
    """A Gated store with blocking twins, held the same way."""

    def __init__(self, inner: DedupStore) -> None:
        super().__init__(inner)
        assert isinstance(inner, SyncDedupStore)
        self.sync_inner: SyncDedupStore = inner

    def claim_many_sync(
        self, keys: Sequence[DedupKey], lease_ttl: float, tokens: Sequence[str] | None = None
    ) -> list[ClaimResult]:
        self._pause_sync("claim_many", "before")
        results = self.sync_inner.claim_many_sync(keys, lease_ttl, tokens)
        self._pause_sync("claim_many", "after")
        return results

    def renew_sync(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        return self.sync_inner.renew_sync(claims, lease_ttl)

    def complete_many_sync(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        self._pause_sync("complete_many", "before")
        refused = self.sync_inner.complete_many_sync(completions, ttl)
        self._pause_sync("complete_many", "after")
        return refused

    def release_many_sync(self, claims: Sequence[Claimed], retention: float) -> None:
        self.sync_inner.release_many_sync(claims, retention)

    def close_sync(self) -> None:
        close_sync = getattr(self.inner, "close_sync", None)
        if close_sync is not None:
            close_sync()


@dataclass
class World:
    name: str
    store: Gated  # what the decorated functions use
    peer: DedupStore  # another instance over the same records
    namespace: str = field(default_factory=lambda: f"test-cancel:{uuid.uuid4().hex}")

    async def stored(self, key: str) -> ClaimResult:
        """What a peer finds for ``key`` (claiming it for a moment if it is free)."""
        return await self.peer.claim(DedupKey(self.namespace, key), 30)

    def stored_sync(self, key: str) -> ClaimResult:
        """:meth:`stored`, for sync tests: on the background loop."""
        return BACKGROUND.run(self.stored(key))


@pytest_asyncio.fixture(params=["memory", "redis", "postgresql", "mariadb", "sqlite"])
async def world(request: pytest.FixtureRequest) -> AsyncIterator[World]:
    name = request.param
    prepare = None
    if name == "memory":
        inner, peer, cleanup = _memory()
    elif name == "redis":
        harness = redis_stores(redis_url())
        inner, peer, cleanup = harness.store, harness.peer, harness.cleanup
    else:
        url = sql_url(name)
        inner, peer, prepare, cleanup = _sql(url)
    if prepare is not None:
        await prepare()
    gated = SyncGated(inner) if isinstance(inner, SyncDedupStore) else Gated(inner)
    try:
        yield World(name, gated, peer)
    finally:
        gated.let_go()
        for store in (gated, peer):  # the background loop's connections
            await asyncio.to_thread(close_sync_connections, store)
        await cleanup()


def charged(key: str) -> dict[str, str]:
    return {"charged": key}


# -- async callers: cancelled at every await ---------------------------------------------------


class AsyncSubject:
    """An async ``charge(order)`` made idempotent on ``order``, counting its runs."""

    def __init__(self, world: World, cancel_itself: bool = False) -> None:
        self.runs: list[str] = []
        self.entered = asyncio.Event()
        self.gate: asyncio.Event | None = None

        @idempotent(world.store, key="order", lease_ttl=LEASE, namespace=world.namespace)
        async def charge(order: str) -> dict[str, str]:
            self.runs.append(order)
            self.entered.set()
            if self.gate is not None:
                await self.gate.wait()
            if cancel_itself:  # delivered at the first await after the function returns
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
            return charged(order)

        self.charge = charge


async def reached(hold: Hold) -> None:
    assert await asyncio.to_thread(hold.reached.wait, WITHIN), "the store call was never made"


@pytest.mark.parametrize("where", ["before", "during", "after"])
async def test_a_caller_cancelled_while_its_result_is_recorded_leaves_it_recorded(
    world: World, where: str
) -> None:
    """before: the cancellation arrives as the function returns, before the store call;
    during: while the store has not yet seen the completion; after: once it recorded it but
    before it answered."""
    subject = AsyncSubject(world, cancel_itself=where == "before")
    first = asyncio.ensure_future(subject.charge.call_with_info("o-1"))
    if where != "before":
        hold = world.store.hold_at("complete_many", "before" if where == "during" else "after")
        await reached(hold)
        first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert subject.runs == ["o-1"]

    retry = asyncio.ensure_future(subject.charge.call_with_info("o-1"))
    world.store.let_go()
    assert await asyncio.wait_for(retry, WITHIN) == IdempotentResult(charged("o-1"), True, "o-1")
    assert subject.runs == ["o-1"], "the retry replayed: the function ran once"
    stored = await world.stored("o-1")
    assert isinstance(stored, Completed) and stored.result["r"] == charged("o-1")


async def test_a_client_timeout_while_the_result_is_recorded_is_replayed_by_the_retry(
    world: World,
) -> None:
    """The natural case: an HTTP client's timeout, asyncio.wait_for around the call."""
    subject = AsyncSubject(world)
    world.store.hold_at("complete_many", "before")
    with pytest.raises(asyncio.TimeoutError):  # held until after the timeout, wherever it hit
        await asyncio.wait_for(subject.charge("o-1"), 0.05)
    retry = asyncio.ensure_future(subject.charge("o-1"))
    world.store.let_go()
    assert await asyncio.wait_for(retry, WITHIN) == charged("o-1")
    assert subject.runs == ["o-1"]
    assert isinstance(await world.stored("o-1"), Completed)


@pytest.mark.parametrize("where", ["before", "after"])
async def test_a_caller_cancelled_during_its_claim_leaves_no_claim_held(
    world: World, where: str
) -> None:
    subject = AsyncSubject(world)
    hold = world.store.hold_at("claim_many", where)
    first = asyncio.ensure_future(subject.charge("o-1"))
    await reached(hold)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    retry = asyncio.ensure_future(subject.charge.call_with_info("o-1"))
    world.store.let_go()
    assert await asyncio.wait_for(retry, WITHIN) == IdempotentResult(charged("o-1"), False, "o-1")
    assert subject.runs == ["o-1"], "the first call never ran the function; the retry did"


async def test_a_function_cancelled_while_it_runs_releases_its_claim(world: World) -> None:
    subject = AsyncSubject(world)
    subject.gate = asyncio.Event()
    first = asyncio.ensure_future(subject.charge("o-1"))
    await asyncio.wait_for(subject.entered.wait(), WITHIN)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    subject.gate.set()
    retry = await asyncio.wait_for(subject.charge.call_with_info("o-1"), WITHIN)
    assert retry == IdempotentResult(charged("o-1"), False, "o-1"), "ran again at once"
    assert subject.runs == ["o-1", "o-1"]


# -- sync callers: interrupted by a signal handler ---------------------------------------------


def _blocked(thread_id: int) -> bool:
    """Whether the thread waits on a lock (in threading's Condition.wait)."""
    frame = sys._current_frames().get(thread_id)
    return (frame is not None and frame.f_code.co_name == "wait"
            and frame.f_code.co_filename == threading.__file__)


@pytest.fixture
def interrupts() -> Iterator[Callable[[], None]]:
    """A function that makes the main thread raise Interrupted, as a signal-based timeout or
    Ctrl-C would: at once when called on the main thread, else once the main thread waits
    (for the background loop: a signal could land anywhere, but that is where it waits)."""
    assert threading.current_thread() is threading.main_thread()
    main = threading.main_thread().ident
    assert main is not None

    def handler(signum: int, frame: object) -> None:
        raise Interrupted()

    def when_blocked() -> None:
        give_up = time.monotonic() + WITHIN
        while not _blocked(main):
            assert time.monotonic() < give_up, "the main thread never waited"
            time.sleep(POLL / 10)
        signal.pthread_kill(main, signal.SIGUSR1)

    def interrupt() -> None:
        if threading.get_ident() == main:
            signal.pthread_kill(main, signal.SIGUSR1)
        else:
            threading.Thread(target=when_blocked, daemon=True).start()

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        yield interrupt
    finally:
        signal.signal(signal.SIGUSR1, previous)


class SyncSubject:
    """A sync ``charge(order)`` made idempotent on ``order``, counting its runs; while
    ``interrupt`` is set, the function calls it and waits to be interrupted."""

    def __init__(self, world: World) -> None:
        self.runs: list[str] = []
        self.interrupt: Callable[[], None] | None = None

        @idempotent(world.store, key="order", lease_ttl=LEASE, namespace=world.namespace)
        def charge(order: str) -> dict[str, str]:
            self.runs.append(order)
            if self.interrupt is not None:
                self.interrupt()
                threading.Event().wait(WITHIN)  # the signal's handler raises in here
                raise AssertionError("never interrupted")
            return charged(order)

        self.charge = charge


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_sync_caller_interrupted_while_its_result_is_recorded_leaves_it_recorded(
    world: World, interrupts: Callable[[], None], where: str
) -> None:
    subject = SyncSubject(world)
    world.store.hold_at("complete_many", where).interrupt = interrupts
    with pytest.raises(Interrupted):
        subject.charge("o-1")
    world.store.let_go()
    assert subject.charge.call_with_info("o-1") == IdempotentResult(charged("o-1"), True, "o-1")
    assert subject.runs == ["o-1"]
    assert isinstance(world.stored_sync("o-1"), Completed)


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_sync_caller_interrupted_during_its_claim_leaves_no_claim_held(
    world: World, interrupts: Callable[[], None], where: str
) -> None:
    subject = SyncSubject(world)
    world.store.hold_at("claim_many", where).interrupt = interrupts
    with pytest.raises(Interrupted):
        subject.charge("o-1")
    world.store.let_go()
    assert subject.charge.call_with_info("o-1") == IdempotentResult(charged("o-1"), False, "o-1")
    assert subject.runs == ["o-1"]


def test_a_sync_function_interrupted_while_it_runs_releases_its_claim(
    world: World, interrupts: Callable[[], None]
) -> None:
    subject = SyncSubject(world)
    subject.interrupt = interrupts
    with pytest.raises(Interrupted):
        subject.charge("o-1")
    subject.interrupt = None
    assert subject.charge.call_with_info("o-1") == IdempotentResult(charged("o-1"), False, "o-1")
    assert subject.runs == ["o-1", "o-1"]


def test_work_whose_event_loop_closed_is_waited_for_no_longer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A call that gave up in a loop that then closed (never running its settling again):
    later calls with the key go on at once, with a warning, instead of waiting wait_timeout."""
    settling = Settling("f")
    loop = asyncio.new_event_loop()
    settling.track("k", loop.create_future())
    loop.close()
    started = time.monotonic()
    settling.wait_sync("k", WITHIN)
    assert time.monotonic() - started < WITHIN / 2, "it waited for work that never ends"
    assert not settling.has("k")
    assert "settling the claim of idempotency key 'k' was cancelled" in caplog.text


async def test_a_client_timeout_in_a_claim_statement_leaves_sqlite_usable() -> None:
    """A client timeout inside the claim's statement (a trigger makes the INSERT take 0.5 s
    inside SQLite, so the timeout lands there every time): the claim is let finish and
    released, and the retry runs the function once. (A loaded run timed out in the claim of the
    test above, the file stayed locked and its retry failed; there the wrapper hid the store's
    ``cancel_safe_calls``, so the claim was cut in flight. This test passes with and without
    that: SQLite released the cut statement's lock here, as it did not under load.)"""
    inner, peer, prepare, cleanup = _sql("sqlite://")
    await prepare()
    engine = inner.engine  # type: ignore[attr-defined]
    sa.event.listen(engine.sync_engine, "connect", lambda connection, _record:
                    connection.create_function("pause", 1, _pause))
    await engine.dispose()  # the pooled connections: made again, with the function
    table = inner.table.name  # type: ignore[attr-defined]
    async with engine.begin() as connection:
        await connection.execute(sa.text(
            f"CREATE TRIGGER slow_claim AFTER INSERT ON {table} BEGIN SELECT pause(0.5); END"))
    world = World("sqlite", Gated(inner), peer)
    subject = AsyncSubject(world)
    try:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(subject.charge("o-1"), 0.1)
        assert subject.runs == []
        assert await asyncio.wait_for(subject.charge("o-1"), WITHIN) == charged("o-1")
        assert subject.runs == ["o-1"]
    finally:
        for store in (world.store, peer):
            await asyncio.to_thread(close_sync_connections, store)
        await cleanup()


def _pause(seconds: float) -> float:
    time.sleep(seconds)  # inside SQLite's statement, on aiosqlite's thread
    return seconds
