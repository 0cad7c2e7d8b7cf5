"""Dedup stores: @idempotent vs AWS Lambda Powertools, batched claims vs SET NX, transactions.

    python -m benchmarks.dedup            # print the tables
    python -m benchmarks.dedup --write    # ... and rewrite the README section

Three comparisons against the shared Redis and PostgreSQL (``--redis``/``--postgres``), variants
interleaved: idempotent functions (first calls and replays; Powertools outside Lambda runs with
a stub context), batched claims, and a transactional handler. What each row is:
``templates/dedup.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks._common import Rates, positive_int, verdict
from benchmarks._dedup_sql_floor import (
    LEASE,
    TTL,
    RawClaims,
    RawIdempotent,
    captured_statements,
)
from benchmarks._harness import add_runs, measured_on, publish, rates_table, render

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_CALLS = 2_000
DEFAULT_BATCHES = 100
DEFAULT_MESSAGES = 2_000
DEFAULT_REPETITIONS = 3
BATCH = 100  # keys per claim call: the Subscriber's default receive batch
SECTION_NAME = "dedup"
COMMAND = "python -m benchmarks.dedup --write"
PG = "@idempotent async, SqlDedupStore on PostgreSQL"
RAW_PG = "raw psycopg loop, the store's two statements (PostgreSQL floor)"
RAW_PG_CLAIMS = "raw psycopg loop, the store's claim statement per 100 keys (PostgreSQL floor)"


async def drop_stores(*stores: Any) -> None:
    """Drop the benchmark's tables of each SQL dedup store, and close it."""
    for store in stores:
        async with store.engine.begin() as connection:
            await connection.run_sync(store.metadata.drop_all)
        await store.close()


async def timed(operations: int, work: Callable[[], Awaitable[None]]) -> float:
    """Operations per second of one ``work()`` run."""
    start = time.perf_counter()
    await work()
    return operations / (time.perf_counter() - start)


# -- 1. idempotent functions -------------------------------------------------------------------


class _StubLambdaContext:
    """What Powertools reads of a Lambda context: the time left (plenty)."""

    function_name = "benchmark"
    aws_request_id = "benchmark"

    @staticmethod
    def get_remaining_time_in_millis() -> int:
        return 300_000


def powertools_function(redis_url: str, prefix: str) -> Callable[[dict[str, Any]], Any]:
    import redis
    from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
    from aws_lambda_powertools.utilities.idempotency.persistence.redis import (
        RedisCachePersistenceLayer,
    )

    layer = RedisCachePersistenceLayer(client=redis.Redis.from_url(redis_url), ssl=False)
    config = IdempotencyConfig(expires_after_seconds=int(TTL))
    config.register_lambda_context(_StubLambdaContext())  # type: ignore[arg-type]

    @idempotent_function(data_keyword_argument="order", persistence_store=layer, config=config,
                         key_prefix=prefix)
    def charge(order: dict[str, Any]) -> dict[str, Any]:
        return {"charged": order["id"]}

    return charge


def ours_function(store: Any, *, is_async: bool) -> Callable[..., Any]:
    from reliable_sub.idempotency import idempotent

    if is_async:
        @idempotent(store, key=lambda order: order["id"], ttl=TTL, lease_ttl=LEASE)
        async def charge_async(order: dict[str, Any]) -> dict[str, Any]:
            return {"charged": order["id"]}

        return charge_async

    @idempotent(store, key=lambda order: order["id"], ttl=TTL, lease_ttl=LEASE)
    def charge(order: dict[str, Any]) -> dict[str, Any]:
        return {"charged": order["id"]}

    return charge


async def run_calls(function: Callable[..., Any], orders: list[dict[str, Any]], *,
                    is_async: bool, keyword: bool) -> None:
    """Call ``function`` once per order, one after another (a sync function on a thread of its
    own, with no event loop, as sync callers run)."""
    if is_async:
        for order in orders:
            await function(order)
        return

    def call_all() -> None:
        for order in orders:
            if keyword:
                function(order=order)
            else:
                function(order)

    await asyncio.to_thread(call_all)


@dataclass
class IdempotentVariant:
    name: str
    make: Callable[[str], Callable[..., Any]]  # run id -> a fresh decorated function
    is_async: bool = False
    keyword: bool = False
    first: Rates = field(init=False)
    replay: Rates = field(init=False)

    def __post_init__(self) -> None:
        self.first = Rates(f"{self.name}: first calls")
        self.replay = Rates(f"{self.name}: replays")


async def bench_idempotent(args: argparse.Namespace) -> list[IdempotentVariant]:
    from reliable_sub.dedup import MemoryDedupStore, RedisDedupStore, SqlDedupStore

    sql_pg = SqlDedupStore(args.postgres, table=f"bench_idem_{uuid.uuid4().hex[:8]}")
    sql_lite = SqlDedupStore("sqlite://", table="bench_idem")
    for store in (sql_pg, sql_lite):
        store.create_schema_sync()
    raw_pg = RawIdempotent(args.postgres, *await captured_statements(sql_pg))
    await raw_pg.connect()
    redis_store = RedisDedupStore(args.redis, prefix=f"bench-dedup-{uuid.uuid4().hex[:8]}")
    variants = [
        IdempotentVariant("Powertools idempotent_function, Redis",
                          lambda run: powertools_function(args.redis, f"bench-pt-{run}"),
                          keyword=True),
        IdempotentVariant("@idempotent sync, RedisDedupStore",
                          lambda run: ours_function(redis_store, is_async=False)),
        IdempotentVariant("@idempotent async, RedisDedupStore",
                          lambda run: ours_function(redis_store, is_async=True), is_async=True),
        IdempotentVariant(PG,
                          lambda run: ours_function(sql_pg, is_async=True), is_async=True),
        IdempotentVariant(RAW_PG, raw_pg.make, is_async=True),
        IdempotentVariant("@idempotent async, SqlDedupStore on SQLite",
                          lambda run: ours_function(sql_lite, is_async=True), is_async=True),
        IdempotentVariant("@idempotent async, MemoryDedupStore (reference)",
                          lambda run: ours_function(MemoryDedupStore(), is_async=True),
                          is_async=True),
    ]
    try:
        for _ in range(args.repetitions):
            for variant in variants:
                run = uuid.uuid4().hex[:12]
                function = variant.make(run)
                orders = [{"id": f"{run}-{n}", "amount": 10} for n in range(args.calls)]

                async def calls(f: Callable[..., Any] = function,
                                o: list[dict[str, Any]] = orders,
                                v: IdempotentVariant = variant) -> None:
                    await run_calls(f, o, is_async=v.is_async, keyword=v.keyword)

                variant.first.rates.append(await timed(args.calls, calls))
                variant.replay.rates.append(await timed(args.calls, calls))
    finally:
        await _delete_redis_keys(args.redis, ["bench-pt-*", f"{redis_store.prefix}*"])
        await redis_store.close()
        await raw_pg.close()
        await drop_stores(sql_pg, sql_lite)
    return variants


# -- 2. batched claims ---------------------------------------------------------------------------


async def bench_claims(args: argparse.Namespace) -> list[Rates]:
    import redis.asyncio as aioredis

    from reliable_sub.dedup import DedupKey, RedisDedupStore, SqlDedupStore

    client = aioredis.Redis.from_url(args.redis)
    prefix = f"bench-claims-{uuid.uuid4().hex[:8]}"
    redis_store = RedisDedupStore(args.redis, prefix=f"{prefix}:ours")
    sql_pg = SqlDedupStore(args.postgres, table=f"bench_claims_{uuid.uuid4().hex[:8]}")
    sql_lite = SqlDedupStore("sqlite://", table="bench_claims")
    for store in (sql_pg, sql_lite):
        await store.create_schema()
    raw_pg = RawClaims(args.postgres, (await captured_statements(sql_pg))[0])
    await raw_pg.connect()
    total = args.batches * BATCH

    def batches(run: str) -> list[list[DedupKey]]:
        return [[DedupKey("bench", f"{run}-{b}-{n}") for n in range(BATCH)]
                for b in range(args.batches)]

    async def set_nx(run: str) -> None:
        ttl_ms = int(LEASE * 1000)
        for batch in batches(run):
            pipe = client.pipeline(transaction=False)
            for key in batch:
                pipe.set(f"{prefix}:raw:{key.namespace}:{key.key}", "p:token", nx=True, px=ttl_ms)
            await pipe.execute()

    async def raw_pg_claims(run: str) -> None:
        for batch in batches(run):
            await raw_pg.claim(batch[0].namespace, [key.key for key in batch], run)

    def claim_many(store: Any) -> Callable[[str], Awaitable[None]]:
        async def work(run: str) -> None:
            for batch in batches(run):
                await store.claim_many(batch, LEASE)
        return work

    variants: list[tuple[Rates, Callable[[str], Awaitable[None]]]] = [
        (Rates("raw SET NX PX, one pipeline per 100 keys (the limit)"), set_nx),
        (Rates("RedisDedupStore.claim_many, one call per 100 keys"), claim_many(redis_store)),
        (Rates("SqlDedupStore.claim_many on PostgreSQL, one statement per 100 keys"),
         claim_many(sql_pg)),
        (Rates("SqlDedupStore.claim_many on SQLite, one transaction per 100 keys"),
         claim_many(sql_lite)),
        (Rates(RAW_PG_CLAIMS), raw_pg_claims),
    ]
    try:
        for _ in range(args.repetitions):
            for row, work in variants:
                run = uuid.uuid4().hex[:12]
                row.rates.append(await timed(total, lambda w=work, r=run: w(r)))  # type: ignore[misc]
    finally:
        await _delete_redis_keys(args.redis, [f"{prefix}*"])
        await client.aclose()
        await redis_store.close()
        await raw_pg.close()
        await drop_stores(sql_pg, sql_lite)
    return [row for row, _ in variants]


# -- 3. transactional handler --------------------------------------------------------------------


async def bench_transactional(args: argparse.Namespace) -> list[Rates]:
    import sqlalchemy as sa

    from reliable_sub import Message, Subscriber
    from reliable_sub.adapters.memory import MemoryAdapter
    from reliable_sub.dedup import SqlDedupStore

    store = SqlDedupStore(args.postgres, table=f"bench_tx_processed_{uuid.uuid4().hex[:8]}")
    payments = sa.Table(
        f"bench_tx_payments_{uuid.uuid4().hex[:8]}", store.metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("message_id", sa.String(100), nullable=False),
    )
    await store.create_schema()

    async def one_run(transactional: bool) -> float:
        broker = MemoryAdapter()
        broker.ensure_subscription_sync("orders", "billing")
        for n in range(args.messages):
            await broker.publish("orders", f"order-{n}".encode())
        done = asyncio.Event()
        count = [0]

        def settled(_message: Message, _outcome: Any) -> None:
            count[0] += 1
            if count[0] == args.messages:
                done.set()

        sub = Subscriber(broker, dedup=store if transactional else None, on_outcome=settled,
                         dedup_purge_interval=None)
        if transactional:
            @sub.handler("billing", transactional=True)
            async def insert_tx(message: Message, connection: Any) -> None:
                await connection.execute(sa.insert(payments).values(message_id=message.id))
        else:
            @sub.handler("billing")
            async def insert_plain(message: Message) -> None:
                async with store.engine.begin() as connection:
                    await connection.execute(sa.insert(payments).values(message_id=message.id))

        start = time.perf_counter()
        serving = asyncio.ensure_future(sub.serve())
        await done.wait()
        seconds = time.perf_counter() - start
        await sub.shutdown(timeout=10)
        await serving
        return args.messages / seconds

    plain = Rates("plain handler: engine.begin(), INSERT, COMMIT (no dedup)")
    tx = Rates("transactional=True: batched claim; INSERT + completion UPDATE, one COMMIT")
    try:
        for _ in range(args.repetitions):
            plain.rates.append(await one_run(False))
            tx.rates.append(await one_run(True))
    finally:
        await drop_stores(store)
    return [plain, tx]


# -- report --------------------------------------------------------------------------------------


async def _delete_redis_keys(url: str, patterns: list[str]) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        for pattern in patterns:
            keys = [key async for key in client.scan_iter(match=pattern, count=1000)]
            for start in range(0, len(keys), 1000):
                await client.delete(*keys[start:start + 1000])
    finally:
        await client.aclose()


def report(args: argparse.Namespace, idem: list[IdempotentVariant], claims: list[Rates],
           tx: list[Rates]) -> str:
    powertools = idem[0]
    ours_sync, ours_async = idem[1], idem[2]
    baseline = {id(r): base for v in idem
                for r, base in ((v.first, powertools.first), (v.replay, powertools.replay))}
    idem_table = rates_table([r for v in idem for r in (v.first, v.replay)], "calls",
                             [("Powertools", lambda r: baseline[id(r)])])
    by_name = {variant.name: variant for variant in idem}
    pg, raw_pg = by_name[PG], by_name[RAW_PG]
    best_first = max(ours_sync.first.median, ours_async.first.median)
    best_replay = max(ours_sync.replay.median, ours_async.replay.median)
    return render(
        "dedup", measured_on=measured_on(COMMAND), args=args, BATCH=BATCH, idem_table=idem_table,
        replay_goal=verdict("replays, @idempotent sync on Redis vs Powertools",
                            ours_sync.replay.median / powertools.replay.median, 3.0),
        first_goal=verdict("first calls, @idempotent sync on Redis vs Powertools",
                           ours_sync.first.median / powertools.first.median, 1.3),
        best_first=best_first / powertools.first.median,
        best_replay=best_replay / powertools.replay.median,
        pg_first_goal=verdict("first calls, @idempotent async on PostgreSQL vs the raw psycopg "
                              "loop", pg.first.median / raw_pg.first.median, 0.5),
        pg_replay_goal=verdict("replays, @idempotent async on PostgreSQL vs the raw psycopg loop",
                               pg.replay.median / raw_pg.replay.median, 0.5),
        claims_table=rates_table(claims, "claims", [("baseline", lambda _: claims[0])]),
        claims_goal=verdict("RedisDedupStore.claim_many vs pipelined SET NX",
                            claims[1].median / claims[0].median, 0.5),
        pg_claims_goal=verdict("SqlDedupStore.claim_many on PostgreSQL vs the raw psycopg loop",
                               claims[2].median / claims[4].median, 0.5),
        tx_table=rates_table(tx, "msgs", [("baseline", lambda _: tx[0])]),
        tx_goal=verdict("time per message, transactional vs plain insert",
                        tx[0].median / tx[1].median, 1.5, at_most=True))


async def amain(args: argparse.Namespace) -> str:
    idem = await bench_idempotent(args)
    claims = await bench_claims(args)
    tx = await bench_transactional(args)
    return report(args, idem, claims, tx)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--redis", default=DEFAULT_REDIS)
    parser.add_argument("--postgres", default=DEFAULT_POSTGRES)
    parser.add_argument("--calls", type=positive_int, default=DEFAULT_CALLS)
    parser.add_argument("--batches", type=positive_int, default=DEFAULT_BATCHES)
    add_runs(parser, DEFAULT_MESSAGES, DEFAULT_REPETITIONS)
    parser.add_argument("--write", action="store_true", help="rewrite the README section")
    args = parser.parse_args(argv)
    publish(SECTION_NAME, asyncio.run(amain(args)), write=args.write, append=True)


if __name__ == "__main__":
    main()
