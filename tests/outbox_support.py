"""A fresh outbox table on PostgreSQL, MariaDB or SQLite for one test, dropped afterwards; the
fixtures ``outbox`` (every database), ``shared_outbox`` (the databases several relays share:
PostgreSQL and MariaDB) and ``pg_outbox`` (PostgreSQL) over it, and ``add``."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from reliable_sub.outbox import Outbox
from reliable_sub.testing.services import sql_url


@asynccontextmanager
async def fresh_outbox(database: str) -> AsyncIterator[Outbox]:
    """An Outbox on ``database`` (``"postgresql"``, ``"mariadb"``: the shared servers;
    ``"sqlite"``: a throwaway file) with a table of its own, created; dropped and disconnected
    at the end."""
    url = sql_url(database)
    box = Outbox(url, table=f"test_outbox_{uuid.uuid4().hex[:10]}")
    await box.create_schema()
    try:
        yield box
    finally:
        async with box.engine.begin() as connection:
            await connection.run_sync(box.metadata.drop_all)
        await box.close()
        box.close_sync()


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
async def outbox(request: pytest.FixtureRequest) -> AsyncIterator[Outbox]:
    async with fresh_outbox(request.param) as box:
        yield box


@pytest.fixture(params=["postgresql", "mariadb"])
async def shared_outbox(request: pytest.FixtureRequest) -> AsyncIterator[Outbox]:
    async with fresh_outbox(request.param) as box:
        yield box


@pytest.fixture
async def pg_outbox() -> AsyncIterator[Outbox]:
    async with fresh_outbox("postgresql") as box:
        yield box


async def add(box: Outbox, data: bytes, ordering_key: str | None = None) -> str:
    """Commit one row on topic ``orders``; returns its key."""
    async with box.engine.begin() as connection:
        return await box.add(connection, "orders", data, ordering_key=ordering_key)
