"""An order service on FastAPI: an idempotent POST that writes a row and its event in one
transaction, the outbox relay that publishes the event, and a consumer that ships each order
once, all started and stopped by the app's lifespan.

* ``POST /orders`` with an ``Idempotency-Key`` header inserts the order and adds an
  ``order-placed`` event to the outbox in one transaction, under ``@idempotent`` on that key:
  a retry of a finished request gets the stored response (``Idempotent-Replayed: true``), one
  that arrives while the first still runs gets HTTP 409, and the same key with another body
  HTTP 422. The orders table's unique key column makes a retry after a crash between commit
  and the idempotency record find the row instead of writing a second one.
* The ``OutboxRelay`` publishes committed events to the broker; the ``Subscriber`` (a typed
  handler, deduplicated in the same database) ships each order once.
* ``GET /healthz`` answers 200 while the consumer is handling, 503 with its problems when not.

Run it with ``python examples/fastapi_service.py`` (SQLite in a temporary file, the in-memory
broker, no services): it places an order twice with one key, once with another key, and checks
that two orders were shipped. ``uvicorn --factory examples.fastapi_service:app_from_env`` serves
it (``DATABASE_URL`` picks the database; ``sqlite:///orders.db`` by default). Needs
``pip install "reliable-sub[sql,pydantic]" fastapi httpx``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from fastapi import FastAPI, Header, HTTPException, Response
from pydantic import BaseModel, Field

from reliable_sub import (
    IdempotencyInProgressError,
    IdempotencyKeyReuseError,
    Message,
    Subscriber,
)
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.dedup import SqlDedupStore
from reliable_sub.idempotency import idempotent
from reliable_sub.outbox import Outbox, OutboxRelay
from reliable_sub.ports import Adapter


class NewOrder(BaseModel):
    item: str = Field(min_length=1)
    quantity: int = Field(gt=0)


@dataclass
class OrderPlaced:
    order_id: int
    item: str
    quantity: int


def create_app(database_url: str, broker: Adapter | None = None,
               tables: str = "service") -> FastAPI:
    """The service on ``database_url`` (its tables named ``<tables>_...``), publishing to
    ``broker`` (default: in memory)."""
    outbox = Outbox(database_url, table=f"{tables}_outbox")
    store = SqlDedupStore(outbox.engine, table=f"{tables}_processed")
    orders = sa.Table(
        f"{tables}_orders", outbox.metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("idempotency_key", sa.String(200), nullable=False, unique=True),
        sa.Column("item", sa.String(100), nullable=False),
        sa.Column("quantity", sa.Integer, nullable=False),
    )
    if broker is None:
        memory = MemoryAdapter()
        memory.ensure_subscription_sync("orders", "shipping")
        broker = memory
    relay = OutboxRelay(outbox, broker, poll_interval=0.1)
    consumer = Subscriber(broker, dedup=store)
    shipped: list[int] = []

    @consumer.handler("shipping")
    async def ship(event: OrderPlaced, message: Message) -> dict[str, Any]:
        shipped.append(event.order_id)
        return {"shipped": event.order_id}

    @idempotent(store, key="key", lease_ttl=30.0, namespace="orders-api")
    async def place_order(key: str, order: dict[str, Any]) -> dict[str, Any]:
        async with outbox.engine.begin() as connection:
            existing = (await connection.execute(
                sa.select(orders.c.id).where(orders.c.idempotency_key == key))).scalar()
            if existing is not None:  # committed before a crash kept the record from being kept
                return {"order_id": existing, **order}
            inserted = await connection.execute(
                sa.insert(orders).values(idempotency_key=key, **order))
            order_id = inserted.inserted_primary_key[0]
            await outbox.add(connection, "orders", {"order_id": order_id, **order},
                             idempotency_key=f"order-placed-{order_id}")
        return {"order_id": order_id, **order}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await outbox.create_schema()  # in production: your migration, from outbox.metadata
        await store.create_schema()
        try:
            async with relay, consumer:  # each runs in this loop until the app stops
                yield
        finally:
            await outbox.close()

    app = FastAPI(lifespan=lifespan)
    app.state.shipped = shipped
    app.state.outbox, app.state.store, app.state.orders = outbox, store, orders

    @app.post("/orders", status_code=201)
    async def post_order(order: NewOrder, response: Response,
                         idempotency_key: str = Header(min_length=1, max_length=200)) -> Any:
        try:
            info = await place_order.call_with_info(idempotency_key, order.model_dump())
        except IdempotencyInProgressError:
            raise HTTPException(409, "a request with this Idempotency-Key is in progress; "
                                     "retry later") from None
        except IdempotencyKeyReuseError:
            raise HTTPException(422, "this Idempotency-Key was used with another request "
                                     "body") from None
        response.headers["Idempotent-Replayed"] = "true" if info.replayed else "false"
        return info.value

    @app.get("/healthz")
    async def healthz(response: Response) -> dict[str, Any]:
        if consumer.healthy():
            return {"healthy": True}
        response.status_code = 503
        return {"healthy": False, "problems": consumer.problems()}

    return app


def app_from_env() -> FastAPI:
    """For ``uvicorn --factory examples.fastapi_service:app_from_env``."""
    return create_app(os.environ.get("DATABASE_URL", "sqlite:///orders.db"))


async def main(database_url: str) -> int:
    import httpx

    service = create_app(database_url)
    async with service.router.lifespan_context(service):
        transport = httpx.ASGITransport(app=service)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            first = await client.post("/orders", json={"item": "book", "quantity": 1},
                                      headers={"Idempotency-Key": "req-1"})
            again = await client.post("/orders", json={"item": "book", "quantity": 1},
                                      headers={"Idempotency-Key": "req-1"})
            other = await client.post("/orders", json={"item": "lamp", "quantity": 2},
                                      headers={"Idempotency-Key": "req-2"})
            reused = await client.post("/orders", json={"item": "pen", "quantity": 9},
                                       headers={"Idempotency-Key": "req-1"})
            for _ in range(100):
                if len(service.state.shipped) >= 2:
                    break
                await asyncio.sleep(0.05)
            health = await client.get("/healthz")
    print("first:", first.status_code, first.json(), first.headers["Idempotent-Replayed"])
    print("again:", again.status_code, again.json(), again.headers["Idempotent-Replayed"])
    print("other:", other.status_code, other.json())
    print("same key, other body:", reused.status_code)
    print("shipped:", sorted(service.state.shipped), "healthz:", health.status_code)
    ok = (first.status_code == again.status_code == other.status_code == 201
          and again.json() == first.json() and again.headers["Idempotent-Replayed"] == "true"
          and reused.status_code == 422 and sorted(service.state.shipped) == [1, 2]
          and health.status_code == 200)
    print("OK: two orders placed and shipped once each" if ok else "FAILED: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as directory:
        url = sys.argv[1] if len(sys.argv) > 1 else f"sqlite:///{directory}/orders.db"
        sys.exit(asyncio.run(main(url)))
