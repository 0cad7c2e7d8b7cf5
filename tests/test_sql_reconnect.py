"""A connection the database closed costs the SQL dedup store no failed call (#27, #30).

The store's own statements run without the pool's pre-ping (a round trip on every call): one
that meets a dead connection runs again on a fresh one, as every store statement may run twice
(a claim retried under its own tokens finds its own claim). Here the server itself ends the
pooled connection (PostgreSQL's ``pg_terminate_backend``, MariaDB's ``KILL CONNECTION``) between
two calls, from a connection of another pool.
"""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from reliable_sub.dedup import Claimed, DedupKey, SqlDedupStore
from reliable_sub.testing.services import sql_url

WHO = {"postgresql": "SELECT pg_backend_pid()", "mariadb": "SELECT CONNECTION_ID()"}
END = {"postgresql": "SELECT pg_terminate_backend({})", "mariadb": "KILL CONNECTION {}"}


@pytest.mark.parametrize("database", ["postgresql", "mariadb"])
async def test_a_connection_the_server_closed_costs_no_failed_call(database: str) -> None:
    store = SqlDedupStore(sql_url(database), table=f"reconnect_{uuid.uuid4().hex[:8]}")
    await store.create_schema()
    engines = store._engines
    try:
        for round_ in range(2):  # a claim, then an epoch read, each after a kill
            await store.claim_many([DedupKey("ns", f"warm-{round_}")], 30)
            async with engines.standalone() as connection:  # the pool's one connection
                pooled = int((await connection.execute(sa.text(WHO[database]))).scalar_one())
            async with engines.transaction_engine.connect() as other:
                await other.execute(sa.text(END[database].format(pooled)))
            if round_ == 0:
                [claim] = await store.claim_many([DedupKey("ns", "after the kill")], 30)
                assert isinstance(claim, Claimed)
            else:
                assert await store.epoch("ns") == 0
            async with engines.standalone() as connection:
                assert (await connection.execute(sa.text(WHO[database]))).scalar_one() != pooled
    finally:
        async with store.engine.begin() as connection:
            await connection.run_sync(store.metadata.drop_all)
        await store.close()


@pytest.mark.parametrize("database", ["postgresql", "mariadb"])
async def test_a_new_epoch_is_counted_once_after_the_server_closed_its_connection(
        database: str) -> None:
    """next_epoch counts, so it is never run twice: it runs on the pool that pings first."""
    store = SqlDedupStore(sql_url(database), table=f"reconnect_{uuid.uuid4().hex[:8]}")
    await store.create_schema()
    engine = store._engines.transaction_engine
    try:
        assert await store.next_epoch("ns") == 1
        async with engine.connect() as connection:  # the pool's one connection
            pooled = int((await connection.execute(sa.text(WHO[database]))).scalar_one())
        async with store._engines.standalone() as other:
            await other.execute(sa.text(END[database].format(pooled)))
        assert await store.next_epoch("ns") == 2
        assert await store.epoch("ns") == 2
    finally:
        async with store.engine.begin() as connection:
            await connection.run_sync(store.metadata.drop_all)
        await store.close()
