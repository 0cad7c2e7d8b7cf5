"""The SQLAlchemy engines of one database, shared by the SQL dedup store and the outbox.

From a URL (``postgresql://...``, ``mariadb://...`` or ``mysql://...``, ``sqlite:///path``,
``sqlite://``) it makes an asyncio engine per event loop (psycopg's async driver, asyncmy,
aiosqlite: a call that waits on a lock never blocks the loop) and, on first use, a sync engine on
the same database (for sync handlers and scripts). Given an ``AsyncEngine``, it uses that one.
Import it only where the ``sql`` (or ``mysql``) extra is needed.

On MariaDB the library's own sessions (claims, renewals, the relay's rounds) run under READ
COMMITTED and wait at most ``MYSQL_LOCK_WAIT_SECONDS`` for a row lock: under InnoDB's default
REPEATABLE READ a relay round's next-key locks stall writers and a purge stalls claims, and a
plain read inside a transaction sees a snapshot older than the lock it waited for.
Handlers' own transactions keep the server's level.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, TypeVar

from ._loops import PerLoop
from .errors import ConfigurationError, MissingExtraError

try:
    import sqlalchemy as sa
    from sqlalchemy.engine import URL, Connection, Engine, make_url
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
except ImportError as error:  # the sql extra is not installed
    raise MissingExtraError("The SQL store and outbox", "sql", "SQLAlchemy") from error

from . import _sql_begin

T = TypeVar("T")

# The async driver of each dialect, and the sync driver of its sync engine.
ASYNC_DRIVERS = {"postgresql": "psycopg", "sqlite": "aiosqlite", "mysql": "asyncmy",
                 "mariadb": "asyncmy"}
SYNC_DRIVERS = {"postgresql": "psycopg", "sqlite": "pysqlite", "mysql": "pymysql",
                "mariadb": "pymysql"}
# SQLAlchemy names a MariaDB server "mysql" when the URL says mysql://
MYSQL_DIALECTS = ("mysql", "mariadb")
_DRIVER_EXTRAS = {"asyncmy": "mysql", "pymysql": "mysql"}
# How long the library's own MariaDB sessions wait for a row lock before failing (error 1205,
# retried by the caller): a stopped holder must not stall claims for InnoDB's default 50 s.
MYSQL_LOCK_WAIT_SECONDS = 5
# SQLite waits this long (ms) for a lock held by another connection before it fails.
SQLITE_BUSY_TIMEOUT_MS = 5000


class SqlEngines:
    """The async engine of each event loop and one sync engine, on one database.

    Args:
        url_or_engine: a database URL or an ``AsyncEngine`` you own.
        owner: who uses it, for error messages (``"SqlDedupStore"``, ``"Outbox"``).
        sync_engine: the sync engine to use (default: one on the same database, on first use).
        engine_options: keyword arguments for every engine made here (SQLAlchemy's
            ``create_engine``: ``pool_size``, ``max_overflow``, ``pool_recycle``, ...).
        retried: the owner runs every statement of its own engines through
            :meth:`standalone_call` (which runs one again on a fresh connection when it met a
            dead one), so those engines need no pre-ping, a round trip per checkout. Handlers'
            transactions cannot be run again: :meth:`begin` starts them with a statement of
            its own instead, before the handler's first (see :mod:`._sql_begin`), so the
            handlers' pool needs no pre-ping either.
    """

    def __init__(
        self, url_or_engine: str | URL | AsyncEngine, *, owner: str,
        sync_engine: Engine | None = None, engine_options: Mapping[str, Any] | None = None,
        retried: bool = False,
    ) -> None:
        self._options = _checked_options(owner, engine_options, url_or_engine)
        self._retried = retried
        self._given_own: AsyncEngine | None = None  # a given engine, for our own statements
        self._given: AsyncEngine | None = None
        self._throwaway = False
        if isinstance(url_or_engine, AsyncEngine):
            self._given = url_or_engine
            self.url: URL = url_or_engine.url
        elif isinstance(url_or_engine, str | URL):
            given = _postgresql(make_url(url_or_engine))
            self.url = _database_url(given)
            # a throwaway database need not survive a crash: its commits skip the fsync
            self._throwaway = self.url is not given
        else:
            raise ConfigurationError(
                f"{owner} needs a database URL or an AsyncEngine, got "
                f"{type(url_or_engine).__name__}"
            )
        self.dialect: str = self.url.get_backend_name()
        if self.dialect not in ASYNC_DRIVERS:
            raise ConfigurationError(
                f"{owner} supports postgresql, mariadb (mysql://) and sqlite URLs, got "
                f"{self.dialect!r}"
            )
        self.mysql = self.dialect in MYSQL_DIALECTS
        # MariaDB from a URL: an autocommit engine (and pool) of its own, see _make_autocommit
        self._own_autocommit = self.mysql and self._given is None
        if self._given is not None:
            # a given engine keeps its level for handlers' transactions; our statements run
            # READ COMMITTED on MariaDB (see the module's docstring), through a view of it
            self._given_own = (self._given.execution_options(isolation_level="READ COMMITTED")
                               if self.mysql else self._given)
        if self.mysql and self._given is None and "charset" not in self.url.query:
            self.url = self.url.update_query_dict({"charset": "utf8mb4"})
        self._sync = sync_engine
        self._engines: PerLoop[AsyncEngine] = PerLoop(self._make)
        self._transaction_engines: PerLoop[AsyncEngine] = PerLoop(
            lambda: self._make(own_session=False))
        # (see standalone) PostgreSQL: the engine's pool, its connections in autocommit while
        # checked out; MariaDB: an autocommit engine of its own (toggling autocommit on a
        # pooled connection costs four statements per checkout there)
        self._autocommit: PerLoop[AsyncEngine] = PerLoop(self._make_autocommit)

    @property
    def engine(self) -> AsyncEngine:
        """The asyncio engine of the running event loop (for the library's own statements)."""
        if self._given_own is None:
            return self._engines.get()
        return self._given_own

    def standalone(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A connection for statements that each stand alone.

        On PostgreSQL and MariaDB in autocommit: each statement its own transaction, one round
        trip, where a transaction around it would add two (``BEGIN`` and ``COMMIT``; under READ
        COMMITTED each statement of a transaction sees a fresh snapshot anyway). On SQLite a
        transaction (its claim reads back what it wrote, in a second statement). On a MariaDB
        engine you gave, a READ COMMITTED transaction too: its connections are yours to
        configure, and SQLAlchemy applies the level of a view of a view in the wrong order (an
        autocommit view of the READ COMMITTED one ran without autocommit, nothing committed).
        """
        if self.dialect == "sqlite" or (self.mysql and self._given is not None):
            return self.engine.begin()
        return self._autocommit.get().connect()

    async def standalone_call(self, work: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        """``work(connection)`` on a :meth:`standalone` connection, and once more on a fresh
        one if that connection turned out dead (the server restarted, or closed it): for work
        that may run twice, as every dedup-store statement but ``next_epoch`` may. On MariaDB
        this stands in for the pool's pre-ping, which costs a round trip on every call."""
        try:
            async with self.standalone() as connection:
                return await work(connection)
        except sa.exc.DBAPIError as error:
            if not error.connection_invalidated:
                raise
        async with self.standalone() as connection:  # the pool was emptied of the dead ones
            return await work(connection)

    def begin(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A connection of :attr:`transaction_engine` in a transaction (committed on exit,
        rolled back on error), begun by a statement of ours: a connection found dead there is
        replaced before the caller's first statement (see :mod:`._sql_begin`)."""
        return _sql_begin.begin(self.transaction_engine)

    def begin_sync(self) -> AbstractContextManager[Connection]:
        """:meth:`begin` on :attr:`sync_engine`, for sync handlers on their worker threads."""
        return _sql_begin.begin_sync(self.sync_engine)

    @property
    def transaction_engine(self) -> AsyncEngine:
        """The asyncio engine of the running event loop for handlers' own transactions.

        A pool of its own: a handler holds its connection for as long as it runs, and with
        more handlers running than the pool has connections, the store's claims, renewals and
        completions would wait behind them (renewals late, claims lapsed, leases unextended).
        A given engine serves both.
        """
        return self._given if self._given is not None else self._transaction_engines.get()

    @property
    def sync_engine(self) -> Engine:
        """A sync engine on the same database."""
        if self._sync is None:
            url = self.url.set(drivername=f"{self.dialect}+{SYNC_DRIVERS[self.dialect]}")
            self._sync = _driven(sa.create_engine, url, **self._pool_options())
            if self.dialect == "sqlite":
                sa.event.listen(self._sync, "connect", self._sqlite_pragmas)
        return self._sync

    def _make(self, *, own_session: bool = True, **options: Any) -> AsyncEngine:
        """An asyncio engine; ``own_session``: for the library's own statements (on MariaDB
        READ COMMITTED and a short lock wait), else for handlers' transactions."""
        url = self.url.set(drivername=f"{self.dialect}+{ASYNC_DRIVERS[self.dialect]}")
        # the handlers' pool neither: its transactions are begun by a statement of ours
        options = {**self._pool_options(ping=own_session and not self._retried), **options}
        engine: AsyncEngine = _driven(create_async_engine, url, **options)
        if self.dialect == "sqlite":
            sa.event.listen(engine.sync_engine, "connect", self._sqlite_pragmas)
        elif self.mysql and own_session:
            sa.event.listen(engine.sync_engine, "connect", _own_session)
        return engine

    def _make_autocommit(self) -> AsyncEngine:
        if self._own_autocommit:
            # no ROLLBACK when a connection goes back to the pool: in autocommit none of its
            # statements leaves a transaction open (asyncmy would send one: a round trip)
            return self._make(isolation_level="AUTOCOMMIT", skip_autocommit_rollback=True)
        return self.engine.execution_options(isolation_level="AUTOCOMMIT")

    def _pool_options(self, ping: bool = True) -> dict[str, Any]:
        if self.dialect != "sqlite":
            # a restarted database costs no failed call (either way: see ``retried``)
            return {"pool_pre_ping": ping, **self._options}
        return dict(self._options)  # SQLAlchemy's default pool: connections to the file reused

    def _sqlite_pragmas(self, connection: Any, _record: Any) -> None:
        cursor = connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        if self._throwaway:
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = OFF")
        cursor.close()

    async def close(self) -> None:
        """Dispose of this loop's engine (its connections); a later call reconnects."""
        autocommit = self._autocommit.pop()
        if not self._own_autocommit:
            autocommit = None  # the engine's own pool, disposed of with it
        for engine in (self._engines.pop(), self._transaction_engines.pop(), autocommit):
            if engine is not None:
                await engine.dispose()

    def close_sync(self) -> None:
        """Dispose of the sync engine's connections; a later call reconnects."""
        if self._sync is not None:
            self._sync.dispose()


class OnSqlEngines:
    """The engines, schema and connection handling of a class with ``_engines`` (its
    :class:`SqlEngines`) and ``metadata`` (its tables): the SQL dedup store and the outbox."""

    _engines: SqlEngines
    metadata: sa.MetaData

    @property
    def url(self) -> URL:
        """The database URL (``sqlite://`` resolved to its temporary file, so another store or
        outbox given this URL shares the database)."""
        return self._engines.url

    @property
    def engine(self) -> AsyncEngine:
        """The asyncio engine of the running event loop."""
        return self._engines.engine

    @property
    def sync_engine(self) -> Engine:
        """A sync engine on the same database (for sync handlers and scripts)."""
        return self._engines.sync_engine

    async def create_schema(self) -> None:
        """Create the tables and indexes of ``metadata`` that are missing (or put ``metadata``
        in your migrations)."""
        async with self.engine.begin() as connection:
            await connection.run_sync(self.metadata.create_all)

    def create_schema_sync(self) -> None:
        """Blocking twin of :meth:`create_schema`."""
        self.metadata.create_all(self.sync_engine)

    async def close(self) -> None:
        """Dispose of this loop's engine (its connections); the next call reconnects."""
        await self._engines.close()

    def close_sync(self) -> None:
        """Dispose of the sync engine's connections; the next call reconnects."""
        self._engines.close_sync()


def _driven(make: Any, url: URL, **options: Any) -> Any:
    """``make(url, **options)``, its driver's missing extra named when it is not installed."""
    try:
        return make(url, **options)
    except ModuleNotFoundError as error:
        extra = _DRIVER_EXTRAS.get(url.get_driver_name(), "sql")
        raise MissingExtraError(f"A {url.get_backend_name()} database", extra,
                                error.name or url.get_driver_name()) from error


def _own_session(connection: Any, _record: Any) -> None:
    """A MariaDB session of the library's own: READ COMMITTED, a short lock wait."""
    cursor = connection.cursor()
    cursor.execute("SELECT VERSION()")
    check_mysql_server(str(cursor.fetchone()[0]))
    cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
    cursor.execute(f"SET SESSION innodb_lock_wait_timeout = {MYSQL_LOCK_WAIT_SECONDS}")
    cursor.close()


def check_mysql_server(version: str) -> None:
    """Refuse a server the statements do not run on, naming it: MariaDB 10.6 or later is
    needed (``JSON_TABLE``, ``INSERT … RETURNING``, ``SKIP LOCKED``). MySQL has no
    ``INSERT … RETURNING``, and is not supported yet."""
    if "mariadb" not in version.lower():
        raise ConfigurationError(
            f"the server at this mysql:// URL is MySQL {version}, which reliable-sub does not "
            "support yet (it needs INSERT ... RETURNING); use MariaDB 10.6 or later, or "
            "PostgreSQL")
    numbers = re.match(r"(?:5\.5\.5-)?(\d+)\.(\d+)", version)
    if numbers is None or (int(numbers[1]), int(numbers[2])) < (10, 6):
        raise ConfigurationError(
            f"MariaDB {version} is too old for reliable-sub: it needs 10.6 or later "
            "(JSON_TABLE, SKIP LOCKED)")


def _postgresql(url: URL) -> URL:
    """``postgres://`` (Heroku's and many platforms' form) as SQLAlchemy's ``postgresql://``,
    a driver kept (``postgres+asyncpg://``)."""
    backend, plus, driver = url.drivername.partition("+")
    return url.set(drivername=f"postgresql{plus}{driver}") if backend == "postgres" else url


def _database_url(url: URL) -> URL:
    """``sqlite://`` as a throwaway database file, removed at exit; any other URL as it is.

    Not a shared-cache memory database: SQLite locks whole tables there and fails concurrent
    writers at once (``database table is locked``) instead of waiting ``busy_timeout``.
    """
    if url.get_backend_name() == "sqlite" and not url.database:
        directory = tempfile.mkdtemp(prefix="reliable-sub-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        return url.set(database=os.path.join(directory, "db.sqlite3"))
    return url


def _checked_options(
    owner: str, options: object, url_or_engine: object
) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ConfigurationError(
            f"{owner}.engine_options must be a dict of create_engine keyword arguments, got "
            f"{type(options).__name__}")
    if isinstance(url_or_engine, AsyncEngine):
        raise ConfigurationError(
            f"{owner}: engine_options apply to the engines it makes from a URL; configure the "
            "AsyncEngine you pass instead")
    return dict(options)
