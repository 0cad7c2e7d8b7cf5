"""The store's statements stay index lookups as its table grows (PostgreSQL).

A claim reads back the rows of its batch it did not write. Written as a semi-join (``(namespace,
key) IN (SELECT ... FROM unnest(...))``) the planner chose a sequential scan and a hash join
whenever its estimates were off: on a table that grew since it was last analyzed, or under a
plan psycopg's prepared statement kept from when the table was small. Each claim then read the
whole table (measured: a claim of 100 keys took 0.8 ms on a 10,000-row table, 7 ms on 30,000,
growing with the table; benchmarks/dedup.py). The lookups are now key by key.

The plans are read from PostgreSQL itself: ``auto_explain`` logs the plan of every statement the
store's connections run, sent to the client as notices (it needs a superuser, as the test
database's ``postgres`` is)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_sub.dedup import SqlDedupStore
from reliable_sub.ports import Completed, Completion, DedupKey
from reliable_sub.testing.services import postgres_url

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
    async with store.engine.begin() as connection:  # the table grows; no ANALYZE, as in life
        await connection.execute(sa.text(  # before autovacuum gets to it
            f"INSERT INTO {table} (namespace, key, owner, state, failures, lease_expires_at, "
            f"expires_at) SELECT 'orders', 'old-' || n, 'o', 'completed', 0, 0, 1e12 "
            f"FROM generate_series(1, {ROWS}) AS n"))
    plans.clear()
    await one_of_each("large")

    assert len(plans) >= 5, plans  # claim, renewal, completion, release, claim
    whole_table = [scan for plan in plans for scan in _scans(plan["Plan"])
                   if scan == ("Seq Scan", table)]
    assert not whole_table, (
        f"{len(whole_table)} of the store's statements read all {ROWS} rows of the table")
