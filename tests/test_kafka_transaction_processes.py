"""Kafka transactions across processes (#45): a consumer SIGKILLed inside a transaction whose
output records already reached the broker, and a zombie that wakes up to commit after its
successor took over. Consumers are tests/kafka_transaction_consumer.py; outputs are counted
by raw readers outside them, ``read_committed`` (what a downstream consumer sees) and
``read_uncommitted`` (what the log holds, aborted records included).

What must hold: no output of an unfinished transaction is ever visible to ``read_committed``;
after the restart every input's output is visible exactly once; a restart with the same
transactional id aborts its predecessor's open transaction at once (the consumers' transaction
timeout is the broker's longest, 15 minutes, so waiting it out would fail the test's deadline);
a zombie's late commit is fenced.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("confluent_kafka", reason='the Kafka tests need "reliable-sub[kafka]"')

from reliable_sub.adapters.kafka import KafkaAdapter
from reliable_sub.testing.cleanup import delete_kafka_names
from tests.kafka_processes import KafkaBroker
from tests.redis_processes import Child
from tests.test_kafka_transactions import read_topic

CONSUMER = Path(__file__).resolve().parent / "kafka_transaction_consumer.py"
INPUTS = 40
WITHIN = 90.0


class Run:
    def __init__(self, bootstrap: str, tmp_path: Path) -> None:
        self.bootstrap = bootstrap
        self.prefix = f"txp-{uuid.uuid4().hex[:8]}"
        self.input, self.output = f"{self.prefix}-in", f"{self.prefix}-out"
        self.subscription = f"{self.prefix}-sub"
        self.go = tmp_path / "go"
        self.children: list[Child] = []
        self.expected = Counter(f"order-{n}-out".encode() for n in range(INPUTS))

    async def prepare(self) -> None:
        adapter = KafkaAdapter(self.bootstrap, prefix=self.prefix, partitions=2)
        try:
            await adapter.ensure_subscription(self.input, self.subscription)
            await adapter.ensure_topic(self.output)
            for n in range(INPUTS):
                await adapter.publish(self.input, f"order-{n}".encode(), ordering_key=f"k{n % 5}")
        finally:
            await adapter.close()

    async def consumer(self, name: str, hold: str | None = None) -> Child:
        child = Child(CONSUMER, json.dumps({
            "bootstrap": self.bootstrap, "prefix": self.prefix, "consumer": name,
            "transactional_id": f"{self.prefix}-worker", "subscription": self.subscription,
            "output": self.output, "hold": hold, "go": str(self.go)}))
        self.children.append(child)
        await asyncio.to_thread(child.wait_for_line, "READY")
        return child

    def read(self, isolation: str, settle: float = 1.0) -> Counter[bytes]:
        return Counter(record.value()
                       for record in read_topic(self.bootstrap, self.output, isolation, settle))

    async def until_committed(self, count: int) -> float:
        """Seconds until ``read_committed`` sees ``count`` outputs."""
        began = time.monotonic()
        while sum((await asyncio.to_thread(self.read, "read_committed", 0.3)).values()) < count:
            assert time.monotonic() - began < WITHIN, "the outputs never became visible"
        return time.monotonic() - began

    async def cleanup(self) -> None:
        for child in self.children:
            child.kill()
        await delete_kafka_names(self.bootstrap, [self.input, self.output, self.subscription,
                                                  f"{self.prefix}-subscriptions"])


@pytest.fixture
async def run(kafka_broker: KafkaBroker, tmp_path: Path):  # type: ignore[no-untyped-def]
    made = Run(kafka_broker.bootstrap, tmp_path)
    await made.prepare()
    yield made
    await made.cleanup()


async def test_a_consumer_killed_inside_a_transaction_leaves_no_output_and_its_successor_one_each(
        run: Run) -> None:
    first = await run.consumer("first", hold="kill")
    held = int((await asyncio.to_thread(first.wait_for_line, "IN-TRANSACTION", WITHIN)).split()[1])
    assert held > 0
    in_log = await asyncio.to_thread(run.read, "read_uncommitted")
    assert sum(in_log.values()) == held, "the open transaction's records are on the broker"
    assert await asyncio.to_thread(run.read, "read_committed") == Counter(), \
        "nothing of an open transaction is visible"

    first.kill()  # SIGKILL, inside the transaction
    killed_at = time.monotonic()
    await run.consumer("second")  # the same transactional id: aborts what the first left open
    recovery = await run.until_committed(INPUTS)
    print(f"kafka transactions: {held} records open at the SIGKILL; every output visible "
          f"{time.monotonic() - killed_at:.1f}s after it ({recovery:.1f}s after the restart)")

    assert await asyncio.to_thread(run.read, "read_committed") == run.expected, \
        "each input's output exactly once"
    everything = await asyncio.to_thread(run.read, "read_uncommitted")
    assert sum(everything.values()) == INPUTS + held, "the aborted records stay in the log only"


async def test_a_zombie_that_wakes_after_its_successor_took_over_is_fenced(run: Run) -> None:
    zombie = await run.consumer("zombie", hold="zombie")
    held = int((await asyncio.to_thread(zombie.wait_for_line, "IN-TRANSACTION", WITHIN)).split()[1])
    # the zombie's poll thread is stuck in its commit: it leaves the group after
    # max.poll.interval.ms, and its successor, with the same transactional id, takes over
    await run.consumer("successor")
    await run.until_committed(INPUTS)

    run.go.touch()  # the zombie wakes and commits
    outcome = await asyncio.to_thread(zombie.wait_for_line, "ZOMBIE-COMMIT", WITHIN)
    assert outcome.startswith("ZOMBIE-COMMIT failed"), outcome
    assert "fenced" in outcome.lower(), outcome

    assert await asyncio.to_thread(run.read, "read_committed", 2.0) == run.expected, \
        "each input's output exactly once: the zombie's never"
    assert sum((await asyncio.to_thread(run.read, "read_uncommitted")).values()) == INPUTS + held
