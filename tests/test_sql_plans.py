"""The statements of the SQL store and the relay stay index lookups as their tables grow
(PostgreSQL): their cost must follow the batch, never the table.

A claim reads back the rows of its batch it did not write. Written as a semi-join (``(namespace,
key) IN (SELECT ... FROM unnest(...))``), PostgreSQL misjudged how many rows it would find
(2,550 for a batch of 100 on a 20,000-row table, statistics fresh) and read the whole table on
a hash join: each claim cost time in proportion to the table (a claim of 100 keys: 1.3 ms on
10,000 rows, 4.1 ms on 20,000, 6.9 ms on 30,000; benchmarks/dedup.py measured the store at 0.24x
its raw psycopg floor). It now looks the rows up key by key.

Each test runs its statements on a small table until psycopg has prepared them, grows the table
(and analyzes it, as autovacuum would), runs them again and reads their plans from PostgreSQL
itself: ``auto_explain`` logs the plan of every statement on the connections, sent to the
client as notices (it needs a superuser, as the test database's ``postgres`` is)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.dedup import SqlDedupStore
from reliable_sub.outbox import OutboxRelay
from reliable_sub.ports import Completed, Completion, DedupKey
from reliable_sub.testing.services import postgres_url
from tests.outbox_support import add, fresh_outbox

# rows the table holds when the plans are checked: an index lookup of 100 keys is far cheaper
ROWS = 20_000
KEYS = 100


def _explained(plans: list[dict[str, Any]]) -> Any:
    """A connect hook that makes a connection log each statement's plan to ``plans``."""
    def on_connect(connection: Any, _record: Any) -> None:
        cursor = connection.cursor()
        for setting in ("LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0",
                        "SET auto_explain.log_format = json", "SET client_min_messages = log"):
            cursor.execute(setting)
        cursor.close()
        connection.commit()

        def notice(diagnostic: Any) -> None:
            text = diagnostic.message_primary or ""
            if text.startswith("duration:") and "{" in text:
                plans.append(json.loads(text[text.index("{"):]))

        connection.driver_connection.add_notice_handler(notice)
    return on_connect


def _scans(node: dict[str, Any]) -> list[tuple[str, str]]:
    """Every (node type, relation) of a plan tree."""
    found = [(node["Node Type"], node.get("Relation Name", ""))]
    for child in node.get("Plans", []):
        found += _scans(child)
    return found


async def _grow(engine: Any, table: str, insert: str, plans: list[dict[str, Any]]) -> None:
    """Add ``ROWS`` rows to ``table`` (``insert``), analyze it as autovacuum would once it
    changed that much (which also makes PostgreSQL plan prepared statements again), and forget
    the plans logged so far."""
    async with engine.begin() as connection:
        await connection.execute(sa.text(insert))
    async with engine.begin() as connection:  # committed: its statistics are transactional
        await connection.execute(sa.text(f"ANALYZE {table}"))
    plans.clear()


def _assert_no_scan_of(table: str, plans: list[dict[str, Any]], statements: int) -> None:
    """At least ``statements`` of the plans logged read ``table``, and none reads all of it."""
    on_table = [plan for plan in plans
                if any(relation == table for _, relation in _scans(plan["Plan"]))]
    assert len(on_table) >= statements, [plan["Query Text"] for plan in plans]
    whole_table = [scan for plan in on_table for scan in _scans(plan["Plan"])
                   if scan == ("Seq Scan", table)]
    assert not whole_table, (
        f"{len(whole_table)} of {len(on_table)} statements read all {ROWS} rows of {table}")


@pytest.fixture
async def store() -> AsyncIterator[SqlDedupStore]:
    made = SqlDedupStore(postgres_url(), table=f"plans_{uuid.uuid4().hex[:8]}")
    await made.create_schema()
    yield made
    async with made.engine.begin() as connection:
        await connection.run_sync(made.metadata.drop_all)
    await made.close()


async def test_claims_and_completions_stay_index_lookups_as_the_table_grows(
        store: SqlDedupStore) -> None:
    plans: list[dict[str, Any]] = []
    await store.engine.dispose()
    sa.event.listen(store.engine.sync_engine, "connect", _explained(plans))
    table = store.table.name

    async def one_of_each(tag: str) -> None:
        # the same number of keys each time: statements whose text depends on it are the same
        keys = [DedupKey("orders", f"{tag}-{n}") for n in range(KEYS)]
        claims = await store.claim_many(keys, 30.0)
        assert not await store.renew(claims[:50], 30.0)
        assert not await store.complete_many(
            [Completion(claim, "{}") for claim in claims[:50]], 3600.0)
        await store.release_many(claims[50:], 0.0)
        again = await store.claim_many(keys[:50], 30.0)  # the rows the claim leaves alone
        assert all(isinstance(result, Completed) for result in again), again

    for round_ in range(8):  # more than psycopg's five runs before it prepares a statement
        await one_of_each(f"small-{round_}")
    await _grow(store.engine, table, plans=plans, insert=(
        f"INSERT INTO {table} (namespace, key, owner, state, failures, lease_expires_at, "
        f"expires_at) SELECT 'orders', 'old-' || n, 'o', 'completed', 0, 0, 1e12 "
        f"FROM generate_series(1, {ROWS}) AS n"))
    await one_of_each("large")

    _assert_no_scan_of(table, plans, 5)  # claim, renewal, completion, release, claim


async def test_relay_rounds_stay_index_lookups_as_the_history_grows() -> None:
    """A relay's rounds read the pending rows through partial indexes and mark them by id:
    none reads the published history, which grows until ``purge_published``."""
    plans: list[dict[str, Any]] = []
    async with fresh_outbox("postgresql") as box:
        await box.engine.dispose()
        sa.event.listen(box.engine.sync_engine, "connect", _explained(plans))
        broker = MemoryAdapter()
        broker.ensure_topic_sync("orders")
        relay = OutboxRelay(box, broker)

        async def add_rows(tag: str) -> None:
            for number in range(KEYS):
                await add(box, f"{tag}-{number}".encode(),
                          ordering_key=f"k{number % 3}" if number % 2 else None)

        async def relay_all() -> None:
            while await relay.relay_once():
                pass

        for round_ in range(8):  # more than psycopg's five runs before it prepares a statement
            await add_rows(f"small-{round_}")
            await relay_all()
        table = box.table.name
        await _grow(box.engine, table, plans=plans, insert=(  # published history
            f"INSERT INTO {table} (key, topic, data, attributes, ordering_key, created_at, "
            f"published_at, attempts) SELECT 'old-' || n, 'orders', '\\x00', '{{}}', "
            f"'k' || (n % 3), 0, 1, 1 FROM generate_series(1, {ROWS}) AS n"))
        await add_rows("large")
        plans.clear()  # the relay's statements alone
        await relay_all()
    _assert_no_scan_of(table, plans, 4)  # keys, unkeyed rows, keyed rows, marks
