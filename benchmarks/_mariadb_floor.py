"""The floor under SqlDedupStore on MariaDB: raw asyncmy loops sending the store's own
statements (their text taken from the store, not written out here), and nothing else.

One connection in autocommit, as the store's own calls run; each batch as the JSON parameter
the store sends. What the store adds on top is SQLAlchemy's execution layers, its pool (a
pre-ping per checkout) and the store's own Python.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from benchmarks._dedup_sql_floor import LEASE, TTL


def _pyformat(text: str) -> str:
    """A SQLAlchemy ``text()``'s ``:name`` parameters as the driver's ``%(name)s``."""
    return re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", text)


class RawMariaDb:
    """The store's claim and completion statements on one asyncmy connection."""

    def __init__(self, url: str, store: Any) -> None:
        self._url = url
        self.claim_sql = _pyformat(store._sql._claim_text.text)
        self.complete_sql = _pyformat(store._sql._complete_text.text)
        self._connection: Any = None

    async def connect(self) -> None:
        import asyncmy
        from sqlalchemy.engine import make_url

        url = make_url(self._url)
        self._connection = await asyncmy.connect(
            host=url.host, port=url.port or 3306, user=url.username,
            password=url.password or "", database=url.database, autocommit=True,
            charset="utf8mb4")

    async def close(self) -> None:
        if self._connection is not None:
            self._connection.close()

    async def claim(self, rows: list[list[str]]) -> list[Any]:
        """One claim statement for ``rows`` of (namespace, key, token), sorted."""
        now = time.time()
        async with self._connection.cursor() as cursor:
            await cursor.execute(self.claim_sql, {
                "batch": json.dumps(sorted(rows)), "now": now, "lease_end": now + LEASE})
            return list(await cursor.fetchall())

    def make(self, run: str) -> Callable[[dict[str, Any]], Awaitable[Any]]:
        """An async ``charge(order)``: claim its key, and when taken record the result."""
        calls = iter(range(1 << 62))

        async def charge(order: dict[str, Any]) -> Any:
            owner = f"{run}.{next(calls)}"
            [row] = await self.claim([["bench", order["id"], owner]])
            if row[2] == "completed":  # a replay: the stored result
                return json.loads(row[6])
            result = {"charged": order["id"]}
            now = time.time()
            async with self._connection.cursor() as cursor:
                await cursor.execute(self.complete_sql, {
                    "batch": json.dumps([["bench", order["id"], owner,
                                          json.dumps({"r": result})]]),
                    "now": now, "expires_at": now + TTL})
                await cursor.fetchall()
            return result

        return charge
