"""The shipped dedup-store suite, run against the memory, Redis (one server and a cluster) and
SQL stores."""

from __future__ import annotations

import pytest

from reliable_sub.testing import (
    DedupStoreSuite,
    StoreHarness,
    fakeredis_stores,
    memory_stores,
    redis_stores,
    sql_stores,
)
from reliable_sub.testing.services import (
    in_ci,
    mariadb_url,
    postgres_url,
    redis_available,
    redis_url,
)
from tests.redis_processes import RedisClusterProcesses


class TestMemoryDedupStore(DedupStoreSuite):
    def make_stores(self) -> StoreHarness:
        return memory_stores()


class TestRedisDedupStore(DedupStoreSuite):
    def make_stores(self) -> StoreHarness:
        return redis_stores(redis_url())


class TestRedisDedupStoreOnACluster(DedupStoreSuite):
    """On a Redis Cluster of 3 masters and 3 replicas: a batch's keys are claimed with one
    script call per hash slot."""

    cluster_url = ""

    @pytest.fixture(autouse=True)
    def _on_the_cluster(self, redis_cluster: RedisClusterProcesses) -> None:
        self.cluster_url = redis_cluster.url

    def make_stores(self) -> StoreHarness:
        return redis_stores(self.cluster_url, name="redis-cluster")


class TestSqlDedupStoreOnPostgres(DedupStoreSuite):
    def make_stores(self) -> StoreHarness:
        return sql_stores(postgres_url(), "postgresql")


class TestSqlDedupStoreOnMariaDb(DedupStoreSuite):
    def make_stores(self) -> StoreHarness:
        return sql_stores(mariadb_url(), "mariadb")


class TestSqlDedupStoreOnSqlite(DedupStoreSuite):
    def make_stores(self) -> StoreHarness:
        return sql_stores("sqlite://", "sqlite")


if not in_ci() and not redis_available():  # a laptop without Redis: fakeredis stands in

    class TestRedisDedupStoreOnFakeredis(DedupStoreSuite):
        def make_stores(self) -> StoreHarness:
            return fakeredis_stores()
