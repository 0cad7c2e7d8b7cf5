"""Outbox.add writes its row in the caller's transaction: committed with it, or not at all.

Runs on PostgreSQL and SQLite, with each kind of connection a caller may hold (Connection,
Session, AsyncConnection, AsyncSession). Rows are read back outside the writer's transaction.
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from reliable_sub.outbox import Outbox
from reliable_sub.testing.services import postgres_url
from tests.redis_processes import poll_until_sync


async def rows(outbox: Outbox) -> list[dict[str, Any]]:
    async with outbox.engine.connect() as connection:
        result = await connection.execute(sa.select(outbox.table).order_by(outbox.table.c.id))
        return [dict(row._mapping) for row in result]


async def test_an_async_connection_commits_the_row_with_the_business_write(
    outbox: Outbox,
) -> None:
    async with outbox.engine.begin() as connection:
        key = await outbox.add(connection, "orders", b"placed", attributes={"tenant": "t1"},
                               ordering_key="order-42")
        assert await rows(outbox) == [], "not visible before the commit"
    [row] = await rows(outbox)
    assert (row["key"], row["topic"], row["data"], row["ordering_key"]) == (
        key, "orders", b"placed", "order-42")
    assert json.loads(row["attributes"]) == {"tenant": "t1"}
    assert row["published_at"] is None and row["failed_at"] is None and row["attempts"] == 0
    assert uuid.UUID(key).version == 7


async def test_a_rollback_discards_the_event(outbox: Outbox) -> None:
    with pytest.raises(RuntimeError, match="business rule"):
        async with outbox.engine.begin() as connection:
            await outbox.add(connection, "orders", {"order": 1})
            raise RuntimeError("business rule violated")
    assert await rows(outbox) == []


async def test_an_async_session_writes_in_its_transaction(outbox: Outbox) -> None:
    async with AsyncSession(outbox.engine) as session:
        await outbox.add(session, "orders", {"order": 1})
        await session.rollback()
        await outbox.add(session, "orders", {"order": 2}, idempotency_key="order-2-placed")
        await session.commit()
    [row] = await rows(outbox)
    assert row["key"] == "order-2-placed", "the caller's key is kept"
    assert json.loads(row["data"]) == {"order": 2}
    assert json.loads(row["attributes"]) == {"content-type": "application/json"}


async def test_a_sync_connection_and_a_session_write_before_add_returns(outbox: Outbox) -> None:
    engine = outbox.sync_engine
    with engine.begin() as connection:
        first = outbox.add(connection, "orders", [1, "two", None])
    with Session(engine) as session:
        second = outbox.add(session, "orders", b"x", attributes={"content-type": "text/plain"})
        session.commit()
    found = await rows(outbox)
    assert [r["key"] for r in found] == [first, second]
    assert json.loads(found[0]["data"]) == [1, "two", None]
    assert json.loads(found[1]["attributes"]) == {"content-type": "text/plain"}


@pytest.mark.parametrize(
    ("arguments", "error", "names"),
    [
        ({"topic": "", "data": b"x"}, ValueError, "topic"),
        ({"topic": 7, "data": b"x"}, ValueError, "topic"),
        ({"topic": "t", "data": {1, 2}}, TypeError, "set"),
        ({"topic": "t", "data": float("nan")}, TypeError, "JSON"),
        ({"topic": "t", "data": b"x", "attributes": {"a": 1}}, TypeError, "attributes"),
        ({"topic": "t", "data": b"x", "ordering_key": ""}, ValueError, "ordering_key"),
        ({"topic": "t", "data": b"x", "idempotency_key": "k" * 201}, ValueError,
         "idempotency_key"),
    ],
)
async def test_bad_input_raises_before_anything_is_written(
    outbox: Outbox, arguments: dict[str, Any], error: type[Exception], names: str
) -> None:
    async with outbox.engine.begin() as connection:
        with pytest.raises(error, match=names):
            outbox.add(connection, **arguments)  # raises at the call, before any await
        await outbox.add(connection, "orders", b"still usable")
    assert [r["data"] for r in await rows(outbox)] == [b"still usable"]


def test_add_refuses_something_that_is_not_a_connection() -> None:
    box = Outbox("sqlite://")
    with pytest.raises(TypeError, match="Connection, Session, AsyncConnection"):
        box.add(object(), "orders", b"x")  # type: ignore[call-overload]


async def test_postgresql_relays_are_notified_at_commit_and_not_at_rollback() -> None:
    url = postgres_url()
    box = Outbox(url, table=f"test_outbox_{uuid.uuid4().hex[:10]}")
    await box.create_schema()
    heard: list[str] = []
    listening = threading.Event()
    stop = threading.Event()

    def listen() -> None:
        with psycopg.connect(url, autocommit=True) as connection:
            connection.execute(f'LISTEN "{box.channel}"')
            listening.set()
            while not stop.is_set():
                for notice in connection.notifies(timeout=0.05, stop_after=1):
                    heard.append(notice.payload)

    listener = threading.Thread(target=listen)
    listener.start()
    try:
        assert listening.wait(10)
        with pytest.raises(RuntimeError):
            async with box.engine.begin() as connection:
                await box.add(connection, "orders", b"rolled back")
                raise RuntimeError("rollback")
        async with box.engine.begin() as connection:
            await box.add(connection, "orders", b"one")
            await box.add(connection, "orders", b"two")  # one notification per transaction
        poll_until_sync(lambda: len(heard) >= 1, "the notification")
        async with box.engine.begin() as connection:  # a marker: all before it has arrived
            await connection.execute(sa.select(sa.func.pg_notify(box.channel, "marker")))
        poll_until_sync(lambda: len(heard) >= 2, "the marker")
    finally:
        stop.set()
        listener.join(10)
        async with box.engine.begin() as connection:
            await connection.run_sync(box.metadata.drop_all)
        await box.close()
    assert heard == ["", "marker"], "one for the commit, then the marker; none for the rollback"


async def test_a_model_or_a_dataclass_is_written_as_json(outbox: Outbox) -> None:
    import dataclasses

    import pydantic

    class Placed(pydantic.BaseModel):
        order: int
        at: str

    @dataclasses.dataclass
    class Cancelled:
        order: int

    async with outbox.engine.begin() as connection:
        await outbox.add(connection, "orders", Placed(order=1, at="2026-11-27"))
        await outbox.add(connection, "orders", Cancelled(order=1))
    written = await rows(outbox)
    assert [json.loads(r["data"]) for r in written] == [{"order": 1, "at": "2026-11-27"},
                                                        {"order": 1}]
    assert {json.loads(r["attributes"])["content-type"] for r in written} == {"application/json"}
