"""A fresh outbox table on PostgreSQL or SQLite for one test, dropped afterwards."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from reliable_sub.outbox import Outbox
from reliable_sub.testing.services import postgres_url


@asynccontextmanager
async def fresh_outbox(database: str) -> AsyncIterator[Outbox]:
    """An Outbox on ``database`` (``"postgresql"``: the shared server; ``"sqlite"``: a throwaway
    file) with a table of its own, created; dropped and disconnected at the end."""
    url = postgres_url() if database == "postgresql" else "sqlite://"
    box = Outbox(url, table=f"test_outbox_{uuid.uuid4().hex[:10]}")
    await box.create_schema()
    try:
        yield box
    finally:
        async with box.engine.begin() as connection:
            await connection.run_sync(box.metadata.drop_all)
        await box.close()
        box.close_sync()
