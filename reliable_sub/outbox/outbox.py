"""``Outbox``: events written in the caller's own transaction, published later by a relay.

::

    outbox = Outbox("postgresql://app@db/orders")

    async with engine.begin() as connection:            # your transaction
        await connection.execute(insert(orders).values(...))
        await outbox.add(connection, "orders", {"order": 42, "status": "placed"})
    # committed together: the order and its event; rolled back together, neither

``add`` never commits: the row becomes visible to the relay when your transaction commits, and
never if it rolls back. So a service cannot commit its rows and lose the event (the publish
failed), nor publish an event for a transaction that then rolled back.
"""

from __future__ import annotations

import json
from collections.abc import Coroutine, Mapping
from typing import Any, overload

from .._bodies import json_payload
from ..clock import Clock, SystemClock
from ..errors import MissingExtraError
from ..idempotency.keys import new_idempotency_key
from ..ports import CONTENT_TYPE, JSON_CONTENT_TYPE, checked_message
from ..telemetry.propagation import context_as_json
from .table import DEFAULT_TABLE, KEY_LIMIT, NAME_LIMIT, outbox_table

try:
    import sqlalchemy as sa
    from sqlalchemy.engine import URL, Connection, Engine
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
    from sqlalchemy.orm import Session
except ImportError as error:  # the sql extra is not installed
    raise MissingExtraError("Outbox", "sql", "SQLAlchemy") from error

from .._sql_engines import OnSqlEngines, SqlEngines

_SYNC_CONNECTIONS = (Connection, Session)
_ASYNC_CONNECTIONS = (AsyncConnection, AsyncSession)


class Outbox(OnSqlEngines):
    """The outbox table of one database, and :meth:`add` to write events into it.

    Args:
        url_or_engine: a database URL (PostgreSQL, MariaDB or SQLite) or an ``AsyncEngine``;
            the relay reads through it. ``add`` writes through whatever connection you pass.
        table: the table name (default ``reliable_sub_outbox``).
        notify: on PostgreSQL, ``add`` also sends ``NOTIFY <table>`` (delivered at commit),
            which wakes relays at once instead of at their next poll (MariaDB and SQLite have
            no such thing: their relays poll).
        clock: the time source of ``created_at`` (``wall()``).
        sync_engine: the sync engine for :meth:`create_schema_sync` (default: one on the same
            database).
        engine_options: ``create_engine`` keyword arguments for each engine made from the URL
            (``pool_size``, ``max_overflow``, ...).
    """

    def __init__(
        self,
        url_or_engine: str | URL | AsyncEngine,
        *,
        table: str = DEFAULT_TABLE,
        notify: bool = True,
        clock: Clock | None = None,
        sync_engine: Engine | None = None,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._engines = SqlEngines(url_or_engine, owner="Outbox", sync_engine=sync_engine,
                                   engine_options=engine_options)
        self.dialect = self._engines.dialect
        self.metadata = sa.MetaData()
        self.table = outbox_table(self.metadata, table)
        self.channel = table
        self._notify = notify and self.dialect == "postgresql"
        self._clock: Clock = clock or SystemClock()

    def __repr__(self) -> str:
        return f"Outbox({self.dialect}, table={self.table.name!r})"

    # -- writing -----------------------------------------------------------------------------

    @overload
    def add(
        self, connection: AsyncConnection | AsyncSession, topic: str, data: Any, *,
        attributes: Mapping[str, str] | None = None, ordering_key: str | None = None,
        idempotency_key: str | None = None,
    ) -> Coroutine[Any, Any, str]: ...

    @overload
    def add(
        self, connection: Connection | Session, topic: str, data: Any, *,
        attributes: Mapping[str, str] | None = None, ordering_key: str | None = None,
        idempotency_key: str | None = None,
    ) -> str: ...

    def add(
        self, connection: Any, topic: str, data: Any, *,
        attributes: Mapping[str, str] | None = None, ordering_key: str | None = None,
        idempotency_key: str | None = None,
    ) -> Any:
        """Write an event to publish into ``connection``'s transaction; returns its key.

        ``connection`` is a SQLAlchemy ``Connection`` or ORM ``Session`` (then the row is
        written before ``add`` returns) or an ``AsyncConnection`` or ``AsyncSession`` (then
        ``await`` it). Nothing is committed: your commit publishes, your rollback discards.

        ``data`` is bytes, or a pydantic model, a dataclass or a JSON-serialisable value (a str
        too: it becomes a JSON string), sent as UTF-8 JSON with ``content-type:
        application/json`` unless ``attributes`` name another. The relay publishes
        ``idempotency_key`` (default: a fresh UUIDv7, returned) as the ``idempotency-key``
        attribute, so a consumer's dedup store drops the relay's duplicates. The current
        OpenTelemetry context is kept with the row: the relay's send span is its child. Bad
        input raises ``TypeError`` or ``ValueError`` before anything is written.
        """
        row = self._row(topic, data, attributes, ordering_key, idempotency_key)
        statement = sa.insert(self.table).values(row)
        if isinstance(connection, _ASYNC_CONNECTIONS):
            return self._add_async(connection, statement, row["key"])
        if not isinstance(connection, _SYNC_CONNECTIONS):
            raise TypeError(
                "Outbox.add needs a SQLAlchemy Connection, Session, AsyncConnection or "
                f"AsyncSession in your transaction, got {type(connection).__name__}"
            )
        connection.execute(statement)
        if self._notify:
            connection.execute(self._notify_statement())
        return row["key"]

    async def _add_async(self, connection: Any, statement: Any, key: str) -> str:
        await connection.execute(statement)
        if self._notify:
            await connection.execute(self._notify_statement())
        return key

    def _notify_statement(self) -> Any:
        # delivered when (and only if) the transaction commits; one per transaction and channel
        return sa.select(sa.func.pg_notify(self.channel, ""))

    def _row(
        self, topic: str, data: Any, attributes: Mapping[str, str] | None,
        ordering_key: str | None, idempotency_key: str | None,
    ) -> dict[str, Any]:
        if not isinstance(topic, str) or not 0 < len(topic) <= NAME_LIMIT:
            raise ValueError(f"Outbox.add: topic must be a str of 1 to {NAME_LIMIT} "
                             f"characters, got {topic!r}")
        if ordering_key is not None and (
            not isinstance(ordering_key, str) or not 0 < len(ordering_key) <= NAME_LIMIT
        ):
            raise ValueError(f"Outbox.add: ordering_key must be None or a str of 1 to "
                             f"{NAME_LIMIT} characters, got {ordering_key!r}")
        if idempotency_key is None:
            idempotency_key = new_idempotency_key()
        elif not isinstance(idempotency_key, str) or not 0 < len(idempotency_key) <= KEY_LIMIT:
            raise ValueError(f"Outbox.add: idempotency_key must be None or a str of 1 to "
                             f"{KEY_LIMIT} characters, got {idempotency_key!r}")
        if isinstance(data, bytes | bytearray | memoryview):
            payload, checked = checked_message(data, dict(attributes or {}))
        else:
            payload, checked = checked_message(json_payload(data, "Outbox.add"),
                                               dict(attributes or {}))
            checked.setdefault(CONTENT_TYPE, JSON_CONTENT_TYPE)
        return {
            "key": idempotency_key, "topic": topic, "data": payload,
            "attributes": json.dumps(checked, sort_keys=True), "ordering_key": ordering_key,
            "created_at": self._clock.wall(),
            "trace_context": context_as_json(),  # the caller's span (None without an SDK)
        }


__all__ = ["CONTENT_TYPE", "JSON_CONTENT_TYPE", "Outbox"]
