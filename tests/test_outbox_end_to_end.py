"""The outbox end to end on every adapter: a business transaction on PostgreSQL adds an event, a
relay publishes it through the broker (in-memory, Redis Streams, the Pub/Sub emulator), and a
Subscriber with a dedup store handles it once, even though the relay publishes one event twice.
A rolled-back transaction publishes nothing.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from reliable_sub import Message, Outcome
from reliable_sub.outbox import JSON_CONTENT_TYPE, OutboxRelay
from reliable_sub.ports import Adapter
from reliable_sub.testing import Harness, Recorder, memory_harness, pubsub_harness, redis_harness
from tests.outbox_support import fresh_outbox

ORDERS = 6
ROLLED_BACK = 4  # the order whose transaction fails after adding its event


class LosesFirstReply:
    """The adapter, except that the first publish's reply is lost after the broker took it."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter
        self.lost = 0

    async def publish(self, topic: str, data: bytes, attributes: dict[str, str] | None = None,
                      ordering_key: str | None = None) -> str:
        message_id = await self.adapter.publish(topic, data, attributes, ordering_key)
        if not self.lost:
            self.lost += 1
            raise TimeoutError("the broker has it, but its reply was lost")
        return message_id

    async def close(self) -> None:
        await self.adapter.close()


@pytest.mark.parametrize("make_harness", [memory_harness, redis_harness, pubsub_harness],
                         ids=["memory", "redis", "pubsub"])
async def test_committed_orders_are_handled_once_and_a_rolled_back_one_never(
    make_harness: Callable[[], Harness],
) -> None:
    harness = make_harness()
    try:
        topic, subscription = await harness.topic_and_subscription()
        async with fresh_outbox("postgresql") as box:
            orders = sa.Table(f"{box.table.name}_orders", sa.MetaData(),
                              sa.Column("id", sa.Integer, primary_key=True))
            async with box.engine.begin() as connection:
                await connection.run_sync(orders.metadata.create_all)
            keys: dict[int, str] = {}
            for order in range(1, ORDERS + 1):
                try:
                    async with box.engine.begin() as connection:  # the service's transaction
                        await connection.execute(sa.insert(orders).values(id=order))
                        keys[order] = await box.add(connection, topic, {"order": order},
                                                    ordering_key=f"customer-{order % 2}")
                        if order == ROLLED_BACK:
                            raise LookupError("out of stock")
                except LookupError:
                    del keys[order]

            effects: Counter[int] = Counter()
            seen_keys: dict[int, str] = {}
            recorder = Recorder()
            publisher = LosesFirstReply(await harness.adapter())
            relay = OutboxRelay(box, publisher, poll_interval=0.05, min_backoff=0.05,
                                max_backoff=0.1)
            sub = harness.subscriber(await harness.adapter(), dedup=harness.dedup_store(),
                                     on_outcome=recorder)

            @sub.handler(subscription)
            async def ship(message: Message) -> None:
                assert message.attributes["content-type"] == JSON_CONTENT_TYPE
                order = json.loads(message.data)["order"]
                effects[order] += 1
                seen_keys[order] = message.idempotency_key

            def done() -> bool:
                return (recorder.count(Outcome.ACKED) == ORDERS - 1
                        and recorder.count(Outcome.DUPLICATE) == 1)

            async with relay, harness.serving(sub):
                await harness.wait_until(done, 30 * harness.ack_deadline,
                                         what="every committed order, and the duplicate")
            async with box.engine.begin() as connection:
                committed = set((await connection.execute(sa.select(orders.c.id))).scalars())
                await connection.run_sync(orders.metadata.drop_all)
            backlog = await relay.backlog()
    finally:
        await harness.close()
    assert publisher.lost == 1 and relay.published == ORDERS - 1
    assert committed == set(keys) and ROLLED_BACK not in committed
    assert effects == Counter({order: 1 for order in keys}), "each committed order once"
    assert seen_keys == keys, "the consumer deduplicated by the outbox row's key"
    assert backlog.pending == 0
