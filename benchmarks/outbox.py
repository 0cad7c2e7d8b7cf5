"""Outbox relay: rows/s PostgreSQL -> Redis Streams, and commit-to-publish latency.

    python -m benchmarks.outbox            # print the tables
    python -m benchmarks.outbox --write    # ... and rewrite the README section

Throughput: worker processes (``--worker``) drain ``--rows`` committed rows after a common start
signal: the raw loop, one relay, three, and one over ordering keys. Latency: a writer commits a
row every ``--spacing`` s while one relay serves, woken by LISTEN/NOTIFY or by polling. The
rows: ``templates/outbox.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks._common import Rates, positive_int, verdict
from benchmarks._harness import measured_on, publish, render, table

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_ROWS = 20_000
DEFAULT_REPETITIONS = 5
DEFAULT_LATENCY_ROWS = 200
DEFAULT_SPACING = 0.02
BATCH = 100  # rows per round: OutboxRelay's default batch_size, and the raw loop's SELECT
ORDERING_KEYS = 20
# The goals of #27: one relay >= 0.6x the raw loop, hot ordering keys >= 8k rows/s.
RELAY_MIN_RATIO = 0.6
KEYED_MIN_RATE = 8_000
POLL_INTERVAL = 1.0  # the polling variant's, and OutboxRelay's default
PAYLOAD = b"x" * 200
SECTION_NAME = "outbox"
COMMAND = "python -m benchmarks.outbox --write"
REPO = Path(__file__).resolve().parent.parent
# Bound on how long one variant may take before the benchmark gives up.
VARIANT_TIMEOUT = 600.0


# -- workers (child processes) -------------------------------------------------------------------


async def _raw_worker(args: argparse.Namespace) -> int:
    """SELECT the next BATCH rows by id, XADD them in one pipeline; until none are left."""
    import redis.asyncio as aioredis
    import sqlalchemy as sa

    from reliable_sub._sql_engines import SqlEngines

    # the library's driver, without its pre-ping (a round trip per checkout)
    engine = SqlEngines(args.postgres, owner="the raw loop",
                        engine_options={"pool_pre_ping": False}).engine
    table = sa.Table(args.table, sa.MetaData(), *_columns())
    client = aioredis.Redis.from_url(args.redis)
    select = (sa.select(table.c.id, table.c.key, table.c.topic, table.c.data,
                        table.c.attributes)
              .where(table.c.id > sa.bindparam("after")).order_by(table.c.id).limit(BATCH))
    await client.ping()
    async with engine.connect() as connection:
        await connection.execute(sa.select(1))
    _ready_and_wait()
    after, relayed = 0, 0
    while True:
        async with engine.connect() as connection:
            rows = list(await connection.execute(select, {"after": after}))
        if not rows:
            break
        pipe = client.pipeline(transaction=False)
        for row in rows:
            attributes = {**json.loads(row.attributes), "idempotency-key": row.key}
            pipe.xadd(row.topic, {"data": bytes(row.data),
                                  "attributes": json.dumps(attributes).encode()})
        await pipe.execute()
        after, relayed = rows[-1].id, relayed + len(rows)
    await client.aclose()
    await engine.dispose()
    return relayed


def _columns() -> list[Any]:
    import sqlalchemy as sa

    return [sa.Column("id", sa.BigInteger, primary_key=True), sa.Column("key", sa.String),
            sa.Column("topic", sa.String), sa.Column("data", sa.LargeBinary),
            sa.Column("attributes", sa.Text)]


async def _relay_worker(args: argparse.Namespace) -> int:
    """An OutboxRelay's rounds until the outbox has nothing pending (other relays included)."""
    from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
    from reliable_sub.outbox import Outbox, OutboxRelay

    adapter = RedisStreamsAdapter(args.redis)
    relay = OutboxRelay(Outbox(args.postgres, table=args.table), adapter, batch_size=BATCH)
    await relay.backlog()
    await adapter.client.ping()
    _ready_and_wait()
    while await relay.relay_once() or (await relay.backlog()).pending:
        pass
    await adapter.close()
    await relay.outbox.close()
    return relay.published


async def _serving_worker(args: argparse.Namespace) -> int:
    """An OutboxRelay serving (LISTEN/NOTIFY and its poll) until stdin closes."""
    from reliable_sub import SystemClock
    from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
    from reliable_sub.outbox import Outbox, OutboxRelay
    from reliable_sub.testing.timing import drive_until

    relay = OutboxRelay(Outbox(args.postgres, table=args.table), RedisStreamsAdapter(args.redis),
                        batch_size=BATCH, poll_interval=POLL_INTERVAL)
    async with relay:
        if relay.outbox.dialect == "postgresql":
            await drive_until(SystemClock(), lambda: relay.listening, 10.0, what="LISTEN")
        print("READY", flush=True)
        await asyncio.to_thread(sys.stdin.read)  # until the parent closes it
    return relay.published


def _ready_and_wait() -> None:
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        raise SystemExit("no GO")


def worker_main(args: argparse.Namespace) -> None:
    work = {"raw": _raw_worker, "relay": _relay_worker, "serve": _serving_worker}[args.worker]
    relayed = asyncio.run(work(args))
    print("DONE", time.monotonic(), relayed, flush=True)


# -- the parent ------------------------------------------------------------------------------


class Worker:
    def __init__(self, args: argparse.Namespace, kind: str, table: str) -> None:
        command = [sys.executable, "-m", "benchmarks.outbox", "--worker", kind,
                   "--table", table, "--redis", args.redis, "--postgres", args.postgres]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, cwd=REPO)

    def expect(self, word: str) -> list[str]:
        assert self.process.stdout is not None
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"worker exited ({self.process.wait()}) before {word}")
            if line.startswith(word):
                return line.split()

    def send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text)
        self.process.stdin.flush()

    def finish(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=VARIANT_TIMEOUT)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from reliable_sub.outbox import Outbox

        self.args = args
        self.table = f"bench_outbox_{uuid.uuid4().hex[:8]}"
        self.outbox = Outbox(args.postgres, table=self.table)
        self.topic = f"bench-outbox-{uuid.uuid4().hex[:8]}"

    async def clear(self) -> None:
        """Empty the outbox table and the stream."""
        import redis.asyncio as aioredis
        import sqlalchemy as sa

        client = aioredis.Redis.from_url(self.args.redis)
        await client.delete(self.topic)
        await client.aclose()
        async with self.outbox.engine.begin() as connection:
            await connection.execute(sa.delete(self.outbox.table))

    async def refill(self, ordering_keys: int | None) -> None:
        """Empty the table and the stream, then commit ``--rows`` fresh rows (as add() would
        write them, in bulk)."""
        import sqlalchemy as sa

        from reliable_sub.idempotency.keys import new_idempotency_key

        await self.clear()
        now = time.time()
        rows = [{"key": new_idempotency_key(), "topic": self.topic, "data": PAYLOAD,
                 "attributes": "{}", "created_at": now,
                 "ordering_key": None if ordering_keys is None else f"k{n % ordering_keys}"}
                for n in range(self.args.rows)]
        async with self.outbox.engine.begin() as connection:
            await connection.execute(sa.insert(self.outbox.table), rows)
            analyze = "ANALYZE" if self.outbox.dialect == "postgresql" else "ANALYZE TABLE"
            await connection.execute(sa.text(f"{analyze} {self.table}"))

    async def drain(self, kind: str, workers: int, ordering_keys: int | None = None) -> float:
        """Rows per second for ``workers`` processes of ``kind`` to drain a full outbox."""
        await self.refill(ordering_keys)
        started = [Worker(self.args, kind, self.table) for _ in range(workers)]
        try:
            for worker in started:
                await asyncio.to_thread(worker.expect, "READY")
            begin = time.monotonic()
            for worker in started:
                worker.send("GO\n")
            done = [await asyncio.to_thread(worker.expect, "DONE") for worker in started]
        finally:
            for worker in started:
                worker.finish()
        relayed = sum(int(line[2]) for line in done)
        if relayed < self.args.rows:
            raise RuntimeError(f"{kind} x{workers} relayed {relayed} of {self.args.rows} rows")
        return self.args.rows / (max(float(line[1]) for line in done) - begin)

    async def latency(self, notify: bool) -> list[float]:
        """Seconds from each commit returning to its entry arriving at a blocked XREAD."""
        import redis.asyncio as aioredis

        from reliable_sub.outbox import Outbox

        await self.clear()
        writer = Outbox(self.args.postgres, table=self.table, notify=notify)
        client = aioredis.Redis.from_url(self.args.redis)
        committed: dict[str, float] = {}
        arrived: dict[str, float] = {}
        relay = Worker(self.args, "serve", self.table)
        try:
            await asyncio.to_thread(relay.expect, "READY")

            async def read() -> None:
                last = "$"
                while len(arrived) < self.args.latency_rows:
                    reply = await client.xread({self.topic: last}, block=1000, count=100)
                    now = time.monotonic()
                    for _, entries in reply:
                        for entry_id, fields in entries:
                            key = json.loads(fields[b"attributes"])["idempotency-key"]
                            arrived[key] = now
                            last = entry_id

            reader = asyncio.ensure_future(read())
            rng = random.Random(1)
            for _ in range(self.args.latency_rows):
                async with writer.engine.begin() as connection:
                    key = await writer.add(connection, self.topic, PAYLOAD)
                committed[key] = time.monotonic()
                await asyncio.sleep(rng.uniform(0.5, 1.5) * self.args.spacing)
            await asyncio.wait_for(reader, POLL_INTERVAL * 5 + 10)
        finally:
            relay.finish()
            await client.aclose()
            await writer.close()
        return sorted(arrived[key] - committed[key] for key in committed)

    async def run(self) -> str:
        await self.outbox.create_schema()
        try:
            variants = [
                ("raw loop: SELECT 100 by id + pipelined XADD (no locks, no marks)", "raw", 1,
                 None),
                ("1 OutboxRelay", "relay", 1, None),
                ("3 OutboxRelays (processes)", "relay", 3, None),
                (f"1 OutboxRelay, rows on {ORDERING_KEYS} ordering keys", "relay", 1,
                 ORDERING_KEYS),
            ]
            rows = [Rates(name) for name, *_ in variants]
            for _ in range(self.args.repetitions):
                for row, (_, kind, workers, keys) in zip(rows, variants, strict=True):
                    row.rates.append(await self.drain(kind, workers, keys))
                    print(f"  {row.variant}: {row.rates[-1]:,.0f} rows/s", file=sys.stderr)
            latencies = {notify: await self.latency(notify) for notify in (True, False)}
        finally:
            async with self.outbox.engine.begin() as connection:
                await connection.run_sync(self.outbox.metadata.drop_all)
            await self.outbox.close()
        return report(self.args, rows, latencies)


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def report(args: argparse.Namespace, rows: list[Rates], latencies: dict[bool, list[float]]) -> str:
    raw, one, three, keyed = rows
    notify, poll = latencies[True], latencies[False]
    latency_rows = [
        f"| {name} | {_quantile(values, 0.5) * 1000:.1f} | "
        f"{_quantile(values, 0.99) * 1000:.1f} | {values[-1] * 1000:.1f} |"
        for name, values in (("LISTEN/NOTIFY", notify),
                             (f"polling every {POLL_INTERVAL:g} s", poll))]
    return render(
        "outbox", measured_on=measured_on(COMMAND), args=args, payload=len(PAYLOAD),
        spacing_ms=args.spacing * 1000, ORDERING_KEYS=ORDERING_KEYS, BATCH=BATCH,
        calls=BATCH // ORDERING_KEYS, latencies=latency_rows,
        throughput=table(rows, [
            ("median rows/s", lambda r: f"{r.median:,.0f}"),
            ("min – max", lambda r: f"{min(r.rates):,.0f} – {max(r.rates):,.0f}"),
            ("ratio to raw loop", lambda r: f"{r.median / raw.median:.2f}×"),
            ("ratio to 1 relay", lambda r: f"{r.median / one.median:.2f}×"),
        ]),
        goals=[verdict("1 relay vs the raw loop", one.median / raw.median, RELAY_MIN_RATIO),
               verdict(f"1 relay, rows on {ORDERING_KEYS} ordering keys", keyed.median,
                       KEYED_MIN_RATE, unit=" rows/s"),
               verdict("3 relays vs 1", three.median / one.median, 1.5),
               verdict("p50 commit-to-publish with NOTIFY", _quantile(notify, 0.5) * 1000, 20,
                       unit=" ms", at_most=True)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--redis", default=DEFAULT_REDIS)
    parser.add_argument("--postgres", default=DEFAULT_POSTGRES,
                        help="the outbox's database URL (benchmarks.sql_databases passes a "
                             "MariaDB one)")
    parser.add_argument("--rows", type=positive_int, default=DEFAULT_ROWS)
    parser.add_argument("--repetitions", type=positive_int, default=DEFAULT_REPETITIONS)
    parser.add_argument("--latency-rows", type=positive_int, default=DEFAULT_LATENCY_ROWS)
    parser.add_argument("--spacing", type=float, default=DEFAULT_SPACING)
    parser.add_argument("--write", action="store_true", help="rewrite the README section")
    parser.add_argument("--worker", choices=["raw", "relay", "serve"], help=argparse.SUPPRESS)
    parser.add_argument("--table", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args)
        return
    publish(SECTION_NAME, asyncio.run(Bench(args).run()), write=args.write, append=True)


if __name__ == "__main__":
    main()
