"""An order service that writes an order and its event in one transaction; a consumer handles the
event once.

* ``place_order`` inserts the order row and adds an ``order-placed`` event to the outbox in the
  same transaction: both commit, or (as for order 3, which fails a business rule) neither does.
* An ``OutboxRelay`` publishes what committed to the in-memory broker; the first publish of
  order 1 "loses its reply" (the broker has it, the relay does not know), so the relay publishes
  it again: at least once.
* The ``shipping`` consumer's dedup store drops that duplicate by the event's idempotency key:
  each order is shipped once.

Run it with ``python examples/outbox.py`` (SQLite in a temporary file) or pass a PostgreSQL URL.
Needs ``pip install "reliable-sub[sql]"``. Exits with status 1 if anything happened otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import uuid
from typing import Any

import sqlalchemy as sa

from reliable_sub import MemoryDedupStore, Message, Outcome, Subscriber
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.outbox import Outbox, OutboxRelay

WAIT_LIMIT = 10.0
RUN = uuid.uuid4().hex[:8]  # table names unique to this run


class FlakyReplies:
    """The broker, except that the first publish's reply is lost after it arrived."""

    def __init__(self, broker: MemoryAdapter) -> None:
        self.broker = broker
        self.lose_next_reply = True

    async def publish(self, topic: str, data: bytes, attributes: dict[str, str] | None = None,
                      ordering_key: str | None = None) -> str:
        message_id = await self.broker.publish(topic, data, attributes, ordering_key)
        if self.lose_next_reply:
            self.lose_next_reply = False
            raise TimeoutError("the broker has it, but its reply was lost")
        return message_id

    async def close(self) -> None:
        await self.broker.close()


async def main(url: str) -> int:
    outbox = Outbox(url, table=f"example_outbox_{RUN}")
    orders = sa.Table(
        f"example_orders_{RUN}", outbox.metadata,  # one metadata: one migration
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("item", sa.String(50), nullable=False),
    )
    await outbox.create_schema()

    async def place_order(order_id: int, item: str) -> None:
        async with outbox.engine.begin() as connection:  # the service's transaction
            await connection.execute(sa.insert(orders).values(id=order_id, item=item))
            await outbox.add(connection, "orders", {"order": order_id, "item": item},
                             ordering_key=f"order-{order_id}")
            if not item:
                raise ValueError(f"order {order_id} has no item")  # rolls back both writes

    await place_order(1, "book")
    await place_order(2, "lamp")
    with contextlib.suppress(ValueError):
        await place_order(3, "")

    broker = MemoryAdapter()
    broker.ensure_subscription_sync("orders", "shipping")
    relay = OutboxRelay(outbox, FlakyReplies(broker), poll_interval=0.05, min_backoff=0.05,
                        max_backoff=0.1)
    shipped: list[int] = []
    outcomes: list[Outcome] = []
    settled = asyncio.Event()

    def on_outcome(_message: Message, outcome: Outcome) -> None:
        outcomes.append(outcome)
        settled.set()

    sub = Subscriber(broker, dedup=MemoryDedupStore(), on_outcome=on_outcome)

    @sub.handler("shipping")
    async def ship(message: Message) -> dict[str, Any]:
        order = json.loads(message.data)
        shipped.append(order["order"])
        return {"shipped": order["order"]}

    def done() -> bool:  # two orders shipped, and the relay's duplicate dropped
        return outcomes.count(Outcome.ACKED) == 2 and Outcome.DUPLICATE in outcomes

    async def until_done() -> None:
        while not done():
            settled.clear()
            await settled.wait()

    async with relay, sub:  # both run in this loop until the block ends
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(until_done(), WAIT_LIMIT)
        backlog = await relay.backlog()

    async with outbox.engine.begin() as connection:
        order_ids = (await connection.execute(sa.select(orders.c.id))).scalars().all()
        await connection.run_sync(outbox.metadata.drop_all)
    await outbox.close()

    print("orders committed:", sorted(order_ids))
    print("published:", relay.published, "publish errors:", relay.publish_errors,
          "pending:", backlog.pending)
    # (a duplicate that arrives while the original runs is deferred first, then dropped)
    print("outcomes:", sorted(o.value for o in outcomes))
    print("shipped:", sorted(shipped))
    ok = (sorted(order_ids) == [1, 2] and sorted(shipped) == [1, 2] and backlog.pending == 0
          and done() and set(outcomes) <= {Outcome.ACKED, Outcome.DUPLICATE, Outcome.DEFERRED})
    print("OK: each committed order shipped once, the rolled-back one never"
          if ok else "FAILED: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "sqlite://")))
