"""Async @idempotent callers cancelled while a store call is in flight: its request sent to Redis
or the database, its answer not yet read.

tests/test_idempotent_cancellation.py cancels callers before and after each store call (a
wrapper store holds it there). Here the real store is used as it is, and the caller is cancelled
from inside the client library while the last request of its claim, completion or release is
in flight (Redis: the script ran, its reply is unread; SQL: the statement is with the driver):
redis-py drops the connection the cancellation finds it reading, SQLAlchemy terminates the
database connection it finds in a transaction (on SQLite that leaves the database locked). A
retry with the same key must still replay a function that ran, run at once one that did not (or
raised), and find the store usable.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio

from reliable_sub import Claimed, Completed, DedupKey, DedupStore
from reliable_sub.dedup import Completion
from reliable_sub.idempotency import IdempotentResult, idempotent
from reliable_sub.testing import redis_stores
from reliable_sub.testing.services import redis_url, sql_url
from tests.test_idempotent import _sql

WITHIN = 10.0  # real seconds a retry may take (it waits for the work its first call left)
LEASE = 60.0  # long: a claim left held shows as IdempotencyInProgressError on the retry


@dataclass
class Cut:
    """Counts the requests each batch call sends (Redis: its script call; SQL: its
    statements), and picks the last request of the next call of ``method``: the caller is
    cancelled while it is in flight."""

    method: str | None = None
    caller: asyncio.Task[Any] | None = None
    requests: dict[str, int] = field(default_factory=dict)  # per method, in its last call
    calling: str | None = None  # the method under way
    sent: int = 0  # requests of the call under way
    at: int = 0  # the request to cut, in the call of ``method``
    done: bool = False

    def request(self) -> bool:
        """Called by the client library with each request of a batch call: whether this is
        the one to cut."""
        if self.calling is None:
            return False
        self.sent += 1
        self.requests[self.calling] = self.sent
        if self.calling != self.method or self.done or self.sent != self.at:
            return False
        self.done = True
        return True

    def arm(self, method: str, caller: asyncio.Task[Any]) -> None:
        self.method, self.caller = method, caller
        self.at = self.requests[method]  # as many as the warm-up's call of it sent

    def cancel(self) -> None:
        assert self.caller is not None
        self.caller.cancel()


@dataclass
class InFlight:
    name: str
    store: DedupStore
    peer: DedupStore
    cut: Cut
    namespace: str = field(default_factory=lambda: f"test-in-flight:{uuid.uuid4().hex}")


def _watch(store: DedupStore, cut: Cut) -> None:
    """Mark the store's batch calls, so ``cut`` knows which request is whose."""
    for method in ("claim_many", "complete_many", "release_many"):
        original = getattr(store, method)

        async def marked(*args: Any, _method: str = method, _original: Any = original) -> Any:
            cut.calling, cut.sent = _method, 0
            try:
                return await _original(*args)
            finally:
                cut.calling = None

        setattr(store, method, marked)


def _cut_redis(cut: Cut, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut a script call once sent, where redis-py reads its reply: the script ran, and the
    cancellation finds redis-py reading (it drops the connection, reply unread)."""
    from redis.asyncio.connection import AbstractConnection

    send = AbstractConnection.send_packed_command
    read = AbstractConnection._read_response_from_parser
    cutting: set[AbstractConnection] = set()

    async def sending(self: AbstractConnection, *args: Any, **kwargs: Any) -> None:
        await send(self, *args, **kwargs)
        if b"EVALSHA" in bytes(args[0][0])[:20] and cut.request():  # not a handshake's
            cutting.add(self)

    async def reading(self: AbstractConnection, *args: Any, **kwargs: Any) -> Any:
        if self in cutting:
            cutting.discard(self)
            cut.cancel()
            await asyncio.sleep(0)  # the reply may be buffered already: wait as for one
        return await read(self, *args, **kwargs)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", sending)
    monkeypatch.setattr(AbstractConnection, "_read_response_from_parser", reading)


def _cut_sql(cut: Cut, store: DedupStore) -> None:
    """Cut a statement as it is handed to the driver: the cancellation finds SQLAlchemy
    waiting for it, inside the call's transaction."""
    import sqlalchemy as sa

    def executing(*_: Sequence[Any]) -> None:
        if cut.request():
            cut.cancel()

    engines = store._engines  # type: ignore[attr-defined]  # the test's event loop's
    # the store's engine and its autocommit one (on MariaDB an engine of its own)
    for engine in {engines.engine.sync_engine, engines._autocommit.get().sync_engine}:
        sa.event.listen(engine, "before_cursor_execute", executing)


@pytest_asyncio.fixture(params=["redis", "postgresql", "mariadb", "sqlite"])
async def in_flight(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[InFlight]:
    name = request.param
    cut = Cut()
    if name == "redis":
        _cut_redis(cut, monkeypatch)
        harness = redis_stores(redis_url())
        store, peer, cleanup = harness.store, harness.peer, harness.cleanup
    else:
        url = sql_url(name)
        store, peer, prepare, cleanup = _sql(url)
        await prepare()
        _cut_sql(cut, store)
    _watch(store, cut)
    try:
        yield InFlight(name, store, peer, cut)
    finally:
        await cleanup()


def charged(key: str) -> dict[str, str]:
    return {"charged": key}


class Subject:
    """An async ``charge(order)`` made idempotent on ``order``, counting its runs."""

    def __init__(self, world: InFlight) -> None:
        self.runs: list[str] = []
        self.fail = False

        @idempotent(world.store, key="order", lease_ttl=LEASE, namespace=world.namespace)
        async def charge(order: str) -> dict[str, str]:
            self.runs.append(order)
            if self.fail:
                raise ValueError("declined")
            return charged(order)

        self.charge = charge


async def warm_up(store: DedupStore) -> None:
    """Connect in the test's event loop (and load Redis's scripts: the cut is meant for a
    call's own request), and count each call's requests."""
    for _ in range(2):  # counted the second time, with the scripts loaded
        key = DedupKey("test-in-flight", uuid.uuid4().hex)
        [claim] = await store.claim_many([key], 1.0)
        assert isinstance(claim, Claimed)
        await store.release_many([claim], 0.0)
        [claim] = await store.claim_many([key], 1.0)
        assert isinstance(claim, Claimed)
        assert await store.complete_many([Completion(claim, "null")], 1.0) == []


async def first_call_cut_in(world: InFlight, subject: Subject, method: str) -> None:
    await warm_up(world.store)
    first = asyncio.ensure_future(subject.charge("o-1"))
    world.cut.arm(method, first)
    with pytest.raises(asyncio.CancelledError):
        await first
    assert world.cut.done, f"no request of {method} was sent"


async def test_a_caller_cancelled_in_its_claim_call_leaves_no_claim_held(
    in_flight: InFlight,
) -> None:
    subject = Subject(in_flight)
    await first_call_cut_in(in_flight, subject, "claim_many")
    assert subject.runs == []
    retry = await asyncio.wait_for(subject.charge.call_with_info("o-1"), WITHIN)
    assert retry == IdempotentResult(charged("o-1"), False, "o-1")
    assert subject.runs == ["o-1"]


async def test_a_caller_cancelled_in_its_completion_call_leaves_the_result_recorded(
    in_flight: InFlight,
) -> None:
    subject = Subject(in_flight)
    await first_call_cut_in(in_flight, subject, "complete_many")
    retry = await asyncio.wait_for(subject.charge.call_with_info("o-1"), WITHIN)
    assert retry == IdempotentResult(charged("o-1"), True, "o-1")
    assert subject.runs == ["o-1"], "the retry replayed: the function ran once"
    stored = await in_flight.peer.claim(DedupKey(in_flight.namespace, "o-1"), 30)
    assert isinstance(stored, Completed) and stored.result["r"] == charged("o-1")


async def test_a_caller_cancelled_in_its_release_call_leaves_no_claim_held(
    in_flight: InFlight,
) -> None:
    subject = Subject(in_flight)
    subject.fail = True
    await first_call_cut_in(in_flight, subject, "release_many")
    subject.fail = False
    retry = await asyncio.wait_for(subject.charge.call_with_info("o-1"), WITHIN)
    assert retry == IdempotentResult(charged("o-1"), False, "o-1"), "ran again at once"
    assert subject.runs == ["o-1", "o-1"]
