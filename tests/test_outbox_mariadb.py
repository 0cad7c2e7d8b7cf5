"""The outbox relay's named locks on MariaDB: a round holds each of its ordering keys' locks
while it publishes, and no pooled connection keeps one afterwards, whether the round committed,
failed or was cancelled. (MariaDB's GET_LOCK locks belong to the session, not the transaction:
a connection back in the pool with a key's lock would keep every other relay off that key.)"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import sqlalchemy as sa

from reliable_sub.outbox import Outbox, OutboxRelay
from reliable_sub.outbox.picking import lock_space
from reliable_sub.ports import Outgoing
from tests.outbox_support import fresh_outbox
from tests.redis_processes import poll_until
from tests.test_outbox_relay_lifecycle import Gate

WITHIN = 10.0


async def _add_keyed(box: Outbox, *keys: str) -> None:
    async with box.engine.begin() as connection:
        for key in keys:
            await box.add(connection, "orders", key.encode(), ordering_key=key)


async def _holders(box: Outbox, keys: Sequence[str]) -> list[object]:
    """Which session holds each key's lock (None: nobody), asked from a session of its own."""
    name = sa.func.concat(f"rs:{lock_space(box.table.name)}:", sa.func.sha1(sa.bindparam("k")))
    async with box.engine.connect() as connection:
        return [(await connection.execute(sa.select(sa.func.is_used_lock(name)),
                                          {"k": key})).scalar() for key in keys]


class Failing(Gate):
    async def publish_many(self, messages: Sequence[Outgoing]) -> list[str]:
        self.entered.set()
        await self.release.wait()
        raise ConnectionError("the broker went away mid-round")


async def test_a_round_holds_its_keys_locks_while_it_publishes_and_lets_go_after() -> None:
    async with fresh_outbox("mariadb") as box:
        await _add_keyed(box, "k1", "k2")
        gate = Gate()
        relay = OutboxRelay(box, gate)
        round_ = asyncio.ensure_future(relay.relay_once())
        await asyncio.wait_for(gate.entered.wait(), WITHIN)
        assert None not in await _holders(box, ["k1", "k2"]), "held during the publish"
        gate.release.set()
        assert await asyncio.wait_for(round_, WITHIN) == 2
        assert await _holders(box, ["k1", "k2"]) == [None, None]


async def test_a_failed_round_and_a_cancelled_round_leave_no_key_locked() -> None:
    async with fresh_outbox("mariadb") as box:
        await _add_keyed(box, "k1")
        failing = Failing()
        relay = OutboxRelay(box, failing)
        round_ = asyncio.ensure_future(relay.relay_once())
        await asyncio.wait_for(failing.entered.wait(), WITHIN)
        failing.release.set()
        assert await asyncio.wait_for(round_, WITHIN) == 1  # the row failed, counted
        assert await _holders(box, ["k1"]) == [None]

        await _add_keyed(box, "k2")
        gate = Gate()  # never released: the round is cancelled mid-publish
        hanging = OutboxRelay(box, gate)
        round_ = asyncio.ensure_future(hanging.relay_once())
        await asyncio.wait_for(gate.entered.wait(), WITHIN)
        assert None not in await _holders(box, ["k2"])
        round_.cancel()
        await asyncio.gather(round_, return_exceptions=True)

        async def freed() -> bool:
            return await _holders(box, ["k2"]) == [None]

        # freed at once (released) or when the server notices the closed connection
        await poll_until(freed, "the cancelled round's connection to let go of k2's lock")


async def test_a_round_reads_the_pending_rows_not_the_published_history() -> None:
    """Without partial indexes, MariaDB's optimizer walked the primary key from its first row
    for ORDER BY id LIMIT, through every published row, so rounds grew slower as history
    grew. Counted exactly with the session's handler reads (rows and index entries read)."""
    import time

    from reliable_sub.idempotency.keys import new_idempotency_key
    from reliable_sub.outbox.picking import RowPicker, release_named_locks

    async with fresh_outbox("mariadb") as box:
        now = time.time()
        rows = [{"key": new_idempotency_key(), "topic": "orders", "data": b"x",
                 "attributes": "{}", "created_at": now, "published_at": now,
                 "ordering_key": None} for n in range(5000)]
        async with box.engine.begin() as connection:
            await connection.execute(sa.insert(box.table), rows)
        await _add_keyed(box, "k1", "k2")
        async with box.engine.begin() as connection:
            await box.add(connection, "orders", b"unkeyed")
        picker = RowPicker(box.table, box.dialect)
        reads = sa.text("SHOW SESSION STATUS LIKE 'Handler_read%'")
        async with box.engine.connect() as connection:
            before = {name: int(value) for name, value in await connection.execute(reads)}
            await connection.rollback()  # the transaction that statement began
            async with connection.begin():
                picked, held = await picker.pick_and_lock(connection, time.time(), 100)
            after = {name: int(value) for name, value in await connection.execute(reads)}
            await release_named_locks(connection)
        assert sorted(row.data for row in picked) == [b"k1", b"k2", b"unkeyed"]
        assert sorted(held) == ["k1", "k2"]
        read = sum(after[name] - before[name] for name in after)
        assert read < 100, f"{read} rows and index entries read for 3 pending rows"  # 5,000+ walked
