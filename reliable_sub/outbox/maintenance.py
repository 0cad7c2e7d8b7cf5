"""What an operator does to an outbox's rows, with or without a relay running: read the
backlog, make parked rows pending again, delete old published rows. :class:`OutboxRelay` and
the ``reliable-sub outbox`` command both use these."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigurationError, MissingExtraError
from ..policy import check_count
from .outbox import Outbox

try:
    import sqlalchemy as sa
except ImportError as error:  # the sql extra is not installed
    raise MissingExtraError("the outbox", "sql", "SQLAlchemy") from error


@dataclass(frozen=True)
class Backlog:
    """What waits in the outbox: pending rows, the age of the oldest, and parked rows."""

    pending: int
    oldest_age: float | None
    parked: int


async def backlog(outbox: Outbox, now: float) -> Backlog:
    """Pending rows, the age in seconds at ``now`` (epoch seconds) of the oldest (None when
    there is none), and parked rows."""
    t = outbox.table
    pending = t.c.failed_at.is_(None)
    # CASE rather than FILTER (WHERE ...), which MariaDB lacks: a CASE without ELSE is NULL,
    # and aggregates skip NULLs
    statement = sa.select(
        sa.func.count(sa.case((pending, 1))),
        sa.func.min(sa.case((pending, t.c.created_at))),
        sa.func.count(sa.case((~pending, 1))),
    ).where(t.c.published_at.is_(None))
    async with outbox.engine.connect() as connection:
        pending, oldest, parked = (await connection.execute(statement)).one()
    age = None if oldest is None else max(0.0, now - float(oldest))
    return Backlog(int(pending), age, int(parked))


async def requeue_parked(outbox: Outbox, keys: Sequence[str] | None = None) -> int:
    """Make parked rows (all, or those of ``keys``) pending again, with fresh attempts;
    returns how many."""
    t = outbox.table
    statement = sa.update(t).where(t.c.failed_at.is_not(None), t.c.published_at.is_(None))
    if keys is not None:
        statement = statement.where(t.c.key.in_(list(keys)))
    async with outbox.engine.begin() as connection:
        result = await connection.execute(
            statement.values(failed_at=None, attempts=0, not_before=None))
    return int(result.rowcount)


async def purge_published(outbox: Outbox, cutoff: float, batch_size: int = 1000) -> int:
    """Delete rows published at or before ``cutoff`` (epoch seconds), ``batch_size`` at a
    time; returns how many. Parked and pending rows are never deleted."""
    check_count("purge_published", "batch_size", batch_size)
    if not isinstance(cutoff, int | float):
        raise ConfigurationError(f"purge_published: cutoff must be a number, got {cutoff!r}")
    t = outbox.table
    deleted = 0
    while True:
        doomed = (sa.select(t.c.id).where(t.c.published_at.is_not(None),
                                          t.c.published_at <= cutoff)
                  .order_by(t.c.id).limit(batch_size))
        async with outbox.engine.begin() as connection:
            ids = list((await connection.execute(doomed)).scalars())
            if ids:
                await connection.execute(sa.delete(t).where(t.c.id.in_(ids)))
        deleted += len(ids)
        if len(ids) < batch_size:
            return deleted


__all__ = ["Backlog", "backlog", "purge_published", "requeue_parked"]
