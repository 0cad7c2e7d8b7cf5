"""The SQL dedup store's batch statements on PostgreSQL and SQLite (MariaDB's are in
:mod:`._sql_claims_mariadb`): claim, complete, update held rows, purge, next epoch.

Each takes a connection the store opened and returns what the store needs to decide, per key.
Batch statements take their rows as one parameter per column (PostgreSQL arrays through
``unnest``) or one JSON array (SQLite, through ``json_each``): their text does not depend on the
batch, so SQLAlchemy compiles each once and caches it. (A multi-row VALUES clause is not
cacheable: compiling it took ~25 ms per 100-key claim, 90% of the call.)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa  # imported by _sql only, once it has checked the sql extra
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from ..ports import Claimed
from ._sql_table import CLAIMED, COMPLETED, EPOCH, EPOCH_KEY, FAILED, NEVER, stored, stored_part

# A claimed key's row as it stands after the claim: state, owner, failures, expires_at, result.
Row = tuple[str, str | None, int, float, str | None]
# What claims and completions carry per key: (namespace, key, token[, result JSON]).
ClaimRow = tuple[str, str, str]
CompletionRow = tuple[str, str, str, str]
_COLUMNS = ("namespace", "key", "state", "owner", "failures", "expires_at", "result")


class SqlClaims:
    """The statements of ``table`` on PostgreSQL or SQLite, each built once."""

    def __init__(self, table: sa.Table, dialect: str) -> None:
        self.table = table
        self.dialect = dialect
        self._claim_sql: tuple[Any, Any] | None = None
        self._complete_sql: Any = None

    # -- claims ---------------------------------------------------------------------------------

    async def claim(
        self, connection: AsyncConnection, rows: list[ClaimRow], now: float, lease_end: float,
    ) -> dict[tuple[str, str], Row]:
        """Upsert the claims; return every row of the batch as it stands afterwards."""
        t = self.table
        statement, read_back = self._claim_statements()
        parameters = self._batch_parameters(("namespace", "key", "owner"), rows)
        parameters.update(now=now, lease_end=lease_end)
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
                again = sa.select(*self._columns()).where(
                    sa.tuple_(t.c.namespace, t.c.key).in_(racing))
                result += (await connection.execute(again)).all()
        return by_key(result)

    def _columns(self) -> list[Any]:
        return [self.table.c[name] for name in _COLUMNS]

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

    def _insert(self) -> Any:
        return (postgresql if self.dialect == "postgresql" else sqlite).insert(self.table)

    def _claim_statements(self) -> tuple[Any, Any]:
        """The claim upsert (and, for SQLite, the read-back that follows it)."""
        if self._claim_sql is not None:
            return self._claim_sql
        t = self.table
        source, (ns, k, owner) = self._batch("namespace", "key", "owner")
        now = sa.bindparam("now", type_=sa.Float)
        lease_end = sa.bindparam("lease_end", type_=sa.Float)
        insert = self._insert()
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
        columns = self._columns()
        if self.dialect == "postgresql":
            # One statement: the CTE's RETURNING gives the rows it wrote; the outer SELECT sees
            # the table as it was before the statement, i.e. the rows it left alone. Those are
            # looked up key by key (LATERAL ... LIMIT 1 cannot be turned into a join): as a
            # semi-join the planner read the whole table on a hash join whenever its row
            # estimates were off (a table that grew since it was analyzed, a plan cached when
            # it was small), and each claim then cost time in proportion to the table.
            written = upsert.returning(*columns).cte("written")
            found = (sa.select(*columns).where(t.c.namespace == ns, t.c.key == k)
                     .limit(1).lateral("found"))
            untouched = sa.select(*found.c).select_from(source).join(found, sa.true()).where(
                sa.tuple_(found.c.namespace, found.c.key).not_in(
                    sa.select(written.c.namespace, written.c.key)
                ),
            )
            self._claim_sql = (sa.union_all(sa.select(*written.c), untouched), None)
        else:
            in_batch = sa.tuple_(t.c.namespace, t.c.key).in_(
                sa.select(ns, k).select_from(source))
            self._claim_sql = (upsert, sa.select(*columns).where(in_batch))
        return self._claim_sql

    # -- completions ------------------------------------------------------------------------

    async def complete(
        self, connection: AsyncConnection, rows: list[CompletionRow], now: float,
        expires_at: float,
    ) -> set[tuple[str, str]]:
        """Record the completions; return the keys refused (held by a peer, not completed)."""
        t = self.table
        parameters = self._batch_parameters(("namespace", "key", "owner", "result"), rows)
        parameters.update(now=now, expires_at=expires_at)
        written = {(r[0], r[1]) for r in
                   (await connection.execute(self._completion_upsert(), parameters)).all()}
        left = [(ns, k) for ns, k, _, _ in rows if (ns, k) not in written]
        if not left:
            return set()
        state = sa.select(t.c.namespace, t.c.key, t.c.state).where(
            sa.tuple_(t.c.namespace, t.c.key).in_(left))
        return {(r[0], r[1]) for r in (await connection.execute(state)).all()
                if r[2] != COMPLETED}

    def _completion_upsert(self) -> Any:
        """Record completions unless a peer holds the key under another token, or it was
        completed already (a fact); RETURNING the rows written."""
        if self._complete_sql is not None:
            return self._complete_sql
        t = self.table
        source, (ns, k, owner, result) = self._batch("namespace", "key", "owner", "result")
        now = sa.bindparam("now", type_=sa.Float)
        expires_at = sa.bindparam("expires_at", type_=sa.Float)
        insert = self._insert()
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

    # -- held rows, purge, epochs -----------------------------------------------------------

    async def update_held(
        self, connection: AsyncConnection, claims: Sequence[Claimed], now: float,
        values: dict[str, Any], *, failures: bool = False, report: bool = True,
    ) -> set[tuple[str, str]]:
        """Update the rows still held under their claims' tokens; returns those it updated
        (with ``report``, else nothing)."""
        statement = self._held_update(claims, now, values, failures)
        if not report:
            await connection.execute(statement)
            return set()
        statement = statement.returning(self.table.c.namespace, self.table.c.key)
        return {(r[0], r[1]) for r in (await connection.execute(statement)).all()}

    def _held_update(
        self, claims: Sequence[Claimed], now: float, values: dict[str, Any], failures: bool,
    ) -> Any:
        t = self.table
        changes: list[tuple[Any, Any]] = []
        if failures:  # tokens are unique, so each row's own count is chosen by its token
            # first: MariaDB assigns left to right, and the owner may be cleared after it
            changes.append((t.c.failures, sa.case(
                {claim.token: claim.failures for claim in claims}, value=t.c.owner,
                else_=t.c.failures,
            )))
        changes += [(t.c[name], value) for name, value in values.items()]
        return sa.update(t).where(*self._held(claims, now)).ordered_values(*changes)

    def _held(self, claims: Sequence[Claimed], now: float | None = None) -> list[Any]:
        """The rows ``claims`` still hold under their tokens (and whose lease has not lapsed
        at ``now``, if given)."""
        t = self.table
        held = [sa.tuple_(t.c.namespace, t.c.key, t.c.owner).in_(
                    [(*stored(c.key), c.token) for c in claims]),
                t.c.state == CLAIMED]
        return held if now is None else [*held, t.c.expires_at > now]

    async def forget(self, connection: AsyncConnection, claims: Sequence[Claimed]) -> None:
        """Delete the rows ``claims`` still hold (lapsed or not)."""
        await connection.execute(sa.delete(self.table).where(*self._held(claims)))

    async def purge(self, connection: AsyncConnection, now: float, batch_size: int) -> int:
        """Delete at most ``batch_size`` expired rows; how many it deleted."""
        t = self.table
        # One statement per batch: the keys never travel to the client and back (a list of
        # a thousand (namespace, key) pairs made each batch cost ~0.5 s on PostgreSQL).
        doomed = sa.select(t.c.namespace, t.c.key).where(t.c.expires_at <= now).limit(batch_size)
        result = await connection.execute(sa.delete(t).where(
            sa.tuple_(t.c.namespace, t.c.key).in_(doomed.scalar_subquery()),
            t.c.expires_at <= now,
        ))
        return int(result.rowcount)

    async def next_epoch(self, connection: AsyncConnection, namespace: str) -> int:
        """Start the next epoch of ``namespace`` (one upsert; the row never expires)."""
        t = self.table
        statement = self._insert().values(
            namespace=stored_part(namespace), key=EPOCH_KEY, owner=None, state=EPOCH, failures=1,
            expires_at=NEVER,
        ).on_conflict_do_update(
            index_elements=[t.c.namespace, t.c.key], set_={"failures": t.c.failures + 1},
        ).returning(t.c.failures)
        return int((await connection.execute(statement)).scalar_one())


def by_key(rows: Any) -> dict[tuple[str, str], Row]:
    """Rows of (namespace, key, state, owner, failures, expires_at, result), by their key."""
    return {(r[0], r[1]): (r[2], r[3], r[4], r[5], r[6]) for r in rows}


__all__ = ["ClaimRow", "CompletionRow", "Row", "SqlClaims", "by_key"]
