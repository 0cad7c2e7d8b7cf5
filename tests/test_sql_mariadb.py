"""The SQL dedup store on MariaDB: what differs from PostgreSQL, tried against the real server.

The shipped ``DedupStoreSuite`` runs on MariaDB in ``test_dedup_contract.py``; here are the
dialect's own traps: the claim's one-statement upsert (its assignments run left to right), the
server's default collation that equates ``abc`` and ``ABC``, 4-byte FLOAT and 64 KiB TEXT, and
REPEATABLE READ (the store's sessions run under READ COMMITTED, with a short lock wait).
"""

from __future__ import annotations

import asyncio
import re
import threading
import uuid
from collections.abc import AsyncIterator

import pytest
import sqlalchemy as sa

from reliable_sub._sql_engines import MYSQL_LOCK_WAIT_SECONDS, check_mysql_server
from reliable_sub.clock import ManualClock
from reliable_sub.dedup import Claimed, Completed, DedupKey, InProgress, SqlDedupStore
from reliable_sub.errors import ConfigurationError
from reliable_sub.testing.services import mariadb_url

WITHIN = 10.0


@pytest.fixture
async def store() -> AsyncIterator[SqlDedupStore]:
    store = SqlDedupStore(mariadb_url(), table=f"test_maria_{uuid.uuid4().hex[:10]}",
                          owner="me", clock=ManualClock(start=1000.0))
    await store.create_schema()
    try:
        yield store
    finally:
        async with store.engine.begin() as connection:
            await connection.run_sync(store.metadata.drop_all)
        await store.close()
        store.close_sync()


async def _put(store: SqlDedupStore, key: str, **row: object) -> None:
    async with store.engine.begin() as connection:
        await connection.execute(sa.insert(store.table).values(namespace="ns", key=key, **row))


async def _row(store: SqlDedupStore, key: str) -> tuple[object, ...]:
    t = store.table
    async with store.engine.connect() as connection:
        return tuple((await connection.execute(
            sa.select(t.c.state, t.c.owner, t.c.failures, t.c.expires_at, t.c.result)
            .where(t.c.namespace == "ns", t.c.key == key))).one())


async def test_every_case_of_the_one_statement_claim(store: SqlDedupStore) -> None:
    """Each row the upsert meets, with what it reports and leaves: a wrong order of its
    assignments (the deciding ``owner`` not first) brings an expired result back to life."""
    now = store._clock.wall()
    await _put(store, "expired-completed", state="completed", failures=0, expires_at=now - 10,
               result='"old"')
    await _put(store, "lapsed", state="claimed", owner="peer-9", failures=2, expires_at=now - 5,
               lease_expires_at=now - 5)
    await _put(store, "failed", state="failed", failures=3, expires_at=now + 100)
    await _put(store, "live-peer", state="claimed", owner="peer-9", failures=1,
               expires_at=now + 100, lease_expires_at=now + 100)
    await _put(store, "completed", state="completed", failures=0, expires_at=now + 100,
               result='{"r": 1}')
    names = ["absent", "expired-completed", "lapsed", "failed", "live-peer", "completed"]
    results = await store.claim_many([DedupKey("ns", n) for n in names], 30)
    verdicts = dict(zip(names, results, strict=True))
    for name in ("absent", "expired-completed", "lapsed", "failed"):
        assert isinstance(verdicts[name], Claimed), (name, verdicts[name])
    assert verdicts["lapsed"].failures == 0, "a lapsed lease's count starts again"
    assert verdicts["failed"].failures == 3, "a released key keeps its failures"
    assert verdicts["live-peer"] == InProgress(100.0, 1)
    assert verdicts["completed"] == Completed('{"r": 1}', DedupKey("ns", "completed"))
    token = verdicts["expired-completed"].token  # type: ignore[union-attr]
    assert await _row(store, "expired-completed") == ("claimed", token, 0, now + 30, None)
    assert (await _row(store, "live-peer"))[:3] == ("claimed", "peer-9", 1), "left alone"
    [again] = await store.claim_many([DedupKey("ns", "absent")], 30,
                                     [verdicts["absent"].token])  # type: ignore[union-attr]
    assert again == verdicts["absent"], "a retried claim finds its own"


async def test_keys_are_compared_exactly_as_written(store: SqlDedupStore) -> None:
    """The server's default collation takes these for one key each; the store keeps them
    apart (a binary NO PAD collation)."""
    keys = ["abc", "ABC", "e", "é", "a", "a ", "😀", "🙂", "ß", "ss"]
    claims = await store.claim_many([DedupKey("ns", k) for k in keys], 30)
    assert all(isinstance(c, Claimed) for c in claims), claims
    assert len({c.key.key for c in claims}) == len(keys)


async def test_long_results_and_precise_times_round_trip(store: SqlDedupStore) -> None:
    """70,000 characters of result (TEXT holds 64 KiB) and epoch times to the microsecond
    (MariaDB's FLOAT is 4 bytes: thousands of seconds off)."""
    clock = store._clock
    assert isinstance(clock, ManualClock)
    clock.advance(1_795_784_666.846_123 - clock.wall())
    key = DedupKey("ns", "big")
    [claim] = await store.claim_many([key], 30)
    assert isinstance(claim, Claimed)
    result = '"' + "é" * 70_000 + '"'
    assert await store.complete_many([_completion(claim, result)], 60) == []
    [found] = await store.claim_many([key], 30)
    assert isinstance(found, Completed) and found.result == "é" * 70_000
    state, owner, failures, expires_at, _ = await _row(store, "big")
    assert (state, owner, failures) == ("completed", None, 0)
    assert expires_at == 1_795_784_666.846_123 + 60


async def test_the_stores_sessions_read_committed_and_wait_briefly_for_locks(
    store: SqlDedupStore,
) -> None:
    """REPEATABLE READ (InnoDB's default) would let a purge's gap locks stall claims, and a
    stopped lock holder would stall them for 50 s."""
    query = sa.text("SELECT @@tx_isolation, @@innodb_lock_wait_timeout")
    async with store._engines.standalone() as connection:
        assert tuple((await connection.execute(query)).one()) == (
            "READ-COMMITTED", MYSQL_LOCK_WAIT_SECONDS)
    async with store.begin() as connection:  # a handler's transaction: the server's level
        assert (await connection.execute(query)).one()[0] == "REPEATABLE-READ"


async def test_a_given_engine_keeps_its_level_for_handlers_and_ours_read_committed() -> None:
    """An AsyncEngine you pass is yours: handlers' transactions keep its level; the library's
    own statements (relay rounds among them) run READ COMMITTED, as on engines it makes."""
    from sqlalchemy.ext.asyncio import create_async_engine

    from reliable_sub.outbox import Outbox

    given = create_async_engine(mariadb_url().replace("mariadb://", "mariadb+asyncmy://"))
    level = sa.text("SELECT @@tx_isolation")
    try:
        for made in (SqlDedupStore(given, table="never_made"), Outbox(given, table="none")):
            async with made.engine.connect() as connection:
                assert (await connection.execute(level)).scalar() == "READ-COMMITTED"
        store = SqlDedupStore(given, table="never_made")
        async with store.begin() as connection:
            assert (await connection.execute(level)).scalar() == "REPEATABLE-READ"
        async with given.connect() as connection:
            assert (await connection.execute(level)).scalar() == "REPEATABLE-READ"
    finally:
        await given.dispose()


async def test_a_given_engines_claims_and_completions_commit() -> None:
    """Given an AsyncEngine, the store's calls ran on a view of its READ COMMITTED view that
    asked for autocommit, and SQLAlchemy applied the outer view's level last: no autocommit,
    so every claim was rolled back when its connection went back to the pool (a transactional
    handler's completion then matched no row, and every delivery was deferred as lost)."""
    from sqlalchemy.ext.asyncio import create_async_engine

    given = create_async_engine(mariadb_url().replace("mariadb://", "mariadb+asyncmy://"))
    store = SqlDedupStore(given, table=f"test_maria_given_{uuid.uuid4().hex[:10]}", owner="me")
    peer = SqlDedupStore(mariadb_url(), table=store.table.name, owner="peer")
    key = DedupKey("ns", "k")
    await store.create_schema()
    try:
        [claim] = await store.claim_many([key], 30)
        assert isinstance(claim, Claimed)
        [seen] = await peer.claim_many([key], 30)
        assert isinstance(seen, InProgress), "the claim was committed"
        async with store.begin() as connection:
            assert await store.complete_in(connection, claim, '"done"', 60)
        assert await peer.claim_many([key], 30) == [Completed('"done"', key)]
    finally:
        async with peer.engine.begin() as connection:
            await connection.run_sync(store.metadata.drop_all)
        await peer.close()
        await store.close()
        await given.dispose()


async def test_a_claim_waits_for_a_late_commit_and_sees_its_completion(
    store: SqlDedupStore,
) -> None:
    """A transactional handler recorded its completion and has not committed yet: a peer's
    claim of that key waits for the commit and reports the result; its other key is taken."""
    peer = SqlDedupStore(store.url, table=store.table.name, owner="peer", clock=store._clock)
    k, other = DedupKey("ns", "k"), DedupKey("ns", "other")
    [held] = await store.claim_many([k], 30)
    assert isinstance(held, Claimed)
    recorded, commit = threading.Event(), threading.Event()

    def late_commit() -> None:
        with store.begin_sync() as connection:
            assert store.complete_in_sync(connection, held, '"mine"', 60)
            recorded.set()
            commit.wait(WITHIN)

    holder = threading.Thread(target=late_commit)
    holder.start()
    try:
        assert await asyncio.to_thread(recorded.wait, WITHIN)
        claim = asyncio.create_task(peer.claim_many([k, other], 30))
        for _ in range(20):  # the claim waits on the row lock while the loop turns
            await asyncio.sleep(0.01)
            assert not claim.done()
        commit.set()
        first, second = await asyncio.wait_for(claim, WITHIN)
    finally:
        commit.set()
        holder.join(WITHIN)
        await peer.close()
    assert first == Completed('"mine"', k)
    assert isinstance(second, Claimed) and second.token.startswith("peer")


def _completion(claim: Claimed, result: str) -> object:
    from reliable_sub.ports import Completion

    return Completion(claim, result)


@pytest.mark.parametrize(("version", "said"), [
    ("8.0.36", "MySQL 8.0.36, which reliable-sub does not support yet"),
    ("10.5.23-MariaDB-0+deb11u1", "MariaDB 10.5.23-MariaDB-0+deb11u1 is too old"),
    ("5.5.5-10.4.1-MariaDB", "is too old"),
])
def test_a_server_the_statements_cannot_run_on_is_refused_by_name(version: str,
                                                                   said: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(said)):
        check_mysql_server(version)
    check_mysql_server("10.11.19-MariaDB-0+deb12u1")
    check_mysql_server("5.5.5-10.6.2-MariaDB")  # as old clients were told
    check_mysql_server("11.4.2-MariaDB")


async def test_a_mysql_server_is_refused_at_the_first_call_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check runs on each new connection of the store's own sessions (here the real
    server's version string is read as MySQL's, the only way to meet one on this machine)."""
    import reliable_sub._sql_engines as engines

    real = engines.check_mysql_server
    monkeypatch.setattr(engines, "check_mysql_server", lambda _version: real("8.0.36"))
    store = SqlDedupStore(mariadb_url().replace("mariadb://", "mysql://"), table="never_made")
    try:
        with pytest.raises(ConfigurationError, match=r"MySQL 8\.0\.36, which reliable-sub does"):
            await store.claim_many([DedupKey("ns", "k")], 30)
    finally:
        await store.close()
