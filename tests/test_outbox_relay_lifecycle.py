"""OutboxRelay runs like a Subscriber: start/stop on a thread, serve/shutdown in a loop, a graceful
stop that finishes the round under way, a second stop that forces, restarts, health, retention.

What was published is counted outside the relay (a recording publisher, the outbox table).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest
import sqlalchemy as sa

from reliable_sub import ConfigurationError, ManualClock, SystemClock
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.outbox import Outbox, OutboxRelay
from reliable_sub.testing.timing import drive_until
from tests.outbox_support import add, fresh_outbox
from tests.redis_processes import poll_until, poll_until_sync

WITHIN = 10.0


@dataclass
class Gate:
    """A publisher whose publishes wait for :attr:`release` (the round stays under way)."""

    broker: MemoryAdapter = field(default_factory=MemoryAdapter)
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    published: list[bytes] = field(default_factory=list)
    closed: int = 0

    def __post_init__(self) -> None:
        self.broker.ensure_topic_sync("orders")

    async def publish(self, topic: str, data: bytes, attributes: dict[str, str] | None = None,
                      ordering_key: str | None = None) -> str:
        self.entered.set()
        await self.release.wait()
        message_id = await self.broker.publish(topic, data, attributes, ordering_key)
        self.published.append(data)
        return message_id

    async def close(self) -> None:
        self.closed += 1


def add_sync(box: Outbox, data: bytes) -> str:
    with box.sync_engine.begin() as connection:
        return box.add(connection, "orders", data)


async def published_at(box: Outbox, key: str) -> float | None:
    t = box.table
    async with box.engine.connect() as connection:
        value = (await connection.execute(
            sa.select(t.c.published_at).where(t.c.key == key))).scalar_one()
    return None if value is None else float(value)


def test_start_and_stop_on_a_thread_then_start_again(outbox: Outbox) -> None:
    broker = MemoryAdapter()
    broker.ensure_topic_sync("orders")
    relay = OutboxRelay(outbox, broker, poll_interval=0.02)
    for run in range(2):
        add_sync(outbox, f"run-{run}".encode())
        relay.start()
        try:
            assert relay.running
            poll_until_sync(lambda run=run: relay.published == run + 1, "the row of this run",
                            WITHIN)
            assert relay.healthy()
        finally:
            relay.stop()
        assert not relay.running and not relay.healthy()
    with pytest.raises(RuntimeError, match="already running"), relay:
        relay.start()
    assert relay.published == 2


async def test_a_graceful_stop_finishes_the_round_under_way(shared_outbox: Outbox) -> None:
    gate = Gate()
    relay = OutboxRelay(shared_outbox, gate, poll_interval=0.05)
    key = await add(shared_outbox, b"in flight")
    serving = asyncio.ensure_future(relay.serve())
    try:
        await asyncio.wait_for(gate.entered.wait(), WITHIN)
        stopping = asyncio.ensure_future(relay.shutdown(timeout=WITHIN))
        await poll_until(lambda: relay.stopping, "the stop request")
        assert not stopping.done(), "the stop waits for the round"
        gate.release.set()
        await asyncio.wait_for(stopping, WITHIN)
    finally:
        gate.release.set()
        await asyncio.wait_for(serving, WITHIN)
    assert gate.published == [b"in flight"]
    assert await published_at(shared_outbox, key) is not None, "the round committed before the stop"
    assert gate.closed == 1, "the relay closed its adapter at the end of the run"


async def test_a_second_stop_forces_and_leaves_the_row_pending(shared_outbox: Outbox) -> None:
    gate = Gate()  # never released: the publish hangs
    relay = OutboxRelay(shared_outbox, gate, poll_interval=0.05)
    key = await add(shared_outbox, b"hangs")
    async with relay:
        await asyncio.wait_for(gate.entered.wait(), WITHIN)
        first = asyncio.ensure_future(relay.shutdown(timeout=3600))
        await poll_until(lambda: relay.stopping, "the stop request")
        await asyncio.wait_for(relay.shutdown(), WITHIN)  # the second stop forces
        await asyncio.wait_for(first, WITHIN)
    assert await published_at(shared_outbox, key) is None, "the cancelled round rolled back"

    broker = MemoryAdapter()
    broker.ensure_subscription_sync("orders", "audit")
    async with OutboxRelay(shared_outbox, broker, poll_interval=0.05) as second:
        await poll_until(lambda: second.published == 1, "the next relay to publish the row")
    [delivery] = await broker.receive("audit", 10, 0)
    assert delivery.message.data == b"hangs"


async def test_a_publish_that_hangs_fails_after_publish_timeout(outbox: Outbox) -> None:
    gate = Gate()  # never released
    relay = OutboxRelay(outbox, gate, publish_timeout=0.2)
    await add(outbox, b"slow broker")
    assert await relay.relay_once() == 1
    t = outbox.table
    async with outbox.engine.connect() as connection:
        row = (await connection.execute(sa.select(t.c.attempts, t.c.last_error,
                                                  t.c.published_at))).one()
    assert row.attempts == 1 and row.published_at is None
    assert "publish_timeout" in row.last_error


async def test_failing_rounds_are_retried_and_make_the_relay_unhealthy(outbox: Outbox) -> None:
    broker = MemoryAdapter()
    broker.ensure_topic_sync("orders")
    relay = OutboxRelay(outbox, broker, poll_interval=0.02, min_backoff=0.05, max_backoff=0.1)
    async with relay:
        await poll_until(relay.healthy, "a healthy relay")
        async with outbox.engine.begin() as connection:  # the table goes away under it
            await connection.run_sync(outbox.metadata.drop_all)
        await poll_until(lambda: relay.round_failures >= 3, "rounds to fail and be retried")
        assert not relay.healthy()
        assert relay.running, "a failing database does not stop the relay"
        await outbox.create_schema()
        await add(outbox, b"after the outage")
        await poll_until(lambda: relay.published == 1 and relay.healthy(),
                         "the relay to recover on its own")


def test_start_names_a_missing_table() -> None:
    box = Outbox("sqlite://", table="never_created")
    relay = OutboxRelay(box, MemoryAdapter())
    with pytest.raises(ConfigurationError, match=r"'never_created'.*create_schema"):
        relay.start()
    assert not relay.running


async def test_a_running_relay_deletes_published_rows_past_their_retention() -> None:
    async with fresh_outbox("sqlite") as box:
        broker = MemoryAdapter()
        broker.ensure_topic_sync("orders")
        clock = ManualClock(wall_offset=time.time())
        # rounds only when asked (no poll within the test), a purge every 30 s of clock time
        relay = OutboxRelay(box, broker, retention=60, purge_interval=30, poll_interval=10_000,
                            clock=clock)
        for n in range(3):
            await add(box, str(n).encode())
        assert await relay.relay_once() == 3  # published at clock 0
        clock.set(55)
        await add(box, b"late")
        assert await relay.relay_once() == 1  # published at clock 55
        async with relay:
            # the purge at 55 + 30 = 85 deletes what was published before 85 - 60 = 25
            await drive_until(clock, lambda: relay.purged > 0, 100_000, what="the first purge")
            async with box.engine.connect() as connection:
                left = list((await connection.execute(sa.select(box.table.c.data))).scalars())
        assert relay.purged == 3
        assert left == [b"late"], "rows younger than the retention are kept"


async def test_serve_in_a_loop_and_stop_from_another_thread(outbox: Outbox) -> None:
    broker = MemoryAdapter()
    broker.ensure_topic_sync("orders")
    relay = OutboxRelay(outbox, broker, poll_interval=0.02)
    await add(outbox, b"one")
    serving = asyncio.ensure_future(relay.serve())
    await drive_until(SystemClock(), lambda: relay.published == 1, WITHIN, what="the row")
    with pytest.raises(RuntimeError, match=r"await relay\.shutdown"):
        relay.stop()
    await asyncio.to_thread(relay.stop)
    await asyncio.wait_for(serving, WITHIN)
    assert not relay.running
