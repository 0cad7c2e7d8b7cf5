"""Outbox relays as real processes, on the shared PostgreSQL or MariaDB, and Redis.

1. A relay SIGKILLed between publishing a batch and committing it, twice, then a third that
   finishes and is stopped with SIGTERM: the killed batches are on the stream twice, and a
   consumer with a dedup store lands every committed row's effect exactly once (counted in a
   Redis hash, outside the consumer).
2. Three relay processes at once over 1,000 rows with 20 ordering keys, written while they run:
   every row published exactly once, each key's rows in the order they were written, the work
   shared, and every relay exits 0 on SIGTERM.
3. A relay whose round hangs: the first SIGTERM waits for the round, the second forces the stop
   (exit 0), and the round's row stays pending.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import textwrap
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from reliable_sub import LeasePolicy, Message, Outcome, RetryPolicy, Subscriber
from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
from reliable_sub.dedup import RedisDedupStore
from reliable_sub.outbox import Outbox, OutboxRelay
from reliable_sub.testing.services import redis_url, sql_url
from tests.redis_processes import EXIT_TIMEOUT, Child, poll_until

# Bound on waits for work that takes well under a second when all is well.
WITHIN = 30.0

# argv[1]: settings as JSON. The child runs OutboxRelay.run() (SIGINT/SIGTERM stop it) and
# prints, through logging, "outbox relay started" and "outbox relay stopped"; after each publish
# of a batch, "PUBLISHED <round> <rows>"; with cfg["pause_after"] = N, after its N-th batch
# "PAUSED" and it never returns (the batch is on the stream, its rows are not marked).
CHILD = textwrap.dedent(
    """
    import asyncio, json, logging, sys

    from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
    from reliable_sub.outbox import Outbox, OutboxRelay

    cfg = json.loads(sys.argv[1])
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")


    class Announcing(RedisStreamsAdapter):
        rounds = 0

        async def publish_many(self, messages):
            results = await super().publish_many(messages)
            Announcing.rounds += 1
            print("PUBLISHED", Announcing.rounds, len(messages), flush=True)
            if cfg["pause_after"] == Announcing.rounds:
                print("PAUSED", flush=True)
                await asyncio.Event().wait()  # never set: the kill lands before the commit
            return results


    adapter = Announcing(cfg["redis"], consumer="relay", key_prefix=cfg["prefix"])
    outbox = Outbox(cfg["database"], table=cfg["table"])
    OutboxRelay(outbox, adapter, batch_size=cfg["batch_size"], poll_interval=0.05).run()
    """
)


@dataclass
class Scene:
    tmp_path: Path
    outbox: Outbox
    redis: aioredis.Redis
    run: str
    database: str  # its URL

    @property
    def topic(self) -> str:
        return f"outbox-{self.run}-events"

    def relay(self, batch_size: int, pause_after: int | None = None) -> Child:
        script = self.tmp_path / "relay_child.py"
        if not script.exists():
            script.write_text(CHILD)
        cfg = {"redis": redis_url(), "database": self.database, "prefix": f"outbox-{self.run}",
               "table": self.outbox.table.name, "batch_size": batch_size,
               "pause_after": pause_after}
        return Child(script, json.dumps(cfg))

    async def write(self, rows: list[tuple[bytes, str | None]], per_transaction: int) -> list[str]:
        keys = []
        for start in range(0, len(rows), per_transaction):
            async with self.outbox.engine.begin() as connection:
                for data, ordering_key in rows[start:start + per_transaction]:
                    keys.append(await self.outbox.add(connection, self.topic, data,
                                                      ordering_key=ordering_key))
        return keys

    async def entries(self) -> list[dict[bytes, bytes]]:
        return [fields for _, fields in await self.redis.xrange(self.topic)]


@pytest.fixture(params=["postgresql", "mariadb"])
async def scene(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Scene]:
    run = uuid.uuid4().hex[:10]
    database = sql_url(request.param)
    outbox = Outbox(database, table=f"outbox_proc_{run}")
    await outbox.create_schema()
    # handlers share it: a blocking pool makes them wait for a connection instead of failing
    client = aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(redis_url()))
    try:
        yield Scene(tmp_path, outbox, client, run, database)
    finally:
        keys = [key async for key in client.scan_iter(match=f"*outbox-{run}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
        async with outbox.engine.begin() as connection:
            await connection.run_sync(outbox.metadata.drop_all)
        await outbox.close()


async def stop_gracefully(child: Child) -> None:
    child.process.send_signal(signal.SIGTERM)
    await child.line("outbox relay stopped")
    status = await asyncio.to_thread(child.process.wait, EXIT_TIMEOUT)
    assert status == 0, child.output


async def test_a_relay_killed_between_publish_and_commit_loses_nothing_and_doubles_nothing(
    scene: Scene,
) -> None:
    rows, batch = 300, 50
    keys = await scene.write([(f"row-{n}".encode(), None) for n in range(rows)],
                             per_transaction=10)
    adapter = RedisStreamsAdapter(redis_url(), consumer="consumer",
                                  key_prefix=f"outbox-{scene.run}")
    # a short deadline: a duplicate deferred while its original runs comes back quickly; not
    # shorter, or on a loaded machine claims lapse and the outcomes counted below change
    await adapter.ensure_subscription(scene.topic, f"outbox-{scene.run}-shipping",
                                      ack_deadline=2.0, start="0")
    effects = f"outbox-{scene.run}-effects"
    outcomes: Counter[Outcome] = Counter()
    sub = Subscriber(adapter, dedup=RedisDedupStore(redis_url(), prefix=f"outbox-{scene.run}"),
                     lease=LeasePolicy(min_extension=1.0, max_extension=2.0),
                     retry=RetryPolicy(min_backoff=0.05, max_backoff=0.5),
                     on_outcome=lambda m, o: outcomes.update([o]))

    @sub.handler(f"outbox-{scene.run}-shipping")
    async def ship(message: Message) -> None:
        await scene.redis.hincrby(effects, message.idempotency_key, 1)

    # two relays die with a published batch whose rows they never marked
    for pause_after in (2, 3):
        relay = scene.relay(batch, pause_after)
        await relay.line("PAUSED")
        relay.kill()
    last = scene.relay(batch)
    try:
        await last.line("outbox relay started")
        async with sub:
            await poll_until(lambda: outcomes[Outcome.ACKED] == rows, "every row's effect",
                             WITHIN)
            await poll_until(lambda: outcomes[Outcome.DUPLICATE] == 2 * batch,
                             "the republished batches, deduplicated", WITHIN)
        await stop_gracefully(last)
    finally:
        last.kill()

    published = [fields[b"data"] for fields in await scene.entries()]
    assert len(published) == rows + 2 * batch, "each killed batch reached the stream twice"
    assert set(published) == {f"row-{n}".encode() for n in range(rows)}
    counts = {key.decode(): int(n) for key, n in (await scene.redis.hgetall(effects)).items()}
    assert counts == dict.fromkeys(keys, 1), "every committed row's effect exactly once"
    assert (await OutboxRelay(scene.outbox, adapter).backlog()).pending == 0


async def test_three_relay_processes_keep_each_keys_order(scene: Scene) -> None:
    rows, ordering_keys, batch = 1000, 20, 10
    relays = [scene.relay(batch) for _ in range(3)]
    try:
        for relay in relays:
            await relay.line("outbox relay started")
        # written while the relays run; key k's n-th row carries (k, n)
        sequence: defaultdict[str, int] = defaultdict(int)
        written: list[tuple[bytes, str | None]] = []
        for n in range(rows):
            key = f"key-{(n * 7) % ordering_keys}"
            written.append((json.dumps([key, sequence[key]]).encode(), key))
            sequence[key] += 1
        await scene.write(written, per_transaction=25)

        async def all_published() -> bool:
            return await scene.redis.xlen(scene.topic) >= rows

        await poll_until(all_published, "every row on the stream", WITHIN)
        for relay in relays:
            await stop_gracefully(relay)
    finally:
        for relay in relays:
            relay.kill()

    entries = await scene.entries()
    assert len(entries) == rows, "no row published twice (no relay died)"
    by_key: defaultdict[str, list[int]] = defaultdict(list)
    for fields in entries:
        key, number = json.loads(fields[b"data"])
        assert fields[b"ordering-key"].decode() == key
        by_key[key].append(number)
    assert len(by_key) == ordering_keys
    for key, numbers in by_key.items():
        assert numbers == list(range(len(numbers))), f"{key} out of order: {numbers[:20]}"
    shares = [_published_by(relay) for relay in relays]
    assert sum(shares) == rows
    assert sum(1 for share in shares if share) >= 2, f"the relays shared the work: {shares}"


def _published_by(child: Child) -> int:
    return sum(int(m.group(1)) for line in child.lines
               if (m := re.match(r"PUBLISHED \d+ (\d+)$", line)))


async def test_a_second_sigterm_forces_a_relay_whose_round_hangs(scene: Scene) -> None:
    await scene.write([(b"stuck", None)], per_transaction=1)
    relay = scene.relay(batch_size=10, pause_after=1)  # its first batch never returns
    try:
        await relay.line("PAUSED")
        relay.process.send_signal(signal.SIGTERM)
        await relay.line("stop requested")  # graceful: waits for the round
        assert relay.process.poll() is None, "the first SIGTERM waits for the round"
        relay.process.send_signal(signal.SIGTERM)
        await relay.line("second stop request: forcing the stop")
        status = await asyncio.to_thread(relay.process.wait, EXIT_TIMEOUT)
        assert status == 0, relay.output
    finally:
        relay.kill()
    backlog = await OutboxRelay(scene.outbox, RedisStreamsAdapter(redis_url())).backlog()
    assert backlog.pending == 1, "the cancelled round rolled back: the row waits for a relay"
    assert len(await scene.entries()) == 1, "its publish had reached the stream"
