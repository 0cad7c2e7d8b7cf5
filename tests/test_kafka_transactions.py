"""Kafka transactions in one process (``KafkaAdapter(transactional_id=...)``): what a handler
publishes with ``publish_in_transaction`` is produced with its message's offset, in one
transaction, when the message is acked; a failed attempt's output never reaches the topic, not
even as an aborted record. Read back by raw consumers outside the Subscriber, ``read_committed``
and ``read_uncommitted``. The crash and zombie cases run in processes:
tests/test_kafka_transaction_processes.py."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

confluent_kafka = pytest.importorskip("confluent_kafka",
                                      reason='the Kafka tests need "reliable-sub[kafka]"')

from reliable_sub import (  # noqa: E402
    ConfigurationError,
    InvalidMessageError,
    Message,
    Outcome,
    RetryPolicy,
    Subscriber,
)
from reliable_sub.adapters.kafka import KafkaAdapter  # noqa: E402
from reliable_sub.testing.cleanup import delete_kafka_names  # noqa: E402
from tests.kafka_processes import KafkaBroker  # noqa: E402

WITHIN = 60.0


def read_topic(bootstrap: str, topic: str, isolation: str, settle: float = 2.0) -> list[Any]:
    """Every record of ``topic`` a fresh ``isolation`` reader sees, once the end stops moving
    for ``settle`` seconds of polling."""
    reader = confluent_kafka.Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex[:8]}",
        "auto.offset.reset": "earliest", "enable.auto.commit": False,
        "isolation.level": isolation})
    records: list[Any] = []
    try:
        reader.subscribe([topic])
        quiet_until = time.monotonic() + settle
        give_up = time.monotonic() + WITHIN
        while time.monotonic() < quiet_until:
            assert time.monotonic() < give_up, "the topic never stopped growing"
            for record in reader.consume(500, 0.2):
                if record.error() is None:
                    records.append(record)
                    quiet_until = time.monotonic() + settle
    finally:
        reader.close()
    return records


class Pipeline:
    """An input topic, its subscription and an output topic, on the test broker."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.prefix = f"tx-{uuid.uuid4().hex[:8]}"
        self.input, self.output = f"{self.prefix}-in", f"{self.prefix}-out"
        self.subscription = f"{self.prefix}-sub"
        self.adapters: list[KafkaAdapter] = []

    def adapter(self, **options: Any) -> KafkaAdapter:
        adapter = KafkaAdapter(self.bootstrap, prefix=self.prefix, partitions=2,
                               consumer_config={"heartbeat.interval.ms": 100,
                                                "session.timeout.ms": 6000}, **options)
        self.adapters.append(adapter)
        return adapter


@pytest_asyncio.fixture
async def pipeline(kafka_broker: KafkaBroker) -> AsyncIterator[Pipeline]:
    made = Pipeline(kafka_broker.bootstrap)
    try:
        yield made
    finally:
        for adapter in made.adapters:
            await adapter.close()
        await delete_kafka_names(made.bootstrap, [made.input, made.output, made.subscription,
                                                  f"{made.prefix}-subscriptions"])


async def until(predicate: Any, what: str) -> None:
    give_up = time.monotonic() + WITHIN
    while not predicate():
        assert time.monotonic() < give_up, what
        await asyncio.sleep(0.01)


async def test_outputs_commit_with_their_offsets_and_a_failed_attempt_leaves_none(
        pipeline: Pipeline) -> None:
    adapter = pipeline.adapter(transactional_id=f"{pipeline.prefix}-worker")
    await adapter.ensure_subscription(pipeline.input, pipeline.subscription)
    await adapter.ensure_topic(pipeline.output)
    outcomes: Counter[Outcome] = Counter()
    subscriber = Subscriber(adapter, receive_timeout=0.1,
                            retry=RetryPolicy(min_backoff=0.01, max_backoff=0.01),
                            on_outcome=lambda message, outcome: outcomes.update([outcome]))

    @subscriber.handler(pipeline.subscription)
    async def enrich(message: Message) -> None:
        await adapter.publish_in_transaction(message, pipeline.output,
                                             message.data + b"-enriched",
                                             attributes={"attempt": str(message.delivery_attempt)},
                                             ordering_key=message.ordering_key)
        if message.data.startswith(b"flaky") and message.delivery_attempt < 3:
            raise RuntimeError("fails twice, after publishing")

    inputs = [f"{'flaky' if n % 5 == 0 else 'order'}-{n}".encode() for n in range(50)]
    for n, data in enumerate(inputs):
        await adapter.publish(pipeline.input, data, ordering_key=f"k{n % 7}")
    task = asyncio.ensure_future(subscriber.serve())
    try:
        await until(lambda: outcomes[Outcome.ACKED] == len(inputs), f"{outcomes}")
    finally:
        await subscriber.shutdown(timeout=10)
        await task

    committed = read_topic(pipeline.bootstrap, pipeline.output, "read_committed")
    everything = read_topic(pipeline.bootstrap, pipeline.output, "read_uncommitted")
    expected = Counter(data + b"-enriched" for data in inputs)
    assert Counter(record.value() for record in committed) == expected, "each output once"
    assert Counter(record.value() for record in everything) == expected, \
        "a failed attempt's output was never produced, not even aborted"
    attempts = {record.value(): dict(record.headers() or [])["attempt"] for record in committed}
    assert {value for value, attempt in attempts.items() if attempt == b"3"} == {
        data + b"-enriched" for data in inputs if data.startswith(b"flaky")}
    figures = await pipeline.adapter().subscription_stats(pipeline.subscription)
    assert figures.backlog == 0, "the offsets were committed with the outputs"


async def test_publish_in_transaction_without_a_transactional_id_says_how_to_turn_it_on(
        pipeline: Pipeline) -> None:
    adapter = pipeline.adapter()
    message = Message.received(f"{pipeline.input}/0/0", b"x", {}, 1, None, None,
                               pipeline.subscription)
    with pytest.raises(ConfigurationError, match=r"transactional_id="):
        await adapter.publish_in_transaction(message, pipeline.output, b"out")
    with pytest.raises(ConfigurationError, match="transactional_id must be a non-empty str"):
        KafkaAdapter(pipeline.bootstrap, transactional_id="  ")


async def test_an_output_that_could_never_be_produced_fails_its_attempt_not_the_transaction(
        pipeline: Pipeline) -> None:
    """An oversized record or an unknown topic is refused in the handler (retried or
    dead-lettered like any failure), not left to abort every later transaction."""
    adapter = pipeline.adapter(transactional_id=f"{pipeline.prefix}-worker")
    await adapter.ensure_subscription(pipeline.input, pipeline.subscription)
    await adapter.ensure_topic(pipeline.output)
    errors: list[BaseException] = []
    outcomes: Counter[Outcome] = Counter()
    subscriber = Subscriber(adapter, receive_timeout=0.1,
                            on_outcome=lambda message, outcome: outcomes.update([outcome]))

    @subscriber.handler(pipeline.subscription)
    async def enrich(message: Message) -> None:
        if message.data == b"huge":
            try:
                await adapter.publish_in_transaction(message, pipeline.output, b"x" * 2_000_000)
            except InvalidMessageError as error:
                errors.append(error)
        elif message.data == b"typo":
            try:
                await adapter.publish_in_transaction(message, f"{pipeline.output}-typo", b"x")
            except LookupError as error:
                errors.append(error)
        await adapter.publish_in_transaction(message, pipeline.output, message.data)

    for data in (b"huge", b"typo", b"fine"):
        await adapter.publish(pipeline.input, data)
    task = asyncio.ensure_future(subscriber.serve())
    try:
        await until(lambda: outcomes[Outcome.ACKED] == 3, f"{outcomes}")
    finally:
        await subscriber.shutdown(timeout=10)
        await task
    assert sorted(type(error).__name__ for error in errors) == ["InvalidMessageError",
                                                                 "UnknownTopicError"]
    assert any("message.max.bytes" in str(error) for error in errors)
    committed = read_topic(pipeline.bootstrap, pipeline.output, "read_committed")
    assert sorted(record.value() for record in committed) == [b"fine", b"huge", b"typo"]
