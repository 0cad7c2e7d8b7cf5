"""The Subscriber's periodic purge of expired dedup records (stores that keep them: SQL)."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from reliable_sub import ConfigurationError, MemoryDedupStore, Message, Subscriber
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.idempotency.sql_store import SqlDedupStore
from tests.memory_world import serve_until

WITHIN = 10.0


async def test_expired_records_are_purged_while_the_subscriber_runs() -> None:
    store = SqlDedupStore("sqlite://", table=f"purge_{uuid.uuid4().hex[:8]}")
    await store.create_schema()
    broker = MemoryAdapter()
    broker.ensure_subscription_sync("orders", "billing")
    sub = Subscriber(broker, dedup=store, dedup_ttl=0.2, dedup_purge_interval=0.05)
    handled: list[str] = []

    @sub.handler("billing")
    async def handle(message: Message) -> None:
        handled.append(message.id)

    for n in range(3):
        await broker.publish("orders", f"order-{n}".encode())
    await serve_until(sub, lambda: sub.stats.purged_records == 3, "three records purged")

    assert len(handled) == 3
    async with store.engine.connect() as connection:
        left = (await connection.execute(sa.select(sa.func.count()).select_from(store.table)))
        assert left.scalar_one() == 0
    await store.close()


class FailingPurge(MemoryDedupStore):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def purge_expired(self, batch_size: int = 1000) -> int:
        self.calls += 1
        if self.calls == 1:
            raise ConnectionError("database went away")
        return 0


async def test_a_failing_purge_is_counted_and_tried_again() -> None:
    store = FailingPurge()
    broker = MemoryAdapter()
    broker.ensure_subscription_sync("orders", "billing")
    sub = Subscriber(broker, dedup=store, dedup_purge_interval=0.02)

    @sub.handler("billing")
    async def handle(message: Message) -> None:
        return None

    await serve_until(sub, lambda: store.calls >= 3, "the purge to run three times")
    assert sub.stats.store_errors >= 1


def test_purge_interval_must_be_positive() -> None:
    with pytest.raises(ConfigurationError, match="dedup_purge_interval"):
        Subscriber(MemoryAdapter(), dedup_purge_interval=0)
