"""What the adapter suite needs from an adapter (a :class:`Harness`), and harnesses for ours.

Tests speak in units of the harness: ``ack_deadline`` (the subscription's deadline) and ``tick``
(a short delay, well under the deadline). A harness with a ManualClock moves virtual time; a real
broker's harness lets real time pass. The :class:`Features` the test author declares say what
the adapter does; the suite checks them against the adapter's ``capabilities`` (a wrong flag
fails a test instead of silently skipping others).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from reliable_sub import (
    DedupStore,
    LeasePolicy,
    MemoryDedupStore,
    Message,
    Outcome,
    RetryPolicy,
    Subscriber,
)
from reliable_sub.clock import Clock, ManualClock, SystemClock
from reliable_sub.message import Delivery
from reliable_sub.ports import Adapter, Capabilities
from reliable_sub.testing.cleanup import delete_nats_streams, delete_rabbitmq_names
from reliable_sub.testing.timing import drive_until, pass_time, run_driven

T = TypeVar("T")
_names = itertools.count(1)


@dataclass(frozen=True)
class Features:
    """What the adapter under test does, declared by the test author.

    Attributes:
        ordering: messages of one ordering key are delivered in order (on a subscription made
            with ``ordering=True``).
        refuses_stale_acks: an ack or extend of a stale ack id is reported as refused.
        cancel_safe_receive: cancelling a receive call in flight never leaves a message taken.
        subscriber_logic: also run the tests of the Subscriber's own logic (hostile handlers,
            settling under failure, hung handlers...). They take many ack deadlines each; on a
            broker whose shortest deadline is long (Pub/Sub: 10 s) you may leave them to the
            in-memory broker, whose code path they share.
        figures_lag: seconds a subscription's figures may trail what happened (0: a reading
            tells the state now). RabbitMQ's management API publishes a queue's figures every
            few seconds; the figures test waits up to this long for each expected one.
        oldest_age: the figures tell the oldest unacked message's age (RabbitMQ's management
            API does not for quorum queues: then the test checks it is left unknown).
        fan_out: every subscription of a topic gets each of its messages (SQS, a queue per
            topic, has none: then the tests of two subscriptions on one topic skip).
        partition_owned: a delivery given back comes back to the consumer that owns its
            partition, not to a peer (Kafka; see ``Capabilities.partition_owned``).
    """

    ordering: bool = False
    refuses_stale_acks: bool = True
    cancel_safe_receive: bool = False
    subscriber_logic: bool = True
    figures_lag: float = 0.0
    oldest_age: bool = True
    fan_out: bool = True
    partition_owned: bool = False


@dataclass
class Harness:
    """One adapter under test, and how time passes for it."""

    name: str
    clock: Clock
    ack_deadline: float
    tick: float
    new_adapter: Callable[[], Awaitable[Adapter]]
    features: Features = field(default_factory=Features)
    prefix: str = "conf"
    cleanup: Callable[[], Awaitable[None]] | None = None
    adapters: list[Adapter] = field(default_factory=list)
    new_store: Callable[[str], DedupStore] | None = None
    memory_store: MemoryDedupStore | None = None  # whose records the memory stores share
    names: list[str] = field(default_factory=list)  # every name name_for gave
    # the broker's URL, and how to make an adapter for another URL of it (the stall test's
    # TCP proxy in front of it); None: the suite's stall test skips
    url: str | None = None
    new_adapter_for: Callable[[str], Awaitable[Adapter]] | None = None

    @property
    def capabilities(self) -> Capabilities:
        return self.adapters[0].capabilities if self.adapters else Capabilities()

    def needs(self, feature: str) -> None:
        """Skip the calling test unless the adapter was declared to have ``feature``."""
        if not getattr(self.features, feature):
            pytest.skip(f"{self.name} is declared without {feature}")

    def name_for(self, kind: str) -> str:
        name = f"{self.prefix}-{kind}-{next(_names)}"
        self.names.append(name)
        return name

    async def adapter(self) -> Adapter:
        """A connection to the broker (several may coexist, as separate consumers)."""
        adapter = await self.new_adapter()
        self.adapters.append(adapter)
        return adapter

    async def topic_and_subscription(self, **options: Any) -> tuple[str, str]:
        topic, subscription = self.name_for("topic"), self.name_for("sub")
        adapter = self.adapters[0] if self.adapters else await self.adapter()
        await adapter.ensure_subscription(
            topic, subscription, ack_deadline=self.ack_deadline, **options
        )
        return topic, subscription

    def dedup_store(self, owner: str | None = None) -> DedupStore:
        """The dedup store that goes with this broker (Redis's beside Redis streams); stores
        made by one harness share their records."""
        if self.new_store is None:
            if self.memory_store is None:
                self.memory_store = MemoryDedupStore(clock=self.clock)
            store = MemoryDedupStore(clock=self.clock, owner=owner)
            store._records = self.memory_store._records  # one process's memory, many owners
            store._epochs = self.memory_store._epochs
            store._lock = self.memory_store._lock
            return store
        return self.new_store(owner or uuid.uuid4().hex)

    def lease_policy(self, **overrides: Any) -> LeasePolicy:
        values: dict[str, Any] = {"min_extension": self.ack_deadline}
        values.update(overrides)
        return LeasePolicy(**values)

    def retry_policy(self, **overrides: Any) -> RetryPolicy:
        values: dict[str, Any] = {"min_backoff": self.tick, "max_backoff": 4 * self.tick}
        values.update(overrides)
        return RetryPolicy(**values)

    def subscriber(self, adapter: Adapter, **options: Any) -> Subscriber:
        options.setdefault("clock", self.clock)
        options.setdefault("lease", self.lease_policy())
        options.setdefault("retry", self.retry_policy())
        options.setdefault("receive_timeout", self.tick)
        return Subscriber(adapter, **options)

    async def wait_until(self, predicate: Callable[[], bool], within: float, what: str) -> None:
        await drive_until(self.clock, predicate, within, what=what)

    async def wait_real(self, predicate: Callable[[], bool], seconds: float, what: str) -> None:
        """Wait up to ``seconds`` of real time for ``predicate()`` (for what runs on the event
        loop's own clock, such as a stop's deadline), without moving a ManualClock."""
        await drive_until(SystemClock(), predicate, seconds, what=what)

    async def pass_time(self, seconds: float) -> None:
        await pass_time(self.clock, seconds)

    async def call(self, awaitable: Awaitable[T], within: float | None = None) -> T:
        """Await a call that may sleep on the harness clock (a receive with a timeout)."""
        budget = within if within is not None else 10 * self.ack_deadline
        return await run_driven(self.clock, awaitable, budget)

    async def receive(
        self, adapter: Adapter, subscription: str, timeout: float, max_messages: int = 100
    ) -> list[Delivery]:
        # on a real clock the call also waits on round trips (a cluster client's first one in a
        # new loop maps the slots), which a loaded machine stretches well past a tick
        slack = self.tick if isinstance(self.clock, ManualClock) else self.tick + REAL_CALL_SLACK
        return await self.call(
            adapter.receive(subscription, max_messages, timeout), within=timeout + slack
        )

    async def receive_count(
        self, adapter: Adapter, subscription: str, count: int, max_messages: int = 100,
        within: float | None = None,
    ) -> list[Delivery]:
        """Receive (a tick at a time) until ``count`` deliveries came or ``within`` seconds of
        the harness clock passed (default: ten ack deadlines); returns what came. A short
        receive that comes back empty is no loss: on a loaded machine a round trip can take
        longer than a tick, so only the final count says whether something went missing."""
        got: list[Delivery] = []
        give_up_at = self.clock.now() + (10 * self.ack_deadline if within is None else within)
        while len(got) < count and self.clock.now() < give_up_at:
            got += await self.receive(adapter, subscription, timeout=self.tick,
                                      max_messages=max_messages)
        return got

    @asynccontextmanager
    async def serving(self, subscriber: Subscriber) -> AsyncIterator[Subscriber]:
        """Run ``subscriber`` in this loop for the duration of the block, then stop it."""
        task = asyncio.ensure_future(subscriber.serve())
        await drive_until(self.clock, lambda: subscriber.running or task.done(), 1.0,
                          what="subscriber to start")
        if task.done():
            task.result()
        try:
            yield subscriber
        finally:
            await subscriber.shutdown(timeout=0.5)
            await task

    async def close(self) -> None:
        for adapter in self.adapters:
            await adapter.close()
        if self.cleanup is not None:
            await self.cleanup()


def memory_harness() -> Harness:
    from reliable_sub.adapters.memory import MemoryAdapter

    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)

    async def new_adapter() -> Adapter:
        return broker  # one in-process broker; each Subscriber on it is a separate consumer

    return Harness(name="memory", clock=clock, ack_deadline=10.0, tick=1.0,
                   new_adapter=new_adapter,
                   features=Features(ordering=True, cancel_safe_receive=True))


def redis_harness(url: str | None = None, name: str = "redis",
                  ack_deadline: float = 1.0) -> Harness:
    """Real Redis: by default on 127.0.0.1:6379, or at ``url`` (a ``redis+cluster://`` URL for
    a Redis Cluster). Real time: a 1 s ack deadline keeps the suite short."""
    from reliable_sub._redis_clients import RedisClients
    from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
    from reliable_sub.clock import SystemClock
    from reliable_sub.testing.services import redis_url

    url = url or redis_url()
    run = uuid.uuid4().hex[:10]
    consumers = itertools.count(1)

    async def new_adapter_for(at: str) -> Adapter:
        return RedisStreamsAdapter(at, consumer=f"consumer-{next(consumers)}",
                                   key_prefix=f"conf-{run}")

    async def cleanup() -> None:
        clients = RedisClients(url, owner="the suite's cleanup")
        client = clients.get()
        try:
            keys = [key async for key in client.scan_iter(match=f"*conf-{run}*")]
            if keys:
                await client.delete(*keys)
        finally:
            await clients.close()

    def new_store(owner: str) -> DedupStore:
        from reliable_sub.dedup import RedisDedupStore

        return RedisDedupStore(url, prefix=f"conf-{run}:dedup", owner=owner)

    single = not url.startswith("redis+cluster")  # a cluster's nodes name their own addresses
    return Harness(name=name, clock=SystemClock(), ack_deadline=ack_deadline, tick=0.1,
                   new_adapter=lambda: new_adapter_for(url), prefix=f"conf-{run}",
                   cleanup=cleanup, new_store=new_store, url=url if single else None,
                   new_adapter_for=new_adapter_for if single else None)


def fakeredis_harness() -> Harness:
    """fakeredis (with lupa for scripts): the Redis adapter on a laptop without Redis."""
    import fakeredis

    from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
    from reliable_sub.clock import SystemClock

    server = fakeredis.FakeServer()
    consumers = itertools.count(1)

    async def new_adapter() -> Adapter:
        return RedisStreamsAdapter(
            fakeredis.FakeAsyncRedis(server=server),
            consumer=f"consumer-{next(consumers)}",
            sync_client=fakeredis.FakeRedis(server=server),
        )

    def new_store(owner: str) -> DedupStore:
        from reliable_sub.dedup import RedisDedupStore

        return RedisDedupStore(fakeredis.FakeAsyncRedis(server=server), owner=owner,
                               sync_client=fakeredis.FakeRedis(server=server))

    return Harness(name="fakeredis", clock=SystemClock(), ack_deadline=1.0, tick=0.1,
                   new_adapter=new_adapter, new_store=new_store)


def pubsub_harness() -> Harness:
    """The official Pub/Sub emulator (real time; Pub/Sub's shortest ack deadline is 10 s)."""
    from reliable_sub.adapters.pubsub import PubSubAdapter
    from reliable_sub.clock import SystemClock
    from reliable_sub.testing.services import emulator_host

    emulator_host()
    run = uuid.uuid4().hex[:10]

    async def new_adapter() -> Adapter:
        return PubSubAdapter("reliable-sub-tests")

    # Pub/Sub refuses stale acks only on exactly-once subscriptions; the Subscriber-logic tests
    # run on memory and Redis, whose code path is the same, in a fraction of the time.
    features = Features(ordering=True, refuses_stale_acks=False, subscriber_logic=False)
    return Harness(name="pubsub", clock=SystemClock(), ack_deadline=10.0, tick=1.0,
                   new_adapter=new_adapter, prefix=f"conf-{run}", features=features)


def nats_harness(url: str, ack_deadline: float = 1.0) -> Harness:
    """A real NATS server with JetStream at ``url``. Real time: a 1 s ack deadline keeps the
    suite short. Streams, consumers and the settings bucket of the run are deleted afterwards;
    dedup records live in the in-memory store (the stores have their own suite). Publishes carry
    no ``Nats-Msg-Id``: the suite's duplicate copies must reach the consumers, as they do when
    they come outside JetStream's duplicate window."""
    from reliable_sub.adapters.nats_jetstream import NatsJetStreamAdapter

    run = uuid.uuid4().hex[:10]
    prefix = f"conf-{run}"

    async def new_adapter_for(at: str) -> Adapter:
        return NatsJetStreamAdapter(at, prefix=prefix, deduplicate_publishes=False)

    async def cleanup() -> None:
        await delete_nats_streams(url, prefix)

    return Harness(name="nats", clock=SystemClock(), ack_deadline=ack_deadline, tick=0.1,
                   new_adapter=lambda: new_adapter_for(url), prefix=prefix, cleanup=cleanup,
                   url=url, new_adapter_for=new_adapter_for)


def rabbitmq_harness(url: str, ack_deadline: float = 1.0, management_url: str | None = None,
                     figures_lag: float = 10.0) -> Harness:
    """A real RabbitMQ broker at ``url``. Real time, as on NATS; the run's exchanges and queues
    (their names hold the run's prefix) are deleted afterwards. With ``management_url`` its
    adapters read figures from the management API, which trail by up to ``figures_lag``."""
    from reliable_sub.adapters.rabbitmq import RabbitMQAdapter

    prefix = f"conf-{uuid.uuid4().hex[:10]}"

    async def new_adapter_for(at: str) -> Adapter:
        return RabbitMQAdapter(at, prefix=prefix, management_url=management_url)

    async def cleanup() -> None:
        await delete_rabbitmq_names(url, prefix, harness.names)

    features = Features() if management_url is None else Features(figures_lag=figures_lag,
                                                                   oldest_age=False)
    harness = Harness(name="rabbitmq", clock=SystemClock(), ack_deadline=ack_deadline,
                      tick=0.1, new_adapter=lambda: new_adapter_for(url), prefix=prefix,
                      cleanup=cleanup, features=features, url=url,
                      new_adapter_for=new_adapter_for)
    return harness


class Recorder:
    """Collects what handlers saw and how each delivery ended."""

    def __init__(self) -> None:
        self.handled: list[Message] = []
        self.outcomes: list[tuple[str, Outcome]] = []

    def __call__(self, message: Message, outcome: Outcome) -> None:
        self.outcomes.append((message.id, outcome))

    def count(self, outcome: Outcome) -> int:
        return sum(1 for _, o in self.outcomes if o is outcome)


# Seconds of real time a broker call may take beyond its own timeout before a test gives up.
REAL_CALL_SLACK = 2.0


# A stopped Subscriber's last extension runs at most one harness ack deadline (the harness's
# LeasePolicy.min_extension, which the p99 of these short handlers never exceeds); a message it
# left unacked is back within that, and this margin.
DRAIN_MARGIN = 1.2


async def drain(harness: Harness, subscription: str) -> list[Delivery]:
    """Whatever is still deliverable after every deadline has passed (should be nothing)."""
    adapter = harness.adapters[0]
    return await harness.receive(adapter, subscription,
                                 timeout=DRAIN_MARGIN * harness.ack_deadline)


__all__ = [
    "Features",
    "Harness",
    "Recorder",
    "delete_nats_streams",
    "delete_rabbitmq_names",
    "drain",
    "fakeredis_harness",
    "memory_harness",
    "nats_harness",
    "pubsub_harness",
    "rabbitmq_harness",
    "redis_harness",
]
