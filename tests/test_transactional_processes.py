"""Transactional handlers under real process faults, on PostgreSQL and MariaDB: every effect
exactly once.

A child process consumes from Redis Streams (the shared Redis) with a SqlDedupStore on the
shared PostgreSQL or MariaDB and a transactional handler that inserts one row into a
``payments`` table (no unique constraint: only the dedup record can keep the effect single).
The test SIGKILLs or SIGSTOPs the child at a point it announces on stdout, a second consumer in
the test's event loop takes the message over after the ack deadline, and the rows are counted
at the end:

1. killed after the commit, before the ack  -> the redelivery is a duplicate; one row;
2. killed before the commit                 -> nothing of the first attempt remains; the
                                               redelivery commits once;
3. frozen past its lease, a peer takes over and commits, then resumed -> its commit finds the
   claim gone and rolls back; one row, the peer's.
"""

from __future__ import annotations

import asyncio
import json
import signal
import textwrap
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_sub import LeasePolicy, Message, Outcome, RetryPolicy, Subscriber
from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
from reliable_sub.dedup import SqlDedupStore
from reliable_sub.testing.services import redis_url, sql_url
from tests.redis_processes import Child, poll_until

# The subscription's ack deadline; leases and dedup claims are sized to it, so a dead or
# frozen consumer's message and claim are taken over about this long after its last renewal.
ACK_DEADLINE = 1.0
LEASE = LeasePolicy(min_extension=0.5, max_extension=ACK_DEADLINE)
RETRY = RetryPolicy(min_backoff=0.05, max_backoff=0.5)
# Bound on every wait for something that should take an ack deadline or two.
WITHIN = 15.0

# argv[1]: settings as JSON. The child prints
#   INSERTED <id>   once its handler has written its row (uncommitted); then, by mode,
#                   "hang": blocks forever (the kill lands before the commit),
#                   "pause": waits for the file cfg["go"] to exist, then returns (commits);
#                   "ack-hangs": returns at once (commits); the adapter's ack never returns;
#   ACKING <ids>    in mode "ack-hangs", after the commit, instead of acking;
#   OUTCOME <id> <outcome>  for every settled delivery.
CHILD = textwrap.dedent(
    """
    import asyncio, json, os, sys

    import sqlalchemy as sa

    from reliable_sub import LeasePolicy, RetryPolicy, Subscriber
    from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
    from reliable_sub.dedup import SqlDedupStore

    cfg = json.loads(sys.argv[1])


    class AckHangs(RedisStreamsAdapter):
        async def ack(self, deliveries):
            print("ACKING", " ".join(d.message.id for d in deliveries), flush=True)
            await asyncio.Event().wait()  # never set: the kill lands here, before XACK


    async def main():
        adapter_type = AckHangs if cfg["mode"] == "ack-hangs" else RedisStreamsAdapter
        adapter = adapter_type(cfg["redis"], consumer=cfg["consumer"], key_prefix=cfg["prefix"])
        store = SqlDedupStore(cfg["database"], table=cfg["processed"], owner=cfg["consumer"])
        payments = sa.Table(cfg["payments"], sa.MetaData(), autoload_with=store.sync_engine)
        sub = Subscriber(
            adapter, dedup=store,
            lease=LeasePolicy(min_extension=cfg["min_extension"],
                              max_extension=cfg["max_extension"]),
            retry=RetryPolicy(min_backoff=0.05, max_backoff=0.5),
            on_outcome=lambda m, o: print("OUTCOME", m.id, o.value, flush=True),
        )

        @sub.handler(cfg["subscription"], transactional=True)
        async def charge(message, connection):
            await connection.execute(
                sa.insert(payments).values(message_id=message.id, consumer=cfg["consumer"])
            )
            print("INSERTED", message.id, flush=True)
            if cfg["mode"] == "hang":
                await asyncio.Event().wait()
            if cfg["mode"] == "pause":
                while not os.path.exists(cfg["go"]):  # the test creates it after SIGCONT
                    await asyncio.sleep(0.01)
            return {"charged": message.id}

        await sub.serve()


    asyncio.run(main())
    """
)


@dataclass
class Scene:
    """One test's stream, tables and processes, and the parent's own connections."""

    tmp_path: Path
    database: str  # a PostgreSQL or MariaDB URL
    redis: str = field(default_factory=redis_url)
    prefix: str = field(default_factory=lambda: f"test-tx-{uuid.uuid4().hex[:12]}")
    subscription: str = "billing"
    children: list[Child] = field(default_factory=list)

    def __post_init__(self) -> None:
        suffix = self.prefix.rsplit("-", 1)[1]
        self.stream = f"{self.prefix}:payments"
        self.store = SqlDedupStore(self.database, table=f"test_txp_processed_{suffix}",
                                   owner="survivor")
        self.payments = sa.Table(
            f"test_txp_payments_{suffix}", self.store.metadata,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("message_id", sa.String(100), nullable=False),
            sa.Column("consumer", sa.String(100), nullable=False),
        )
        self.adapter = RedisStreamsAdapter(self.redis, consumer="survivor",
                                           key_prefix=self.prefix)

    def spawn(self, mode: str) -> Child:
        script = self.tmp_path / "consumer.py"
        script.write_text(CHILD)
        settings = {
            "redis": self.redis, "database": self.database, "mode": mode, "consumer": "first",
            "prefix": self.prefix, "subscription": self.subscription,
            "processed": self.store.table.name, "payments": self.payments.name,
            "go": str(self.tmp_path / "go"), "min_extension": LEASE.min_extension,
            "max_extension": LEASE.max_extension,
        }
        child = Child(script, json.dumps(settings))
        self.children.append(child)
        return child

    async def rows(self) -> list[tuple[str, str]]:
        async with self.store.engine.connect() as connection:
            result = await connection.execute(
                sa.select(self.payments.c.message_id, self.payments.c.consumer)
            )
            return [(r[0], r[1]) for r in result]

    async def record(self, message_id: str) -> tuple[str | None, str]:
        t = self.store.table
        async with self.store.engine.connect() as connection:
            row = (await connection.execute(
                sa.select(t.c.owner, t.c.state).where(t.c.key == message_id)
            )).one()
        return row[0], row[1]

    async def cleanup(self) -> None:
        for child in self.children:
            child.kill()
        raw = self.adapter.client
        keys = [key async for key in raw.scan_iter(match=f"{self.prefix}*", count=1000)]
        if keys:
            await raw.delete(*keys)
        await self.adapter.close()
        async with self.store.engine.begin() as connection:
            await connection.run_sync(self.store.metadata.drop_all)
        await self.store.close()


@pytest.fixture(params=["postgresql", "mariadb"])
async def scene(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Scene]:
    scene = Scene(tmp_path, sql_url(request.param))
    await scene.store.create_schema()
    await scene.adapter.ensure_subscription(
        scene.stream, scene.subscription, ack_deadline=ACK_DEADLINE
    )
    try:
        yield scene
    finally:
        await scene.cleanup()


@dataclass
class Survivor:
    sub: Subscriber
    calls: list[tuple[str, int]] = field(default_factory=list)
    outcomes: list[tuple[str, Outcome]] = field(default_factory=list)

    def settled(self, outcome: Outcome) -> bool:
        return any(o is outcome for _, o in self.outcomes)


@asynccontextmanager
async def survivor(scene: Scene) -> AsyncIterator[Survivor]:
    """A second consumer with the same transactional handler, serving until the block ends."""
    outcomes: list[tuple[str, Outcome]] = []
    sub = Subscriber(scene.adapter, dedup=scene.store, lease=LEASE, retry=RETRY,
                     on_outcome=lambda m, o: outcomes.append((m.id, o)))
    seen = Survivor(sub, outcomes=outcomes)

    @sub.handler(scene.subscription, transactional=True)
    async def charge(message: Message, connection: Any) -> dict[str, str]:
        seen.calls.append((message.id, message.delivery_attempt))
        await connection.execute(
            sa.insert(scene.payments).values(message_id=message.id, consumer="survivor")
        )
        return {"charged": message.id}

    task = asyncio.create_task(sub.serve(), name="survivor")
    try:
        await poll_until(lambda: sub.running or task.done(), "the survivor to start")
        yield seen
    finally:
        await sub.shutdown(timeout=5)
        await asyncio.wait_for(task, timeout=WITHIN)


def ran_once_more_after_the_first_attempt(peer: Survivor, message_id: str) -> None:
    """The peer's handler ran once, on attempt 2 or later.

    The first consumer renews its dedup claim just after its broker lease, so its claim can
    outlive the lease by a few milliseconds; a redelivery in that window is deferred (Redis
    counts it as a delivery) and the handler then runs on attempt 3.
    """
    [(called_id, attempt)] = peer.calls
    assert called_id == message_id
    assert attempt >= 2, "the first attempt counts"
    before_the_ack = {outcome for _, outcome in peer.outcomes[:-1]}
    assert before_the_ack <= {Outcome.DEFERRED}, peer.outcomes
    assert attempt == 2 + len(peer.outcomes) - 1, "one delivery per deferral, then the run"


def killed(child: Child) -> None:
    status = child.kill()
    assert status == -signal.SIGKILL, f"child ended with {status}, not by SIGKILL:\n{child.output}"


async def test_killed_after_commit_before_ack_the_redelivery_is_a_no_op(scene: Scene) -> None:
    child = scene.spawn("ack-hangs")
    message_id = await scene.adapter.publish(scene.stream, b"pay 10 EUR")

    assert await child.line("ACKING") == f"ACKING {message_id}", child.output
    killed(child)
    assert await scene.rows() == [(message_id, "first")], "committed before the ack"
    assert await scene.record(message_id) == (None, "completed")

    async with survivor(scene) as peer:
        await poll_until(lambda: peer.settled(Outcome.DUPLICATE), "the redelivery", WITHIN)
    assert peer.calls == [], "the handler did not run again"
    assert await scene.rows() == [(message_id, "first")], "exactly one effect"


async def test_killed_before_commit_nothing_remains_and_the_redelivery_commits_once(
    scene: Scene,
) -> None:
    child = scene.spawn("hang")
    message_id = await scene.adapter.publish(scene.stream, b"pay 10 EUR")

    assert await child.line("INSERTED") == f"INSERTED {message_id}", child.output
    assert await scene.rows() == [], "not committed: invisible to others"
    killed(child)

    async with survivor(scene) as peer:
        await poll_until(lambda: peer.settled(Outcome.ACKED), "the redelivery to commit", WITHIN)
    assert peer.outcomes[-1] == (message_id, Outcome.ACKED)
    ran_once_more_after_the_first_attempt(peer, message_id)
    assert await scene.rows() == [(message_id, "survivor")], "the killed attempt left nothing"
    assert await scene.record(message_id) == (None, "completed")


async def test_frozen_past_its_lease_the_first_consumer_rolls_back_after_a_takeover(
    scene: Scene,
) -> None:
    child = scene.spawn("pause")
    message_id = await scene.adapter.publish(scene.stream, b"pay 10 EUR")

    assert await child.line("INSERTED") == f"INSERTED {message_id}", child.output
    child.process.send_signal(signal.SIGSTOP)
    try:
        async with survivor(scene) as peer:
            await poll_until(lambda: peer.settled(Outcome.ACKED), "the takeover to commit",
                             WITHIN)
        ran_once_more_after_the_first_attempt(peer, message_id)
        assert await scene.rows() == [(message_id, "survivor")]
    finally:
        (scene.tmp_path / "go").touch()
        child.process.send_signal(signal.SIGCONT)

    # The first consumer wakes up, finishes its handler and tries to commit: the claim is gone.
    assert await child.line("OUTCOME", WITHIN) == f"OUTCOME {message_id} deferred", child.output
    killed(child)
    assert await scene.rows() == [(message_id, "survivor")], "exactly one effect: the peer's"
    assert await scene.record(message_id) == (None, "completed")
