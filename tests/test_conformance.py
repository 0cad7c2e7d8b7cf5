"""The shipped adapter suite, run against this package's three adapters.

fakeredis stands in for Redis only on a laptop without one; under ``CI=true`` a missing Redis
fails the Redis class instead.
"""

from __future__ import annotations

from reliable_sub.testing import (
    AdapterSuite,
    Harness,
    fakeredis_harness,
    memory_harness,
    pubsub_harness,
    redis_harness,
)
from reliable_sub.testing.services import in_ci, redis_available


class TestMemoryAdapter(AdapterSuite):
    def make_harness(self) -> Harness:
        return memory_harness()


class TestRedisStreamsAdapter(AdapterSuite):
    def make_harness(self) -> Harness:
        return redis_harness()


class TestPubSubAdapter(AdapterSuite):
    def make_harness(self) -> Harness:
        return pubsub_harness()


if not in_ci() and not redis_available():  # a laptop without Redis: fakeredis stands in

    class TestRedisStreamsAdapterOnFakeredis(AdapterSuite):
        def make_harness(self) -> Harness:
            return fakeredis_harness()
