"""The outbox table: one row per event to publish, written in the business transaction.

::

    id  key  topic  data  attributes  ordering_key  created_at  published_at  attempts
    last_error  not_before  failed_at  trace_context

``id`` orders rows (oldest first); ``key`` is the idempotency key the relay publishes (the
caller's, or a fresh UUIDv7), unique. A row is *pending* while ``published_at`` and
``failed_at`` are both NULL; ``failed_at`` parks a row whose publishing failed too often (it
blocks only its own ordering key); after a failed publish ``not_before`` holds the row back for
its backoff. ``trace_context`` holds the writer's OpenTelemetry context, so the relay's send
span continues the business transaction's trace. Times are epoch seconds.
"""

from __future__ import annotations

from typing import Any, cast

from ..errors import MissingExtraError

try:
    import sqlalchemy as sa
except ImportError as error:  # the sql extra is not installed
    raise MissingExtraError("Outbox", "sql", "SQLAlchemy") from error

from .._sql_engines import MYSQL_DIALECTS
from .._sql_types import TABLE_OPTIONS, exact_text, long_bytes, long_text, seconds

DEFAULT_TABLE = "reliable_sub_outbox"
# Longest idempotency key, topic and ordering key a row holds.
KEY_LIMIT = 200
NAME_LIMIT = 255


def outbox_table(metadata: sa.MetaData, name: str = DEFAULT_TABLE) -> sa.Table:
    """The outbox table, defined on ``metadata`` (put it in your migrations)."""
    table = sa.Table(
        name,
        metadata,
        # BIGINT on PostgreSQL and MariaDB; INTEGER PRIMARY KEY (the rowid) on SQLite
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("key", exact_text(KEY_LIMIT), nullable=False, unique=True),
        sa.Column("topic", sa.String(NAME_LIMIT), nullable=False),
        sa.Column("data", long_bytes(), nullable=False),
        sa.Column("attributes", long_text(), nullable=False),  # a JSON object of str to str
        sa.Column("ordering_key", exact_text(NAME_LIMIT), nullable=True),
        sa.Column("created_at", seconds(), nullable=False),
        sa.Column("published_at", seconds(), nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_error", long_text(), nullable=True),
        sa.Column("not_before", seconds(), nullable=True),
        sa.Column("failed_at", seconds(), nullable=True),
        # the writer's trace context (a JSON object, as the propagator injects it), or NULL
        sa.Column("trace_context", long_text(), nullable=True),
        **TABLE_OPTIONS,
    )
    pending = sa.and_(table.c.published_at.is_(None), table.c.failed_at.is_(None))
    unkeyed = sa.and_(pending, table.c.ordering_key.is_(None))
    keyed = sa.and_(pending, table.c.ordering_key.is_not(None))
    unpublished = table.c.published_at.is_(None)
    # What a relay reads (reliable_sub.outbox.picking), each through its own partial index, so
    # no round scans published rows or other keys' backlogs: pending rows without a key, and
    # with one, oldest first; and one key's unpublished rows, oldest first.
    # a tuple of dialect names, as SQLAlchemy documents (its type hint says str)
    partial: Any = ("postgresql", "sqlite")
    sa.Index(f"ix_{name}_pending_unkeyed", table.c.id, postgresql_where=unkeyed,
             sqlite_where=unkeyed).ddl_if(dialect=partial)
    sa.Index(f"ix_{name}_pending_keyed", table.c.id, postgresql_where=keyed,
             sqlite_where=keyed).ddl_if(dialect=partial)
    sa.Index(f"ix_{name}_unpublished_key", table.c.ordering_key, table.c.id,
             postgresql_where=unpublished, sqlite_where=unpublished).ddl_if(dialect=partial)
    # MariaDB has no partial indexes: a key's unpublished rows, oldest first, come through this
    # one; where pending rows start, through ix_published_at (reliable_sub.outbox.picking)
    sa.Index(f"ix_{name}_key_unpublished", table.c.ordering_key, table.c.published_at,
             table.c.id).ddl_if(dialect=cast(Any, MYSQL_DIALECTS))
    # SQLite's single relay reads all pending rows in one statement, oldest first
    sa.Index(f"ix_{name}_pending", table.c.id, sqlite_where=pending).ddl_if(dialect="sqlite")
    sa.Index(f"ix_{name}_published_at", table.c.published_at)  # for retention and MariaDB
    return table


__all__ = ["DEFAULT_TABLE", "outbox_table"]
