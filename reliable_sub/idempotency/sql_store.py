"""SqlDedupStore: the dedup store in your own database, so a handler's effect and its dedup
record can commit in one transaction (extra ``sql``).

SQLAlchemy 2 Core, on PostgreSQL (psycopg 3) and SQLite. One table (``metadata`` holds it, for
your Alembic migrations; :meth:`SqlDedupStore.create_schema` creates it)::

    namespace  key  owner  state  failures  lease_expires_at  completed_at  expires_at  result
    primary key (namespace, key); index on expires_at (for purge_expired)

``state`` is ``claimed`` (``owner`` holds it until ``lease_expires_at``), ``failed`` (released
after ``failures`` failed attempts, kept until ``expires_at``) or ``completed`` (``result`` is the
handler's result as JSON text). A row whose ``expires_at`` has passed counts as absent. A
namespace's dedup epoch (see :mod:`reliable_sub.idempotency.epochs`) is a row of state ``epoch``
under the key ``h:epoch``, which no message key is stored as. Times are
epoch seconds from the store's clock: keep consumers' clocks in sync (NTP), as their claims are
compared across hosts. Namespaces and keys longer than ``READABLE_LIMIT`` characters are stored
as ``h:`` + their SHA-256 hex, as in the Redis store.

Never blocking the event loop: the store's own calls run on SQLAlchemy's asyncio engine
(psycopg's async driver, aiosqlite); a *sync* transactional handler, which runs on a worker
thread, gets a connection of a sync engine on the same database. Each batch method is one
statement on PostgreSQL (the claim is an ``INSERT ... ON CONFLICT DO UPDATE`` inside a CTE that
also reports the rows it left alone) and one transaction of at most two statements on SQLite.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

from .._results import checked_result_json
from ..clock import Clock, SystemClock
from ..errors import ConfigurationError, MissingExtraError
from ..policy import check_seconds
from ..ports import Claimed, ClaimResult, Completed, Completion, DedupKey, InProgress
from .memory_store import SingleKeyMethods, TokenSource, check_owner

try:
    import sqlalchemy as sa
    from sqlalchemy.dialects import postgresql, sqlite
    from sqlalchemy.engine import URL, Connection, Engine
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
except ImportError as error:  # the sql extra is not installed
    raise MissingExtraError("SqlDedupStore", "sql", "SQLAlchemy") from error

from ..sql_engines import OnSqlEngines, SqlEngines

DEFAULT_TABLE = "reliable_sub_processed"
# Namespaces and keys up to this many characters are stored as they are; longer ones hashed.
READABLE_LIMIT = 200
_HASHED = "h:"
CLAIMED, FAILED, COMPLETED = "claimed", "failed", "completed"
# A namespace's epoch is a row of its own: key EPOCH_KEY (no message key is stored as it: keys
# that start with "h:" are stored hashed), state EPOCH, the number in ``failures``, never expiring.
EPOCH_KEY, EPOCH = "h:epoch", "epoch"
NEVER = 1e18  # epoch seconds, some thirty billion years ahead


def processed_table(metadata: sa.MetaData, name: str = DEFAULT_TABLE) -> sa.Table:
    """The dedup table, defined on ``metadata`` (put it in your migrations)."""
    return sa.Table(
        name,
        metadata,
        sa.Column("namespace", sa.String(2 * READABLE_LIMIT), primary_key=True),
        sa.Column("key", sa.String(2 * READABLE_LIMIT), primary_key=True),
        sa.Column("owner", sa.String(200), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("failures", sa.Integer, nullable=False, server_default="0"),
        sa.Column("lease_expires_at", sa.Float, nullable=True),
        sa.Column("completed_at", sa.Float, nullable=True),
        sa.Column("expires_at", sa.Float, nullable=False),
        sa.Column("result", sa.Text, nullable=True),
        sa.Index(f"ix_{name}_expires_at", "expires_at"),
    )


class SqlDedupStore(OnSqlEngines, SingleKeyMethods):
    """A dedup store on PostgreSQL or SQLite, usable inside a handler's own transaction.

    Args:
        url_or_engine: a database URL (``postgresql://...``, ``sqlite:///path``, ``sqlite://``
            for an in-process database) or an ``AsyncEngine`` you own.
        table: the table name (default ``reliable_sub_processed``).
        owner: readable prefix of this store's fencing tokens, such as the service's name
            (default: a short random one); see
            :func:`~reliable_sub.idempotency.memory_store.check_owner`.
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
        self._claim_sql: tuple[Any, Any] | None = None
        self._complete_sql: Any = None
        self._update_sql: Any = None
        self._engines = SqlEngines(url_or_engine, owner="SqlDedupStore", sync_engine=sync_engine,
                                   engine_options=engine_options)
        self.dialect = self._engines.dialect

    def __repr__(self) -> str:
        return f"SqlDedupStore({self.dialect}, table={self.table.name!r}, owner={self.owner!r})"

    # -- maintenance ---------------------------------------------------------------------------

    async def purge_expired(self, batch_size: int = 1000) -> int:
        """Delete rows whose retention (or lease) has passed, ``batch_size`` at a time;
        returns how many were deleted."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigurationError(f"purge_expired: batch_size must be >= 1, got {batch_size}")
        t = self.table
        deleted = 0
        while True:
            now = self._clock.wall()
            # One statement per batch: the keys never travel to the client and back (a list of
            # a thousand (namespace, key) pairs made each batch cost ~0.5 s on PostgreSQL).
            doomed = (
                sa.select(t.c.namespace, t.c.key).where(t.c.expires_at <= now).limit(batch_size)
            )
            async with self._engines.standalone() as connection:
                result = await connection.execute(
                    sa.delete(t).where(
                        sa.tuple_(t.c.namespace, t.c.key).in_(doomed.scalar_subquery()),
                        t.c.expires_at <= now,
                    )
                )
            count = result.rowcount
            deleted += count
            if count < batch_size:
                return deleted

    # -- epochs (the DedupEpochs capability) -----------------------------------------------

    async def epoch(self, namespace: str) -> int:
        """The current epoch of ``namespace`` (0 if it never had one)."""
        t = self.table
        async with self.engine.connect() as connection:
            found = await connection.scalar(sa.select(t.c.failures).where(
                t.c.namespace == _part(namespace), t.c.key == EPOCH_KEY))
        return int(found) if found is not None else 0

    async def next_epoch(self, namespace: str) -> int:
        """Start the next epoch of ``namespace`` (one upsert; the row never expires)."""
        t = self.table
        insert = (postgresql.insert(t) if self.dialect == "postgresql" else sqlite.insert(t))
        statement = insert.values(
            namespace=_part(namespace), key=EPOCH_KEY, owner=None, state=EPOCH, failures=1,
            expires_at=NEVER,
        ).on_conflict_do_update(
            index_elements=[t.c.namespace, t.c.key], set_={"failures": t.c.failures + 1},
        ).returning(t.c.failures)
        async with self._engines.standalone() as connection:
            return int((await connection.execute(statement)).scalar_one())

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
        stored = [_stored(key) for key in keys]
        first: dict[tuple[str, str], int] = {}
        for index, row_key in enumerate(stored):
            first.setdefault(row_key, index)
        rows = [(ns, k, chosen[index]) for (ns, k), index in first.items()]
        now = self._clock.wall()
        async with self._engines.standalone() as connection:
            found = await self._claim_rows(connection, rows, now, now + lease)
        results: list[ClaimResult] = []
        for index, key in enumerate(keys):
            row = found.get(stored[index])
            token = chosen[index]
            if row is None:  # cannot happen: the upsert either wrote or saw every key
                raise RuntimeError(f"claim of {key!r} left no row")
            state, owner, failures, expires_at, result = row
            if state == COMPLETED:
                results.append(Completed(result, key))
            elif owner == token and first[stored[index]] == index:
                results.append(Claimed(key, token, failures))
            else:
                results.append(InProgress(max(0.0, expires_at - now), failures))
        return results

    # Batch statements take their rows as one parameter per column (PostgreSQL arrays through
    # unnest) or one JSON array (SQLite, through json_each): their text does not depend on the
    # batch, so SQLAlchemy compiles each once and caches it. (A multi-row VALUES clause is not
    # cacheable: compiling it took ~25 ms per 100-key claim, 90% of the call.)

    def _batch(self, *columns: str) -> tuple[Any, list[Any]]:
        """A FROM clause yielding the batch's rows, and its columns (all text)."""
        if self.dialect == "postgresql":
            arrays = [sa.bindparam(f"batch_{c}", type_=postgresql.ARRAY(sa.Text)) for c in columns]
            source = sa.func.unnest(*arrays).table_valued(*columns).render_derived()
            return source, [source.c[c] for c in columns]
        source = sa.func.json_each(sa.bindparam("batch")).table_valued("value").alias("batch")
        return source, [
            sa.func.json_extract(source.c.value, f"$[{i}]").label(c)
            for i, c in enumerate(columns)
        ]

    def _batch_parameters(
        self, columns: Sequence[str], rows: Sequence[Sequence[str]]
    ) -> dict[str, Any]:
        if self.dialect == "postgresql":
            return {f"batch_{c}": [row[i] for row in rows] for i, c in enumerate(columns)}
        return {"batch": json.dumps([list(row) for row in rows])}

    def _claim_statements(self) -> tuple[Any, Any]:
        """The claim upsert (and, for SQLite, the read-back that follows it), built once."""
        if self._claim_sql is not None:
            return self._claim_sql
        t = self.table
        source, (ns, k, owner) = self._batch("namespace", "key", "owner")
        now = sa.bindparam("now", type_=sa.Float)
        lease_end = sa.bindparam("lease_end", type_=sa.Float)
        insert = (postgresql if self.dialect == "postgresql" else sqlite).insert(t)
        excluded = insert.excluded
        upsert = insert.from_select(
            ["namespace", "key", "owner", "state", "failures", "lease_expires_at", "expires_at"],
            # WHERE true: SQLite would read ON CONFLICT as a join's ON without it
            sa.select(ns, k, owner, sa.literal(CLAIMED), sa.literal(0), lease_end, lease_end)
            .select_from(source).where(sa.true()),
        ).on_conflict_do_update(
            index_elements=[t.c.namespace, t.c.key],
            set_={
                "owner": excluded.owner,
                "state": CLAIMED,
                "failures": sa.case((t.c.expires_at <= now, 0), else_=t.c.failures),
                "lease_expires_at": excluded.lease_expires_at,
                "completed_at": None,
                "expires_at": excluded.expires_at,
                "result": None,
            },
            where=sa.or_(
                t.c.expires_at <= now,
                t.c.state == FAILED,
                sa.and_(t.c.state == CLAIMED, t.c.owner == excluded.owner),
            ),
        )
        columns = (t.c.namespace, t.c.key, t.c.state, t.c.owner, t.c.failures, t.c.expires_at,
                   t.c.result)
        in_batch = sa.tuple_(t.c.namespace, t.c.key).in_(sa.select(ns, k).select_from(source))
        if self.dialect == "postgresql":
            # One statement: the CTE's RETURNING gives the rows it wrote; the outer SELECT sees
            # the table as it was before the statement, i.e. the rows it left alone.
            written = upsert.returning(*columns).cte("written")
            untouched = sa.select(*columns).where(
                in_batch,
                sa.tuple_(t.c.namespace, t.c.key).not_in(
                    sa.select(written.c.namespace, written.c.key)
                ),
            )
            self._claim_sql = (sa.union_all(sa.select(*written.c), untouched), None)
        else:
            self._claim_sql = (upsert, sa.select(*columns).where(in_batch))
        return self._claim_sql

    async def _claim_rows(
        self, connection: AsyncConnection, rows: list[tuple[str, str, str]], now: float,
        lease_end: float,
    ) -> dict[tuple[str, str], tuple[str, str | None, int, float, str | None]]:
        """Upsert the claims; return every row of the batch as it stands afterwards."""
        t = self.table
        statement, read_back = self._claim_statements()
        parameters = self._batch_parameters(("namespace", "key", "owner"), rows)
        parameters.update(now=now, lease_end=lease_end)
        columns = (t.c.namespace, t.c.key, t.c.state, t.c.owner, t.c.failures, t.c.expires_at,
                   t.c.result)
        if read_back is not None:
            await connection.execute(statement, parameters)
            result = list((await connection.execute(read_back, parameters)).all())
        else:
            result = list((await connection.execute(statement, parameters)).all())
            seen = {(r[0], r[1]) for r in result}
            racing = [(ns, k) for ns, k, _ in rows if (ns, k) not in seen]
            if racing:
                # A row a concurrent transaction inserted and committed while this statement
                # waited on it is newer than the statement's snapshot: read it afresh.
                again = sa.select(*columns).where(sa.tuple_(t.c.namespace, t.c.key).in_(racing))
                result += (await connection.execute(again)).all()
        return {(r[0], r[1]): (r[2], r[3], r[4], r[5], r[6]) for r in result}

    async def renew(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        if not claims:
            return []
        lease = check_seconds("SqlDedupStore", "lease_ttl", lease_ttl)
        now = self._clock.wall()
        async with self._engines.standalone() as connection:
            renewed = await self._update_held(
                connection, claims, now,
                {"expires_at": now + lease, "lease_expires_at": now + lease},
                failures=True,
            )
        return [claim for claim in claims if _stored(claim.key) not in renewed]

    async def _update_held(
        self, connection: AsyncConnection, claims: Sequence[Claimed], now: float,
        values: dict[str, Any], *, failures: bool = False,
    ) -> set[tuple[str, str]]:
        """Update the rows still held under their claims' tokens; returns those it updated."""
        t = self.table
        changes = dict(values)
        if failures:  # tokens are unique, so each row's own count is chosen by its token
            changes["failures"] = sa.case(
                {claim.token: claim.failures for claim in claims}, value=t.c.owner,
                else_=t.c.failures,
            )
        statement = (
            sa.update(t)
            .where(
                sa.tuple_(t.c.namespace, t.c.key, t.c.owner).in_(
                    [(*_stored(c.key), c.token) for c in claims]
                ),
                t.c.state == CLAIMED,
                t.c.expires_at > now,
            )
            .values(**changes)
            .returning(t.c.namespace, t.c.key)
        )
        return {(r[0], r[1]) for r in (await connection.execute(statement)).all()}

    async def complete_many(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        if not completions:
            return []
        retention = check_seconds("SqlDedupStore", "ttl", ttl)
        checked = [checked_result_json(c.result_json) for c in completions]
        now = self._clock.wall()
        t = self.table
        rows: dict[tuple[str, str], tuple[str, str, str, str]] = {}
        for completion, result_json in zip(completions, checked, strict=True):
            ns, k = _stored(completion.claim.key)
            rows[(ns, k)] = (ns, k, completion.claim.token, result_json)
        parameters = self._batch_parameters(("namespace", "key", "owner", "result"),
                                            list(rows.values()))
        parameters.update(now=now, expires_at=now + retention)
        async with self._engines.standalone() as connection:
            written = {(r[0], r[1]) for r in
                       (await connection.execute(self._completion_upsert(), parameters)).all()}
            left = [key for key in rows if key not in written]
            refused: set[tuple[str, str]] = set()
            if left:
                state = sa.select(t.c.namespace, t.c.key, t.c.state).where(
                    sa.tuple_(t.c.namespace, t.c.key).in_(left)
                )
                refused = {(r[0], r[1]) for r in (await connection.execute(state)).all()
                           if r[2] != COMPLETED}
        return [c.claim for c in completions if _stored(c.claim.key) in refused]

    def _completion_upsert(self) -> Any:
        """Record completions unless a peer holds the key under another token, or it was
        completed already (a fact); RETURNING the rows written. Built once."""
        if self._complete_sql is not None:
            return self._complete_sql
        t = self.table
        source, (ns, k, owner, result) = self._batch("namespace", "key", "owner", "result")
        now = sa.bindparam("now", type_=sa.Float)
        expires_at = sa.bindparam("expires_at", type_=sa.Float)
        insert = (postgresql if self.dialect == "postgresql" else sqlite).insert(t)
        excluded = insert.excluded
        self._complete_sql = insert.from_select(
            ["namespace", "key", "owner", "state", "failures", "completed_at", "expires_at",
             "result"],
            sa.select(ns, k, owner, sa.literal(COMPLETED), sa.literal(0), now, expires_at, result)
            .select_from(source).where(sa.true()),
        ).on_conflict_do_update(
            index_elements=[t.c.namespace, t.c.key],
            set_={"owner": None, "state": COMPLETED, "failures": 0, "lease_expires_at": None,
                  "completed_at": excluded.completed_at, "expires_at": excluded.expires_at,
                  "result": excluded.result},
            where=sa.or_(
                t.c.expires_at <= now,
                t.c.state == FAILED,
                sa.and_(t.c.state == CLAIMED, t.c.owner == excluded.owner),
            ),
        ).returning(t.c.namespace, t.c.key)
        return self._complete_sql

    async def release_many(self, claims: Sequence[Claimed], retention: float) -> None:
        if not claims:
            return
        now = self._clock.wall()
        keep = [c for c in claims if c.failures > 0 and retention > 0]
        forget = [c for c in claims if not (c.failures > 0 and retention > 0)]
        t = self.table
        async with self._engines.standalone() as connection:
            if keep:
                await self._update_held(
                    connection, keep, now,
                    {"state": FAILED, "owner": None, "lease_expires_at": None,
                     "expires_at": now + retention},
                    failures=True,
                )
            if forget:
                await connection.execute(sa.delete(t).where(
                    sa.tuple_(t.c.namespace, t.c.key, t.c.owner).in_(
                        [(*_stored(c.key), c.token) for c in forget]
                    ),
                    t.c.state == CLAIMED,
                ))

    # -- inside a handler's transaction ------------------------------------------------------

    def begin(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """An ``AsyncConnection`` in a transaction (commits on exit), from a pool of its own
        (see :attr:`~reliable_sub.sql_engines.SqlEngines.transaction_engine`): the store's
        calls never wait for a connection behind running handlers."""
        return self._engines.transaction_engine.begin()

    def begin_sync(self) -> AbstractContextManager[Connection]:
        """A sync ``Connection`` in a transaction (for sync handlers; commits on exit)."""
        return self.sync_engine.begin()

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
        ns, k = _stored(claim.key)
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
        ns, k = _stored(key)
        now = self._clock.wall()
        t = self.table
        async with self.engine.begin() as connection:
            await connection.execute(sa.delete(t).where(t.c.namespace == ns, t.c.key == k))
            await connection.execute(sa.insert(t).values(
                namespace=ns, key=k, owner=None, state=COMPLETED, failures=0, completed_at=now,
                expires_at=now + ttl, result=result_json,
            ))


def _stored(key: DedupKey) -> tuple[str, str]:
    """The (namespace, key) as stored: as they are, or hashed when long or hash-like."""
    return _part(key.namespace), _part(key.key)


def _part(text: str) -> str:
    # Databases refuse NUL in text and lone surrogates in UTF-8: those are hashed too.
    if len(text) <= READABLE_LIMIT and not text.startswith(_HASHED) and _storable(text):
        return text
    return _HASHED + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _storable(text: str) -> bool:
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


__all__ = ["DEFAULT_TABLE", "SqlDedupStore", "processed_table"]
