"""The floor under ``@idempotent`` on PostgreSQL: a raw psycopg loop sending the statements
SqlDedupStore sends for one call, and nothing else.

The statements are not written out here: one call of an ``@idempotent`` function on the store is
run once and its two statements captured (SQLAlchemy's ``before_cursor_execute``), so the floor
sends exactly what the store sends -- the claim (an ``INSERT ... ON CONFLICT DO UPDATE`` in a CTE,
returning the row) and, when the claim was taken, the owner-fenced completion -- each in a
transaction of its own (autocommit), as the store's calls are.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event

# The @idempotent functions' lease and retention, here and in benchmarks.dedup.
LEASE = 30.0
TTL = 3600.0


@dataclass
class Statement:
    text: str
    parameters: dict[str, Any]


async def captured_statements(store: Any) -> tuple[Statement, Statement]:
    """The claim and the completion ``store`` (a SqlDedupStore) sends for a first call."""
    from reliable_sub.idempotency import idempotent

    seen: list[Statement] = []

    def capture(connection: Any, cursor: Any, text: str, parameters: Any, context: Any,
                executemany: bool) -> None:
        seen.append(Statement(text, dict(parameters)))

    @idempotent(store, key=lambda order: order["id"], ttl=TTL, lease_ttl=LEASE)
    async def charge(order: dict[str, Any]) -> dict[str, Any]:
        return {"charged": order["id"]}

    event.listen(store.engine.sync_engine, "before_cursor_execute", capture)
    try:
        await charge({"id": f"capture-{uuid.uuid4().hex}"})
    finally:
        event.remove(store.engine.sync_engine, "before_cursor_execute", capture)
    if len(seen) != 2:
        raise RuntimeError(f"expected a claim and a completion, captured {len(seen)} statements")
    return seen[0], seen[1]


class _OneConnection:
    """A floor's psycopg connection (autocommit, as the store's calls are), and the claim
    statement it sends."""

    def __init__(self, url: str, claim: Statement) -> None:
        self._url = url
        self._claim = claim
        self._connection: Any = None

    async def connect(self) -> None:
        import psycopg

        self._connection = await psycopg.AsyncConnection.connect(self._url, autocommit=True)

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()


class RawIdempotent(_OneConnection):
    """``make(run)`` gives an async function of an order that claims its key and, when the
    claim was taken, records ``{"charged": id}`` as completed: the store's two statements,
    sent with psycopg on one connection."""

    def __init__(self, url: str, claim: Statement, completion: Statement) -> None:
        super().__init__(url, claim)
        self._completion = completion

    def make(self, run: str) -> Callable[[dict[str, Any]], Awaitable[Any]]:
        connection, claim, completion = self._connection, self._claim, self._completion
        calls = iter(range(1 << 62))

        async def charge(order: dict[str, Any]) -> Any:
            owner = f"{run}.{next(calls)}"
            now = time.time()
            cursor = await connection.execute(claim.text, {
                **claim.parameters, "batch_key": [order["id"]], "batch_owner": [owner],
                "now": now, "lease_end": now + LEASE})
            row = await cursor.fetchone()
            if row[2] == "completed":  # a replay: the stored result
                return json.loads(row[6])
            result = {"charged": order["id"]}
            now = time.time()
            await connection.execute(completion.text, {
                **completion.parameters, "batch_key": [order["id"]], "batch_owner": [owner],
                "batch_result": [json.dumps({"r": result})], "now": now,
                "expires_at": now + TTL})
            return result

        return charge


class RawClaims(_OneConnection):
    """The store's claim statement for a batch of fresh keys, sent with psycopg on one
    connection (autocommit): the floor under ``SqlDedupStore.claim_many`` on PostgreSQL."""

    async def claim(self, namespace: str, keys: list[str], run: str) -> None:
        now = time.time()
        cursor = await self._connection.execute(self._claim.text, {
            **self._claim.parameters, "batch_namespace": [namespace] * len(keys),
            "batch_key": keys,
            "batch_owner": [f"{run}.{n}" for n in range(len(keys))],
            "now": now, "lease_end": now + LEASE})
        if len(await cursor.fetchall()) != len(keys):
            raise RuntimeError("the claim statement returned fewer rows than keys")
