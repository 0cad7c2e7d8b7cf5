"""The shipped dedup-store suite, run against the memory and Redis stores."""

from __future__ import annotations

from reliable_sub.testing import (
    DedupStoreSuite,
    StoreHarness,
    fakeredis_stores,
    memory_stores,
    redis_stores,
    sql_stores,
)
from reliable_sub.testing.services import in_ci, postgres_url, redis_available, redis_url


class TestMemoryDedupStore(DedupStoreSuite):
    def make_stores(self) -> StoreHarness:
        return memory_stores()


class TestRedisDedupStore(DedupStoreSuite):
    def make_stores(self) -> StoreHarness:
        return redis_stores(redis_url())


class TestSqlDedupStoreOnPostgres(DedupStoreSuite):
    def make_stores(self) -> StoreHarness:
        return sql_stores(postgres_url(), "postgresql")


class TestSqlDedupStoreOnSqlite(DedupStoreSuite):
    def make_stores(self) -> StoreHarness:
        return sql_stores("sqlite://", "sqlite")


if not in_ci() and not redis_available():  # a laptop without Redis: fakeredis stands in

    class TestRedisDedupStoreOnFakeredis(DedupStoreSuite):
        def make_stores(self) -> StoreHarness:
            return fakeredis_stores()
