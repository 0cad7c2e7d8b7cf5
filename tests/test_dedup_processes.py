"""Two real processes claim the same keys at the same time: every key has exactly one winner.

Each child builds its own store over the shared database (Redis, PostgreSQL, MariaDB, an SQLite
file), connects, prints ``ready``, waits for the parent's start file (polled, with a deadline)
and for the start time written in it, then claims 1,000 keys in its own shuffled order, one
``claim_many`` batch of 10 at a time, and prints the keys it won and when it began and ended.
The parent checks the two sets are disjoint and cover all keys, and that the two claimed at the
same time.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from reliable_sub.testing.services import redis_url, sql_url
from tests.redis_processes import Child

KEYS = 1000
# Seconds between the parent writing the start time and the start: more than the children's
# polling takes to see the file.
START_AHEAD = 0.2

CHILD = r'''
import asyncio, json, random, sys, time
from pathlib import Path

from reliable_sub import Claimed, DedupKey

settings = json.loads(sys.argv[1])


def build_store():
    if settings["kind"] == "redis":
        from reliable_sub.dedup import RedisDedupStore
        return RedisDedupStore(settings["url"], prefix=settings["name"], owner=settings["owner"])
    from reliable_sub.dedup import SqlDedupStore
    return SqlDedupStore(settings["url"], table=settings["name"], owner=settings["owner"])


async def main():
    store = build_store()
    keys = [DedupKey("race", str(i)) for i in range(settings["keys"])]
    random.Random(settings["owner"]).shuffle(keys)
    # connect (and compile the statement) before the race, so neither starts far behind
    await store.claim_many([DedupKey("warm-up", settings["owner"])], 60)
    print("ready", flush=True)
    start = Path(settings["start_file"])
    give_up = time.monotonic() + 30
    while not start.exists() or not start.read_text():
        assert time.monotonic() < give_up, "no start file"
        await asyncio.sleep(0.001)
    # both begin at the wall-clock time the parent wrote, not when each noticed the file
    await asyncio.sleep(max(0.0, float(start.read_text()) - time.time()))
    won = []
    began = time.time()
    for first in range(0, len(keys), 10):
        batch = keys[first:first + 10]
        for key, result in zip(batch, await store.claim_many(batch, 60)):
            if isinstance(result, Claimed):
                won.append(key.key)
    ended = time.time()
    await store.close()
    print("won " + json.dumps({"keys": won, "began": began, "ended": ended}), flush=True)


asyncio.run(main())
'''


@pytest.fixture(params=["redis", "postgresql", "mariadb", "sqlite-file"])
def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    """Settings naming one fresh store on a shared database; the schema made for SQL."""
    name = f"test_race_{uuid.uuid4().hex[:10]}"
    if request.param == "redis":
        yield {"kind": "redis", "url": redis_url(), "name": name}
        import redis

        client = redis.Redis.from_url(redis_url())
        keys = list(client.scan_iter(match=f"{name}*"))
        if keys:
            client.delete(*keys)
        client.close()
        return
    from reliable_sub.dedup import SqlDedupStore

    if request.param == "sqlite-file":
        url = f"sqlite:///{tmp_path / 'd.db'}"
    else:
        url = sql_url(request.param)
    store = SqlDedupStore(url, table=name)
    store.create_schema_sync()
    yield {"kind": "sql", "url": url, "name": name}
    store.metadata.drop_all(store.sync_engine)
    store.close_sync()


def test_two_processes_claiming_the_same_keys_never_both_win(
    shared_store: dict[str, str], tmp_path: Path
) -> None:
    start_file = tmp_path / "start"
    script = tmp_path / "claimer.py"
    script.write_text(CHILD)
    children = [
        Child(script, json.dumps({**shared_store, "owner": owner, "keys": KEYS,
                                  "start_file": str(start_file)}))
        for owner in ("left", "right")
    ]
    try:
        for child in children:
            child.wait_for_line("ready")
        # a start a moment ahead, so that neither child's polling delay decides who goes first
        start_file.write_text(repr(time.time() + START_AHEAD))
        reports = [json.loads(child.wait_for_line("won ", timeout=60)[4:]) for child in children]
    finally:
        for child in children:
            child.process.kill()
            child.process.wait(timeout=10)
    won = [set(report["keys"]) for report in reports]
    assert won[0].isdisjoint(won[1]), f"both processes won {sorted(won[0] & won[1])[:10]}"
    assert won[0] | won[1] == {str(i) for i in range(KEYS)}
    # the two claimed at the same time (one may still win every key: SQLite's busy handler
    # can keep the other waiting for the whole race)
    assert max(r["began"] for r in reports) < min(r["ended"] for r in reports), reports
