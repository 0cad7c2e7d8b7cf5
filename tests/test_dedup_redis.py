"""RedisDedupStore against the real Redis on 127.0.0.1:6379 (skipped without it, failed in CI)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from reliable_sub import Claimed, Completed, InProgress, Message, Outcome, Subscriber
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.dedup import DedupStore, encode_result, scoped_key
from reliable_sub.errors import ConfigurationError, ResultNotSerializableError
from reliable_sub.policy import RetryPolicy
from tests.redis_support import redis_url

if importlib.util.find_spec("redis") is None and os.environ.get("CI", "").lower() != "true":
    pytest.skip('RedisDedupStore needs pip install "reliable-sub[redis]"',
                allow_module_level=True)

from reliable_sub.dedup_redis import READABLE_LIMIT, RedisDedupStore

if TYPE_CHECKING:
    import redis.asyncio as aioredis

REPO = Path(__file__).resolve().parent.parent
# Real-time waits poll at this interval until their deadline; they never sleep to synchronise.
POLL_INTERVAL = 0.01
DEADLINE = 10.0


async def poll_until(check: Callable[[], Awaitable[bool]], what: str,
                     within: float = DEADLINE) -> None:
    """Await ``check()`` every POLL_INTERVAL until it is true, or fail after ``within`` s."""
    give_up = time.monotonic() + within
    while not await check():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(POLL_INTERVAL)


class RoundTrips:
    """Counts writes to Redis sockets: one per command or per pipeline, i.e. round trips."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from redis.asyncio.connection import AbstractConnection

        original = AbstractConnection.send_packed_command
        self.count = 0

        async def counting(connection: Any, command: Any, check_health: bool = True) -> None:
            self.count += 1
            await original(connection, command, check_health)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)

    def reset(self) -> None:
        self.count = 0


@pytest.fixture
def url() -> str:
    return redis_url()


@pytest.fixture
async def raw(url: str) -> AsyncIterator[aioredis.Redis]:
    """A plain client for looking at what the store wrote."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def prefix(raw: aioredis.Redis) -> AsyncIterator[str]:
    """A key prefix of this test alone; its keys are deleted afterwards."""
    prefix = f"test-dedup-{uuid.uuid4().hex}"
    try:
        yield prefix
    finally:
        keys = [key async for key in raw.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await raw.delete(*keys)


@pytest.fixture
async def store(url: str, prefix: str) -> AsyncIterator[RedisDedupStore]:
    store = RedisDedupStore(url, prefix=prefix, owner="me")
    try:
        yield store
    finally:
        await store.aclose()


@pytest.fixture
async def peer(url: str, prefix: str) -> AsyncIterator[RedisDedupStore]:
    """Another consumer's store over the same records (its own client and owner token)."""
    store = RedisDedupStore(url, prefix=prefix, owner="peer")
    try:
        yield store
    finally:
        await store.aclose()


async def redis_keys(raw: aioredis.Redis, prefix: str) -> set[str]:
    return {key.decode() async for key in raw.scan_iter(match=f"{prefix}*", count=1000)}


# -- the protocol ---------------------------------------------------------------------------------


async def test_the_store_satisfies_the_protocol_and_loads_lazily_from_dedup(
    store: RedisDedupStore,
) -> None:
    from reliable_sub.dedup import RedisDedupStore as lazily_loaded

    assert lazily_loaded is RedisDedupStore
    assert isinstance(store, DedupStore)
    assert store.owner == "me"
    assert len(RedisDedupStore("redis://127.0.0.1:1/0").owner) == 32, "a random default owner"


async def test_claim_then_in_progress_then_completed(
    store: RedisDedupStore, raw: aioredis.Redis
) -> None:
    key = scoped_key("billing", "order-1")
    assert await store.claim(key, 30) == Claimed()
    assert await raw.get(store.redis_key(key)) == b"p:me"
    again = await store.claim(key, 30)
    assert isinstance(again, InProgress) and 0 < again.expires_in <= 30

    result = {"charged": 10, "items": [1, "two", None, {"ok": True, "ratio": 0.5}], "note": None}
    await store.complete(key, result, ttl=3600)
    assert await store.claim(key, 30) == Completed(result)
    assert 3590_000 < await raw.pttl(store.redis_key(key)) <= 3600_000


async def test_claim_many_reports_every_state_in_order_in_one_round_trip(
    store: RedisDedupStore, peer: RedisDedupStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    done, busy = scoped_key("s", "done"), scoped_key("s", "busy")
    new, other = scoped_key("s", "new"), scoped_key("s", "other")
    await store.complete(done, {"n": 1}, ttl=60)
    await peer.claim(busy, 30)
    await store.claim(scoped_key("s", "warm-up"), 30)  # connection open, script loaded
    trips = RoundTrips(monkeypatch)

    results = await store.claim_many([new, done, busy, new, other], 30)
    assert trips.count == 1
    assert results[0] == Claimed()
    assert results[1] == Completed({"n": 1})
    assert isinstance(results[2], InProgress) and 0 < results[2].expires_in <= 30
    assert isinstance(results[3], InProgress), "a key repeated in one batch is claimed once"
    assert results[4] == Claimed()

    trips.reset()
    await store.complete_many([(new, '"ok"'), (other, "null"), (busy, "[1,2]")], ttl=60)
    assert trips.count == 1
    trips.reset()
    assert await store.renew([new, other, busy], 30) == [new, other, busy]
    assert trips.count == 1
    trips.reset()
    assert await store.claim_many([new, other, busy], 30) == [
        Completed("ok"), Completed(None), Completed([1, 2])
    ]
    assert await store.claim_many([], 30) == []
    assert await store.renew([], 30) == []
    await store.complete_many([], 60)
    assert trips.count == 1, "empty batches make no call at all"


async def test_a_flushed_script_cache_is_reloaded(
    store: RedisDedupStore, peer: RedisDedupStore
) -> None:
    # After a Redis restart the server has forgotten the scripts; a bogus SHA is the same to
    # EVALSHA (NOSCRIPT) without flushing the cache other clients of this Redis rely on.
    bogus = "0" * 40
    store._claim_script.sha = store._release_script.sha = store._renew_script.sha = bogus
    key = scoped_key("s", "k")
    assert await store.claim(key, 30) == Claimed()
    assert await store.renew([key], 30) == []
    assert await store.release(key) is True
    assert bogus not in {store._claim_script.sha, store._release_script.sha,
                         store._renew_script.sha}


async def test_durations_must_be_positive(store: RedisDedupStore) -> None:
    with pytest.raises(ConfigurationError, match=r"lease_ttl must be in \(0, inf\), got 0"):
        await store.claim(scoped_key("s", "k"), 0)
    with pytest.raises(ConfigurationError, match="ttl must be in"):
        await store.complete(scoped_key("s", "k"), None, ttl=-1)
    with pytest.raises(ConfigurationError, match="braces"):
        RedisDedupStore(prefix="app:{dedup}")
    with pytest.raises(ConfigurationError, match=r"redis\.asyncio\.Redis"):
        RedisDedupStore(42)  # type: ignore[arg-type]


# -- exactly one winner -------------------------------------------------------------------------


async def test_200_concurrent_claims_have_exactly_one_winner(store: RedisDedupStore) -> None:
    key = scoped_key("s", "contended")
    results = await asyncio.gather(*(store.claim(key, 30) for _ in range(200)))
    assert sum(isinstance(r, Claimed) for r in results) == 1
    assert sum(isinstance(r, InProgress) for r in results) == 199


CLAIMER = textwrap.dedent("""
    import asyncio, sys, time
    import redis.asyncio as aioredis
    from reliable_sub import Claimed, InProgress
    from reliable_sub.dedup import RedisDedupStore

    url, prefix, key, owner = sys.argv[1:5]
    n = int(sys.argv[5])

    async def main() -> None:
        signals = aioredis.Redis.from_url(url)
        store = RedisDedupStore(url, prefix=prefix, owner=owner)
        # open n connections and load the script first, so the claims start together
        await asyncio.gather(*(store.client.ping() for _ in range(n)))
        await store.claim(key + "-warm-up-" + owner, 30)
        await signals.rpush(prefix + ":ready", owner)
        give_up = time.monotonic() + 30
        while await signals.blpop([prefix + ":go"], timeout=1) is None:
            if time.monotonic() > give_up:
                sys.exit("no go signal")
        results = await asyncio.gather(*(store.claim(key, 30) for _ in range(n)))
        won = sum(isinstance(r, Claimed) for r in results)
        waiting = sum(isinstance(r, InProgress) for r in results)
        print(f"won={won} in_progress={waiting}", flush=True)
        await store.aclose()
        await signals.aclose()

    asyncio.run(main())
""")


async def test_claims_from_two_processes_have_exactly_one_winner(
    url: str, prefix: str, raw: aioredis.Redis, store: RedisDedupStore, tmp_path: Path
) -> None:
    script = tmp_path / "claimer.py"
    script.write_text(CLAIMER)
    key, claims_each = scoped_key("s", "contended"), 50
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable, str(script), url, prefix, key, owner, str(claims_each),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
        )
        for owner in ("proc-a", "proc-b")
    ]
    try:
        await poll_until(lambda: _list_length(raw, f"{prefix}:ready", 2), "both processes ready",
                         within=60)
        await raw.rpush(f"{prefix}:go", "go", "go")
        outputs = [await asyncio.wait_for(p.communicate(), 60) for p in processes]
    finally:
        for process in processes:
            if process.returncode is None:
                process.kill()
                await process.wait()
    tallies = []
    for process, (out, err) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, err.decode()
        won, waiting = (int(part.split("=")[1]) for part in out.decode().split())
        tallies.append((won, waiting))
    assert sum(won for won, _ in tallies) == 1, tallies
    assert sum(waiting for _, waiting in tallies) == 2 * claims_each - 1, tallies
    winner = "proc-a" if tallies[0][0] else "proc-b"
    assert await raw.get(store.redis_key(key)) == f"p:{winner}".encode()


async def _list_length(raw: aioredis.Redis, name: str, length: int) -> bool:
    return bool(await raw.llen(name) >= length)


# -- leases, release, renew, retention ----------------------------------------------------------


async def test_an_expired_claim_lets_a_retry_claim_it(
    store: RedisDedupStore, peer: RedisDedupStore, raw: aioredis.Redis
) -> None:
    key = scoped_key("s", "crashed")
    assert await peer.claim(key, 0.15) == Claimed()  # a consumer that then crashes
    first = await store.claim(key, 30)
    assert isinstance(first, InProgress) and 0 < first.expires_in <= 0.15

    async def claimed() -> bool:
        return await store.claim(key, 30) == Claimed()

    await poll_until(claimed, "the crashed peer's claim to expire", within=5)
    assert await raw.get(store.redis_key(key)) == b"p:me"


async def test_release_deletes_only_this_owners_claim(
    store: RedisDedupStore, peer: RedisDedupStore, raw: aioredis.Redis
) -> None:
    key = scoped_key("s", "k")
    await store.claim(key, 30)
    assert await peer.release(key) is False
    assert await raw.get(store.redis_key(key)) == b"p:me", "a peer's release must not touch it"
    assert await store.release(key) is True
    assert await raw.exists(store.redis_key(key)) == 0
    assert await store.release(key) is False, "nothing left to release"
    assert await peer.claim(key, 30) == Claimed()

    done = scoped_key("s", "done")
    await store.claim(done, 30)
    await store.complete(done, "ok", ttl=60)
    assert await store.release(done) is False, "a completed record is no claim"
    assert await store.claim(done, 30) == Completed("ok")


async def test_renew_extends_only_this_owners_claims(
    store: RedisDedupStore, peer: RedisDedupStore, raw: aioredis.Redis
) -> None:
    key, unknown = scoped_key("s", "k"), scoped_key("s", "never-claimed")
    await store.claim(key, 1.0)
    assert await peer.renew([key], 100) == [key]
    assert 0 < await raw.pttl(store.redis_key(key)) <= 1000, "a peer's renew must not extend"
    assert await store.renew([key, unknown], 100) == [unknown]
    assert 99_000 < await raw.pttl(store.redis_key(key)) <= 100_000
    assert await raw.exists(store.redis_key(unknown)) == 0, "renew never creates a claim"

    done = scoped_key("s", "done")
    await store.complete(done, None, ttl=60)
    assert await store.renew([done], 100) == [done]
    assert await raw.pttl(store.redis_key(done)) <= 60_000
    assert await store.claim(done, 30) == Completed(None)


async def test_a_completed_record_expires_after_its_retention(
    store: RedisDedupStore, raw: aioredis.Redis
) -> None:
    key = scoped_key("s", "k")
    await store.claim(key, 30)
    await store.complete(key, {"n": 1}, ttl=0.15)
    assert await store.claim(key, 30) == Completed({"n": 1})
    assert 0 < await raw.pttl(store.redis_key(key)) <= 150

    async def new_again() -> bool:
        return await store.claim(key, 30) == Claimed()

    await poll_until(new_again, "the completed record to expire", within=5)


# -- keys and values ----------------------------------------------------------------------------


def test_redis_keys_are_readable_when_safe_and_hashed_otherwise() -> None:
    store = RedisDedupStore("redis://127.0.0.1:1/0", prefix="app")  # never connects
    assert store.redis_key(scoped_key("billing", "order-42")) == "app:{billing}:order-42"
    assert store.redis_key("no-namespace") == "app:{_}:no-namespace"
    assert store.redis_key(scoped_key("", "no-namespace")) == "app:{_}:no-namespace"
    hashed = store.redis_key(scoped_key("billing", "with space"))
    assert hashed.startswith("app:{billing}:h:") and len(hashed) == len("app:{billing}:h:") + 64
    # a key that looks like a hash, or a namespace that looks like the empty one, is hashed too
    lookalike = "h:" + hashed.rsplit("h:", 1)[1]
    assert store.redis_key(scoped_key("billing", lookalike)) != hashed
    assert store.redis_key(scoped_key("_", "k")) != store.redis_key("k")
    # braces cannot end the hash tag early: such a namespace is hashed, the same for every key
    odd = {store.redis_key(scoped_key("a}:{b", key)).split("}")[0] for key in ("x", "y")}
    assert len(odd) == 1 and odd.pop().startswith("app:{h:")
    assert store.redis_key(scoped_key("a}:{b", "x")) != store.redis_key(scoped_key("a", "{b}:x"))
    assert store.redis_key(scoped_key("a", "b:c")) != store.redis_key(scoped_key("a:b", "c"))


async def test_any_key_round_trips_in_its_own_record_in_the_namespace_slot(
    store: RedisDedupStore, raw: aioredis.Redis, prefix: str
) -> None:
    from redis.crc import key_slot

    long_a = "a" * 1000
    keys = [
        "order-42",
        long_a,
        long_a[:-1] + "b",  # a different long key sharing a 999-character prefix
        "x" * 100,
        "x" * 101,
        "with space",
        "ünïcødé ключ 🔑",
        "\x00\x01binary\xff\ud800",  # control characters and a lone surrogate
        "",
        "h:" + "0" * 64,
    ]
    scoped = [scoped_key("orders", key) for key in keys]
    assert await store.claim_many(scoped, 30) == [Claimed()] * len(keys), "two keys collided"
    await store.complete_many([(key, json.dumps(i)) for i, key in enumerate(scoped)], ttl=60)
    assert await store.claim_many(scoped, 30) == [Completed(i) for i in range(len(keys))]

    names = await redis_keys(raw, prefix)
    assert len(names) == len(keys)
    assert all(name.startswith(f"{prefix}:{{orders}}:") for name in names)
    assert len({key_slot(name.encode()) for name in names}) == 1, "one slot per namespace"
    assert max(len(name) for name in names) <= len(f"{prefix}:{{orders}}:") + READABLE_LIMIT
    assert f"{prefix}:{{orders}}:order-42" in names, "plain keys stay readable"
    assert f"{prefix}:{{orders}}:{'x' * 100}" in names


async def test_results_are_stored_as_json_text_never_pickle(
    store: RedisDedupStore, raw: aioredis.Redis
) -> None:
    key = scoped_key("s", "k")
    await store.claim(key, 30)
    with pytest.raises(ResultNotSerializableError, match="object"):
        await store.complete(key, object(), ttl=60)
    with pytest.raises(ResultNotSerializableError):
        await store.complete(key, float("nan"), ttl=60)
    assert await raw.get(store.redis_key(key)) == b"p:me", "a failed complete stores nothing"

    result = {"list": [1, "two", None, [3.5]], "none": None, "text": "ünï"}
    await store.complete(key, result, ttl=60)
    value = await raw.get(store.redis_key(key))
    assert value is not None and value.startswith(b"c:")
    assert not value[2:].startswith(b"\x80"), "pickle protocol header"
    assert value[2:] == encode_result(result).encode()
    assert json.loads(value[2:]) == result


def test_without_redis_the_import_names_the_extra_to_install() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["redis"] = None  # as if redis were not installed
        import reliable_sub, reliable_sub.dedup, reliable_sub.subscriber
        from reliable_sub.errors import MissingExtraError
        try:
            from reliable_sub.dedup import RedisDedupStore
        except MissingExtraError as error:
            print("MissingExtraError:", error)
        else:
            print("imported", RedisDedupStore)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("MissingExtraError:"), result.stdout
    assert 'pip install "reliable-sub[redis]"' in result.stdout


# -- with the Subscriber ------------------------------------------------------------------------


async def test_the_subscriber_runs_a_handler_once_for_three_copies(
    store: RedisDedupStore, raw: aioredis.Redis
) -> None:
    broker = MemoryAdapter()
    broker.ensure_subscription_sync("orders", "billing")
    # a copy deferred behind the live claim comes back after max_backoff (0.2 s), not seconds
    sub = Subscriber(broker, dedup=store, retry=RetryPolicy(min_backoff=0.05, max_backoff=0.2))
    runs: list[bytes] = []

    @sub.handler("billing")
    async def charge(message: Message) -> dict[str, Any]:
        runs.append(message.data)
        return {"charged": 10, "currency": "EUR"}

    for copy in range(3):
        broker.publish_sync("orders", f"copy-{copy}".encode(), {"idempotency-key": "order-7"})
    task = asyncio.ensure_future(sub.serve())
    try:
        async def all_settled() -> bool:
            stats = sub.stats
            return stats[Outcome.ACKED] + stats[Outcome.DUPLICATE] == 3 and (
                broker.backlog("billing") == 0
            )

        await poll_until(all_settled, "three copies to be settled")
    finally:
        await asyncio.wait_for(sub.shutdown(timeout=5), DEADLINE)
        await asyncio.wait_for(task, DEADLINE)

    assert len(runs) == 1, runs
    assert sub.stats[Outcome.ACKED] == 1
    assert sub.stats[Outcome.DUPLICATE] == 2
    key = scoped_key("billing", "order-7")
    assert await store.claim(key, 30) == Completed({"charged": 10, "currency": "EUR"})
    assert await raw.get(store.redis_key(key)) == b'c:{"charged":10,"currency":"EUR"}'
