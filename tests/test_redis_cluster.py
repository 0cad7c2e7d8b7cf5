"""Redis Cluster under failure: a master SIGKILLed mid-run (its replica takes over), and slots
moved with ``redis-cli --cluster reshard`` while a Subscriber consumes. Each test has a cluster
of its own (3 masters, 3 replicas): it breaks it.

Effects are counted per message outside the Subscriber (in the test), and the stream is read
back at the end: every message the cluster kept must have had its effect, once. What
asynchronous replication lost (an XADD the old master acknowledged and never passed on) is
counted and reported, not excused beyond that.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from reliable_sub import FlowControl, LeasePolicy, Message, Outcome, RetryPolicy, Subscriber
from reliable_sub._redis_clients import RedisClients
from reliable_sub.adapters.redis_streams import RedisStreamsAdapter, hash_tag
from reliable_sub.dedup import RedisDedupStore
from reliable_sub.ports import DedupKey
from tests.redis_processes import RedisClusterProcesses, RedisServer

MESSAGES = 600
PUBLISH_SECONDS = 6.0
ACK_DEADLINE = 2.0
# Seconds the run may take after the last publish for every kept message to have its effect.
SETTLE_WITHIN = 60.0
POLL = 0.05
# Seconds from the promoted replica's first write to the first new effect: the consumer's own
# share of the recovery (the backoffs of its receive and store calls are capped at 1 s here).
RECOVERY_BOUND = 10.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisClusterProcesses]:
    cluster = RedisClusterProcesses(tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.kill()


class Run:
    """A Subscriber with the Redis dedup store on the cluster, and what it did per message."""

    def __init__(self, cluster: RedisClusterProcesses, topic: str | None = None) -> None:
        name = f"cluster-{uuid.uuid4().hex[:8]}"
        self.topic, self.subscription = topic or f"{name}-orders", f"{name}-billing"
        self.adapter = RedisStreamsAdapter(cluster.url, consumer="consumer-1", key_prefix=name)
        self.publisher = RedisStreamsAdapter(cluster.url, consumer="publisher", key_prefix=name)
        self.store = RedisDedupStore(cluster.url, prefix=f"{name}:dedup")
        self.effects: Counter[int] = Counter()
        self.outcomes: Counter[Outcome] = Counter()
        self.published: dict[int, float] = {}  # message number -> when its XADD was confirmed
        self.sub = Subscriber(
            self.adapter, dedup=self.store, on_outcome=self._outcome,
            lease=LeasePolicy(min_extension=1.0, max_extension=ACK_DEADLINE),
            retry=RetryPolicy(min_backoff=0.1, max_backoff=1.0),
            flow_control=FlowControl(max_messages=50), receive_timeout=0.5,
        )
        self.first_effect_after: dict[int, float] = {}

        @self.sub.handler(self.subscription)
        async def count(message: Message) -> None:
            number = int(message.data)
            self.effects[number] += 1
            self.first_effect_after.setdefault(number, time.monotonic())

    def _outcome(self, message: Message, outcome: Outcome) -> None:
        self.outcomes[outcome] += 1

    async def publish_all(self) -> None:
        """Publish MESSAGES over PUBLISH_SECONDS, each retried until the cluster confirms it
        (a producer's retries; the idempotency key makes a repeat a duplicate)."""
        for number in range(MESSAGES):
            while True:
                try:
                    await self.publisher.publish(self.topic, str(number).encode(),
                                                 {"idempotency-key": f"order-{number}"})
                    break
                except Exception:  # the master is gone and not yet replaced
                    await asyncio.sleep(POLL)
            self.published[number] = time.monotonic()
            await asyncio.sleep(PUBLISH_SECONDS / MESSAGES)

    def kept(self, url: str) -> set[int]:
        """The message numbers the stream holds now."""
        client = cluster_client(url)
        try:
            return {int(fields[b"data"]) for _, fields in client.xrange(self.topic)}
        finally:
            client.close()

    async def close(self) -> None:
        await self.publisher.close()


def cluster_client(url: str) -> RedisCluster:
    """A blocking cluster client seeded with every node of ``url`` (some may be down)."""
    client = RedisClients(url, owner="the test").sync
    assert isinstance(client, RedisCluster)
    return client


def master_of(cluster: RedisClusterProcesses, key: str) -> RedisServer:
    client = cluster_client(cluster.url)
    try:
        node = client.get_node_from_key(key)
        [server] = [s for s in cluster.servers if s.port == node.port]
        return server
    finally:
        client.close()


def slot_writable_again(cluster: RedisClusterProcesses, key: str, dead: RedisServer) -> float:
    """When a live node first takes a write to ``key``'s slot (its replica, once promoted)."""
    give_up = time.monotonic() + SETTLE_WITHIN
    probe = f"{{{hash_tag(key)}}}:failover-probe"
    while time.monotonic() < give_up:
        for server in cluster.servers:
            if server is dead:
                continue
            node = redis.Redis(port=server.port, socket_timeout=1.0)
            try:
                node.set(probe, "1")
                return time.monotonic()
            except redis.RedisError:  # MOVED to the dead master, or not up yet
                pass
            finally:
                node.close()
        time.sleep(POLL / 5)
    raise AssertionError(f"no node took writes to the slot of {key!r} in {SETTLE_WITHIN}s")


async def wait_for(check: object, what: str, within: float) -> None:
    give_up = time.monotonic() + within
    while not check():  # type: ignore[operator]
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(POLL)


@pytest.mark.parametrize("holding", ["stream", "dedup records"])
async def test_a_master_killed_mid_run_fails_over_and_no_kept_message_is_lost(
    cluster: RedisClusterProcesses, holding: str,
) -> None:
    """The master that holds the stream, or the one that holds the subscription's dedup
    records (the same one, sometimes: then both go), is SIGKILLed mid-run."""
    run = Run(cluster)
    await run.adapter.ensure_subscription(run.topic, run.subscription, ack_deadline=ACK_DEADLINE)
    record = run.store.redis_key(DedupKey(run.adapter.dedup_namespace(run.subscription), "x"))
    victim = master_of(cluster, run.topic if holding == "stream" else record)
    async with run.sub:
        publishing = asyncio.create_task(run.publish_all())
        await wait_for(lambda: len(run.published) >= MESSAGES // 3, "a third published", 30)
        victim.kill()  # SIGKILL: the replica is promoted after the node timeout
        killed_at = time.monotonic()
        promoted = asyncio.create_task(asyncio.to_thread(
            slot_writable_again, cluster, run.topic if holding == "stream" else record, victim))
        await asyncio.wait_for(publishing, timeout=SETTLE_WITHIN)
        kept = run.kept(cluster.url)
        await wait_for(lambda: all(run.effects[n] for n in kept), "every kept message handled",
                       SETTLE_WITHIN)
    await run.close()

    after = [n for n, at in run.published.items() if at > killed_at]
    recovery = min(run.first_effect_after[n] for n in after if n in run.first_effect_after)
    writable_again = await promoted
    lost_by_replication = set(run.published) - kept
    doubled = sum(1 for count in run.effects.values() if count > 1)
    print(f"failover of the master holding the {holding}: recovered {recovery - killed_at:.2f}s "
          f"after the kill, {recovery - writable_again:.2f}s after the slot took writes again "
          f"({writable_again - killed_at:.2f}s after the kill); {len(lost_by_replication)} "
          f"acknowledged XADDs lost with it; {doubled} effects ran twice (completions lost "
          "with it)")
    assert after, "messages were published after the kill"
    assert recovery - killed_at < SETTLE_WITHIN
    assert recovery - writable_again < RECOVERY_BOUND, "the Subscriber was slow to follow"
    assert all(run.effects[n] >= 1 for n in kept), "a kept message without its effect"
    assert len(lost_by_replication) < MESSAGES // 3, "the replica had nearly everything"
    # a message whose ack was lost in the failover comes back and ends as a duplicate
    assert run.outcomes[Outcome.ACKED] + run.outcomes[Outcome.DUPLICATE] >= len(kept)


def node_id(server: RedisServer) -> str:
    client = redis.Redis(port=server.port)
    try:
        return str(client.execute_command("CLUSTER", "MYID"), "utf-8")
    finally:
        client.close()


def first_slot_of(server: RedisServer) -> int:
    """The lowest slot ``server`` serves: the one ``redis-cli --cluster reshard`` moves first."""
    client = redis.Redis(port=server.port)
    try:
        ranges = [r for r in client.execute_command("CLUSTER", "SLOTS")
                  if r[2][1] == server.port]
        return min(int(r[0]) for r in ranges)
    finally:
        client.close()


def name_in_slot(slot: int, stem: str) -> str:
    """A key name (no hash tag) whose hash slot is ``slot``."""
    from redis.crc import key_slot

    return next(f"{stem}-{n}" for n in range(10**6) if key_slot(f"{stem}-{n}".encode()) == slot)


async def test_the_stream_s_slot_moved_while_consuming_loses_and_doubles_nothing(
    cluster: RedisClusterProcesses,
) -> None:
    cli = shutil.which("redis-cli")
    assert cli is not None, "redis-cli moves the slot"
    masters = [s for s in cluster.servers if s.role() == "master"]
    source, target = masters[0], masters[1]
    run = Run(cluster, topic=name_in_slot(first_slot_of(source), "orders"))
    await run.adapter.ensure_subscription(run.topic, run.subscription, ack_deadline=ACK_DEADLINE)
    assert master_of(cluster, run.topic) is source
    async with run.sub:
        publishing = asyncio.create_task(run.publish_all())
        await wait_for(lambda: len(run.published) >= MESSAGES // 3, "a third published", 30)
        moved = await asyncio.to_thread(
            subprocess.run,
            [cli, "--cluster", "reshard", f"127.0.0.1:{source.port}",
             "--cluster-from", node_id(source), "--cluster-to", node_id(target),
             "--cluster-slots", "1", "--cluster-yes"],
            capture_output=True, text=True, timeout=60, check=False)
        assert moved.returncode == 0, moved.stdout + moved.stderr
        await asyncio.wait_for(publishing, timeout=SETTLE_WITHIN)
        kept = run.kept(cluster.url)
        await wait_for(lambda: all(run.effects[n] for n in kept), "every message handled",
                       SETTLE_WITHIN)
    await run.close()

    assert master_of(cluster, run.topic) is target, "the stream's slot moved"
    assert kept == set(range(MESSAGES)), "nothing is lost when the slot moves"
    assert max(run.effects.values()) == 1, "and no effect runs twice"


@pytest.mark.parametrize("topic", ["orders", "{tenant-7}orders", "orders{}", "a{b}c{d}"])
def test_a_stream_and_its_parked_nacks_share_a_slot(topic: str) -> None:
    from redis.crc import key_slot

    adapter = RedisStreamsAdapter("redis+cluster://127.0.0.1:1", key_prefix="p")
    parked = adapter._delayed_key(topic, "billing")
    assert key_slot(parked.encode()) == key_slot(topic.encode())


@pytest.mark.parametrize(("url", "seeds"), [
    ("redis+cluster://h1:7000/0", [("h1", 7000)]),
    ("redis+cluster://h1:7000,h2:7001,h3/0", [("h1", 7000), ("h2", 7001), ("h3", 6379)]),
    ("rediss+cluster://user:pw@h1:7000,h2:7001/0", [("h1", 7000), ("h2", 7001)]),
])
def test_a_cluster_url_may_name_several_seed_nodes(url: str, seeds: list[tuple[str, int]]) -> None:
    clients = RedisClients(url, owner="the test")
    assert clients.cluster and clients.seeds == seeds
    assert clients.connection_kwargs["host"] == seeds[0][0]


def command_calls(cluster: RedisClusterProcesses, command: str) -> int:
    """How often every node of ``cluster`` has run ``command`` (INFO commandstats)."""
    calls = 0
    for server in cluster.servers:
        node = redis.Redis(host="127.0.0.1", port=server.port)
        try:
            calls += node.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)
        finally:
            node.close()
    return calls


async def test_reads_and_batch_scripts_are_routed_without_asking_a_node_for_their_keys(
    redis_cluster: RedisClusterProcesses,
) -> None:
    """redis-py finds the keys of XREADGROUP with COMMAND GETKEYS, a round trip per read, and
    hashes every key of an EVAL; our cluster client routes both from the first key."""
    name = f"routing-{uuid.uuid4().hex[:8]}"
    adapter = RedisStreamsAdapter(redis_cluster.url, consumer="c", key_prefix=name)
    store = RedisDedupStore(redis_cluster.url, prefix=f"{name}:dedup")
    try:
        await adapter.ensure_subscription(f"{name}-orders", "billing", ack_deadline=5.0)
        for number in range(20):
            await adapter.publish(f"{name}-orders", str(number).encode())
        asked_before = command_calls(redis_cluster, "command|getkeys")
        reads_before = command_calls(redis_cluster, "xreadgroup")
        deliveries = []
        while len(deliveries) < 20:
            deliveries += await adapter.receive("billing", 20, 1.0)
        keys = [DedupKey("billing", d.message.id) for d in deliveries]
        claims = await store.claim_many(keys, 5.0)
        assert len(claims) == 20
        await adapter.ack(deliveries)
        assert command_calls(redis_cluster, "xreadgroup") > reads_before
        assert command_calls(redis_cluster, "command|getkeys") == asked_before
    finally:
        await adapter.close()
        await store.close()
