"""The fault-injection scenarios' parts: a world (broker, effects), a fleet of consumer
processes, the load, and the final count.

* :class:`World`: one scenario's topic and subscription on Redis Streams, the Pub/Sub
  emulator or RabbitMQ (``rabbitmq_world``), its dedup mode, and where the handler's effects
  are recorded (a Redis hash, or a PostgreSQL table for the transactional path);
  :meth:`World.effects` reads them back.
* :class:`Fleet`: consumer processes (``tests/chaos/consumer.py``) started, SIGKILLed, SIGTERMed
  and restarted by number; when each was killed or asked to stop, and the health samples each
  printed.
* :func:`publish_steadily`: the load, ``n`` = 0, 1, ... as JSON payloads, at a steady rate.
* :class:`Count`: messages, lost (published, no effect), duplicate effects (effects beyond one
  per message).

Every wait is polling with a deadline; nothing sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
import sqlalchemy as sa

from reliable_sub.message import IDEMPOTENCY_KEY_ATTRIBUTE
from reliable_sub.ports import Adapter, BatchPublisher, Outgoing
from reliable_sub.testing.services import emulator_host, postgres_url, rabbitmq_url, redis_url
from tests.redis_processes import EXIT_TIMEOUT, Child

if TYPE_CHECKING:
    from tests.chaos.rabbitmq_world import RabbitQueues

CONSUMER = Path(__file__).resolve().parent / "consumer.py"
PUBSUB_PROJECT = "reliable-sub-chaos"
# Redis Streams' ack deadline in the scenarios: a killed consumer's entries are reclaimable this
# long after its last extension. Pub/Sub's shortest is 10 s.
REDIS_ACK_DEADLINE = 2.0
PUBSUB_ACK_DEADLINE = 10.0
# RabbitMQ's (kept by the adapter; the broker gives a dead consumer's deliveries back at once):
# as on Redis, what a killed consumer's dedup claims outlive it by.
RABBITMQ_ACK_DEADLINE = 2.0
# Kafka: the ack deadline the adapter keeps (a killed consumer's partitions move after its
# session times out, KAFKA_SESSION_MS), over 12 partitions.
KAFKA_ACK_DEADLINE = 2.0
KAFKA_PARTITIONS = 12
KAFKA_SESSION_MS = 6000  # the broker's group.min.session.timeout.ms
ACK_DEADLINES = {"redis": REDIS_ACK_DEADLINE, "pubsub": PUBSUB_ACK_DEADLINE,
                 "rabbitmq": RABBITMQ_ACK_DEADLINE, "kafka": KAFKA_ACK_DEADLINE}
# How often the load is published, in batches.
PUBLISH_TICK = 0.05
# A consumer process starts in 1-3 s; six starting at once (two worlds side by side) beside other
# work took more than 15 s.
READY_TIMEOUT = 60.0


@dataclass
class Count:
    """The final count of one scenario."""

    messages: int
    lost: int
    duplicate_effects: int
    effects: int

    @classmethod
    def of(cls, messages: int, effects: dict[int, int]) -> Count:
        lost = sum(1 for n in range(messages) if effects.get(n, 0) == 0)
        duplicates = sum(count - 1 for count in effects.values() if count > 1)
        return cls(messages, lost, duplicates, sum(effects.values()))


@dataclass
class World:
    """One scenario's broker objects and effect store (see the module's docstring)."""

    adapter_kind: str  # "redis", "pubsub", "rabbitmq" or "kafka"
    dedup: str  # "sql", "redis" or "none"
    name: str = field(default_factory=lambda: f"chaos-{uuid.uuid4().hex[:10]}")
    # Redis Streams: the broker's Redis; RabbitMQ: its node (default: the shared ones); Kafka:
    # the bootstrap servers
    broker_url: str = ""
    consumer_url: str = ""  # where the consumers connect, if not to broker_url (a TCP proxy)
    messages: int = 0  # the load: how many, published evenly over load_seconds
    load_seconds: float = 0.0
    dedup_on_broker: bool = False  # the Redis dedup store on the broker's Redis (one server)

    def __post_init__(self) -> None:
        self.effects_url = redis_url()
        if self.adapter_kind == "redis" and not self.broker_url:
            self.broker_url = self.effects_url
        self.rabbit: RabbitQueues | None = None
        if self.adapter_kind == "rabbitmq":
            from tests.chaos.rabbitmq_world import RabbitQueues

            self.broker_url = self.broker_url or rabbitmq_url()
            self.rabbit = RabbitQueues(self.broker_url, self.name, f"{self.name}-orders",
                                       f"{self.name}-shipping")
        if self.adapter_kind == "pubsub":
            emulator_host()  # started on first use; its address is in the environment
        self.topic = f"{self.name}-orders"
        self.subscription = f"{self.name}-shipping"
        self.effects_key = f"{self.name}:effects"
        suffix = self.name.replace("-", "_")
        self.effects_table = f"{suffix}_effects"
        self.processed_table = f"{suffix}_processed"
        self.postgres = postgres_url() if self.dedup == "sql" else ""
        self.ack_deadline = ACK_DEADLINES[self.adapter_kind]
        self._engine: Any = None
        self._effects_client: aioredis.Redis | None = None

    def adapter(self) -> Adapter:
        """A new adapter on the scenario's broker (the test's own: to publish and inspect)."""
        if self.adapter_kind == "redis":
            from reliable_sub.adapters.redis_streams import RedisStreamsAdapter

            return RedisStreamsAdapter(self.broker_url, consumer="chaos-test",
                                       key_prefix=self.name)
        if self.adapter_kind == "kafka":
            from reliable_sub.adapters.kafka import KafkaAdapter

            return KafkaAdapter(self.broker_url, prefix=self.name, partitions=KAFKA_PARTITIONS)
        if self.adapter_kind == "rabbitmq":
            from reliable_sub.adapters.rabbitmq import RabbitMQAdapter

            return RabbitMQAdapter(self.broker_url, prefix=self.name, name="chaos-test")
        from reliable_sub.adapters.pubsub import PubSubAdapter

        return PubSubAdapter(PUBSUB_PROJECT)

    async def set_up_broker(self, adapter: Adapter) -> None:
        """The topic and subscription."""
        await adapter.ensure_subscription(self.topic, self.subscription,
                                          ack_deadline=self.ack_deadline)

    async def set_up(self, adapter: Adapter) -> None:
        await self.set_up_broker(adapter)
        self._effects_client = aioredis.Redis.from_url(self.effects_url)
        if self.dedup == "sql":
            from reliable_sub.dedup import SqlDedupStore

            store = SqlDedupStore(self.postgres, table=self.processed_table)
            await store.create_schema()
            await store.close()
            self._engine = sa.create_engine(self.postgres.replace("postgresql://",
                                                                  "postgresql+psycopg://"))
            with self._engine.begin() as connection:
                connection.execute(sa.text(
                    f"CREATE TABLE {self.effects_table} (n integer NOT NULL, "
                    f"consumer varchar(100) NOT NULL)"))

    async def effects(self) -> dict[int, int]:
        """Effects recorded per payload number."""
        if self.dedup == "sql":
            with self._engine.connect() as connection:
                rows = connection.execute(sa.text(
                    f"SELECT n, count(*) FROM {self.effects_table} GROUP BY n")).all()
            return {int(n): int(count) for n, count in rows}
        assert self._effects_client is not None
        found = await self._effects_client.hgetall(self.effects_key)
        return {int(n): int(count) for n, count in found.items()}

    async def logged(self, log: str) -> list[str]:
        """The lines of consumer.py's ``log`` (the effect log) or ``calls`` list."""
        assert self._effects_client is not None
        return [line.decode() for line in
                await self._effects_client.lrange(f"{self.effects_key}:{log}", 0, -1)]

    def terminate_database_connections(self) -> int:
        """``pg_terminate_backend`` every connection of this scenario's consumers; how many."""
        with self._engine.connect() as connection:
            return len(connection.execute(sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = :name AND pid <> pg_backend_pid()"),
                {"name": self.name}).all())

    async def redis_backlog(self) -> int:
        """Redis Streams: entries of the group not yet acked or not yet delivered."""
        client = aioredis.Redis.from_url(self.broker_url)
        try:
            pending = (await client.xpending(self.topic, self.subscription))["pending"]
            groups = await client.xinfo_groups(self.topic)
            lag = sum(int(g.get("lag") or 0) for g in groups
                      if g["name"].decode() == self.subscription)
            return int(pending) + lag
        finally:
            await client.aclose()

    async def kafka_backlog(self, adapter: Adapter) -> int:
        """Kafka: records of the group not yet committed as settled (its exact backlog)."""
        from reliable_sub.ports import Inspectable

        assert isinstance(adapter, Inspectable)
        return (await adapter.subscription_stats(self.subscription)).backlog or 0

    async def tear_down(self) -> None:
        if self.adapter_kind == "kafka":
            from reliable_sub.testing.cleanup import delete_kafka_names

            await delete_kafka_names(self.broker_url, [
                self.topic, self.subscription, f"{self.name}-subscriptions"])
        if self.rabbit is not None:
            await self.rabbit.delete()
        if self._effects_client is not None:
            await self._effects_client.delete(self.effects_key)
            keys = [key async for key in self._effects_client.scan_iter(f"{self.name}*")]
            if keys:
                await self._effects_client.delete(*keys)
            await self._effects_client.aclose()
        if self._engine is not None:
            with self._engine.begin() as connection:
                connection.execute(sa.text(f"DROP TABLE IF EXISTS {self.effects_table}"))
                connection.execute(sa.text(f"DROP TABLE IF EXISTS {self.processed_table}"))
            self._engine.dispose()

    def consumer_config(self, consumer: str, *, seed: int, handler_ms: tuple[float, float],
                        max_messages: int, stop_timeout: float, sabotage: str | None = None,
                        **more: Any) -> dict[str, Any]:
        """The consumer process's settings (``more``: the options consumer.py documents, such
        as ``health_every`` or ``fail_first``)."""
        return {
            "adapter": self.adapter_kind, "broker_url": self.broker_url,
            "consumer_url": self.consumer_url,
            "prefix": self.name, "project": PUBSUB_PROJECT, "consumer": consumer,
            "subscription": self.subscription, "dedup": self.dedup,
            "effects_url": self.effects_url, "effects_key": self.effects_key,
            "dedup_url": self.broker_url if self.dedup_on_broker else self.effects_url,
            "dedup_prefix": f"{self.name}:dedup",
            # named, so a scenario can terminate exactly these consumers' connections
            "postgres": f"{self.postgres}?application_name={self.name}" if self.postgres else "",
            "effects_table": self.effects_table, "processed_table": self.processed_table,
            "handler_ms": list(handler_ms), "seed": seed, "max_messages": max_messages,
            "min_extension": min(1.0, self.ack_deadline / 2),
            "max_extension": self.ack_deadline, "stop_timeout": stop_timeout,
            "kafka_session_ms": KAFKA_SESSION_MS,
            "sabotage": sabotage, **more,
        }


class Fleet:
    """Consumer processes, numbered 0..size-1, each restartable."""

    def __init__(self, world: World, size: int, **options: Any) -> None:
        self.world = world
        self.size = size
        self.options = options
        self.children: list[Child | None] = [None] * size
        self.ready: set[int] = set()  # the numbers whose current process printed READY
        self.outcomes: list[dict[str, int]] = []  # each gracefully stopped process's outcomes
        self.starts = 0
        self.kills = 0
        self.kills_landed = 0
        self.terms = 0
        self.names: list[str] = [""] * size  # the consumer name of each number's process
        self.started: list[tuple[str, Child]] = []  # every process, by consumer name
        self.killed_at: dict[str, float] = {}  # consumer name -> time.monotonic() of SIGKILL
        self.stopping_at: dict[str, float] = {}  # ... of SIGTERM
        self.settle_rounds = 0  # restarts of the fleet to handle what was left (RabbitMQ)

    def spawn(self, number: int) -> None:
        """Start consumer ``number`` without waiting for it (as a supervisor restarts a crashed
        process)."""
        self.starts += 1
        name = f"consumer-{number}-{self.starts}"
        config = self.world.consumer_config(name, seed=self.starts, **self.options)
        self.children[number] = child = Child(CONSUMER, json.dumps(config))
        self.names[number] = name
        self.started.append((name, child))
        self.ready.discard(number)

    async def wait_ready(self, number: int) -> None:
        """Wait until consumer ``number`` receives."""
        child = self.children[number]
        assert child is not None
        if number not in self.ready:
            await child.line("READY", timeout=READY_TIMEOUT)
            self.ready.add(number)

    async def start(self, number: int) -> None:
        """Start consumer ``number`` and wait until it receives."""
        self.spawn(number)
        await self.wait_ready(number)

    async def start_all(self) -> None:
        await asyncio.gather(*(self.start(number) for number in range(self.size)))

    def kill(self, number: int) -> None:
        """SIGKILL consumer ``number``: a crash, mid-work."""
        child = self.children[number]
        assert child is not None
        self.killed_at.setdefault(self.names[number], time.monotonic())
        if child.kill() == -signal.SIGKILL:
            self.kills_landed += 1  # it was running, not already gone
        self.kills += 1
        self.children[number] = None
        self.ready.discard(number)

    async def kill_and_respawn_one(self, rng: random.Random) -> None:
        """SIGKILL a consumer drawn by ``rng`` and start it again at once (the storm does not
        wait for it to be ready)."""
        victim = rng.randrange(self.size)
        self.kill(victim)
        self.spawn(victim)

    async def terminate(self, number: int, within: float) -> str:
        """SIGTERM consumer ``number`` (a graceful stop, once it runs) and wait for it to exit;
        its STATS."""
        await self.wait_ready(number)
        child = self.children[number]
        assert child is not None
        self.stopping_at[self.names[number]] = time.monotonic()
        child.process.send_signal(signal.SIGTERM)
        stats = await child.line("STATS", timeout=within)
        self.outcomes.append(json.loads(stats.split(" ", 1)[1]))
        await asyncio.to_thread(child.process.wait, EXIT_TIMEOUT)
        self.terms += 1
        self.children[number] = None
        self.ready.discard(number)
        return stats

    async def terminate_all(self, within: float) -> None:
        await asyncio.gather(*(self.terminate(number, within)
                               for number, child in enumerate(self.children)
                               if child is not None))

    def kill_all(self) -> None:
        for number, child in enumerate(self.children):
            if child is not None:
                self.kill(number)

    def outcome_total(self, outcome: str) -> int:
        """How many deliveries ended in ``outcome`` in the processes stopped gracefully."""
        return sum(stats.get(outcome, 0) for stats in self.outcomes)

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the running consumer processes have used so far."""
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for child in self.children:
            if child is None:
                continue
            fields = Path(f"/proc/{child.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        return total

    def output(self) -> str:
        """The end of what the running consumers printed (health samples left out)."""
        return "\n".join(
            "\n".join(line for line in child.output.splitlines()
                      if not line.startswith("HEALTH "))[-3000:]
            for child in self.children if child is not None)

    def health_samples(self) -> dict[str, list[tuple[float, bool, str]]]:
        """Every process's health samples (``health_every``), by consumer name: (time, healthy,
        first problem), up to when it was killed or asked to stop."""
        samples: dict[str, list[tuple[float, bool, str]]] = {}
        for name, child in self.started:
            end = min(self.killed_at.get(name, math.inf), self.stopping_at.get(name, math.inf))
            mine = samples[name] = []
            for line in child.output.splitlines():
                if line.startswith("HEALTH "):
                    _, at, healthy, *problem = line.split(" ", 3)
                    if float(at) < end:
                        mine.append((float(at), healthy == "1", " ".join(problem)))
        return samples


class Load:
    """How far the load has got, and a gate that holds it (while a broker is away)."""

    def __init__(self) -> None:
        self.sent = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.idle = asyncio.Event()  # no batch is being published
        self.idle.set()
        self.held_at: int | None = None  # messages published when it was last held

    async def hold(self) -> None:
        """Close the gate and wait for the batch in flight (``held_at`` then says how many
        messages were published)."""
        self.gate.clear()
        await self.idle.wait()
        self.held_at = self.sent

    def release(self) -> None:
        self.gate.set()


async def publish_steadily(adapter: Adapter, topic: str, messages: int, seconds: float,
                           load: Load | None = None) -> float:
    """Publish payloads ``{"n": 0..messages-1}`` evenly over ``seconds`` (waiting while
    ``load.gate`` is closed); when it finished."""
    load = load or Load()
    started = time.monotonic()
    sent = 0
    while sent < messages:
        if not load.gate.is_set():
            held = time.monotonic()
            await load.gate.wait()
            started += time.monotonic() - held  # the rate resumes where it stopped
        due = min(messages, int(messages * (time.monotonic() - started) / seconds) + 1)
        # Each message carries its own idempotency key: the emulator numbers message ids from
        # 1 again after a restart, and a key falling back to the message id would then match
        # records of earlier messages (see docs/reliability.md).
        batch = [Outgoing(topic, json.dumps({"n": n}).encode(),
                          {IDEMPOTENCY_KEY_ATTRIBUTE: f"{topic}:{n}"})
                 for n in range(sent, due)]
        if batch:
            load.idle.clear()
            if isinstance(adapter, BatchPublisher):
                results = await adapter.publish_many(batch)
                failed = [r for r in results if isinstance(r, Exception)]
                if failed:
                    raise failed[0]
            else:
                await asyncio.gather(*(adapter.publish(m.topic, m.data, m.attributes)
                                       for m in batch))
            sent = load.sent = due
            load.idle.set()
        await asyncio.sleep(PUBLISH_TICK)
    return time.monotonic()


__all__ = ["Count", "Fleet", "Load", "World", "publish_steadily"]
