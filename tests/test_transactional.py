"""Transactional handlers: the handler's writes and its dedup record commit together, or neither.

Each test runs a Subscriber on the in-memory broker with a SqlDedupStore on PostgreSQL and on
SQLite, and counts the handler's effects as rows of a ``payments`` table, read outside the
consumer. The real-process cases (SIGKILL, SIGSTOP) are in test_transactional_processes.py.
"""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_sub import (
    ClaimLostError,
    ConfigurationError,
    DeadLetterPolicy,
    LeasePolicy,
    MemoryDedupStore,
    Message,
    Outcome,
    RetryPolicy,
    Subscriber,
    SystemClock,
    current_claim,
)
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.dedup import Completed, DedupKey, InProgress, SqlDedupStore
from reliable_sub.testing.services import sql_url
from reliable_sub.testing.timing import drive_until
from tests.memory_world import serve_until

# Real seconds a test may wait for something that takes milliseconds.
WITHIN = 10.0


@dataclass
class World:
    store: SqlDedupStore
    payments: Any  # sa.Table
    broker: MemoryAdapter = field(default_factory=MemoryAdapter)
    outcomes: list[tuple[str, Outcome]] = field(default_factory=list)

    def subscriber(self, **options: Any) -> Subscriber:
        options.setdefault("retry", RetryPolicy(min_backoff=0.01, max_backoff=0.02))
        return Subscriber(
            self.broker, dedup=self.store,
            on_outcome=lambda m, o: self.outcomes.append((m.id, o)), **options,
        )

    async def rows(self) -> list[tuple[str, str]]:
        async with self.store.engine.connect() as connection:
            result = await connection.execute(
                sa.select(self.payments.c.message_id, self.payments.c.note)
                .order_by(self.payments.c.id)
            )
            return [(r[0], r[1]) for r in result]

    async def record(self, message_id: str) -> Any:
        key = DedupKey(self.broker.dedup_namespace("billing"), message_id)
        [result] = await self.store.claim_many([key], 0.001, ["probe"])
        return result

    async def served(self, sub: Subscriber, until: Callable[[], bool], what: str) -> None:
        await serve_until(sub, until, what, WITHIN)


def _payments_table(metadata: Any, name: str) -> Any:
    return sa.Table(
        name, metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        # no unique constraint on purpose: only the dedup record keeps effects single
        sa.Column("message_id", sa.String(100), nullable=False),
        sa.Column("note", sa.String(100), nullable=False),
    )


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
async def world(request: pytest.FixtureRequest) -> AsyncIterator[World]:
    url = sql_url(request.param)
    suffix = uuid.uuid4().hex[:10]
    store = SqlDedupStore(url, table=f"test_tx_processed_{suffix}")
    payments = _payments_table(store.metadata, f"test_tx_payments_{suffix}")
    await store.create_schema()  # creates every table on store.metadata: payments too
    world = World(store, payments)
    world.broker.ensure_subscription_sync("orders", "billing")
    try:
        yield world
    finally:
        async with store.engine.begin() as connection:
            await connection.run_sync(store.metadata.drop_all)
        await store.close()
        store.close_sync()


def _insert(world: World, message: Message, note: str) -> Any:
    return sa.insert(world.payments).values(message_id=message.id, note=note)


async def test_async_handler_commits_its_write_with_the_record_and_a_duplicate_is_a_no_op(
    world: World,
) -> None:
    sub = world.subscriber()

    @sub.handler("billing", transactional=True)
    async def charge(message: Message, connection: Any) -> dict[str, str]:
        assert connection.in_transaction()
        await connection.execute(_insert(world, message, "charged"))
        return {"charged": message.id}

    first = await world.broker.publish("orders", b"pay", {"idempotency-key": "order-1"})
    task = asyncio.ensure_future(sub.serve())
    try:
        await drive_until(SystemClock(), lambda: len(world.outcomes) == 1, WITHIN)
        # the producer retries: the same key again, after the first was handled
        second = await world.broker.publish("orders", b"pay", {"idempotency-key": "order-1"})
        await drive_until(SystemClock(), lambda: len(world.outcomes) == 2, WITHIN)
    finally:
        await sub.shutdown(timeout=5)
        await task

    assert world.outcomes == [(first, Outcome.ACKED), (second, Outcome.DUPLICATE)]
    assert await world.rows() == [(first, "charged")]
    record = await world.record("order-1")
    assert isinstance(record, Completed) and record.result == {"charged": first}


async def test_sync_handler_gets_a_sync_connection_on_its_worker_thread(world: World) -> None:
    sub = world.subscriber()
    threads: list[str] = []

    @sub.handler("billing", transactional=True)
    def charge(message: Message, connection: Any) -> int:
        threads.append(threading.current_thread().name)
        assert connection.in_transaction()
        connection.execute(_insert(world, message, "sync"))
        return 7

    message_id = await world.broker.publish("orders", b"pay")
    await world.served(sub, lambda: len(world.outcomes) == 1, "the delivery to settle")

    assert world.outcomes == [(message_id, Outcome.ACKED)]
    assert threads and threads[0] != threading.main_thread().name
    assert await world.rows() == [(message_id, "sync")]
    record = await world.record(message_id)
    assert isinstance(record, Completed) and record.result == 7


async def test_a_failing_handler_leaves_nothing_and_the_retry_commits_once(world: World) -> None:
    sub = world.subscriber()
    attempts: list[int] = []

    @sub.handler("billing", transactional=True)
    async def charge(message: Message, connection: Any) -> None:
        attempts.append(message.delivery_attempt)
        await connection.execute(_insert(world, message, f"attempt {len(attempts)}"))
        if len(attempts) < 3:
            raise ConnectionError("the payment provider timed out")

    message_id = await world.broker.publish("orders", b"pay")
    await world.served(sub, lambda: (message_id, Outcome.ACKED) in world.outcomes,
                       "the third attempt to succeed")

    assert [o for _, o in world.outcomes] == [Outcome.RETRY, Outcome.RETRY, Outcome.ACKED]
    assert await world.rows() == [(message_id, "attempt 3")], "failed attempts rolled back"


async def test_a_claim_taken_over_before_commit_rolls_back_the_handlers_writes(
    world: World,
) -> None:
    sub = world.subscriber()
    peer_token = "peer.1"

    @sub.handler("billing", transactional=True)
    async def charge(message: Message, connection: Any) -> str:
        claim = current_claim()
        assert claim is not None
        if message.delivery_attempt == 1:
            # A peer takes the key over while this handler runs (as after its lease lapsed),
            # committing on a connection of its own. (Before this handler's first write: on
            # SQLite that write takes the database's write lock until the commit.)
            await _take_over(world.store, claim.key, peer_token)
        await connection.execute(_insert(world, message, "stale"))
        return "done"

    message_id = await world.broker.publish("orders", b"pay")
    await world.served(sub, lambda: len(world.outcomes) >= 1, "the first delivery to settle")

    assert world.outcomes[0] == (message_id, Outcome.DEFERRED)
    assert await world.rows() == [], "the handler's write went with the rollback"
    assert sub.stats.lost_claims == 1
    key = DedupKey(world.broker.dedup_namespace("billing"), message_id)
    t = world.store.table
    async with world.store.engine.connect() as connection:
        owner = (await connection.execute(
            sa.select(t.c.owner, t.c.state).where(t.c.key == key.key)
        )).one()
    assert tuple(owner) == (peer_token, "claimed"), "the peer's claim is untouched"


async def _take_over(store: SqlDedupStore, key: DedupKey, token: str) -> None:
    t = store.table
    async with store.engine.begin() as connection:
        updated = await connection.execute(
            sa.update(t).where(t.c.namespace == key.namespace, t.c.key == key.key)
            .values(owner=token)
        )
        assert updated.rowcount == 1


async def test_claim_lost_error_is_not_a_handler_failure_even_through_middleware(
    world: World,
) -> None:
    seen: list[Any] = []

    async def watching(context: Any, call_next: Any) -> Any:
        try:
            decision = await call_next(context)
        except ClaimLostError as error:
            seen.append(error)
            raise
        return decision

    sub = world.subscriber(middleware=[watching])

    @sub.handler("billing", transactional=True)
    async def charge(message: Message, connection: Any) -> None:
        claim = current_claim()
        assert claim is not None
        await _take_over(world.store, claim.key, "peer.2")
        await connection.execute(_insert(world, message, "stale"))

    message_id = await world.broker.publish("orders", b"pay")
    await world.served(sub, lambda: len(world.outcomes) >= 1, "the delivery to settle")
    assert world.outcomes[0] == (message_id, Outcome.DEFERRED)
    assert len(seen) == 1 and message_id in str(seen[0])
    assert sub.stats.handler_errors == 0
    assert await world.rows() == []


async def test_a_sync_decorator_around_an_async_transactional_handler_commits_once(
    world: World,
) -> None:
    """A ``functools.wraps`` wrapper around ``async def`` is run as the coroutine it returns,
    on an async connection: the write and the record commit once (#24: before, the
    coroutine was never awaited and the message acked with nothing written)."""
    sub = world.subscriber()

    async def charge(message: Message, connection: Any) -> str:
        await connection.execute(_insert(world, message, "wrapped"))
        return "charged"

    @functools.wraps(charge)
    def logged(*args: Any) -> Any:
        return charge(*args)

    sub.handler("billing", transactional=True)(logged)
    message_id = await world.broker.publish("orders", b"pay")
    await world.served(sub, lambda: len(world.outcomes) == 1, "the delivery to settle")

    assert world.outcomes == [(message_id, Outcome.ACKED)]
    assert await world.rows() == [(message_id, "wrapped")]
    record = await world.record(message_id)
    assert isinstance(record, Completed) and record.result == "charged"


async def test_a_sync_transactional_handler_returning_a_coroutine_is_a_failed_attempt(
    world: World,
) -> None:
    """A sync callable that hands back a coroutine cannot run it inside its transaction on its
    thread: the attempt fails and rolls back (never acked as done), and says why."""
    events: list[Any] = []
    sub = world.subscriber(retry=RetryPolicy(min_backoff=60, max_backoff=60),
                           on_event=events.append)
    calls: list[str] = []

    async def charge(message: Message, connection: Any) -> str:
        calls.append(message.id)  # never reached: the coroutine is closed unrun
        return "charged"

    sub.handler("billing", transactional=True)(lambda message, connection: charge(
        message, connection))
    message_id = await world.broker.publish("orders", b"pay")
    await world.served(sub, lambda: len(world.outcomes) == 1, "the delivery to settle")

    assert world.outcomes == [(message_id, Outcome.RETRY)]
    assert calls == [] and await world.rows() == []
    assert "returned an awaitable from a sync call" in str(events[0].error)
    assert not isinstance(await world.record(message_id), Completed)


async def test_a_renewal_blocked_by_the_handlers_open_transaction_does_not_let_leases_lapse(
    tmp_path: Path,
) -> None:
    """#24 item 14: on SQLite a transactional handler's first write takes the database's write
    lock until its commit, so its claim's renewal waits on its own transaction. The lease tick
    used to wait with it: the broker lease lapsed and the message came back (a duplicate at
    best). Renewals now run beside the tick, bounded; the broker lease is extended meanwhile."""
    store = SqlDedupStore(f"sqlite:///{tmp_path}/dedup.db", table="processed")
    payments = _payments_table(store.metadata, "payments")
    await store.create_schema()
    broker = MemoryAdapter()
    await broker.ensure_subscription("orders", "billing", ack_deadline=1.0)
    outcomes: list[Outcome] = []
    sub = Subscriber(broker, dedup=store, lease=LeasePolicy(min_extension=0.5,
                                                            max_extension=1.0),
                     on_outcome=lambda m, o: outcomes.append(o))
    runs: list[str] = []

    @sub.handler("billing", transactional=True)
    async def charge(message: Message, connection: Any) -> None:
        runs.append(message.id)
        await connection.execute(sa.insert(payments).values(message_id=message.id,
                                                            note="held"))
        await asyncio.sleep(3.0)  # the handler's own slow work, inside its transaction

    try:
        await broker.publish("orders", b"pay")
        await serve_until(sub, lambda: bool(outcomes), "the delivery to settle", WITHIN)
    finally:
        await store.close()
        store.close_sync()
    assert outcomes == [Outcome.ACKED] and len(runs) == 1


def test_transactional_needs_a_store_that_commits_in_the_handlers_transaction() -> None:
    broker = MemoryAdapter()
    for dedup in (None, MemoryDedupStore()):
        sub = Subscriber(broker, dedup=dedup)
        with pytest.raises(ConfigurationError, match="SqlDedupStore"):
            sub.handler("billing", transactional=True)


@pytest.mark.parametrize("database", ["postgresql", "mariadb"])
async def test_the_event_loop_keeps_ticking_while_a_claim_waits_on_a_locked_row(
    database: str,
) -> None:
    """A claim blocked by a row lock (a peer's open transaction) must not stall the loop: the
    loop goes on turning while the claim waits, and the claim finishes once the lock is let go.
    (A claim that blocked the loop could not finish before the holder lets go, which it does
    only after the loop has turned 30 times.)"""
    store = SqlDedupStore(sql_url(database), table=f"test_tx_lock_{uuid.uuid4().hex[:10]}")
    await store.create_schema()
    key = DedupKey("ns", "locked")
    [first] = await store.claim_many([key], 60)
    holder = store.sync_engine
    t = store.table
    locked, release = threading.Event(), threading.Event()

    def hold_the_row_lock() -> None:
        with holder.begin() as connection:
            connection.execute(sa.select(t.c.key).where(t.c.key == "locked").with_for_update())
            locked.set()
            release.wait(WITHIN)

    holder_thread = threading.Thread(target=hold_the_row_lock)
    holder_thread.start()
    try:
        assert await asyncio.to_thread(locked.wait, WITHIN)
        claim = asyncio.create_task(store.claim_many([key], 60, ["me.waiting"]))
        for _ in range(30):  # 30 turns of the loop with the claim parked on the row lock
            await asyncio.sleep(0.01)
            assert not claim.done(), "the claim should wait for the row lock"
        release.set()
        [verdict] = await asyncio.wait_for(claim, WITHIN)
    finally:
        release.set()
        holder_thread.join(WITHIN)
        async with store.engine.begin() as connection:
            await connection.run_sync(store.metadata.drop_all)
        await store.close()
        store.close_sync()
    assert first is not None and isinstance(verdict, InProgress)


@pytest.mark.parametrize("database", ["sqlite", "postgresql", "mariadb"])
def test_the_transactional_example_runs_and_charges_each_payment_once(database: str) -> None:
    url = sql_url(database)
    done = subprocess.run(
        [sys.executable, "examples/transactional.py", url],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "payments: ['P-1', 'P-2'] balance: 50.00" in done.stdout, done.stdout


async def test_an_orm_session_bound_to_the_connection_joins_the_transaction(
    world: World,
) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession

    sub = world.subscriber()

    @sub.handler("billing", transactional=True)
    async def charge(message: Message, connection: Any) -> None:
        async with AsyncSession(bind=connection) as session:
            await session.execute(_insert(world, message, "orm"))
            await session.commit()  # joins the outer transaction: does not commit it
        if message.delivery_attempt == 1:
            raise ConnectionError("after the session's commit: must still roll back")

    message_id = await world.broker.publish("orders", b"pay")
    await world.served(sub, lambda: (message_id, Outcome.ACKED) in world.outcomes,
                       "the second attempt to succeed")
    assert await world.rows() == [(message_id, "orm")], "the first attempt left nothing"


@dataclass
class Payment:
    order: str
    cents: int


async def test_a_typed_body_in_a_transactional_handler(world: World) -> None:
    """``handler(body, message, connection)``: the body decoded, the write committed with the
    record; a body that does not validate is dead-lettered at once and writes nothing."""
    world.broker.ensure_subscription_sync("orders-dlq", "orders-dlq-ops")
    sub = world.subscriber(dead_letter=DeadLetterPolicy("orders-dlq", 5))

    @sub.handler("billing", transactional=True)
    async def charge(payment: Payment, message: Message, connection: Any) -> Payment:
        await connection.execute(_insert(world, message, f"{payment.order}:{payment.cents}"))
        return payment

    good = await world.broker.publish("orders", b'{"order": "o-1", "cents": 250}')
    await world.broker.publish("orders", b'{"order": "o-2"}')
    await world.served(sub, lambda: len(world.outcomes) == 2, "both settled")
    assert sorted(o for _, o in world.outcomes) == [Outcome.ACKED, Outcome.DEAD_LETTERED]
    assert await world.rows() == [(good, "o-1:250")]
    record = await world.record(good)
    assert isinstance(record, Completed) and record.result == {"order": "o-1", "cents": 250}
