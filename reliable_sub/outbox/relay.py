"""``OutboxRelay``: publishes what committed in the outbox, oldest first, at least once.

One round (:meth:`OutboxRelay.relay_once`)::

    BEGIN
      SELECT the oldest pending rows              -- published_at, failed_at NULL; not held back
        WHERE no older unpublished row has the same ordering_key
        ORDER BY id LIMIT batch_size
        FOR UPDATE SKIP LOCKED                    -- PostgreSQL: relays share the work
      publish them through the adapter, concurrently (one row per ordering key at most)
      UPDATE the published rows SET published_at  -- one statement
      UPDATE each failed row: attempts + 1, last_error, not_before = now + backoff,
                              failed_at once attempts reach max_attempts (parked)
    COMMIT

* **Never skips a row.** Pending rows are found by state, not by an offset, so a transaction
  that commits late with a lower id is published when it commits.
* **Per-key order.** Only the oldest unpublished row of an ordering key is eligible, and it stays
  unpublished (locked) until its relay commits; a parked row blocks its own key only. Order is
  the order in which rows *became visible*: of two transactions writing one key concurrently,
  the one that committed first (with the lower id, if both are visible) is published first.
* **At least once.** A relay that dies after publishing and before its commit leaves the rows
  pending (its locks go with its connection); they are published again, with the same
  ``idempotency-key`` attribute, which a consumer's dedup store turns into duplicates.
* **SQLite** has no row locks: run one relay at a time there. Its rows are read in one short
  transaction and marked in another, so the publish holds no lock that would stall your writers.

:meth:`OutboxRelay.serve` repeats rounds while they come back full, and otherwise waits for a
``NOTIFY`` from :meth:`Outbox.add` (PostgreSQL) or ``poll_interval`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..clock import Clock, SystemClock
from ..errors import ConfigurationError, MissingExtraError
from ..policy import check_count, check_seconds
from ..ports import Publisher
from .outbox import Outbox

try:
    import sqlalchemy as sa
except ImportError as error:  # the sql extra is not installed
    raise MissingExtraError("OutboxRelay", "sql", "SQLAlchemy") from error

logger = logging.getLogger(__name__)

# The attribute that carries each row's key to the consumer's dedup store.
IDEMPOTENCY_KEY_ATTRIBUTE = "idempotency-key"
# The longest error text kept on a row.
ERROR_LIMIT = 1000


@dataclass(frozen=True)
class Backlog:
    """What waits in the outbox: pending rows, the age of the oldest, and parked rows."""

    pending: int
    oldest_age: float | None
    parked: int


@dataclass(frozen=True)
class _Row:
    id: int
    key: str
    topic: str
    data: bytes
    attributes: dict[str, str]
    ordering_key: str | None
    attempts: int


class OutboxRelay:
    """Publishes an :class:`Outbox`'s committed rows through ``adapter``.

    Args:
        outbox: the outbox to read.
        adapter: where to publish (any adapter: its ``publish``).
        batch_size: most rows per round.
        poll_interval: seconds between rounds when there is nothing to do and no ``NOTIFY``.
        max_attempts: failed publishes after which a row is parked (``failed_at`` set).
        min_backoff, max_backoff: seconds a row waits after a failed publish, doubling from
            ``min_backoff`` up to ``max_backoff``, jittered.
        clock: the time source (``wall()`` for the rows, ``sleep`` for waits).
    """

    def __init__(
        self,
        outbox: Outbox,
        adapter: Publisher,
        *,
        batch_size: int = 100,
        poll_interval: float = 1.0,
        max_attempts: int = 10,
        min_backoff: float = 1.0,
        max_backoff: float = 60.0,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        check_count("OutboxRelay", "batch_size", batch_size)
        check_count("OutboxRelay", "max_attempts", max_attempts)
        for name, value in (("poll_interval", poll_interval), ("min_backoff", min_backoff),
                            ("max_backoff", max_backoff)):
            check_seconds("OutboxRelay", name, value)
        if max_backoff < min_backoff:
            raise ConfigurationError(
                f"OutboxRelay.max_backoff ({max_backoff}) must be >= min_backoff ({min_backoff})"
            )
        self.outbox = outbox
        self.adapter = adapter
        self.batch_size = batch_size
        self.poll_interval = float(poll_interval)
        self.max_attempts = max_attempts
        self.min_backoff = float(min_backoff)
        self.max_backoff = float(max_backoff)
        self._clock: Clock = clock or SystemClock()
        self._rng = rng or random.Random()
        self._claim = self._claim_statement()
        # counters, and what serve() is doing (for health checks and tests)
        self.published = 0
        self.publish_errors = 0
        self.parked = 0
        self.rounds = 0
        self.listening = False  # LISTEN is in place (PostgreSQL)
        self.waiting = False  # serve() waits for a NOTIFY or its poll
        self._stop: asyncio.Event | None = None

    # -- one round -----------------------------------------------------------------------------

    def _claim_statement(self) -> Any:
        t = self.outbox.table
        older = t.alias("older")
        oldest_of_its_key = sa.or_(
            t.c.ordering_key.is_(None),
            ~sa.exists().where(older.c.ordering_key == t.c.ordering_key, older.c.id < t.c.id,
                               older.c.published_at.is_(None)),
        )
        statement = (
            sa.select(t.c.id, t.c.key, t.c.topic, t.c.data, t.c.attributes, t.c.ordering_key,
                      t.c.attempts)
            .where(t.c.published_at.is_(None), t.c.failed_at.is_(None),
                   sa.or_(t.c.not_before.is_(None), t.c.not_before <= sa.bindparam("now")),
                   oldest_of_its_key)
            .order_by(t.c.id)
            .limit(sa.bindparam("batch"))
        )
        if self.outbox.dialect == "postgresql":
            statement = statement.with_for_update(skip_locked=True, of=t)
        return statement

    async def relay_once(self) -> int:
        """Publish one batch of pending rows; returns how many rows were taken (published or
        failed)."""
        parameters = {"now": self._clock.wall(), "batch": self.batch_size}
        if self.outbox.dialect == "postgresql":
            async with self.outbox.engine.begin() as connection:  # holds the row locks
                rows = _rows(await connection.execute(self._claim, parameters))
                if rows:
                    await self._mark(connection, rows, await self._publish(rows))
            return len(rows)
        async with self.outbox.engine.begin() as connection:
            rows = _rows(await connection.execute(self._claim, parameters))
        if rows:
            outcomes = await self._publish(rows)
            async with self.outbox.engine.begin() as connection:
                await self._mark(connection, rows, outcomes)
        return len(rows)

    async def _publish(self, rows: Sequence[_Row]) -> list[BaseException | None]:
        async def one(row: _Row) -> None:
            attributes = {**row.attributes, IDEMPOTENCY_KEY_ATTRIBUTE: row.key}
            await self.adapter.publish(row.topic, row.data, attributes, row.ordering_key)

        results = await asyncio.gather(*(one(row) for row in rows), return_exceptions=True)
        outcomes: list[BaseException | None] = []
        for result in results:
            if isinstance(result, asyncio.CancelledError):
                raise result
            outcomes.append(result if isinstance(result, BaseException) else None)
        return outcomes

    async def _mark(
        self, connection: Any, rows: Sequence[_Row], outcomes: Sequence[BaseException | None]
    ) -> None:
        t = self.outbox.table
        now = self._clock.wall()
        done = [row.id for row, error in zip(rows, outcomes, strict=True) if error is None]
        if done:
            await connection.execute(
                sa.update(t).where(t.c.id.in_(done)).values(published_at=now, not_before=None)
            )
            self.published += len(done)
        for row, error in zip(rows, outcomes, strict=True):
            if error is None:
                continue
            self.publish_errors += 1
            attempts = row.attempts + 1
            parked = attempts >= self.max_attempts
            text = f"{type(error).__name__}: {error}"[:ERROR_LIMIT]
            await connection.execute(
                sa.update(t).where(t.c.id == row.id).values(
                    attempts=attempts, last_error=text,
                    not_before=now + self._backoff(attempts),
                    failed_at=now if parked else None,
                )
            )
            if parked:
                self.parked += 1
                logger.error("outbox row %d (key %r, topic %r) failed %d times and is parked: "
                             "%s; its ordering key %r waits until it is re-queued",
                             row.id, row.key, row.topic, attempts, text, row.ordering_key)
            else:
                logger.warning("publishing outbox row %d (key %r, topic %r) failed (attempt "
                               "%d of %d): %s", row.id, row.key, row.topic, attempts,
                               self.max_attempts, text)

    def _backoff(self, attempts: int) -> float:
        ceiling = min(self.max_backoff, self.min_backoff * 2 ** (attempts - 1))
        return self._rng.uniform(self.min_backoff, max(self.min_backoff, ceiling))

    # -- operations -----------------------------------------------------------------------------

    async def requeue_parked(self, keys: Sequence[str] | None = None) -> int:
        """Make parked rows (all, or those with ``keys``) pending again, with fresh attempts;
        returns how many."""
        t = self.outbox.table
        statement = sa.update(t).where(t.c.failed_at.is_not(None), t.c.published_at.is_(None))
        if keys is not None:
            statement = statement.where(t.c.key.in_(list(keys)))
        async with self.outbox.engine.begin() as connection:
            result = await connection.execute(
                statement.values(failed_at=None, attempts=0, not_before=None)
            )
        return int(result.rowcount)

    async def purge_published(self, older_than: float, batch_size: int = 1000) -> int:
        """Delete rows published more than ``older_than`` seconds ago, ``batch_size`` at a
        time; returns how many. (Parked and pending rows are never deleted.)"""
        check_count("OutboxRelay.purge_published", "batch_size", batch_size)
        if not isinstance(older_than, int | float) or not older_than >= 0:
            raise ConfigurationError(
                f"OutboxRelay.purge_published: older_than must be >= 0, got {older_than!r}")
        t = self.outbox.table
        cutoff = self._clock.wall() - older_than
        deleted = 0
        while True:
            doomed = (sa.select(t.c.id).where(t.c.published_at.is_not(None),
                                              t.c.published_at <= cutoff)
                      .order_by(t.c.id).limit(batch_size))
            async with self.outbox.engine.begin() as connection:
                ids = list((await connection.execute(doomed)).scalars())
                if ids:
                    await connection.execute(sa.delete(t).where(t.c.id.in_(ids)))
            deleted += len(ids)
            if len(ids) < batch_size:
                return deleted

    async def backlog(self) -> Backlog:
        """Pending rows, the age in seconds of the oldest (None when there is none), and parked
        rows."""
        t = self.outbox.table
        unpublished = t.c.published_at.is_(None)
        statement = sa.select(
            sa.func.count().filter(t.c.failed_at.is_(None)),
            sa.func.min(t.c.created_at).filter(t.c.failed_at.is_(None)),
            sa.func.count().filter(t.c.failed_at.is_not(None)),
        ).where(unpublished)
        async with self.outbox.engine.connect() as connection:
            pending, oldest, parked = (await connection.execute(statement)).one()
        age = None if oldest is None else max(0.0, self._clock.wall() - float(oldest))
        return Backlog(int(pending), age, int(parked))

    # -- running ----------------------------------------------------------------------------

    async def serve(self) -> None:
        """Relay until :meth:`shutdown`: rounds back to back while they come back full, else a
        wait for ``NOTIFY`` (PostgreSQL) or ``poll_interval``. A failing round (the database or
        broker away) is logged and retried after ``poll_interval``."""
        self._stop = stop = asyncio.Event()
        wake = asyncio.Event()
        listener = asyncio.ensure_future(self._listen(wake, stop))
        try:
            while not stop.is_set():
                self.rounds += 1
                try:
                    taken = await self.relay_once()
                except Exception:
                    logger.warning("outbox relay round failed; retrying in %gs",
                                   self.poll_interval, exc_info=True)
                    taken = 0
                if taken >= self.batch_size:
                    continue
                wake.clear()
                waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stop.wait()),
                           asyncio.ensure_future(self._clock.sleep(self.poll_interval))]
                self.waiting = True
                try:
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    self.waiting = False
                    for waiter in waiters:
                        waiter.cancel()
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
            await self.outbox.close()

    async def shutdown(self) -> None:
        """Ask :meth:`serve` to end after its current round."""
        if self._stop is not None:
            self._stop.set()

    async def _listen(self, wake: asyncio.Event, stop: asyncio.Event) -> None:
        """Set ``wake`` on each ``NOTIFY`` of the outbox's channel (PostgreSQL); reconnects."""
        if self.outbox.dialect != "postgresql":
            return
        import psycopg

        conninfo = self.outbox.url.set(drivername="postgresql").render_as_string(
            hide_password=False)
        while not stop.is_set():
            try:
                async with await psycopg.AsyncConnection.connect(conninfo,
                                                                 autocommit=True) as conn:
                    await conn.execute(f'LISTEN "{self.outbox.channel}"')
                    self.listening = True
                    wake.set()  # anything committed before LISTEN: look now
                    async for _ in conn.notifies():
                        wake.set()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.listening = False
                logger.warning("outbox relay: LISTEN failed; polling every %gs meanwhile",
                               self.poll_interval, exc_info=True)
                await self._clock.sleep(self.poll_interval)


def _rows(result: Any) -> list[_Row]:
    return [
        _Row(id=int(r.id), key=r.key, topic=r.topic, data=bytes(r.data),
             attributes=json.loads(r.attributes), ordering_key=r.ordering_key,
             attempts=int(r.attempts))
        for r in result
    ]


__all__ = ["IDEMPOTENCY_KEY_ATTRIBUTE", "Backlog", "OutboxRelay"]
