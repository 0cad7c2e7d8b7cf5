"""The SQL dedup store's batch statements on MariaDB (10.6+): each batch one statement.

The batch is one JSON parameter read through ``JSON_TABLE``. A claim or completion is an
``INSERT … SELECT … ON DUPLICATE KEY UPDATE … RETURNING``; MariaDB's RETURNING gives every row
of the batch as it stands afterwards, the ones the update left alone too, so no read-back is
needed. The update's assignments are evaluated left to right, each seeing the columns already
assigned, and a PostgreSQL-style ``WHERE`` on the update does not exist: every assignment is an
``IF``. The first one decides: ``owner`` becomes this call's token where the row may be taken
(tokens are unique, and a row nobody may take never holds ours), so every later ``IF`` asks
only "is the owner ours now?". Completions then clear the owner last.

Batches are sorted by (namespace, key): two claims of the same keys in different orders
deadlock InnoDB's row locks (measured: a third of racing shuffled batches), sorted ones never.
Renewals and releases are ``UPDATE``s (MariaDB has no ``UPDATE … RETURNING``), a renewal's rows
read back by the token it wrote.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa  # imported by _sql only, once it has checked the sql extra
from sqlalchemy.dialects import mysql
from sqlalchemy.ext.asyncio import AsyncConnection

from ..ports import Claimed
from ._sql_claims import ClaimRow, CompletionRow, Row, SqlClaims, by_key
from ._sql_table import (
    CLAIMED,
    COMPLETED,
    EPOCH,
    EPOCH_KEY,
    FAILED,
    NEVER,
    OWNER_LENGTH,
    stored_part,
)

_KEYS = "j_ns VARCHAR(255) CHARACTER SET utf8mb4 PATH '$[0]', " \
        "j_key VARCHAR(255) CHARACTER SET utf8mb4 PATH '$[1]', " \
        f"j_owner VARCHAR({OWNER_LENGTH}) CHARACTER SET utf8mb4 PATH '$[2]'"


class MariaDbClaims(SqlClaims):
    """The statements of ``table`` on MariaDB."""

    def __init__(self, table: sa.Table, dialect: str) -> None:
        super().__init__(table, dialect)
        t = mysql.dialect().identifier_preparer.quote(table.name)
        # May this call take the row? Expired, released after failures, or its own claim.
        take = (f"({t}.expires_at <= :now OR {t}.state = '{FAILED}' OR "
                f"({t}.state = '{CLAIMED}' AND {t}.owner = j.j_owner))")
        ours = f"{t}.owner = j.j_owner"
        returning = "RETURNING namespace, `key`, state, owner, failures, expires_at, result"
        self._claim_text = sa.text(f"""
            INSERT INTO {t} (namespace, `key`, owner, state, failures, lease_expires_at,
                             expires_at)
            SELECT j.j_ns, j.j_key, j.j_owner, '{CLAIMED}', 0, :lease_end, :lease_end
            FROM JSON_TABLE(:batch, '$[*]' COLUMNS ({_KEYS})) AS j
            ON DUPLICATE KEY UPDATE
                owner = IF({take}, j.j_owner, {t}.owner),
                failures = IF({ours}, IF({t}.expires_at <= :now, 0, {t}.failures), {t}.failures),
                lease_expires_at = IF({ours}, :lease_end, {t}.lease_expires_at),
                completed_at = IF({ours}, NULL, {t}.completed_at),
                result = IF({ours}, NULL, {t}.result),
                state = IF({ours}, '{CLAIMED}', {t}.state),
                expires_at = IF({ours}, :lease_end, {t}.expires_at)
            {returning}""")
        self._complete_text = sa.text(f"""
            INSERT INTO {t} (namespace, `key`, owner, state, failures, completed_at, expires_at,
                             result)
            SELECT j.j_ns, j.j_key, NULL, '{COMPLETED}', 0, :now, :expires_at, j.j_result
            FROM JSON_TABLE(:batch, '$[*]' COLUMNS ({_KEYS},
                                                   j_result LONGTEXT PATH '$[3]')) AS j
            ON DUPLICATE KEY UPDATE
                owner = IF({take}, j.j_owner, {t}.owner),
                failures = IF({ours}, 0, {t}.failures),
                lease_expires_at = IF({ours}, NULL, {t}.lease_expires_at),
                completed_at = IF({ours}, :now, {t}.completed_at),
                expires_at = IF({ours}, :expires_at, {t}.expires_at),
                result = IF({ours}, j.j_result, {t}.result),
                state = IF({ours}, '{COMPLETED}', {t}.state),
                owner = IF({ours}, NULL, {t}.owner)
            RETURNING namespace, `key`, state""")
        self._purge_text = sa.text(f"DELETE FROM {t} WHERE expires_at <= :now LIMIT :n")
        self._epoch_text = sa.text(f"""
            INSERT INTO {t} (namespace, `key`, owner, state, failures, expires_at)
            VALUES (:ns, '{EPOCH_KEY}', NULL, '{EPOCH}', 1, :never)
            ON DUPLICATE KEY UPDATE failures = failures + 1
            RETURNING failures""")

    async def claim(
        self, connection: AsyncConnection, rows: list[ClaimRow], now: float, lease_end: float,
    ) -> dict[tuple[str, str], Row]:
        result = await connection.execute(
            self._claim_text, {"batch": _sorted_json(rows), "now": now, "lease_end": lease_end})
        return by_key(result.all())

    async def complete(
        self, connection: AsyncConnection, rows: list[CompletionRow], now: float,
        expires_at: float,
    ) -> set[tuple[str, str]]:
        result = await connection.execute(
            self._complete_text,
            {"batch": _sorted_json(rows), "now": now, "expires_at": expires_at})
        return {(r[0], r[1]) for r in result.all() if r[2] != COMPLETED}

    async def update_held(
        self, connection: AsyncConnection, claims: Sequence[Claimed], now: float,
        values: dict[str, Any], *, failures: bool = False, report: bool = True,
    ) -> set[tuple[str, str]]:
        await connection.execute(self._held_update(claims, now, values, failures))
        if not report:
            return set()
        t = self.table
        # A row held under one of these tokens now was held when the update ran (no other
        # call writes our tokens, and the lease just extended cannot have lapsed since).
        held = sa.select(t.c.namespace, t.c.key).where(*self._held(claims, now))
        return {(r[0], r[1]) for r in (await connection.execute(held)).all()}

    async def purge(self, connection: AsyncConnection, now: float, batch_size: int) -> int:
        result = await connection.execute(self._purge_text, {"now": now, "n": batch_size})
        return int(result.rowcount)

    async def next_epoch(self, connection: AsyncConnection, namespace: str) -> int:
        result = await connection.execute(
            self._epoch_text, {"ns": stored_part(namespace), "never": NEVER})
        return int(result.scalar_one())


def _sorted_json(rows: Sequence[Sequence[str]]) -> str:
    # code-point order, as the utf8mb4_nopad_bin primary key sorts
    return json.dumps(sorted(rows), ensure_ascii=False)


__all__ = ["MariaDbClaims"]
