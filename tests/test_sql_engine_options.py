"""engine_options: the pools a SQL store or outbox makes are bounded as configured, on a real
PostgreSQL (the number of server connections a process opens is what runs a server out)."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from reliable_sub import ConfigurationError, DedupKey
from reliable_sub.dedup import SqlDedupStore
from reliable_sub.outbox import Outbox
from reliable_sub.testing.services import postgres_url


def connections_named(name: str) -> int:
    url = sa.make_url(postgres_url())
    with psycopg.connect(host=url.host, port=url.port, user=url.username, dbname=url.database,
                         autocommit=True) as connection:
        row = connection.execute("SELECT count(*) FROM pg_stat_activity "
                                 "WHERE application_name = %s", (name,)).fetchone()
    assert row is not None
    return int(row[0])


async def test_a_store_opens_no_more_connections_than_its_pool_allows() -> None:
    name = f"engine-options-{uuid.uuid4().hex[:8]}"
    store = SqlDedupStore(f"{postgres_url()}?application_name={name}",
                          table=f"processed_{uuid.uuid4().hex[:8]}",
                          engine_options={"pool_size": 1, "max_overflow": 1})
    await store.create_schema()
    try:
        peak = 0

        async def claim(index: int) -> None:
            nonlocal peak
            await store.claim_many([DedupKey("options", f"k{index}")], 30)
            peak = max(peak, connections_named(name))

        await asyncio.gather(*(claim(i) for i in range(12)))
        assert 1 <= peak <= 2 and connections_named(name) <= 2
    finally:
        async with store.engine.begin() as connection:
            await connection.run_sync(store.table.drop)
        await store.close()


def test_engine_options_are_refused_for_a_given_engine_or_when_not_a_dict() -> None:
    engine = create_async_engine(postgres_url().replace("postgresql://",
                                                        "postgresql+psycopg://"))
    with pytest.raises(ConfigurationError, match="configure the AsyncEngine you pass"):
        SqlDedupStore(engine, engine_options={"pool_size": 1})
    with pytest.raises(ConfigurationError, match=r"Outbox\.engine_options must be a dict"):
        Outbox(postgres_url(), engine_options=[("pool_size", 1)])  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_handlers_transaction_keeps_the_engines_isolation_and_read_only(
        kind: str) -> None:
    """On PostgreSQL the handler's BEGIN is the store's, sent in the driver's autocommit (#44):
    it carries what psycopg's own would have (the engine's isolation level, read-only), and
    the connection goes back to the pool as it came."""
    url = postgres_url()
    options = {"isolation_level": "SERIALIZABLE",
               "execution_options": {"postgresql_readonly": True}}
    store = SqlDedupStore(url, table="never_made", engine_options=options)
    show = ("SELECT current_setting('transaction_isolation'), "
            "current_setting('transaction_read_only')")
    try:
        if kind == "async":
            async with store.begin() as connection:
                seen = tuple((await connection.exec_driver_sql(show)).one())
            async with store._engines.transaction_engine.connect() as connection:
                raw = await connection.get_raw_connection()
                autocommit = raw.driver_connection.autocommit  # type: ignore[union-attr]
        else:
            def run() -> tuple[tuple[object, ...], bool]:
                with store.begin_sync() as connection:
                    found = tuple(connection.exec_driver_sql(show).one())
                with store.sync_engine.connect() as connection:
                    return found, connection.connection.driver_connection.autocommit
            seen, autocommit = await asyncio.to_thread(run)
        assert seen == ("serializable", "on")
        assert autocommit is False, "the pool got its connection back out of autocommit"
    finally:
        await store.close()
        store.close_sync()
