"""Round trips to PostgreSQL per @idempotent call and per outbox relay round, counted exactly
(libpq's protocol trace: one ``ReadyForQuery`` per round trip). The floor of a store call is one
statement; a transaction around it would add BEGIN and COMMIT, and a pre-ping of each checkout
one more (#27)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.dedup import SqlDedupStore
from reliable_sub.idempotency import idempotent
from reliable_sub.outbox import OutboxRelay
from reliable_sub.testing.services import postgres_url
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
