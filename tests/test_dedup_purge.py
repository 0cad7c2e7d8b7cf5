"""The Subscriber's periodic purge of expired dedup records (stores that keep them: SQL)."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from reliable_sub import ConfigurationError, MemoryDedupStore, Message, Subscriber
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.clock import ManualClock
from reliable_sub.dedup import SqlDedupStore
from reliable_sub.ports import Completion, DedupKey
from reliable_sub.testing.services import sql_url
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


@pytest.mark.parametrize("database", ["postgresql", "mariadb", "sqlite"])
async def test_purge_deletes_exactly_the_expired_records_in_batches(database: str) -> None:
    clock = ManualClock()
    url = sql_url(database)
    store = SqlDedupStore(url, table=f"purge_{uuid.uuid4().hex[:8]}", clock=clock)
    await store.create_schema()
    try:
        short = [DedupKey("ns", f"short-{n}") for n in range(7)]
        long = [DedupKey("ns", f"long-{n}") for n in range(4)]
        claims = await store.claim_many([*short, *long], 60.0)
        await store.complete_many([Completion(c, "null") for c in claims[:7]], 10.0)
        await store.complete_many([Completion(c, "null") for c in claims[7:]], 100.0)
        assert await store.purge_expired(batch_size=3) == 0
        clock.advance(10.0)
        assert await store.purge_expired(batch_size=3) == 7, "three batches: 3, 3, 1"
        async with store.engine.connect() as connection:
            left = (await connection.execute(sa.select(store.table.c.key))).scalars().all()
        assert sorted(left) == [key.key for key in long]
        with pytest.raises(ConfigurationError, match="batch_size must be >= 1"):
            await store.purge_expired(batch_size=0)
    finally:
        async with store.engine.begin() as connection:
            await connection.run_sync(store.metadata.drop_all)
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
