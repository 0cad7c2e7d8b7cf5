"""SqlDedupStore: the dedup store in your own database, so a handler's effect and its dedup
record can commit in one transaction (extra ``sql``).

SQLAlchemy 2 Core, on PostgreSQL (psycopg 3), MariaDB 10.6+ (asyncmy and PyMySQL, extra
``mysql``) and SQLite. One table (:mod:`reliable_sub.dedup._sql_table`; ``metadata`` holds
it, for your Alembic migrations; :meth:`SqlDedupStore.create_schema` creates it). Times are
epoch seconds from the store's clock: keep consumers' clocks in sync (NTP), as their claims are
compared across hosts.

Never blocking the event loop: the store's own calls run on SQLAlchemy's asyncio engine
(psycopg's async driver, asyncmy, aiosqlite); a *sync* transactional handler, which runs on a
worker thread, gets a connection of a sync engine on the same database. Each batch method is one
statement on PostgreSQL (the claim is an ``INSERT ... ON CONFLICT DO UPDATE`` inside a CTE that
also reports the rows it left alone) and on MariaDB (``INSERT ... ON DUPLICATE KEY UPDATE ...
RETURNING``; see :mod:`._sql_claims_mariadb`), and one transaction of at most two statements on
SQLite.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

from .._results import checked_result_json
from ..clock import Clock, SystemClock
from ..errors import ConfigurationError, MissingExtraError
from ..policy import check_seconds
from ..ports import Claimed, ClaimResult, Completed, Completion, DedupKey, InProgress
from ._store_base import SingleKeyMethods, TokenSource, check_owner

try:
    import sqlalchemy as sa
    from sqlalchemy.engine import URL, Connection, Engine
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
except ImportError as error:  # the sql extra is not installed
    raise MissingExtraError("SqlDedupStore", "sql", "SQLAlchemy") from error

from .._sql_engines import MYSQL_DIALECTS, OnSqlEngines, SqlEngines
from ._sql_claims import SqlClaims
from ._sql_claims_mariadb import MariaDbClaims
from ._sql_table import (
    CLAIMED,
    COMPLETED,
    DEFAULT_TABLE,
    EPOCH_KEY,
    FAILED,
    READABLE_LIMIT,
    processed_table,
    stored,
    stored_part,
)


class SqlDedupStore(OnSqlEngines, SingleKeyMethods):
    """A dedup store on PostgreSQL, MariaDB or SQLite, usable inside a handler's own
    transaction.

    Args:
        url_or_engine: a database URL (``postgresql://...``, ``mariadb://...`` or
            ``mysql://...`` for a MariaDB server, ``sqlite:///path``, ``sqlite://`` for an
            in-process database) or an ``AsyncEngine`` you own.
        table: the table name (default ``reliable_sub_processed``).
        owner: readable prefix of this store's fencing tokens, such as the service's name
            (default: a short random one); see
            :func:`~reliable_sub.dedup.check_owner`.
        clock: the time source (``wall()`` is what rows record).
        sync_engine: the engine sync transactional handlers use (default: one on the same
            database, made on first use).
        engine_options: ``create_engine`` keyword arguments for each engine made from the URL.
            A Subscriber's loop has two pools (claims and completions; handlers' own
            transactions), each SQLAlchemy's default of up to 15 connections: bound them for
            many replicas on one server, e.g. ``{"pool_size": 5, "max_overflow": 5}``.
    """

    # A call cancelled while a statement is in flight must not be left to SQLAlchemy, which
    # terminates the connection inside its transaction: on SQLite (aiosqlite) the database
    # stays write-locked until the garbage collector closes that connection, and every write
    # meanwhile fails after busy_timeout. @idempotent lets this store's calls finish instead.
    cancel_safe_calls = False

    def __init__(
        self,
        url_or_engine: str | URL | AsyncEngine,
        *,
        table: str = DEFAULT_TABLE,
        owner: str | None = None,
        clock: Clock | None = None,
        sync_engine: Engine | None = None,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._tokens = TokenSource(check_owner(owner, "SqlDedupStore"))
        self.owner = self._tokens.owner
        self._clock: Clock = clock or SystemClock()
        self.metadata = sa.MetaData()
        self.table = processed_table(self.metadata, table)
        self._update_sql: Any = None
        self._engines = SqlEngines(url_or_engine, owner="SqlDedupStore", sync_engine=sync_engine,
                                   engine_options=engine_options, retried=True)
        self.dialect = self._engines.dialect
        self._sql = (MariaDbClaims if self.dialect in MYSQL_DIALECTS else SqlClaims)(
            self.table, self.dialect)

    def __repr__(self) -> str:
        return f"SqlDedupStore({self.dialect}, table={self.table.name!r}, owner={self.owner!r})"

    # -- maintenance ---------------------------------------------------------------------------

    async def purge_expired(self, batch_size: int = 1000) -> int:
        """Delete rows whose retention (or lease) has passed, ``batch_size`` at a time;
        returns how many were deleted (a batch deleted just before a lost connection may be
        left out of the count: the batch is sent again on a fresh connection)."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigurationError(f"purge_expired: batch_size must be >= 1, got {batch_size}")
        deleted = 0
        while True:
            count = await self._engines.standalone_call(
                lambda connection: self._sql.purge(connection, self._clock.wall(), batch_size))
            deleted += count
            if count < batch_size:
                return deleted

    # -- epochs (the DedupEpochs capability) -----------------------------------------------

    async def epoch(self, namespace: str) -> int:
        """The current epoch of ``namespace`` (0 if it never had one)."""
        t = self.table
        statement = sa.select(t.c.failures).where(
            t.c.namespace == stored_part(namespace), t.c.key == EPOCH_KEY)
        found = await self._engines.standalone_call(
            lambda connection: connection.scalar(statement))
        return int(found) if found is not None else 0

    async def next_epoch(self, namespace: str) -> int:
        """Start the next epoch of ``namespace`` (one upsert; the row never expires)."""
        # not run twice (it counts): in a transaction begun by a statement of ours, which
        # alone is sent again when it met a dead connection
        async with self._engines.begin() as connection:
            return await self._sql.next_epoch(connection, namespace)

    # -- the DedupStore protocol ----------------------------------------------------------------

    async def claim_many(
        self,
        keys: Sequence[DedupKey],
        lease_ttl: float,
        tokens: Sequence[str] | None = None,
    ) -> list[ClaimResult]:
        if not keys:
            return []
        lease = check_seconds("SqlDedupStore", "lease_ttl", lease_ttl)
        chosen = list(tokens) if tokens else [self._tokens.next() for _ in keys]
        row_keys = [stored(key) for key in keys]
        first: dict[tuple[str, str], int] = {}
        for index, row_key in enumerate(row_keys):
            first.setdefault(row_key, index)
        rows = [(ns, k, chosen[index]) for (ns, k), index in first.items()]
        now = self._clock.wall()
        found = await self._engines.standalone_call(
            lambda connection: self._sql.claim(connection, rows, now, now + lease))
        results: list[ClaimResult] = []
        for index, key in enumerate(keys):
            row = found.get(row_keys[index])
            token = chosen[index]
            if row is None:  # cannot happen: the upsert either wrote or saw every key
                raise RuntimeError(f"claim of {key!r} left no row")
            state, owner, failures, expires_at, result = row
            if state == COMPLETED:
                results.append(Completed(result, key))
            elif owner == token and first[row_keys[index]] == index:
                results.append(Claimed(key, token, failures))
            else:
                results.append(InProgress(max(0.0, expires_at - now), failures))
        return results

    async def renew(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        if not claims:
            return []
        lease = check_seconds("SqlDedupStore", "lease_ttl", lease_ttl)
        now = self._clock.wall()
        renewed = await self._engines.standalone_call(lambda connection: self._sql.update_held(
            connection, claims, now, {"expires_at": now + lease, "lease_expires_at": now + lease},
            failures=True))
        return [claim for claim in claims if stored(claim.key) not in renewed]

    async def complete_many(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        if not completions:
            return []
        retention = check_seconds("SqlDedupStore", "ttl", ttl)
        checked = [checked_result_json(c.result_json) for c in completions]
        now = self._clock.wall()
        rows: dict[tuple[str, str], tuple[str, str, str, str]] = {}
        for completion, result_json in zip(completions, checked, strict=True):
            ns, k = stored(completion.claim.key)
            rows[(ns, k)] = (ns, k, completion.claim.token, result_json)
        refused = await self._engines.standalone_call(lambda connection: self._sql.complete(
            connection, list(rows.values()), now, now + retention))
        return [c.claim for c in completions if stored(c.claim.key) in refused]

    async def release_many(self, claims: Sequence[Claimed], retention: float) -> None:
        if not claims:
            return
        now = self._clock.wall()
        keep = [c for c in claims if c.failures > 0 and retention > 0]
        forget = [c for c in claims if not (c.failures > 0 and retention > 0)]

        async def release(connection: AsyncConnection) -> None:
            if keep:
                await self._sql.update_held(
                    connection, keep, now,
                    {"state": FAILED, "owner": None, "lease_expires_at": None,
                     "expires_at": now + retention},
                    failures=True, report=False,
                )
            if forget:
                await self._sql.forget(connection, forget)

        await self._engines.standalone_call(release)

    # -- inside a handler's transaction ------------------------------------------------------

    def begin(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """An ``AsyncConnection`` in a transaction (commits on exit), from a pool of its own
        (see :attr:`~reliable_sub._sql_engines.SqlEngines.transaction_engine`): the store's
        calls never wait for a connection behind running handlers. The transaction is begun
        by a statement of the store's, so a pooled connection the database closed is replaced
        before your first statement, not failed on it."""
        return self._engines.begin()

    def begin_sync(self) -> AbstractContextManager[Connection]:
        """A sync ``Connection`` in a transaction (for sync handlers; commits on exit), a dead
        pooled connection replaced as in :meth:`begin`."""
        return self._engines.begin_sync()

    def completion_statement(self, claim: Claimed, result_json: str, ttl: float) -> Any:
        """The UPDATE that records ``claim`` as completed, conditional on its token, with its
        parameters bound: run it in your own transaction (an ORM ``Session`` too); 0 rows
        updated means a peer took the key over, and you must roll back."""
        return self._completion_update().params(self._completion_parameters(claim, result_json,
                                                                            ttl))

    async def complete_in(
        self, connection: AsyncConnection, claim: Claimed, result_json: str, ttl: float
    ) -> bool:
        """Record ``claim`` as completed inside ``connection``'s open transaction; False if
        the claim was taken over (then roll the transaction back)."""
        result = await connection.execute(
            self._completion_update(), self._completion_parameters(claim, result_json, ttl)
        )
        return result.rowcount == 1

    def complete_in_sync(
        self, connection: Connection, claim: Claimed, result_json: str, ttl: float
    ) -> bool:
        """:meth:`complete_in` for a sync ``Connection``."""
        result = connection.execute(
            self._completion_update(), self._completion_parameters(claim, result_json, ttl)
        )
        return result.rowcount == 1

    def _completion_parameters(
        self, claim: Claimed, result_json: str, ttl: float
    ) -> dict[str, Any]:
        ns, k = stored(claim.key)
        now = self._clock.wall()
        return {"c_namespace": ns, "c_key": k, "c_owner": claim.token, "c_now": now,
                "c_expires_at": now + check_seconds("SqlDedupStore", "ttl", ttl),
                "c_result": checked_result_json(result_json)}

    def _completion_update(self) -> Any:
        """The owner-fenced completion UPDATE, built once (SQLAlchemy caches its compilation)."""
        if self._update_sql is None:
            t = self.table
            self._update_sql = (
                sa.update(t)
                .where(t.c.namespace == sa.bindparam("c_namespace"),
                       t.c.key == sa.bindparam("c_key"),
                       t.c.owner == sa.bindparam("c_owner"),
                       t.c.state == CLAIMED)
                .values(owner=None, state=COMPLETED, failures=0, lease_expires_at=None,
                        completed_at=sa.bindparam("c_now", type_=sa.Float),
                        expires_at=sa.bindparam("c_expires_at", type_=sa.Float),
                        result=sa.bindparam("c_result", type_=sa.Text))
            )
        return self._update_sql

    async def write_raw(self, key: DedupKey, result_json: str, ttl: float) -> None:
        """Store ``result_json`` unchecked as a completed record (for tests of bad records)."""
        ns, k = stored(key)
        now = self._clock.wall()
        t = self.table
        async with self.engine.begin() as connection:
            await connection.execute(sa.delete(t).where(t.c.namespace == ns, t.c.key == k))
            await connection.execute(sa.insert(t).values(
                namespace=ns, key=k, owner=None, state=COMPLETED, failures=0, completed_at=now,
                expires_at=now + ttl, result=result_json,
            ))


__all__ = ["DEFAULT_TABLE", "READABLE_LIMIT", "SqlDedupStore", "processed_table"]
