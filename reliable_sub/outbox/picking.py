"""Which outbox rows a relay round takes: pending rows, oldest first, each ordering key's in order.

A row is *pending* while neither published nor parked, and *due* once its backoff (after a
failed publish) has passed. A row with an ordering key is taken only with every older
unpublished row of its key, so a round holds a *prefix* of each of its keys' rows; a key stops
at its first row that is parked or waiting out a backoff (which blocks that key only).

PostgreSQL, where several relays share the work (each statement bounded by an index, never a
scan of the whole backlog)::

    1. keys:  the ordering keys of the oldest `batch` pending, due rows whose key is not
              blocked; take each key's transaction-scoped advisory lock (try: a key another
              relay holds is skipped this round)
    2. rows:  the oldest `batch` pending, due rows without a key, FOR UPDATE SKIP LOCKED
    3. rows:  for each key now held, its oldest `batch / keys held` unpublished rows
              (LATERAL), cut in Python at the first one that is parked or not due

Locking a key *before* reading its rows matters: its previous holder has committed by the time
the lock is free, so the round's snapshot shows everything that relay published, and no other
relay reads the key's rows until this round commits. (A single statement that tried each key's
lock as it scanned could skip a key's early rows while another relay held it and take its later
rows once that relay let go.)

MariaDB (10.6+) takes the same three steps with what it has: each key's lock is a named lock,
``GET_LOCK('rs:<table>:<sha1 of the key>', 0)`` (session-scoped, unlike PostgreSQL's
transaction-scoped advisory locks: the relay releases them with ``RELEASE_ALL_LOCKS()`` once its
round has committed or rolled back, and closes a connection it could not release them on), and
each key's oldest rows come from a window function, as MariaDB has no LATERAL (numbering ids from
an index, then reading the rows chosen). Having no partial indexes either, a round first reads
the oldest pending row's id, and the other statements start there: left alone, the optimizer
walked every published row for ORDER BY id LIMIT (a round read 5,041 rows for 3 pending ones
after 5,000 published). The round runs
under READ COMMITTED (the relay's sessions, see ``reliable_sub._sql_engines``): each statement
reads what has committed before it, so the rows of a key read after its lock are fresh, where
REPEATABLE READ would show the snapshot of the round's first read and publish them again.

SQLite runs one relay at a time, so one statement does: pending, due rows without a key or
whose key is not blocked, oldest first.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

from .._sql_engines import MYSQL_DIALECTS
from ..errors import MissingExtraError
from ..message import IDEMPOTENCY_KEY_ATTRIBUTE
from ..ports import Outgoing

try:
    import sqlalchemy as sa
    from sqlalchemy.dialects import postgresql
except ImportError as error:  # the sql extra is not installed
    raise MissingExtraError("OutboxRelay", "sql", "SQLAlchemy") from error


@dataclass(frozen=True)
class Row:
    """One outbox row a round took."""

    id: int
    key: str
    topic: str
    data: bytes
    attributes: dict[str, str]
    ordering_key: str | None
    attempts: int
    trace_context: str | None = None  # the writer's, as JSON

    def outgoing(self) -> Outgoing:
        """The message to publish: the row's attributes plus its idempotency key."""
        attributes = {**self.attributes, IDEMPOTENCY_KEY_ATTRIBUTE: self.key}
        return Outgoing(self.topic, self.data, attributes, self.ordering_key)


class RowPicker:
    """Picks a round's rows from ``table`` (see the module's docstring)."""

    def __init__(self, table: sa.Table, dialect: str) -> None:
        self.table = table
        self.dialect = dialect
        t = table
        self._columns = [t.c.id, t.c.key, t.c.topic, t.c.data, t.c.attributes,
                         t.c.ordering_key, t.c.attempts, t.c.trace_context]
        self.shared = dialect == "postgresql" or dialect in MYSQL_DIALECTS
        self.named_locks = dialect in MYSQL_DIALECTS
        if self.named_locks:
            # the oldest pending row's id: the first entry of ix_published_at (NULLs by id)
            # not parked; walked in that index's order, as MIN(id) walks the primary key
            index = f"FORCE INDEX (ix_{t.name}_published_at)"
            self._first_pending = (
                sa.select(t.c.id).where(_pending(t)).order_by(t.c.id)
                .limit(1).with_hint(t, index, "mysql").with_hint(t, index, "mariadb"))
        if self.shared:
            self._keys = self._keys_statement()
            self._unkeyed = self._unkeyed_statement()
            self._keyed = (self._ranked_keyed_statement() if self.named_locks
                           else self._keyed_statement())
        else:
            self._single = self._single_statement()

    async def pick(self, connection: Any, now: float, batch: int) -> list[Row]:
        """The round's rows, oldest first, at most ``batch``; on PostgreSQL ``connection``'s
        transaction holds their keys' advisory locks (and the unkeyed rows' row locks) until
        it ends; on MariaDB the keys' named locks are the session's until
        :func:`release_named_locks` runs on it."""
        return (await self.pick_and_lock(connection, now, batch))[0]

    async def pick_and_lock(
        self, connection: Any, now: float, batch: int
    ) -> tuple[list[Row], list[str]]:
        """:meth:`pick`, and the ordering keys whose locks it took."""
        parameters: dict[str, Any] = {"now": now, "batch": batch}
        if not self.shared:
            return _rows(await connection.execute(self._single, parameters)), []
        if self.named_locks:
            parameters["start"] = await connection.scalar(self._first_pending)
            if parameters["start"] is None:  # nothing pending: an idle poll is this statement
                return [], []
        held = [key for key, locked in await connection.execute(self._keys, parameters)
                if locked]
        rows = _rows(await connection.execute(self._unkeyed, parameters))
        if held:
            # order across keys does not matter, only within one: each key gets an equal share
            parameters.update(held=held, per_key=max(1, batch // len(held)))
            keyed = list(await connection.execute(self._keyed, parameters))
            rows += _rows(_prefixes(keyed, now))
            rows.sort(key=lambda row: row.id)
        return rows[:batch], held

    # -- statements ---------------------------------------------------------------------------

    def _blocked(self, now: Any) -> Any:
        """An older unpublished row of the same key is parked or waiting out a backoff."""
        t = self.table
        older = t.alias("older")
        return sa.exists().where(
            older.c.ordering_key == t.c.ordering_key, older.c.id < t.c.id,
            older.c.published_at.is_(None),
            sa.or_(older.c.failed_at.is_not(None), older.c.not_before > now),
        )

    def _single_statement(self) -> Any:
        t = self.table
        now: Any = sa.bindparam("now")
        return (sa.select(*self._columns)
                .where(_pending(t), _due(t, now),
                       sa.or_(t.c.ordering_key.is_(None), ~self._blocked(now)))
                .order_by(t.c.id).limit(sa.bindparam("batch")))

    def _keys_statement(self) -> Any:
        t = self.table
        now: Any = sa.bindparam("now")
        oldest = self._through_unpublished(
            sa.select(t.c.ordering_key)
            .where(_pending(t), t.c.ordering_key.is_not(None), _due(t, now), ~self._blocked(now))
            .order_by(t.c.id).limit(sa.bindparam("batch"))).subquery("oldest")
        keys = sa.select(oldest.c.ordering_key).distinct().subquery("keys")
        # in the select list: evaluated once per key, never for rows a filter would drop
        if self.named_locks:
            # a name of at most 64 characters (MySQL's limit), unique per table and key
            name = sa.func.concat(f"rs:{lock_space(t.name)}:", sa.func.sha1(keys.c.ordering_key))
            locked = sa.func.get_lock(name, 0)
        else:
            locked = sa.func.pg_try_advisory_xact_lock(lock_space(t.name),
                                                       sa.func.hashtext(keys.c.ordering_key))
        return sa.select(keys.c.ordering_key, locked.label("locked"))

    def _unkeyed_statement(self) -> Any:
        t = self.table
        # MariaDB has no FOR UPDATE OF (and needs none: the statement reads one table)
        return self._through_unpublished(
            sa.select(*self._columns)
            .where(_pending(t), t.c.ordering_key.is_(None), _due(t, sa.bindparam("now")))
            .order_by(t.c.id).limit(sa.bindparam("batch"))
            .with_for_update(skip_locked=True, of=None if self.named_locks else t))

    def _through_unpublished(self, statement: Any) -> Any:
        """On MariaDB, ``statement`` (ORDER BY id LIMIT) from the oldest pending row on (the
        ``start`` parameter, which :meth:`pick_and_lock` reads first). Without partial indexes
        the optimizer walks the primary key from its first row, through every published one
        (18.6 ms a round with 50,000 published rows, and more each round as history grows);
        a subquery for the start was not used to bound the walk."""
        if not self.named_locks:
            return statement  # PostgreSQL: partial indexes hold the pending rows only
        return statement.where(self.table.c.id >= sa.bindparam("start"))

    def _ranked_keyed_statement(self) -> Any:
        """:meth:`_keyed_statement` without LATERAL: each held key's rows numbered in order."""
        t = self.table
        number = sa.func.row_number().over(partition_by=t.c.ordering_key, order_by=t.c.id)
        # numbered from ix_key_unpublished alone (ids, no payloads), then the chosen rows read
        ranked = (sa.select(t.c.id, number.label("n"))
                  .where(t.c.ordering_key.in_(sa.bindparam("held", expanding=True)),
                         t.c.published_at.is_(None))
                  .subquery("ranked"))
        return (sa.select(*self._columns, t.c.failed_at, t.c.not_before)
                .join(ranked, ranked.c.id == t.c.id)
                .where(ranked.c.n <= sa.bindparam("per_key")))

    def _keyed_statement(self) -> Any:
        """Each held key's ``per_key`` oldest unpublished rows (parked and not-due ones too, so
        that :func:`_prefixes` can stop the key there)."""
        t = self.table
        held = sa.func.unnest(sa.bindparam("held", type_=postgresql.ARRAY(sa.Text)))
        keys = held.table_valued("ordering_key").render_derived(name="held")
        oldest = (sa.select(*self._columns, t.c.failed_at, t.c.not_before)
                  .where(t.c.ordering_key == keys.c.ordering_key, t.c.published_at.is_(None))
                  .order_by(t.c.id).limit(sa.bindparam("per_key")).lateral("oldest"))
        return sa.select(oldest).select_from(keys).join(oldest, sa.true())


def _prefixes(rows: list[Any], now: float) -> list[Any]:
    """Each key's rows (oldest first) up to its first parked or not-yet-due row."""
    rows = sorted(rows, key=lambda row: (row.ordering_key, row.id))
    taken, stopped = [], set()
    for row in rows:
        if row.ordering_key in stopped:
            continue
        if row.failed_at is not None or (row.not_before is not None and row.not_before > now):
            stopped.add(row.ordering_key)
            continue
        taken.append(row)
    return taken


def _pending(t: sa.Table) -> Any:
    """Neither published nor parked."""
    return sa.and_(t.c.published_at.is_(None), t.c.failed_at.is_(None))


def _due(t: sa.Table, now: Any) -> Any:
    return sa.or_(t.c.not_before.is_(None), t.c.not_before <= now)


def lock_space(table: str) -> int:
    """The first key of the relays' advisory locks on ``table``'s ordering keys: a signed
    32-bit number from the table's name, so two outboxes' keys do not share locks."""
    value = zlib.crc32(table.encode())
    return value - 2**32 if value >= 2**31 else value


def _rows(result: Any) -> list[Row]:
    # by position (RowPicker._columns' order): a result row's fields read by name cost more
    # than the rest of building a Row; an empty attributes object (bytes published without
    # attributes) needs no parsing
    return [
        Row(int(r[0]), r[1], r[2], bytes(r[3]), {} if r[4] == "{}" else json.loads(r[4]),
            r[5], int(r[6]), r[7])
        for r in result
    ]


async def release_named_locks(connection: Any) -> None:
    """Let go of every named lock of ``connection``'s session (MariaDB), once its round's
    transaction has ended. If that fails (the round was cancelled mid-statement, the server
    went away), the connection is closed instead of going back to the pool, which lets go of
    them too: a pooled connection must never keep a key locked."""
    try:
        await connection.execute(sa.select(sa.func.release_all_locks()))
    except Exception:
        await connection.invalidate()
    except BaseException:  # cancelled: the same, and the cancellation goes on
        await connection.invalidate()
        raise


__all__ = ["IDEMPOTENCY_KEY_ATTRIBUTE", "Row", "RowPicker", "lock_space",
           "release_named_locks"]
