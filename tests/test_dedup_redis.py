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

from reliable_sub import Claimed, Completion, DedupKey, InProgress, Message, Outcome, Subscriber
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.dedup import encode_result
from reliable_sub.errors import ConfigurationError
from reliable_sub.policy import RetryPolicy
from reliable_sub.testing.services import redis_url

if importlib.util.find_spec("redis") is None and os.environ.get("CI", "").lower() != "true":
    pytest.skip('RedisDedupStore needs pip install "reliable-sub[redis]"',
                allow_module_level=True)

from reliable_sub._redis_clients import URL_SCHEMES
from reliable_sub.dedup._redis import READABLE_LIMIT, RedisDedupStore

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
        await store.close()


@pytest.fixture
async def peer(url: str, prefix: str) -> AsyncIterator[RedisDedupStore]:
    """Another consumer's store over the same records (its own client and owner token)."""
    store = RedisDedupStore(url, prefix=prefix, owner="peer")
    try:
        yield store
    finally:
        await store.close()


async def redis_keys(raw: aioredis.Redis, prefix: str) -> set[str]:
    return {key.decode() async for key in raw.scan_iter(match=f"{prefix}*", count=1000)}


# -- one round trip per batch, whatever Redis's script cache holds -------------------------------


async def test_every_batch_method_is_one_round_trip(
    store: RedisDedupStore, peer: RedisDedupStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [DedupKey("s", f"k{i}") for i in range(5)]
    # warm up: open the connection and load every script, whatever the cache held before
    warm = DedupKey("s", "warm-up")
    [claim] = await store.claim_many([warm], 30)
    assert isinstance(claim, Claimed)
    await store.renew([claim], 30)
    await store.release_many([claim], 60)
    [claim] = await store.claim_many([warm], 30)
    assert isinstance(claim, Claimed)
    await store.complete_many([Completion(claim, "null")], 60)
    trips = RoundTrips(monkeypatch)

    claims = await store.claim_many(keys, 30)
    assert trips.count == 1
    held = [c for c in claims if isinstance(c, Claimed)]
    assert len(held) == 5
    trips.reset()
    assert await store.renew(held, 30) == []
    assert trips.count == 1
    trips.reset()
    await store.release_many(held[:2], 60)
    assert trips.count == 1
    trips.reset()
    assert await store.complete_many([Completion(c, "[1,2]") for c in held[2:]], 60) == []
    assert trips.count == 1
    trips.reset()
    assert await store.claim_many([], 30) == []
    assert await store.renew([], 30) == []
    assert await store.complete_many([], 60) == []
    await store.release_many([], 60)
    assert trips.count == 0, "empty batches make no call at all"


async def test_a_flushed_script_cache_is_reloaded(store: RedisDedupStore) -> None:
    # After a Redis restart the server has forgotten the scripts; a bogus SHA is the same to
    # EVALSHA (NOSCRIPT) without flushing the cache other clients of this Redis rely on.
    bogus = "0" * 40
    scripts = [store._claim_script, store._renew_script, store._release_script,
               store._complete_script]
    for script in scripts:
        script.sha = bogus
    claim = await store.claim(DedupKey("s", "k"), 30)
    assert isinstance(claim, Claimed)
    assert await store.renew([claim], 30) == []
    assert await store.complete(claim, "ok", 60) is True
    await store.release(claim, 60)
    assert bogus not in {script.sha for script in scripts}


async def test_a_dropped_connection_is_retried_on_a_fresh_one(
    store: RedisDedupStore, raw: aioredis.Redis
) -> None:
    first = await store.claim(DedupKey("s", "before"), 30)
    assert isinstance(first, Claimed)
    connection_id = await store.client.client_id()  # the pooled connection the calls use
    assert await raw.client_kill_filter(_id=connection_id) == 1
    # the next call meets the dead socket: redis-py retries it on a fresh connection
    results = await store.claim_many([DedupKey("s", "after"), first.key], 30)
    assert isinstance(results[0], Claimed)
    assert isinstance(results[1], InProgress)
    assert await store.client.client_id() != connection_id


async def test_values_say_the_state_and_hold_json_never_pickle(
    store: RedisDedupStore, raw: aioredis.Redis
) -> None:
    key = DedupKey("s", "k")
    claim = await store.claim(key, 30)
    assert isinstance(claim, Claimed)
    assert await raw.get(store.redis_key(key)) == f"p:{claim.token}|0".encode()
    await store.release(Claimed(key, claim.token, failures=2), 60)
    assert await raw.get(store.redis_key(key)) == b"f:2"
    again = await store.claim(key, 30)
    assert isinstance(again, Claimed) and again.failures == 2
    result = {"list": [1, "two", None, [3.5]], "none": None, "text": "ünï"}
    await store.complete(again, result, ttl=60)
    value = await raw.get(store.redis_key(key))
    assert value == b"c:" + encode_result(result).encode()
    assert json.loads(value[2:]) == result
    assert 59_000 < await raw.pttl(store.redis_key(key)) <= 60_000


CLAIMER = textwrap.dedent("""
    import asyncio, sys, time
    import redis.asyncio as aioredis
    from reliable_sub import Claimed, DedupKey, InProgress
    from reliable_sub.dedup import RedisDedupStore

    url, prefix, key, owner = sys.argv[1:5]
    n = int(sys.argv[5])
    key = DedupKey("s", key)

    async def main() -> None:
        signals = aioredis.Redis.from_url(url)
        store = RedisDedupStore(url, prefix=prefix, owner=owner)
        # open n connections and load the script first, so the claims start together
        await asyncio.gather(*(store.client.ping() for _ in range(n)))
        await store.claim(DedupKey("s", "warm-up-" + owner), 30)
        await signals.rpush(prefix + ":ready", owner)
        give_up = time.monotonic() + 30
        while await signals.blpop([prefix + ":go"], timeout=1) is None:
            if time.monotonic() > give_up:
                sys.exit("no go signal")
        results = await asyncio.gather(*(store.claim(key, 30) for _ in range(n)))
        won = sum(isinstance(r, Claimed) for r in results)
        waiting = sum(isinstance(r, InProgress) for r in results)
        print(f"won={won} in_progress={waiting}", flush=True)
        await store.close()
        await signals.aclose()

    asyncio.run(main())
""")


async def test_claims_from_two_processes_have_exactly_one_winner(
    url: str, prefix: str, raw: aioredis.Redis, store: RedisDedupStore, tmp_path: Path
) -> None:
    script = tmp_path / "claimer.py"
    script.write_text(CLAIMER)
    claims_each = 50
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable, str(script), url, prefix, "contended", owner, str(claims_each),
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
    value = await raw.get(store.redis_key(DedupKey("s", "contended")))
    assert value is not None and value.startswith(f"p:{winner}.".encode())


async def _list_length(raw: aioredis.Redis, name: str, length: int) -> bool:
    return bool(await raw.llen(name) >= length)


# -- keys -----------------------------------------------------------------------------------------


def test_redis_keys_are_readable_when_safe_and_hashed_otherwise() -> None:
    store = RedisDedupStore("redis://127.0.0.1:1/0", prefix="app")  # never connects
    assert store.redis_key(DedupKey("billing", "order-42")) == "app:{billing}:order-42"
    assert store.redis_key(DedupKey("", "no-namespace")) == "app:{_}:no-namespace"
    hashed = store.redis_key(DedupKey("billing", "with space"))
    assert hashed.startswith("app:{billing}:h:") and len(hashed) == len("app:{billing}:h:") + 64
    # a key that looks like a hash, or a namespace that looks like the empty one, is hashed too
    lookalike = "h:" + hashed.rsplit("h:", 1)[1]
    assert store.redis_key(DedupKey("billing", lookalike)) != hashed
    assert store.redis_key(DedupKey("_", "k")) != store.redis_key(DedupKey("", "k"))
    # braces cannot end the hash tag early: such a namespace is hashed, the same for every key
    odd = {store.redis_key(DedupKey("a}:{b", key)).split("}")[0] for key in ("x", "y")}
    assert len(odd) == 1 and odd.pop().startswith("app:{h:")


async def test_every_key_of_a_namespace_lives_in_one_slot(
    store: RedisDedupStore, raw: aioredis.Redis, prefix: str
) -> None:
    from redis.crc import key_slot

    keys = [DedupKey("orders", k) for k in ("order-42", "a" * 1000, "x" * 100, "with space")]
    await store.claim_many(keys, 30)
    names = await redis_keys(raw, prefix)
    assert len(names) == len(keys)
    assert len({key_slot(name.encode()) for name in names}) == 1, "one slot per namespace"
    assert max(len(name) for name in names) <= len(f"{prefix}:{{orders}}:") + READABLE_LIMIT
    assert f"{prefix}:{{orders}}:order-42" in names, "plain keys stay readable"


async def test_bad_settings_are_refused(store: RedisDedupStore) -> None:
    with pytest.raises(ConfigurationError, match="braces"):
        RedisDedupStore(prefix="app:{dedup}")
    with pytest.raises(ConfigurationError, match=r"redis\.asyncio\.Redis"):
        RedisDedupStore(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="owner"):
        RedisDedupStore(owner="a|b")


@pytest.mark.parametrize(("url", "what"), [
    ("http://127.0.0.1:6379", "scheme 'http://'"),
    ("nats://user:secret@127.0.0.1:4222", "scheme 'nats://'"),
    ("127.0.0.1:6379", "no scheme"),
    ("redis://127.0.0.1:port/0", "Port could not be cast"),
    ("redis+cluster://127.0.0.1:port", "redis+cluster://127.0.0.1:port"),
])
def test_a_url_it_cannot_use_is_a_configuration_error_naming_every_scheme(
    url: str, what: str,
) -> None:
    """Not redis-py's raw ValueError, whose list of schemes leaves out redis+cluster://."""
    with pytest.raises(ConfigurationError) as refused:
        RedisDedupStore(url)
    message = str(refused.value)
    assert "RedisDedupStore" in message and what in message
    assert "secret" not in message, "a password is never shown"
    if "scheme" in what:
        assert all(scheme in message for scheme in URL_SCHEMES), message


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
    # a copy deferred behind the live claim comes back after max_backoff (1 s)
    sub = Subscriber(broker, dedup=store, retry=RetryPolicy(min_backoff=0.05, max_backoff=1))
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
    key = DedupKey(broker.dedup_namespace("billing"), "order-7")
    assert await raw.get(store.redis_key(key)) == b'c:{"charged":10,"currency":"EUR"}'
