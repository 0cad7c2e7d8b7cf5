"""Kafka consumer processes killed during retry backoffs (#45): a handler that fails three times
per message, the consumer SIGKILLed in the quiet between the failures and the next deliveries.
Runs and effects are recorded outside the consumer (tests/kafka_retry_consumer.py).

A record waiting out its backoff is held by the consumer, its offset uncommitted, and its
deliveries so far are in the group's commit metadata: after the kill, the next consumer of the
partition delivers it at once (the backoff does not survive the crash) with the next attempt
number, and the Redis store still holds its handler failures. So nothing is lost, every message
runs exactly four times (three failures, then the success), with delivery attempts 1, 2, 3, 4,
and none is dead-lettered (the policy allows five).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("confluent_kafka", reason='the Kafka tests need "reliable-sub[kafka]"')

import redis

from reliable_sub.adapters.kafka import KafkaAdapter
from reliable_sub.testing.cleanup import delete_kafka_names
from reliable_sub.testing.services import redis_url
from tests.kafka_processes import KafkaBroker
from tests.redis_processes import Child

CONSUMER = Path(__file__).resolve().parent / "kafka_retry_consumer.py"
MESSAGES = 60
FAIL_RUNS = 3
# The retry backoff: long beside a round of runs (milliseconds), so a kill lands in the quiet.
BACKOFF = 2.0
# A round of runs is over when no run was recorded for this long.
QUIET = 0.4
WITHIN = 90.0


class Runs:
    """What the consumers recorded in Redis."""

    def __init__(self, url: str, key: str) -> None:
        self.url = url
        self.client = redis.Redis.from_url(url)
        self.key = key

    def attempts(self) -> dict[int, list[int]]:
        return {n: [int(a) for a in self.client.lrange(f"{self.key}:runs:{n}", 0, -1)]
                for n in range(MESSAGES)}

    def effects(self) -> dict[int, int]:
        found = self.client.hgetall(f"{self.key}:effects")
        return {int(n): int(count) for n, count in found.items()}

    async def wait_for_round(self, runs: int) -> None:
        """Until every message has run ``runs`` times and nothing ran for QUIET seconds."""
        give_up = time.monotonic() + WITHIN
        last: dict[int, list[int]] = {}
        quiet_since = time.monotonic()
        while True:
            now = self.attempts()
            if now != last:
                last, quiet_since = now, time.monotonic()
            elif (all(len(a) >= runs for a in now.values())
                  and time.monotonic() - quiet_since >= QUIET):
                return
            assert time.monotonic() < give_up, f"round {runs} never ended: {now}"
            await asyncio.sleep(0.05)

    def close(self) -> None:
        keys = list(self.client.scan_iter(f"{self.key}*"))
        if keys:
            self.client.delete(*keys)
        self.client.close()


@pytest.fixture
def runs() -> Iterator[Runs]:
    made = Runs(redis_url(), f"kretry-{uuid.uuid4().hex[:8]}")
    yield made
    made.close()


async def test_a_consumer_killed_during_backoffs_loses_nothing_and_counts_attempts_on(
        kafka_broker: KafkaBroker, runs: Runs) -> None:
    prefix = runs.key
    topic, subscription = f"{prefix}-orders", f"{prefix}-billing"
    dlq_topic, dlq = f"{prefix}-orders-dlq", f"{prefix}-dlq"
    adapter = KafkaAdapter(kafka_broker.bootstrap, prefix=prefix, partitions=4)
    await adapter.ensure_subscription(topic, subscription, ack_deadline=10.0)
    await adapter.ensure_subscription(dlq_topic, dlq, ack_deadline=10.0)
    # a key per message, so that every message runs once per round and each kill lands in
    # everyone's backoff (a key's later records wait for its earlier ones' retries:
    # tests/test_kafka_records.py)
    for n in range(MESSAGES):
        await adapter.publish(topic, json.dumps({"n": n}).encode(), ordering_key=f"k{n}")
    children: list[Child] = []

    async def consumer(number: int) -> Child:
        child = Child(CONSUMER, json.dumps({
            "bootstrap": kafka_broker.bootstrap, "prefix": prefix, "consumer": f"c{number}",
            "redis": runs.url, "key": runs.key, "subscription": subscription,
            "dead_letter_topic": dlq_topic, "fail_runs": FAIL_RUNS, "backoff": BACKOFF}))
        children.append(child)
        await asyncio.to_thread(child.wait_for_line, "READY")
        return child

    try:
        current = await consumer(0)
        for failures in range(1, FAIL_RUNS + 1):
            await runs.wait_for_round(failures)  # each message failed that often: backing off
            current.kill()
            current = await consumer(failures)
        give_up = time.monotonic() + WITHIN
        while len(runs.effects()) < MESSAGES:
            assert time.monotonic() < give_up, f"{len(runs.effects())} of {MESSAGES} done"
            await asyncio.sleep(0.1)
        current.process.terminate()
        await asyncio.to_thread(current.process.wait, 30)
        dead = await adapter.receive(dlq, 100, 1.0)
    finally:
        for child in children:
            child.kill()
        await adapter.close()
        await delete_kafka_names(kafka_broker.bootstrap, [
            topic, dlq_topic, subscription, dlq, f"{prefix}-subscriptions"])
    attempts = runs.attempts()
    assert runs.effects() == dict.fromkeys(range(MESSAGES), 1), "an effect lost or doubled"
    wrong = {n: a for n, a in attempts.items() if a != [1, 2, 3, 4]}
    assert wrong == {}, f"delivery attempts across the kills: {wrong}"
    assert dead == [], "nothing is dead-lettered: 3 failures, 5 allowed"
