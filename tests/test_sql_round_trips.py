"""Round trips to PostgreSQL per @idempotent call, counted exactly (libpq's protocol trace: one
``ReadyForQuery`` per round trip). The floor is one statement per store call; a transaction
around it would add BEGIN and COMMIT, and each checkout pings the connection first (#27)."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_sub.dedup import SqlDedupStore
from reliable_sub.idempotency import idempotent
from reliable_sub.testing.services import postgres_url


class Trace:
    """libpq's trace of every connection the engine opens, into one file."""

    def __init__(self) -> None:
        self.file = tempfile.NamedTemporaryFile(prefix="pq-trace-", delete=False)  # noqa: SIM115

    def attach(self, dbapi_connection: Any, _record: Any) -> None:
        pgconn = dbapi_connection.driver_connection.pgconn
        pgconn.trace(self.file.fileno())
        import psycopg

        pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)

    def round_trips(self) -> int:
        with open(self.file.name, encoding="utf-8", errors="replace") as lines:
            return sum(1 for line in lines if "\tReadyForQuery\t" in line)

    def lines(self) -> list[str]:
        with open(self.file.name, encoding="utf-8", errors="replace") as lines:
            return [line.rstrip() for line in lines]

    def close(self) -> None:
        self.file.close()
        os.unlink(self.file.name)


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
    sa.event.listen(made.engine.sync_engine, "connect", trace.attach)
    yield made
    async with made.engine.begin() as connection:
        await connection.run_sync(made.metadata.drop_all)
    await made.close()


async def test_a_first_call_and_a_replay_cost_one_statement_per_store_call_and_a_ping(
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
    # claim, completion: each a pre-ping (a restarted database costs no failed call) and one
    # statement in autocommit, no BEGIN, no COMMIT
    assert (first, replay) == (4, 2), "\n".join(trace.lines()[-40:])
    assert not any('"BEGIN"' in line for line in trace.lines())
