"""Rebalances with work in flight: two Subscribers (two group members) on one 4-partition topic,
one joining while the other works and then leaving, under cooperative-sticky (the default) and
eager rebalancing. Effects are counted by the test, outside the consumers.

A revoked partition hands out nothing more; its deliveries out get ``revoke_timeout`` to be
settled; what is settled is committed before the partition goes, and the new owner skips it
(the commit metadata). So nothing is lost, and nothing runs twice: with a dedup store (Redis)
any redelivery would be a duplicate, never a second effect; without one, a graceful rebalance
whose handlers finish within the bound redelivers nothing either.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

pytest.importorskip("confluent_kafka", reason='the Kafka tests need "reliable-sub[kafka]"')

from reliable_sub import FlowControl, Message, Outcome, Subscriber
from reliable_sub.adapters.kafka import KafkaAdapter
from reliable_sub.dedup import RedisDedupStore
from reliable_sub.testing.cleanup import delete_kafka_names
from reliable_sub.testing.services import redis_url
from tests.kafka_processes import KafkaBroker

MESSAGES = 400
KEYS = 40
# Seconds each handler call takes, and calls at once per member: about 160 messages a second,
# so that one member alone takes 2.5 s, past a cooperative rebalance (librdkafka joins at most
# once a second: a joining member gets its partitions 1-1.5 s after it asked), and a rebalance
# finds work in flight.
WORK = 0.05
CONCURRENCY = 8
# Seconds the whole run may take (it takes 3-6 here).
WITHIN = 60.0


class Run:
    """One group of consumers on one topic, and the effects its handlers had."""

    def __init__(self, bootstrap: str, rebalance: str) -> None:
        self.bootstrap = bootstrap
        self.prefix = f"rb-{uuid.uuid4().hex[:8]}"
        self.topic, self.subscription = f"{self.prefix}-topic", f"{self.prefix}-sub"
        self.rebalance = rebalance
        self.effects: Counter[bytes] = Counter()
        self.by_member: Counter[str] = Counter()
        self.outcomes: Counter[Outcome] = Counter()
        self.adapters: list[KafkaAdapter] = []

    def adapter(self) -> KafkaAdapter:
        adapter = KafkaAdapter(self.bootstrap, prefix=self.prefix, partitions=4,
                               rebalance=self.rebalance, revoke_timeout=10.0,
                               consumer_config={"heartbeat.interval.ms": 100,
                                                "session.timeout.ms": 6000})
        self.adapters.append(adapter)
        return adapter

    def member(self, name: str, dedup: Any) -> Subscriber:
        subscriber = Subscriber(self.adapter(), dedup=dedup, receive_timeout=0.1,
                                flow_control=FlowControl(max_messages=CONCURRENCY),
                                on_outcome=lambda m, outcome: self.outcomes.update([outcome]))

        @subscriber.handler(self.subscription)
        async def work(message: Message) -> None:
            await asyncio.sleep(WORK)
            self.effects[message.data] += 1
            self.by_member[name] += 1

        return subscriber

    async def until(self, predicate: Any, what: str) -> None:
        give_up = time.monotonic() + WITHIN
        while not predicate():
            assert time.monotonic() < give_up, f"{what}: {len(self.effects)} of {MESSAGES} done"
            await asyncio.sleep(0.01)


@pytest_asyncio.fixture(params=["cooperative", "eager"])
async def run(request: pytest.FixtureRequest, kafka_broker: KafkaBroker) -> AsyncIterator[Run]:
    made = Run(kafka_broker.bootstrap, request.param)
    try:
        yield made
    finally:
        for adapter in made.adapters:
            await adapter.close()
        await delete_kafka_names(made.bootstrap, [made.topic, made.subscription,
                                                  f"{made.prefix}-subscriptions"])


@pytest.mark.parametrize("with_store", [True, False], ids=["redis-dedup", "no-dedup"])
async def test_a_member_joins_while_another_works_and_then_leaves(run: Run,
                                                                  with_store: bool) -> None:
    stores = []
    if with_store:
        url = redis_url()  # fails under CI=true without Redis
        stores = [RedisDedupStore(url, prefix=f"{run.prefix}:dedup", owner=owner)
                  for owner in ("first", "second")]
    publisher = run.adapter()
    await publisher.ensure_subscription(run.topic, run.subscription, ack_deadline=10)
    payloads = [f"m{i}".encode() for i in range(MESSAGES)]
    for i, payload in enumerate(payloads):
        await publisher.publish(run.topic, payload, ordering_key=f"k{i % KEYS}")

    first = run.member("first", stores[0] if stores else None)
    second = run.member("second", stores[1] if stores else None)
    first_task = asyncio.ensure_future(first.serve())
    await run.until(lambda: len(run.effects) >= 40, "the first member at work")
    second_task = asyncio.ensure_future(second.serve())
    await run.until(lambda: run.by_member["second"] >= 20, "the joining member given work")
    assert len(run.effects) < MESSAGES, "the first finished before the rebalance: too quick"
    await first.shutdown(timeout=10)  # leaves: its partitions move to the second
    await first_task
    await run.until(lambda: len(run.effects) == MESSAGES, "every message handled")
    await second.shutdown(timeout=10)
    await second_task

    assert set(run.effects) == set(payloads), "a message was lost"
    doubled = {payload: n for payload, n in run.effects.items() if n > 1}
    assert doubled == {}, f"{len(doubled)} messages had their effect twice"
    assert run.by_member["first"] > 0 and run.by_member["second"] > 0
    figures = await run.adapter().subscription_stats(run.subscription)
    assert figures.backlog == 0, "everything handled is committed"
    for store in stores:
        await store.close()
