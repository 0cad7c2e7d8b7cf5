"""Handlers' transactions begun by a statement of ours, so a dead pooled connection costs the
handler nothing (#44).

A connection the server closed while it sat in the pool (a restart, ``wait_timeout``, ``KILL``,
``pg_terminate_backend``) fails the first statement sent on it. Were that the handler's own, the
attempt would fail and count toward dead-lettering for a fault that was never the message's. So
the transaction begins with a ``BEGIN`` sent here, before the handler runs: one that meets a
dead connection (SQLAlchemy's ``is_disconnect`` then invalidates it, and the pool every
connection older than it) is begun once more on a fresh connection, invisibly. Once the handler
has run statements, a lost connection is that attempt's failure: its writes are rolled back
with the transaction, and the retry counts.

It costs no round trip more than the handler paid anyway, so the handler pool needs no pre-ping
(a round trip per checkout):

* PostgreSQL: the ``BEGIN`` is the one psycopg would send before the handler's first statement
  (a round trip of its own), sent here instead, with the driver in autocommit for the checkout
  so that it does not send a second one; it carries the isolation level, read-only and
  deferrable settings psycopg would have given it. COMMIT and ROLLBACK go through the driver as
  before (psycopg sends them whenever a transaction is open, autocommit or not).
* MariaDB begins a transaction implicitly with its first statement: the ``BEGIN`` takes the
  pre-ping's place, and is left out where the pool pings each checkout anyway (the sync engine,
  shared with scripts, does).
* SQLite has no server to close a connection: a plain ``engine.begin()``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    AsyncExitStack,
    ExitStack,
    asynccontextmanager,
    contextmanager,
)
from typing import Any

import sqlalchemy as sa  # imported by _sql_engines only, once it has checked the sql extra
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

# A connection found dead is replaced this many times before the failure is the handler's: the
# first failure empties the pool of the connections as old as the dead one, so a second
# checkout is a new connection (a second failure means the database is down).
_ATTEMPTS = 2


def begin(engine: AsyncEngine) -> AbstractAsyncContextManager[AsyncConnection]:
    """``engine.begin()``, its transaction begun by a ``BEGIN`` of ours where a dead pooled
    connection would otherwise fail the handler's first statement (see the module)."""
    if _sends_begin(engine.sync_engine):
        return _checked(engine)
    return engine.begin()


def begin_sync(engine: Engine) -> AbstractContextManager[Connection]:
    """:func:`begin` for a sync engine (a sync handler on its worker thread)."""
    if _sends_begin(engine):
        return _checked_sync(engine)
    return engine.begin()


def _sends_begin(engine: Engine) -> bool:
    name = engine.dialect.name
    # pool_pre_ping, as the pool keeps it (since SQLAlchemy 1.2); unknown counts as no ping
    return name == "postgresql" or (name != "sqlite" and not getattr(engine.pool, "_pre_ping",
                                                                     False))


@asynccontextmanager
async def _checked(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    async with AsyncExitStack() as stack:
        for attempt in range(1, _ATTEMPTS + 1):
            own = AsyncExitStack()  # this connection's way out, last in first out
            connection = await engine.connect()
            own.push_async_callback(connection.close)  # (rolls back what is left open)
            try:
                transaction = await connection.begin()  # SQLAlchemy's: nothing sent yet
                statement = "BEGIN"
                if engine.dialect.name == "postgresql":
                    driver: Any = (await connection.get_raw_connection()).driver_connection
                    statement, autocommit = _postgresql_begin(driver)
                    await driver.set_autocommit(True)
                    own.push_async_callback(_restored, connection, driver, autocommit)
                await connection.exec_driver_sql(statement)
            except BaseException as error:
                await own.aclose()
                if attempt == _ATTEMPTS or not _dead(error):
                    raise
                continue
            own.push_async_exit(transaction)  # commit, or roll back on an error
            await stack.enter_async_context(own)
            break
        yield connection


@contextmanager
def _checked_sync(engine: Engine) -> Iterator[Connection]:
    with ExitStack() as stack:
        for attempt in range(1, _ATTEMPTS + 1):
            own = ExitStack()
            connection = engine.connect()
            own.callback(connection.close)
            try:
                transaction = connection.begin()
                statement = "BEGIN"
                if engine.dialect.name == "postgresql":
                    driver: Any = connection.connection.driver_connection
                    statement, autocommit = _postgresql_begin(driver)
                    driver.autocommit = True
                    own.callback(_restored_sync, connection, driver, autocommit)
                connection.exec_driver_sql(statement)
            except BaseException as error:
                own.close()
                if attempt == _ATTEMPTS or not _dead(error):
                    raise
                continue
            own.push(transaction)
            stack.enter_context(own)
            break
        yield connection


def _dead(error: BaseException) -> bool:
    """Did our own first statement meet a connection the database had closed?"""
    return isinstance(error, sa.exc.DBAPIError) and error.connection_invalidated


def _postgresql_begin(driver: Any) -> tuple[str, bool]:
    """The BEGIN psycopg would send on ``driver`` (a psycopg connection), and its autocommit."""
    parts = ["BEGIN"]
    if driver.isolation_level is not None:
        parts.append("ISOLATION LEVEL " + driver.isolation_level.name.replace("_", " "))
    if driver.read_only is not None:
        parts.append("READ ONLY" if driver.read_only else "READ WRITE")
    if driver.deferrable is not None:
        parts.append("DEFERRABLE" if driver.deferrable else "NOT DEFERRABLE")
    return " ".join(parts), bool(driver.autocommit)


async def _restored(connection: AsyncConnection, driver: Any, autocommit: bool) -> None:
    """The driver's autocommit as it was, before the connection goes back to the pool; one
    whose state is unknown (a transaction left open: a rollback the dialect skipped, a
    cancelled statement) is invalidated instead, so that the pool discards it."""
    if connection.invalidated or driver.closed or driver.broken:
        return  # the pool discards it
    if driver.info.transaction_status != _idle():
        await connection.invalidate()
        return
    await driver.set_autocommit(autocommit)


def _restored_sync(connection: Connection, driver: Any, autocommit: bool) -> None:
    if connection.invalidated or driver.closed or driver.broken:
        return
    if driver.info.transaction_status != _idle():
        connection.invalidate()
        return
    driver.autocommit = autocommit


def _idle() -> Any:
    from psycopg.pq import TransactionStatus  # PostgreSQL's driver, there when it is in use

    return TransactionStatus.IDLE


__all__ = ["begin", "begin_sync"]
