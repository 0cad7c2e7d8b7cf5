"""OutboxRelay: what committed is published, oldest first per key, at least once, never skipped.

Runs on PostgreSQL (and SQLite where one relay at a time is the rule), publishing into a
recording publisher in front of the in-memory broker, so what was published, and in which
order, is counted outside the relay.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_sub import (
    ManualClock,
    MemoryDedupStore,
    Message,
    Outcome,
    Subscriber,
    SystemClock,
)
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.outbox import Outbox, OutboxRelay
from reliable_sub.testing.services import postgres_url
from reliable_sub.testing.timing import drive_until
from tests.outbox_support import add

WITHIN = 10.0


@dataclass
class Recorder:
    """A publisher that records every publish (and can refuse some) before the memory broker."""

    broker: MemoryAdapter = field(default_factory=MemoryAdapter)
    published: list[tuple[str, bytes, dict[str, str], str | None]] = field(default_factory=list)
    refuse: set[str] = field(default_factory=set)  # ordering keys whose publishes fail
    fail_after_publish: int = 0  # this many publishes raise after reaching the broker
    rng: random.Random = field(default_factory=lambda: random.Random(7))

    def __post_init__(self) -> None:
        self.broker.ensure_topic_sync("orders")

    async def publish(self, topic: str, data: bytes, attributes: dict[str, str] | None = None,
                      ordering_key: str | None = None) -> str:
        for _ in range(self.rng.randrange(4)):  # concurrent publishes finish in any order
            await asyncio.sleep(0)
        if ordering_key in self.refuse:
            raise ConnectionError(f"broker refused key {ordering_key}")
        message_id = await self.broker.publish(topic, data, attributes, ordering_key)
        self.published.append((topic, data, dict(attributes or {}), ordering_key))
        if self.fail_after_publish > 0:
            self.fail_after_publish -= 1
            raise TimeoutError("the publish reached the broker but its reply was lost")
        return message_id

    async def close(self) -> None:
        await self.broker.close()


async def drain(relay: OutboxRelay) -> None:
    while await relay.relay_once():
        pass


async def test_committed_rows_are_published_with_their_key_and_marked(outbox: Outbox) -> None:
    recorder = Recorder()
    relay = OutboxRelay(outbox, recorder)
    first = await add(outbox, b"one", ordering_key="order-1")
    with pytest.raises(RuntimeError):
        async with outbox.engine.begin() as connection:
            await outbox.add(connection, "orders", b"rolled back")
            raise RuntimeError("rollback")
    second = await add(outbox, b"two")

    assert await relay.relay_once() == 2
    assert await relay.relay_once() == 0, "published rows are not taken again"
    # (rows of different keys are published concurrently: in any order)
    assert sorted((data, attrs["idempotency-key"], key)
                  for _, data, attrs, key in recorder.published) \
        == [(b"one", first, "order-1"), (b"two", second, None)]
    assert (await relay.backlog()).pending == 0
    assert relay.published == 2


async def test_a_late_commit_with_a_lower_id_is_still_published(shared_outbox: Outbox) -> None:
    recorder = Recorder()
    relay = OutboxRelay(shared_outbox, recorder)
    async with shared_outbox.engine.connect() as slow:
        transaction = await slow.begin()
        await shared_outbox.add(slow, "orders", b"late")  # takes the lower id, commits last
        await add(shared_outbox, b"early")
        await drain(relay)
        assert [data for _, data, _, _ in recorder.published] == [b"early"]
        await transaction.commit()
    await drain(relay)
    assert [data for _, data, _, _ in recorder.published] == [b"early", b"late"]


async def test_three_relays_keep_each_keys_order(shared_outbox: Outbox) -> None:
    recorder = Recorder()
    keys = [f"key-{k}" for k in range(10)]
    async with shared_outbox.engine.begin() as connection:
        for n in range(300):
            await shared_outbox.add(connection, "orders", str(n).encode(),
                                ordering_key=keys[n % len(keys)])
    relays = [OutboxRelay(shared_outbox, recorder, batch_size=7) for _ in range(3)]

    async def until_empty(relay: OutboxRelay) -> None:
        # a round may find everything locked by the others (SKIP LOCKED): go on while rows wait
        while await relay.relay_once() or (await relay.backlog()).pending:
            pass

    await asyncio.gather(*(until_empty(relay) for relay in relays))

    assert len(recorder.published) == 300, "each row published exactly once"
    for key in keys:
        numbers = [int(data) for _, data, _, k in recorder.published if k == key]
        assert numbers == sorted(numbers), f"{key} published out of order: {numbers}"
    assert sum(1 for relay in relays if relay.published) >= 2, "the relays shared the work"


async def test_a_round_takes_a_hot_keys_rows_in_order(outbox: Outbox) -> None:
    recorder = Recorder()
    for n in range(30):
        await add(outbox, str(n).encode(), ordering_key="hot" if n % 3 else "warm")
    relay = OutboxRelay(outbox, recorder, batch_size=100)
    assert await relay.relay_once() == 30, "one round: several rows of one key"
    for key in ("hot", "warm"):
        numbers = [int(data) for _, data, _, k in recorder.published if k == key]
        assert numbers == sorted(numbers) and len(numbers) == (20 if key == "hot" else 10)


async def test_a_failing_key_is_parked_and_blocks_only_itself(outbox: Outbox) -> None:
    recorder = Recorder(refuse={"bad"})
    clock = ManualClock(wall_offset=time.time())
    relay = OutboxRelay(outbox, recorder, max_attempts=3, min_backoff=1, max_backoff=2,
                        clock=clock)
    await add(outbox, b"bad-1", ordering_key="bad")
    await add(outbox, b"bad-2", ordering_key="bad")
    await add(outbox, b"good", ordering_key="good")

    for _ in range(3):
        await relay.relay_once()
        assert await relay.relay_once() == 0, "a failed row waits out its backoff"
        clock.advance(2)
    assert [data for _, data, _, _ in recorder.published] == [b"good"]
    backlog = await relay.backlog()
    assert (backlog.pending, backlog.parked) == (1, 1), "bad-2 waits behind the parked bad-1"
    t = outbox.table
    async with outbox.engine.connect() as connection:
        row = (await connection.execute(
            sa.select(t.c.attempts, t.c.last_error).where(t.c.data == b"bad-1"))).one()
        behind = (await connection.execute(
            sa.select(t.c.attempts).where(t.c.data == b"bad-2"))).scalar_one()
    assert row.attempts == 3 and "broker refused key bad" in row.last_error
    assert behind == 0, "bad-2 was never sent: it waits behind bad-1 with no attempt spent"

    recorder.refuse.clear()
    assert await relay.requeue_parked() == 1
    await drain(relay)
    assert [data for _, data, _, _ in recorder.published] == [b"good", b"bad-1", b"bad-2"]


class _Unprintable(ConnectionError):
    def __str__(self) -> str:
        raise RuntimeError("__str__ failed")


async def test_a_publish_error_that_cannot_be_printed_is_recorded_and_retried(
    outbox: Outbox,
) -> None:
    """#24: the row's last_error was built with str(error); a raising __str__ failed the whole
    round, which then retried for ever without counting the row's attempts."""

    class Hostile(Recorder):
        async def publish(self, *args: Any, **kwargs: Any) -> str:
            raise _Unprintable()

    clock = ManualClock(wall_offset=time.time())
    relay = OutboxRelay(outbox, Hostile(), max_attempts=2, min_backoff=1, max_backoff=2,
                        clock=clock)
    await add(outbox, b"bad", ordering_key="k")
    for _ in range(2):
        await relay.relay_once()
        clock.advance(2)
    t = outbox.table
    async with outbox.engine.connect() as connection:
        row = (await connection.execute(sa.select(t.c.attempts, t.c.last_error))).one()
    assert row.attempts == 2
    assert row.last_error.startswith("_Unprintable: <unprintable _Unprintable")
    assert (await relay.backlog()).parked == 1


async def test_a_late_commit_ahead_of_a_parked_row_does_not_unblock_its_key(
    shared_outbox: Outbox,
) -> None:
    recorder = Recorder(refuse={"k"})
    relay = OutboxRelay(shared_outbox, recorder, max_attempts=1)
    async with shared_outbox.engine.connect() as slow:
        transaction = await slow.begin()
        await shared_outbox.add(slow, "orders", b"late", ordering_key="k")  # the lowest id
        await add(shared_outbox, b"parked", ordering_key="k")
        await add(shared_outbox, b"behind", ordering_key="k")
        await drain(relay)  # "parked" fails once and is parked; "behind" waits
        assert (await relay.backlog()).parked == 1
        recorder.refuse.clear()
        await transaction.commit()
    await drain(relay)
    assert [data for _, data, _, _ in recorder.published] == [b"late"], (
        "the late row is published; the row behind the parked one still waits")
    assert await relay.requeue_parked() == 1
    await drain(relay)
    assert [data for _, data, _, _ in recorder.published] == [b"late", b"parked", b"behind"]


async def test_a_publish_whose_reply_was_lost_is_republished_and_deduplicated(
    outbox: Outbox,
) -> None:
    recorder = Recorder(fail_after_publish=1)
    recorder.broker.ensure_subscription_sync("orders", "billing")
    clock = ManualClock(wall_offset=time.time())
    relay = OutboxRelay(outbox, recorder, min_backoff=1, max_backoff=1, clock=clock)
    await add(outbox, b"charge")
    effects: list[bytes] = []
    outcomes: list[Outcome] = []
    sub = Subscriber(recorder.broker, dedup=MemoryDedupStore(),
                     on_outcome=lambda m, o: outcomes.append(o))

    @sub.handler("billing")
    async def charge(message: Message) -> None:
        effects.append(message.data)

    serving = asyncio.ensure_future(sub.serve())
    try:
        await relay.relay_once()  # reaches the broker, but the relay sees a failure
        await drive_until(SystemClock(), lambda: outcomes == [Outcome.ACKED], WITHIN)
        clock.advance(1)  # the row's backoff
        await relay.relay_once()  # at least once: published again
        await drive_until(SystemClock(), lambda: len(outcomes) == 2, WITHIN)
    finally:
        await sub.shutdown(timeout=5)
        await serving
    assert len(recorder.published) == 2, "the broker had it twice"
    assert outcomes == [Outcome.ACKED, Outcome.DUPLICATE]
    assert effects == [b"charge"], "the consumer's dedup store dropped the relay's duplicate"
    assert (await relay.backlog()).pending == 0


async def test_serve_wakes_on_notify_long_before_its_poll(pg_outbox: Outbox) -> None:
    recorder = Recorder()
    relay = OutboxRelay(pg_outbox, recorder, poll_interval=60.0)
    serving = asyncio.ensure_future(relay.serve())
    try:
        # LISTEN in place, its first wake-up spent, and serve() waiting on a 60 s poll
        await drive_until(SystemClock(), lambda: (relay.listening and relay.rounds >= 1
                          and relay.waiting) or serving.done(), WITHIN)
        await add(pg_outbox, b"now")
        await drive_until(SystemClock(), lambda: relay.published == 1 or serving.done(),
                          WITHIN, what="the NOTIFY to wake the relay")
    finally:
        await relay.shutdown()
        await asyncio.wait_for(serving, WITHIN)
    assert relay.published == 1


async def test_serve_polls_without_notify(outbox: Outbox) -> None:
    recorder = Recorder()
    relay = OutboxRelay(outbox, recorder, poll_interval=0.05)
    serving = asyncio.ensure_future(relay.serve())
    try:
        for n in range(3):
            await add(outbox, str(n).encode())
            await drive_until(SystemClock(), lambda n=n: relay.published == n + 1, WITHIN)
    finally:
        await relay.shutdown()
        await asyncio.wait_for(serving, WITHIN)
    assert [data for _, data, _, _ in recorder.published] == [b"0", b"1", b"2"]


async def test_purge_published_deletes_old_published_rows_only(outbox: Outbox) -> None:
    recorder = Recorder(refuse={"bad"})
    clock = ManualClock(wall_offset=time.time())
    relay = OutboxRelay(outbox, recorder, max_attempts=1, clock=clock)
    for n in range(5):
        await add(outbox, str(n).encode())
    await add(outbox, b"parked", ordering_key="bad")
    await drain(relay)
    await add(outbox, b"pending")
    clock.advance(3600)
    assert await relay.purge_published(older_than=60, batch_size=2) == 5
    left = {bytes(r.data) for r in await _all_rows(outbox)}
    assert left == {b"parked", b"pending"}
    assert await relay.purge_published(older_than=60) == 0


async def _all_rows(outbox: Outbox) -> list[Any]:
    async with outbox.engine.connect() as connection:
        return list(await connection.execute(sa.select(outbox.table)))


def test_bad_configuration_names_the_value() -> None:
    from reliable_sub import ConfigurationError

    box = Outbox("sqlite://")
    with pytest.raises(ConfigurationError, match="poll_interval"):
        OutboxRelay(box, Recorder(), poll_interval=0)
    with pytest.raises(ConfigurationError, match="max_backoff"):
        OutboxRelay(box, Recorder(), min_backoff=5, max_backoff=1)


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_the_outbox_example_ships_each_committed_order_once(database: str) -> None:
    import subprocess
    import sys
    from pathlib import Path

    url = postgres_url() if database == "postgresql" else "sqlite://"
    done = subprocess.run(
        [sys.executable, "examples/outbox.py", url], capture_output=True, text=True,
        timeout=60, cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "shipped: [1, 2]" in done.stdout, done.stdout


def test_a_rows_backoff_stays_within_its_bounds_at_any_attempt() -> None:
    relay = OutboxRelay(Outbox("sqlite://"), Recorder(), min_backoff=0.5, max_backoff=30,
                        max_attempts=5000)
    for attempts in (1, 2, 7, 65, 1100, 5000):
        assert 0.5 <= relay._backoff(attempts) <= 30
    assert relay._backoff(1) == 0.5, "the first retry waits min_backoff"
