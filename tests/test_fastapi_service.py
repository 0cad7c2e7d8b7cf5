"""examples/fastapi_service.py, driven through httpx's ASGI transport on SQLite and PostgreSQL:
an idempotent POST (replay, 409 while in progress, 422 for a reused key), the outbox relay and
the consumer started and stopped by the lifespan, and /healthz."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import sqlalchemy.ext.asyncio

from reliable_sub import DedupKey
from reliable_sub.testing.services import postgres_url

pytest.importorskip("fastapi")
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from fastapi_service import create_app


@pytest.fixture(params=["sqlite", "postgresql"])
async def service(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    url = f"sqlite:///{tmp_path}/orders.db" if request.param == "sqlite" else postgres_url()
    app = create_app(url, tables=f"api_{uuid.uuid4().hex[:8]}")
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client
    if request.param == "postgresql":  # once the consumer and the relay have stopped
        engine = sa.ext.asyncio.create_async_engine(
            app.state.outbox.engine.url.set(drivername="postgresql+psycopg"))
        try:
            async with engine.begin() as connection:
                await connection.run_sync(app.state.outbox.metadata.drop_all)
                await connection.run_sync(app.state.store.metadata.drop_all)
        finally:
            await engine.dispose()


async def post(client: httpx.AsyncClient, key: str, item: str, quantity: int) -> httpx.Response:
    return await client.post("/orders", json={"item": item, "quantity": quantity},
                             headers={"Idempotency-Key": key})


async def until_shipped(client: Any, count: int) -> list[int]:
    shipped: list[int] = client.app.state.shipped
    for _ in range(400):  # polled, with a deadline generous under load
        if len(shipped) >= count:
            break
        await asyncio.sleep(0.05)
    return sorted(shipped)


async def order_rows(client: Any) -> list[tuple[Any, ...]]:
    state = client.app.state
    async with state.outbox.engine.connect() as connection:
        rows = await connection.execute(sa.select(state.orders.c.id, state.orders.c.item))
        return [tuple(row) for row in rows]


async def test_a_retried_request_replays_and_each_order_ships_once(service: Any) -> None:
    first = await post(service, "req-1", "book", 1)
    again = await post(service, "req-1", "book", 1)
    other = await post(service, "req-2", "lamp", 2)
    reused = await post(service, "req-1", "pen", 9)
    assert (first.status_code, again.status_code, other.status_code) == (201, 201, 201)
    assert again.json() == first.json() == {"order_id": 1, "item": "book", "quantity": 1}
    assert [r.headers["Idempotent-Replayed"] for r in (first, again)] == ["false", "true"]
    assert reused.status_code == 422
    assert await until_shipped(service, 2) == [1, 2]
    assert await order_rows(service) == [(1, "book"), (2, "lamp")]
    health = await service.get("/healthz")
    assert (health.status_code, health.json()) == (200, {"healthy": True})


async def test_a_request_whose_key_is_in_progress_gets_409(service: Any) -> None:
    store = service.app.state.store
    held = await store.claim(DedupKey("orders-api", "req-busy"), 30.0)  # a peer's request
    busy = await post(service, "req-busy", "book", 1)
    assert busy.status_code == 409 and "in progress" in busy.json()["detail"]
    await store.release(held)
    assert (await post(service, "req-busy", "book", 1)).status_code == 201


async def test_an_order_committed_before_a_crash_is_found_not_written_again(
    service: Any,
) -> None:
    state = service.app.state
    async with state.outbox.engine.begin() as connection:  # committed; its record never was
        await connection.execute(sa.insert(state.orders).values(
            idempotency_key="req-crash", item="book", quantity=1))
    retried = await post(service, "req-crash", "book", 1)
    assert retried.status_code == 201 and retried.json()["order_id"] == 1
    assert await order_rows(service) == [(1, "book")]


async def test_a_bad_body_or_a_missing_key_is_refused(service: Any) -> None:
    assert (await post(service, "req-3", "", 1)).status_code == 422
    assert (await post(service, "req-3", "book", 0)).status_code == 422
    missing = await service.post("/orders", json={"item": "book", "quantity": 1})
    assert missing.status_code == 422
    assert await order_rows(service) == []
