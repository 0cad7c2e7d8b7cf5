"""Round trips to PostgreSQL per @idempotent call, per transactional handler and per outbox
relay round, counted exactly (libpq's protocol trace: one ``ReadyForQuery`` per round trip). The
floor of a store call is one statement; a transaction around it would add BEGIN and COMMIT, and
a pre-ping of each checkout one more (#27)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_sub import Message, Outcome, Subscriber, SystemClock
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.dedup import SqlDedupStore
from reliable_sub.idempotency import idempotent
from reliable_sub.outbox import OutboxRelay
from reliable_sub.testing.services import postgres_url
from reliable_sub.testing.timing import drive_until
from tests.outbox_support import add, fresh_outbox
from tests.pq_trace import Trace


@pytest.fixture
def trace() -> Iterator[Trace]:
    traced = Trace()
    yield traced
    traced.close()


@pytest.fixture
async def store(trace: Trace) -> AsyncIterator[SqlDedupStore]:
    made = SqlDedupStore(postgres_url(), table=f"trips_{uuid.uuid4().hex[:8]}")
    await made.create_schema()
    await made.engine.dispose()  # every connection from here on is traced
    trace.follow(made.engine)
    yield made
    async with made.engine.begin() as connection:
        await connection.run_sync(made.metadata.drop_all)
    await made.close()


async def test_a_first_call_and_a_replay_cost_one_statement_per_store_call(
        store: SqlDedupStore, trace: Trace) -> None:
    @idempotent(store, key=lambda order: order["id"], ttl=3600, lease_ttl=30)
    async def charge(order: dict[str, str]) -> dict[str, str]:
        return {"charged": order["id"]}

    await charge({"id": "warm-up"})  # connects: the handshake is not a store call's
    before = trace.round_trips()
    assert await charge({"id": "o-1"}) == {"charged": "o-1"}
    first = trace.round_trips() - before
    assert await charge({"id": "o-1"}) == {"charged": "o-1"}
    replay = trace.round_trips() - before - first
    # claim, completion: each one statement in autocommit, no BEGIN, no COMMIT, and no
    # pre-ping (a statement that meets a dead connection runs again: test_sql_reconnect.py)
    assert (first, replay) == (2, 1), "\n".join(trace.lines()[-40:])
    assert not any('"BEGIN"' in line for line in trace.lines())


async def test_a_transactional_handler_costs_its_own_statements_and_three_more(
        store: SqlDedupStore, trace: Trace) -> None:
    """BEGIN, the handler's INSERT, the completion UPDATE, COMMIT; the claim on the store's own
    pool. No pre-ping: the BEGIN, sent before the handler runs, finds a dead connection
    instead (#44; test_transactional_dead_connections.py)."""
    effects = sa.Table(f"trips_effects_{uuid.uuid4().hex[:8]}", store.metadata,
                       sa.Column("id", sa.Integer, primary_key=True, autoincrement=True))
    await store.create_schema()
    handlers = Trace()
    handlers.follow(store._engines.transaction_engine)
    broker = MemoryAdapter()
    broker.ensure_subscription_sync("orders", "billing")
    outcomes: list[Outcome] = []
    sub = Subscriber(broker, dedup=store, dedup_purge_interval=None,
                     on_outcome=lambda _message, outcome: outcomes.append(outcome))

    @sub.handler("billing", transactional=True)
    async def charge(_message: Message, connection: Any) -> None:
        await connection.execute(effects.insert())

    task = asyncio.ensure_future(sub.serve())
    try:
        await broker.publish("orders", b"warm-up")  # connects: the handshakes are not counted
        await drive_until(SystemClock(), lambda: len(outcomes) == 1, 10.0)
        before = (trace.round_trips(), handlers.round_trips())
        await broker.publish("orders", b"order")
        await drive_until(SystemClock(), lambda: len(outcomes) == 2, 10.0)
        after = (trace.round_trips(), handlers.round_trips())
        lines = handlers.lines()
        begun, pinged = handlers.sent('"BEGIN"'), handlers.sent('";"')
    finally:
        await sub.shutdown(timeout=5)
        await task
        handlers.close()
    assert outcomes == [Outcome.ACKED, Outcome.ACKED]
    assert (after[0] - before[0], after[1] - before[1]) == (1, 4), "\n".join(lines[-40:])
    assert (begun, pinged) == (2, 0), "a BEGIN per message, no pre-ping"


async def test_a_relay_round_marks_without_waiting_for_the_log_flush(trace: Trace) -> None:
    async with fresh_outbox("postgresql") as box:
        await box.engine.dispose()
        trace.follow(box.engine)
        broker = MemoryAdapter()
        broker.ensure_topic_sync("orders")
        relay = OutboxRelay(box, broker)
        assert await relay.relay_once() == 0  # connects: the handshake is not the round's
        for number in range(5):
            await add(box, f"row-{number}".encode())
        before = trace.round_trips()
        assert await relay.relay_once() == 5
        # a pre-ping; BEGIN; the keys, the unkeyed rows; SET LOCAL; the marks; COMMIT
        assert trace.round_trips() - before == 7, "\n".join(trace.lines()[-60:])
        assert trace.sent("SET LOCAL synchronous_commit = off") == 1
        assert await relay.relay_once() == 0
        assert trace.sent("synchronous_commit") == 1, "an empty round writes nothing"
