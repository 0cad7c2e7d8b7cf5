"""A payment handler whose effect and dedup record commit in one database transaction.

The ``charge`` handler debits an account and writes a payment row. It is registered with
``transactional=True``, so it receives a SQLAlchemy connection inside an open transaction, and the
Subscriber adds the message's "completed" record to that same transaction before it commits:

* P-1   a charge: the debit, the payment row and the dedup record commit together;
* P-1'  the producer retries the publish (same ``idempotency-key``): a duplicate, no second debit;
* P-2   the handler writes, then fails (the ledger service is down) on attempt 1: the whole
        transaction rolls back, the redelivery commits once.

A process killed between its commit and its ack would leave nothing to redo either: the record is
already there, so the redelivery is a duplicate (tests/test_transactional_processes.py kills real
processes to show it).

Run it with ``python examples/transactional.py`` (SQLite in a temporary file) or pass a database
URL: ``python examples/transactional.py postgresql://postgres@127.0.0.1:5432/test``. Needs
``pip install "reliable-sub[sql]"``. Exits with status 1 if anything happened otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid
from typing import Any

import sqlalchemy as sa

from reliable_sub import Message, Outcome, RetryPolicy, Subscriber
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.dedup import SqlDedupStore

WAIT_LIMIT = 10.0  # seconds to wait for the expected outcomes
OPENING_BALANCE = 100_00  # cents

# Table names unique to this run, so the example can share a database with anything else.
RUN = uuid.uuid4().hex[:8]


def business_tables(metadata: sa.MetaData) -> tuple[sa.Table, sa.Table]:
    """The service's own tables, on the same metadata as the dedup table (one migration)."""
    accounts = sa.Table(
        f"example_accounts_{RUN}", metadata,
        sa.Column("id", sa.String(20), primary_key=True),
        sa.Column("balance", sa.Integer, nullable=False),
    )
    payments = sa.Table(
        f"example_payments_{RUN}", metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("order_id", sa.String(20), nullable=False),
        sa.Column("amount", sa.Integer, nullable=False),
    )
    return accounts, payments


async def main(url: str) -> int:
    broker = MemoryAdapter()
    broker.ensure_subscription_sync("payments", "ledger")
    store = SqlDedupStore(url, table=f"example_processed_{RUN}")
    accounts, payments = business_tables(store.metadata)
    await store.create_schema()  # in production: your Alembic migration, from store.metadata
    async with store.engine.begin() as connection:
        await connection.execute(sa.insert(accounts).values(id="acct-1", balance=OPENING_BALANCE))

    outcomes: list[tuple[str, Outcome]] = []
    settled = asyncio.Event()

    def on_outcome(message: Message, outcome: Outcome) -> None:
        outcomes.append((message.data.decode(), outcome))
        settled.set()

    ledger_down_once = {"P-2"}
    sub = Subscriber(
        broker, dedup=store, retry=RetryPolicy(min_backoff=0.05, max_backoff=0.1),
        on_outcome=on_outcome,
    )

    @sub.handler("ledger", transactional=True)
    async def charge(message: Message, connection: Any) -> dict[str, Any]:
        order_id, amount = message.data.decode(), 25_00
        await connection.execute(
            sa.update(accounts).where(accounts.c.id == "acct-1")
            .values(balance=accounts.c.balance - amount)
        )
        await connection.execute(sa.insert(payments).values(order_id=order_id, amount=amount))
        if order_id in ledger_down_once:
            ledger_down_once.discard(order_id)
            raise ConnectionError("ledger service unavailable")  # rolls back the two writes
        return {"order": order_id, "charged": amount}

    async def settled_count(count: int) -> None:
        while len(outcomes) < count:
            settled.clear()
            await settled.wait()

    async def wait_for(count: int) -> None:
        # on timeout, the check at the end says what is missing
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(settled_count(count), WAIT_LIMIT)

    serving = asyncio.ensure_future(sub.serve())
    try:
        await broker.publish("payments", b"P-1", {"idempotency-key": "charge-P-1"})
        await wait_for(1)
        await broker.publish("payments", b"P-1", {"idempotency-key": "charge-P-1"})  # a retry
        await wait_for(2)
        await broker.publish("payments", b"P-2", {"idempotency-key": "charge-P-2"})
        await wait_for(4)
    finally:
        await sub.shutdown(timeout=5)
        await serving

    async with store.engine.connect() as connection:
        balance = (await connection.execute(sa.select(accounts.c.balance))).scalar_one()
        rows = (await connection.execute(
            sa.select(payments.c.order_id).order_by(payments.c.id))).scalars().all()
        await connection.run_sync(store.metadata.drop_all)
    await store.close()

    print("outcomes:", ", ".join(f"{order} {outcome.value}" for order, outcome in outcomes))
    print("payments:", list(rows), "balance:", f"{balance / 100:.2f}")
    expected = [("P-1", Outcome.ACKED), ("P-1", Outcome.DUPLICATE), ("P-2", Outcome.RETRY),
                ("P-2", Outcome.ACKED)]
    ok = outcomes == expected and list(rows) == ["P-1", "P-2"]
    ok = ok and balance == OPENING_BALANCE - 2 * 25_00
    print("OK: two charges, each once" if ok else "FAILED: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "sqlite://")))
