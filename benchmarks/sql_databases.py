"""SQL databases side by side: SqlDedupStore, @idempotent, transactional handlers and the
outbox relay on PostgreSQL and on MariaDB, with MariaDB's raw-driver floors.

    python -m benchmarks.sql_databases            # print the tables
    python -m benchmarks.sql_databases --write    # ... and rewrite the README section

Every workload alternates the databases over ``--repetitions`` runs. The floors send the store's
own statements with asyncmy (``benchmarks/_mariadb_floor.py``); the relay's floor is
``benchmarks.outbox``'s raw loop. The rows: ``templates/sql_databases.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from benchmarks import dedup, outbox
from benchmarks._common import Rates, positive_int, verdict
from benchmarks._dedup_sql_floor import LEASE
from benchmarks._harness import measured_on, publish, rates_table, render
from benchmarks._mariadb_floor import RawMariaDb

DEFAULT_MARIADB = "mariadb://root@127.0.0.1:3306/test"
DEFAULT_BATCHES = 100
DEFAULT_CALLS = 1_000
DEFAULT_MESSAGES = 1_000
DEFAULT_ROWS = 10_000
DEFAULT_REPETITIONS = 3
BATCH = 100
WITHIN_1_5 = 0.67  # "within 1.5x of PostgreSQL's figure", as a throughput ratio
SECTION_NAME = "sql-databases"
COMMAND = "python -m benchmarks.sql_databases --write"
DATABASES = ("PostgreSQL", "MariaDB")


def _log(row: Rates, unit: str) -> None:
    print(f"  {row.variant}: {row.rates[-1]:,.0f} {unit}/s", file=sys.stderr)


@contextlib.asynccontextmanager
async def stores_and_floor(args: argparse.Namespace,
                           name: str) -> AsyncIterator[tuple[list[Any], RawMariaDb]]:
    """A SqlDedupStore on each database (a fresh table each) and MariaDB's floor; the tables
    dropped and everything closed at the end."""
    from reliable_sub.dedup import SqlDedupStore

    stores = [SqlDedupStore(url, table=f"bench_sqldb_{name}_{uuid.uuid4().hex[:8]}")
              for url in (args.postgres, args.mariadb)]
    for store in stores:
        await store.create_schema()
    floor = RawMariaDb(args.mariadb, stores[1])
    await floor.connect()
    try:
        yield stores, floor
    finally:
        await floor.close()
        await dedup.drop_stores(*stores)


async def bench_claims(args: argparse.Namespace) -> list[Rates]:
    async with stores_and_floor(args, "claims") as (stores, floor):
        return await _claims(args, stores, floor)


async def _claims(args: argparse.Namespace, stores: list[Any], floor: RawMariaDb) -> list[Rates]:
    from reliable_sub.dedup import DedupKey

    def batches(run: str) -> list[list[DedupKey]]:
        return [[DedupKey("bench", f"{run}-{b}-{n}") for n in range(BATCH)]
                for b in range(args.batches)]

    def ours(store: Any) -> Callable[[str], Awaitable[None]]:
        async def work(run: str) -> None:
            for batch in batches(run):
                await store.claim_many(batch, LEASE)
        return work

    async def raw(run: str) -> None:
        for batch in batches(run):
            await floor.claim([["bench", key.key, f"{run}.{n}"] for n, key in enumerate(batch)])

    variants = [
        (Rates("PostgreSQL: SqlDedupStore.claim_many, 100 keys a statement"), ours(stores[0])),
        (Rates("MariaDB: SqlDedupStore.claim_many, 100 keys a statement"), ours(stores[1])),
        (Rates("MariaDB floor: raw asyncmy, the store's claim statement"), raw),
    ]
    for _ in range(args.repetitions):
        for row, work in variants:
            run = uuid.uuid4().hex[:12]
            row.rates.append(await dedup.timed(args.batches * BATCH,
                                               lambda w=work, r=run: w(r)))  # type: ignore[misc]
            _log(row, "keys")
    return [row for row, _ in variants]


async def bench_idempotent(args: argparse.Namespace) -> list[tuple[Rates, Rates]]:
    async with stores_and_floor(args, "idem") as (stores, floor):
        return await _idempotent(args, stores, floor)


async def _idempotent(args: argparse.Namespace, stores: list[Any],
                      floor: RawMariaDb) -> list[tuple[Rates, Rates]]:
    variants: list[tuple[str, Callable[[str], Callable[..., Any]]]] = [
        ("PostgreSQL: @idempotent async", lambda run: dedup.ours_function(stores[0],
                                                                          is_async=True)),
        ("MariaDB: @idempotent async", lambda run: dedup.ours_function(stores[1],
                                                                       is_async=True)),
        ("MariaDB floor: raw asyncmy, the store's two statements", floor.make),
    ]
    rows = [(Rates(f"{name}, first calls"), Rates(f"{name}, replays")) for name, _ in variants]
    for _ in range(args.repetitions):
        for (first, replay), (_, make) in zip(rows, variants, strict=True):
            run = uuid.uuid4().hex[:12]
            function = make(run)
            orders = [{"id": f"{run}-{n}", "amount": 10} for n in range(args.calls)]

            async def calls(f: Callable[..., Any] = function,
                            o: list[dict[str, Any]] = orders) -> None:
                await dedup.run_calls(f, o, is_async=True, keyword=False)

            first.rates.append(await dedup.timed(args.calls, calls))
            replay.rates.append(await dedup.timed(args.calls, calls))
            _log(first, "calls")
            _log(replay, "calls")
    return rows


async def bench_transactional(args: argparse.Namespace) -> list[Rates]:
    rows: list[Rates] = []
    for name in DATABASES:
        rows += [Rates(f"{name}: plain handler, INSERT in its own transaction (no dedup)"),
                 Rates(f"{name}: transactional=True, INSERT + completion, one COMMIT")]
    for _ in range(args.repetitions):
        for index, url in enumerate((args.postgres, args.mariadb)):
            once = argparse.Namespace(postgres=url, messages=args.messages, repetitions=1)
            plain, tx = await dedup.bench_transactional(once)
            rows[2 * index].rates += plain.rates
            rows[2 * index + 1].rates += tx.rates
            _log(rows[2 * index], "msgs")
            _log(rows[2 * index + 1], "msgs")
    return rows


async def bench_relay(args: argparse.Namespace) -> tuple[list[Rates], list[float]]:
    benches = []
    for url in (args.postgres, args.mariadb):
        bench = outbox.Bench(argparse.Namespace(
            redis=args.redis, postgres=url, rows=args.rows, latency_rows=args.latency_rows,
            spacing=args.spacing))
        await bench.outbox.create_schema()
        benches.append(bench)
    rows = []
    for name in DATABASES:
        rows += [Rates(f"{name}: raw loop, SELECT 100 by id + pipelined XADD"),
                 Rates(f"{name}: 1 OutboxRelay")]
    try:
        for _ in range(args.repetitions):
            for index, bench in enumerate(benches):
                for offset, kind in enumerate(("raw", "relay")):
                    row = rows[2 * index + offset]
                    row.rates.append(await bench.drain(kind, 1))
                    _log(row, "rows")
        latencies = await benches[1].latency(notify=False)
    finally:
        for bench in benches:
            await bench.clear()
            async with bench.outbox.engine.begin() as connection:
                await connection.run_sync(bench.outbox.metadata.drop_all)
            await bench.outbox.close()
    return rows, latencies


def _table(rows: list[Rates], unit: str, ratios: list[tuple[str, Rates]]) -> list[str]:
    return rates_table(rows, unit, [(name, lambda _, base=base: base) for name, base in ratios])


def report(args: argparse.Namespace, claims: list[Rates], idem: list[tuple[Rates, Rates]],
           tx: list[Rates], relay: list[Rates], latencies: list[float]) -> str:
    pg_claim, maria_claim, floor_claim = claims
    (pg_first, pg_replay), (maria_first, maria_replay), (floor_first, floor_replay) = idem
    pg_plain, pg_tx, maria_plain, maria_tx = tx
    pg_raw, pg_relay, maria_raw, maria_relay = relay
    p50 = latencies[len(latencies) // 2] * 1000
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000
    return render(
        "sql_databases", measured_on=measured_on(COMMAND), args=args, BATCH=BATCH,
        claims=_table(claims, "keys", [("PostgreSQL", pg_claim), ("MariaDB floor", floor_claim)]),
        idempotent=_table([r for pair in idem for r in pair], "calls",
                          [("PostgreSQL first calls", pg_first)]),
        transactional=_table(tx, "msgs", [("PostgreSQL plain", pg_plain)]),
        relay=_table(relay, "rows", [("PostgreSQL relay", pg_relay)]),
        POLL_INTERVAL=outbox.POLL_INTERVAL, latency_rows=len(latencies),
        spacing_ms=args.spacing * 1000, p50=p50, p99=p99, latency_max=latencies[-1] * 1000,
        goals=[
            verdict("claims, MariaDB vs PostgreSQL", maria_claim.median / pg_claim.median,
                    WITHIN_1_5),
            verdict("claims, MariaDB store vs its raw asyncmy floor",
                    maria_claim.median / floor_claim.median, 0.5),
            verdict("@idempotent first calls, MariaDB vs PostgreSQL",
                    maria_first.median / pg_first.median, WITHIN_1_5),
            verdict("@idempotent replays, MariaDB vs PostgreSQL",
                    maria_replay.median / pg_replay.median, WITHIN_1_5),
            verdict("@idempotent first calls, MariaDB vs its floor",
                    maria_first.median / floor_first.median, 0.5),
            verdict("@idempotent replays, MariaDB vs its floor",
                    maria_replay.median / floor_replay.median, 0.5),
            verdict("transactional handler, MariaDB vs PostgreSQL",
                    maria_tx.median / pg_tx.median, WITHIN_1_5),
            verdict("one relay, MariaDB vs PostgreSQL", maria_relay.median / pg_relay.median,
                    WITHIN_1_5),
            verdict("one relay vs the raw loop, MariaDB", maria_relay.median / maria_raw.median,
                    0.5)],
        pg_relay_ratio=pg_relay.median / pg_raw.median,
        pg_tx_ratio=pg_tx.median / pg_plain.median,
        maria_tx_ratio=maria_tx.median / maria_plain.median)


async def amain(args: argparse.Namespace) -> str:
    claims = await bench_claims(args)
    idem = await bench_idempotent(args)
    tx = await bench_transactional(args)
    relay, latencies = await bench_relay(args)
    return report(args, claims, idem, tx, relay, latencies)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--redis", default=dedup.DEFAULT_REDIS)
    parser.add_argument("--postgres", default=dedup.DEFAULT_POSTGRES)
    parser.add_argument("--mariadb", default=DEFAULT_MARIADB)
    parser.add_argument("--batches", type=positive_int, default=DEFAULT_BATCHES)
    parser.add_argument("--calls", type=positive_int, default=DEFAULT_CALLS)
    parser.add_argument("--messages", type=positive_int, default=DEFAULT_MESSAGES)
    parser.add_argument("--rows", type=positive_int, default=DEFAULT_ROWS)
    parser.add_argument("--latency-rows", type=positive_int, default=100)
    parser.add_argument("--spacing", type=float, default=outbox.DEFAULT_SPACING)
    parser.add_argument("--repetitions", type=positive_int, default=DEFAULT_REPETITIONS)
    parser.add_argument("--write", action="store_true", help="rewrite the README section")
    args = parser.parse_args(argv)
    publish(SECTION_NAME, asyncio.run(amain(args)), write=args.write, append=True)


if __name__ == "__main__":
    main()
