"""RabbitMQ fault trials: consumers SIGKILLed, a connection closed by the broker -- every
effect exactly once, nothing lost, consumption goes on. (A node killed and restarted under load
is a scenario of the chaos suite: tests/chaos/test_rabbitmq.py.)

* A consumer process SIGKILLed mid-handler, and one SIGKILLed between its dedup completion and
  its ack, on the shared RabbitMQ (127.0.0.1:5672; names unique to each test and removed after)
  with a ``RedisDedupStore`` on the shared Redis. The broker gives back what the dead
  connection held at once; a second consumer (in the test's event loop) handles it as delivery
  attempt 2, or finds it completed. Effects are counted in Redis, outside the consumers.
* The Subscriber's connection closed by ``rabbitmqctl close_connection`` on a private RabbitMQ
  node (its own ports, data and cookie in the test's directory). Effects are counted in the
  test; the Subscriber must take up the work again within seconds.

Nothing sleeps to synchronise: processes are followed through the lines they print and the
ports they open, everything else is polled until a deadline.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import textwrap
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from reliable_sub import LeasePolicy, Message, Outcome, RetryPolicy, Subscriber
from reliable_sub.dedup import Completed, DedupKey
from reliable_sub.testing.services import in_ci, rabbitmq_url, redis_url
from tests.rabbitmq_processes import RabbitNode
from tests.redis_processes import (
    Child,
    poll_until,
)

for _module, _extra in (("aio_pika", "rabbitmq"), ("redis", "redis")):
    if importlib.util.find_spec(_module) is None and not in_ci():
        pytest.skip(f'the RabbitMQ fault trials need pip install "reliable-sub[{_extra}]"',
                    allow_module_level=True)

import aio_pika  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402

from reliable_sub.adapters._rabbitmq_topology import delay_lengths  # noqa: E402
from reliable_sub.adapters.rabbitmq import RabbitMQAdapter  # noqa: E402
from reliable_sub.dedup import RedisDedupStore  # noqa: E402

# The subscriptions' ack deadline. Leases (and so dedup claims) are sized to it: the claim of
# a killed consumer lapses this long after its last renewal.
ACK_DEADLINE = 1.0
LEASE = LeasePolicy(min_extension=0.5, max_extension=ACK_DEADLINE)
# A redelivery that finds its message's claim held (its first delivery's handler still
# completing) is deferred by the first backoff: short, so that it comes back within the test.
RETRY = RetryPolicy(min_backoff=0.5, max_backoff=1.0)
# Bound on every wait for something that should take about one ack deadline, or a reconnect.
WITHIN = 20.0
# The Subscriber's share of a recovery: from the connection closed to the first message
# settled. Its receive retries back off to 2 s.
RECOVERY_BOUND = 10.0
SETTLED = (Outcome.ACKED, Outcome.DUPLICATE)
# Messages published before the fault; the handlers of those from HELD_FROM on wait for the
# fault, so that it lands with them in flight. AFTER more are published once the broker is back.
BEFORE, HELD_FROM, AFTER = 150, 100, 150


# -- consumer processes on the shared broker -----------------------------------------------------

# The consumer that gets killed. argv[1]: its settings as JSON. It prints
#   STARTED <id> <attempt>  when its handler starts (mode "mid-handler": then blocks forever);
#   HANDLED <id> <attempt>  after its handler's effect (mode "after-effect");
#   ACKING <ids>            when the Subscriber acks (mode "after-effect": then blocks forever,
#                           after the dedup completions of the batch were written).
CHILD = textwrap.dedent(
    """
    import asyncio, json, sys, threading

    import redis

    from reliable_sub import LeasePolicy, Subscriber
    from reliable_sub.adapters.rabbitmq import RabbitMQAdapter
    from reliable_sub.dedup import RedisDedupStore

    cfg = json.loads(sys.argv[1])
    effects = redis.Redis.from_url(cfg["redis"])


    class AckNeverReturns(RabbitMQAdapter):
        async def ack(self, deliveries):
            print("ACKING", " ".join(d.message.id for d in deliveries), flush=True)
            await asyncio.Event().wait()  # never set: the kill lands here, before basic.ack


    async def main():
        adapter_type = AckNeverReturns if cfg["mode"] == "after-effect" else RabbitMQAdapter
        adapter = adapter_type(cfg["amqp"], prefix=cfg["prefix"], name=cfg["consumer"])
        store = RedisDedupStore(cfg["redis"], prefix=cfg["dedup_prefix"], owner=cfg["consumer"])
        sub = Subscriber(adapter, dedup=store, receive_timeout=0.5, lease=LeasePolicy(
            min_extension=cfg["min_extension"], max_extension=cfg["max_extension"]))

        @sub.handler(cfg["subscription"])
        def handle(message):
            if cfg["mode"] == "mid-handler":
                print("STARTED", message.id, message.delivery_attempt, flush=True)
                threading.Event().wait()  # never set: the kill lands here
            effects.rpush(cfg["effects"], f"{message.id} {cfg['consumer']}")
            print("HANDLED", message.id, message.delivery_attempt, flush=True)
            return {"effect": message.id}

        await sub.serve()


    asyncio.run(main())
    """
)


@dataclass
class Scene:
    """Names on the shared RabbitMQ and Redis, unique to one test, and the test's own
    connections: an adapter (publisher, and the survivor's), a raw AMQP connection for the
    queue's counts, a Redis client for the effects."""

    amqp_url: str
    redis_url: str
    tmp_path: Path
    prefix: str = field(default_factory=lambda: f"rs-crash-{uuid.uuid4().hex[:12]}")
    children: list[Child] = field(default_factory=list)
    amqp: Any = None

    def __post_init__(self) -> None:
        self.topic = f"{self.prefix}-orders"
        self.subscription = f"{self.prefix}-billing"
        self.effects = f"{self.prefix}:effects"
        self.dedup_prefix = f"{self.prefix}:dedup"
        self.adapter = RabbitMQAdapter(self.amqp_url, prefix=self.prefix,
                                       name=f"{self.prefix}-survivor")
        self.redis = aioredis.Redis.from_url(self.redis_url)
        self._channel: Any = None

    def spawn(self, mode: str, consumer: str) -> Child:
        script = self.tmp_path / "consumer.py"
        script.write_text(CHILD)
        settings = {
            "amqp": self.amqp_url, "redis": self.redis_url, "mode": mode, "consumer": consumer,
            "prefix": self.prefix, "dedup_prefix": self.dedup_prefix,
            "subscription": self.subscription, "effects": self.effects,
            "min_extension": LEASE.min_extension, "max_extension": LEASE.max_extension,
        }
        child = Child(script, json.dumps(settings))
        self.children.append(child)
        return child

    def redis_key(self, message_id: str) -> str:
        key = DedupKey(self.adapter.dedup_namespace(self.subscription), message_id)
        return RedisDedupStore(prefix=self.dedup_prefix).redis_key(key)

    async def effect_list(self) -> list[str]:
        return [_text(item) for item in await self.redis.lrange(self.effects, 0, -1)]

    async def record(self, message_id: str) -> bytes | None:
        """The dedup store's record of ``message_id`` as Redis holds it (None: no record)."""
        value = await self.redis.get(self.redis_key(message_id))
        return value.encode() if isinstance(value, str) else value

    async def queue_counts(self) -> tuple[int, int]:
        """The subscription queue's ready messages and consumers (a passive declare)."""
        if self.amqp is None:
            self.amqp = await aio_pika.connect(self.amqp_url)
        if self._channel is None or self._channel.is_closed:
            self._channel = await self.amqp.channel()
        queue = await self._channel.declare_queue(self.subscription, passive=True)
        result = queue.declaration_result
        return int(result.message_count or 0), int(result.consumer_count or 0)

    async def cleanup(self) -> None:
        for child in self.children:
            child.kill()
        await self.adapter.close()
        connection = self.amqp or await aio_pika.connect(self.amqp_url)
        try:
            channel = await connection.channel()
            for queue in [self.subscription, f"{self.prefix}.settings.{self.subscription}",
                          *(f"{self.prefix}.delay.{self.subscription}.{ms}"
                            for ms in delay_lengths())]:
                await channel.queue_delete(queue)  # a queue that does not exist: fine
            await channel.exchange_delete(self.topic)
        finally:
            await connection.close()
        keys = [key async for key in self.redis.scan_iter(match=f"{self.prefix}*", count=1000)]
        if keys:
            await self.redis.delete(*keys)
        await self.redis.aclose()


@pytest.fixture
async def scene(tmp_path: Path) -> AsyncIterator[Scene]:
    made = Scene(rabbitmq_url(), redis_url(), tmp_path)
    try:
        await made.adapter.ensure_subscription(made.topic, made.subscription,
                                               ack_deadline=ACK_DEADLINE)
        yield made
    finally:
        await made.cleanup()


@dataclass
class Survivor:
    """The second consumer, run in the test's event loop; records what it saw."""

    sub: Subscriber
    calls: list[tuple[str, int]] = field(default_factory=list)
    outcomes: list[tuple[str, int, Outcome]] = field(default_factory=list)


@asynccontextmanager
async def survivor(scene: Scene) -> AsyncIterator[Survivor]:
    """A second consumer of the subscription, serving until the block ends (then stopped)."""
    store = RedisDedupStore(scene.redis_url, prefix=scene.dedup_prefix, owner="survivor")
    outcomes: list[tuple[str, int, Outcome]] = []
    sub = Subscriber(
        scene.adapter, dedup=store, lease=LEASE, receive_timeout=0.5,
        on_outcome=lambda m, o: outcomes.append((m.id, m.delivery_attempt, o)),
    )
    seen = Survivor(sub, outcomes=outcomes)

    @sub.handler(scene.subscription)
    async def handle(message: Message) -> dict[str, str]:
        seen.calls.append((message.id, message.delivery_attempt))
        await scene.redis.rpush(scene.effects, f"{message.id} survivor")
        return {"effect": message.id}

    task = asyncio.create_task(sub.serve(), name="survivor")
    try:
        await poll_until(lambda: sub.running or task.done(), "the survivor to start", WITHIN)
        yield seen
    finally:
        await sub.shutdown(timeout=5)
        await asyncio.wait_for(task, timeout=WITHIN)  # re-raises what serve() failed with
        await store.close()


def killed(child: Child) -> float:
    """SIGKILL ``child``; the time it was reaped."""
    status = child.kill()
    assert status == -signal.SIGKILL, f"child ended with {status}, not by SIGKILL:\n{child.output}"
    return time.monotonic()


async def given_back(scene: Scene, killed_at: float) -> float:
    """Wait until the broker has given the dead consumer's delivery back to the queue (it
    requeues what a connection held when the connection closes); how long after the kill."""
    await poll_until(lambda: _counts_are(scene, (1, 0)), "the delivery back in the queue", WITHIN)
    return time.monotonic() - killed_at


async def _counts_are(scene: Scene, wanted: tuple[int, int]) -> bool:
    return await scene.queue_counts() == wanted


async def nothing_left(scene: Scene) -> None:
    """No message is left in the queue, ready or held: a fresh receive finds nothing (one the
    survivor held would be back in the queue, its connection closed)."""
    leftover = await scene.adapter.receive(scene.subscription, 10, timeout=2 * ACK_DEADLINE)
    assert leftover == [], "nothing left in the queue"
    await scene.adapter.close()


async def test_a_consumer_killed_mid_handler_leaves_its_message_to_a_peer(scene: Scene) -> None:
    child = scene.spawn("mid-handler", consumer="doomed")
    message_id = await scene.adapter.publish(scene.topic, b"order-1")

    started = await child.line("STARTED")
    assert started == f"STARTED {message_id} 1", child.output
    held = await scene.record(message_id)
    assert held is not None and held.startswith(b"p:doomed."), "the child holds the claim"
    assert await scene.queue_counts() == (0, 1), "the child's consumer holds the message"
    requeued_in = await given_back(scene, killed(child))
    assert await scene.effect_list() == [], "the killed handler had no effect"
    # The dead consumer's claim lapses with its last lease. Waiting for it makes the survivor's
    # first delivery the one that runs the handler (attempt 2) instead of deferring it.
    await poll_until(lambda: _is_none(scene.record(message_id)),
                     "the dead consumer's claim to lapse", WITHIN)

    async with survivor(scene) as peer:
        await poll_until(lambda: len(peer.outcomes) >= 1, "the survivor to settle it", WITHIN)
        assert peer.sub.running
    print(f"requeued {requeued_in:.3f}s after the kill")
    assert peer.calls == [(message_id, 2)], "handled once more, as delivery attempt 2"
    assert peer.outcomes == [(message_id, 2, Outcome.ACKED)]
    assert await scene.effect_list() == [f"{message_id} survivor"], "exactly one effect"
    assert (await scene.record(message_id) or b"").startswith(b"c:"), "recorded as completed"
    assert scene.adapter.stats["refused_as_stale"] == 0
    await nothing_left(scene)


async def test_a_consumer_killed_between_completion_and_ack_is_deduplicated(
    scene: Scene,
) -> None:
    child = scene.spawn("after-effect", consumer="doomed")
    message_id = await scene.adapter.publish(scene.topic, b"order-1")

    acking = await child.line("ACKING")
    assert acking == f"ACKING {message_id}", child.output
    assert f"HANDLED {message_id} 1" in child.lines, child.output
    assert await scene.queue_counts() == (0, 1), "the child's consumer holds the message"
    requeued_in = await given_back(scene, killed(child))
    assert await scene.effect_list() == [f"{message_id} doomed"], "the child's effect happened"
    raw_record = await scene.record(message_id)
    assert raw_record is not None and raw_record.startswith(b"c:"), raw_record
    assert json.loads(raw_record[2:]) == {"effect": message_id}, "the result is stored as JSON"
    checker = RedisDedupStore(scene.redis_url, prefix=scene.dedup_prefix, owner="checker")
    try:
        key = DedupKey(scene.adapter.dedup_namespace(scene.subscription), message_id)
        found = await checker.claim(key, 30)
        assert isinstance(found, Completed) and found.result == {"effect": message_id}
    finally:
        await checker.close()

    async with survivor(scene) as peer:
        await poll_until(lambda: len(peer.outcomes) >= 1, "the survivor to settle it", WITHIN)
        assert peer.sub.running
    print(f"requeued {requeued_in:.3f}s after the kill")
    assert peer.outcomes == [(message_id, 2, Outcome.DUPLICATE)]
    assert peer.calls == [], "the handler is not called again"
    assert await scene.effect_list() == [f"{message_id} doomed"], "still exactly one effect"
    assert peer.sub.stats.store_errors == 0
    await nothing_left(scene)


async def test_acks_in_flight_together_settle_each_delivery_once(scene: Scene) -> None:
    """Found by the connection trial below: an ack of tags 5-10 (sent one by one, tags 1-4
    still held) and, while it is being written, an ack of 1-4 and 11-20 (one basic.ack with
    multiple up to 20, as nothing else is held) settled 5-10 twice: the broker closed the
    channel (unknown delivery tag), giving back everything it held."""
    for n in range(20):
        await scene.adapter.publish(scene.topic, f"order-{n}".encode())
    got: list[Any] = []
    while len(got) < 20:
        got += await scene.adapter.receive(scene.subscription, 20, timeout=WITHIN)
    assert await scene.adapter.extend(got, WITHIN) == []  # no lease ends during the test
    by_tag = {int(d.ack_id.partition(".")[2]): d for d in got}
    assert sorted(by_tag) == list(range(1, 21))
    one_by_one = [by_tag[tag] for tag in range(5, 11)]
    with_multiple = [by_tag[tag] for tag in [*range(1, 5), *range(11, 21)]]
    refused = await asyncio.gather(scene.adapter.ack(one_by_one),
                                   scene.adapter.ack(with_multiple))
    assert list(refused) == [[], []]
    # the channel is still open (a basic.qos round trip on it), and nothing comes back
    consumer = scene.adapter._links.get().consumers[scene.subscription]
    await consumer.channel.set_qos(prefetch_count=consumer.prefetch)
    assert consumer.alive, "the broker closed the consumer's channel"
    await nothing_left(scene)


async def _is_none(value: Any) -> bool:
    return (await value) is None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@pytest.fixture
def node(tmp_path: Path) -> Iterator[RabbitNode]:
    made = RabbitNode(tmp_path)
    try:
        made.start()
        yield made
    finally:
        made.kill()


@pytest.fixture
async def dedup_prefix() -> AsyncIterator[str]:
    """A prefix of its own for a RedisDedupStore on the shared Redis; its keys deleted after."""
    url = redis_url()
    prefix = f"rs-restart-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = aioredis.Redis.from_url(url)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@dataclass
class Run:
    """A Subscriber on a private node, its effects counted here, the handlers of the messages
    from HELD_FROM on waiting for ``release``."""

    sub: Subscriber
    adapter: RabbitMQAdapter
    publisher: RabbitMQAdapter
    effects: Counter[str] = field(default_factory=Counter)
    # (time.monotonic(), message id, body, delivery attempt, outcome)
    outcomes: list[tuple[float, str, str, int, Outcome]] = field(default_factory=list)
    waiting: int = 0
    published: list[str] = field(default_factory=list)  # each publish's outcome
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def publish(self, n: int) -> None:
        """Publish ``order-<n>`` (its idempotency key the same), retrying while the broker is
        away: a retried publish that had landed is a second copy, which the store catches."""
        give_up = time.monotonic() + WITHIN
        while True:
            try:
                await self.publisher.publish("orders", f"order-{n}".encode(),
                                             {"idempotency-key": f"order-{n}"})
                self.published.append("published")
                return
            except Exception as error:
                self.published.append(type(error).__name__)
                if time.monotonic() > give_up:
                    raise
                await asyncio.sleep(0.1)

    def settled_after(self, moment: float) -> float:
        """When the first message was settled (acked as done or as a duplicate) after
        ``moment``."""
        return min(t for t, _, _, _, outcome in self.outcomes
                   if t > moment and outcome in SETTLED)

    def all_settled(self) -> bool:
        """Every message published has been handled, and the latest delivery of each settled
        it: none was given back (an ack refused, a deferral) to come again. (Outcomes of one
        message can come out of order: a redelivery's deferral before the first delivery's
        ack was refused.)"""
        return len(self.effects) == BEFORE + AFTER and not self.unsettled()

    def unsettled(self) -> dict[str, tuple[int, Outcome]]:
        latest: dict[str, tuple[int, Outcome]] = {}
        for _, message_id, _, attempt, outcome in self.outcomes:
            if attempt >= latest.get(message_id, (0, outcome))[0]:
                latest[message_id] = (attempt, outcome)
        return {message_id: seen for message_id, seen in latest.items()
                if seen[1] not in SETTLED}


@asynccontextmanager
async def running(node: RabbitNode, dedup_prefix: str) -> AsyncIterator[Run]:
    """A Subscriber on ``node`` with BEFORE messages published, the first HELD_FROM of them
    handled and the rest in their handlers, waiting."""
    publisher = RabbitMQAdapter(node.url, prefix="trial", name="publisher")
    adapter = RabbitMQAdapter(node.url, prefix="trial", name="subscriber")
    await publisher.ensure_subscription("orders", "billing", ack_deadline=ACK_DEADLINE)
    store = RedisDedupStore(redis_url(), prefix=dedup_prefix, owner="subscriber")
    outcomes: list[tuple[float, str, str, int, Outcome]] = []
    sub = Subscriber(adapter, dedup=store, lease=LEASE, retry=RETRY, receive_timeout=0.5,
                     on_outcome=lambda m, o: outcomes.append(
                         (time.monotonic(), m.id, m.data.decode(), m.delivery_attempt, o)))
    run = Run(sub, adapter, publisher, outcomes=outcomes)

    @sub.handler("billing")
    async def charge(message: Message) -> None:
        if int(message.data.decode().split("-")[1]) in range(HELD_FROM, BEFORE):
            run.waiting += 1
            await run.release.wait()
        run.effects[message.data.decode()] += 1

    for n in range(BEFORE):
        await run.publish(n)
    try:
        async with sub:
            await poll_until(lambda: len(run.effects) == HELD_FROM
                             and run.waiting == BEFORE - HELD_FROM,
                             "the first ones handled, the rest in their handlers", WITHIN)
            yield run
            try:
                await poll_until(run.all_settled, "every message handled and settled", WITHIN)
            except AssertionError as error:
                raise AssertionError(f"{error}: {len(run.effects)} handled, unsettled "
                                     f"{run.unsettled()}; {figures(run)}\n"
                                     f"{await where_they_are(node, run)}"
                                     ) from None
            assert sub.running
        leftover = await adapter.receive("billing", 100, timeout=2 * ACK_DEADLINE)
        assert [(d.message.data, d.message.delivery_attempt) for d in leftover] == [], (
            "nothing left in the queue")
    finally:
        run.release.set()
        await adapter.close()
        await publisher.close()
        await store.close()


async def where_they_are(node: RabbitNode, run: Run) -> str:
    """For a failure seen twice in CI and not reproduced: what the broker holds (ready, or
    unacked on which channel), what the subscriber's consumers hold, what publishes returned,
    and the end of the node's own log."""
    queues = await _told(node, "list_queues", "name", "messages_ready",
                         "messages_unacknowledged", "consumers")
    channels = await _told(node, "list_channels", "connection", "number", "consumer_count",
                           "messages_unacknowledged", "prefetch_count")
    # the quorum queue's own state: its counts, and each publishing channel's next expected
    # sequence number (an enqueue out of sequence, or taken for a duplicate, is confirmed to
    # the publisher and dropped: RabbitMQ 3.10's rabbit_fifo)
    fifo = await _told(
        node, "eval", "S = {'%2F_billing', node()}, "
        "{ok, {_, O}, _} = ra:local_query(S, fun rabbit_fifo:overview/1), "
        "{ok, {_, E}, _} = ra:local_query(S, fun(F) -> [M || M <- tuple_to_list(F), "
        "is_map(M), map_size(M) > 0, lists:all(fun erlang:is_pid/1, maps:keys(M))] end), "
        "{maps:with([num_messages, num_ready_messages, num_checked_out, num_consumers, "
        "num_enqueuers], O), E}.")
    consumers = {name: (c.generation, c.alive, c.consumer_tag, len(c.buffer), len(c.held))
                 for name, c in run.adapter._links.get().consumers.items()}
    return (f"queues:\n{queues}channels:\n{channels}the quorum queue's state (counts; "
            f"enqueuers): {fifo}subscriber's consumers (generation, alive, tag, buffered, "
            f"held): {consumers}; publish results: {Counter(run.published)}\nthe node's log "
            f"ends:\n{node.node_log()}")


async def _told(node: RabbitNode, *args: str) -> str:
    """What ``rabbitmqctl ARGS`` printed, or why it failed (the test's own failure comes first)."""
    try:
        return await asyncio.to_thread(node.ctl, *args)
    except Exception as error:
        return f"({error})\n"


def exactly_once(run: Run) -> None:
    """Every message published has had its effect once. Those in their handlers when the
    fault came were completed in the store, their acks refused (or lost with the
    connection): they came back and were caught as duplicates; no other message did but
    those acked just before the fault (an ack is not confirmed in AMQP)."""
    assert run.effects == Counter({f"order-{n}": 1 for n in range(BEFORE + AFTER)}), (
        "every message's effect exactly once")
    duplicates = {data for _, _, data, _, o in run.outcomes if o is Outcome.DUPLICATE}
    held = {f"order-{n}" for n in range(HELD_FROM, BEFORE)}
    assert held <= duplicates, sorted(held - duplicates)
    assert duplicates <= {f"order-{n}" for n in range(BEFORE)}, sorted(duplicates)
    assert run.sub.stats.handler_errors == run.sub.stats.store_errors == 0


def figures(run: Run) -> str:
    outcomes = Counter(o.value for *_, o in run.outcomes)
    counters = {name: count for name, count in run.sub.stats.as_dict().items()
                if count and name.endswith(("errors", "refused", "claims"))}
    return f"outcomes {dict(outcomes)}, counters {counters}"


async def test_a_connection_closed_by_the_broker_loses_nothing_and_resumes(
    node: RabbitNode, dedup_prefix: str,
) -> None:
    async with running(node, dedup_prefix) as run:
        first = await asyncio.to_thread(node.connections)
        # the publishing adapter's two (declares, publishing); the consumer's one
        assert set(first) == {"publisher", "publisher (publishing)", "subscriber"}, first
        errors_before = run.sub.stats.receive_errors
        await asyncio.to_thread(node.ctl, "close_connection", first["subscriber"],
                                "closed by the test")
        closed_at = time.monotonic()
        run.release.set()  # their completions are recorded; their acks are refused as stale
        for n in range(BEFORE, BEFORE + AFTER):
            await run.publish(n)
        await poll_until(lambda: _reconnected(node, first), "the subscriber's new connection",
                         WITHIN)
    recovered_in = run.settled_after(closed_at) - closed_at
    errors = run.sub.stats.receive_errors - errors_before
    print(f"connection closed: first message settled {recovered_in:.2f}s after, {errors} "
          f"failed receive calls; {figures(run)}")
    exactly_once(run)
    assert recovered_in < RECOVERY_BOUND
    assert errors <= 2, "a receive call may fail with the connection, the next one reconnects"


async def _reconnected(node: RabbitNode, before: dict[str, str]) -> bool:
    """Whether the subscriber has a new connection (the publisher keeps its own)."""
    now = await asyncio.to_thread(node.connections)
    if now.get("subscriber", before["subscriber"]) == before["subscriber"]:
        return False
    for name in ("publisher", "publisher (publishing)"):
        assert now[name] == before[name], "the publisher's connections were not touched"
    return True
