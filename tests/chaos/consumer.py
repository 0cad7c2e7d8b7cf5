"""A consumer process for the fault-injection scenarios: ``python tests/chaos/consumer.py CFG``.

``CFG`` is JSON (see :class:`tests.chaos.fleet.Fleet`). The process runs one Subscriber on Redis
Streams, Pub/Sub, RabbitMQ or Kafka until SIGTERM (graceful) or SIGKILL. Its handler waits a
random time in ``handler_ms`` and then records its **effect outside the consumer**, keyed by the
message's payload number ``n``:

* dedup ``sql``: a transactional handler inserts a row ``(n, consumer)`` into the effects table
  in the transaction that records the message as processed (exactly once);
* dedup ``redis`` or ``none``: ``HINCRBY effects n 1`` on Redis (at least once: the effect and
  the completion are two writes, so a kill between them repeats the effect).

With ``log: true`` (the RabbitMQ scenarios) each effect is written together with a line
``n consumer time attempt`` in a Redis list (one MULTI/EXEC: a kill leaves both or neither), so a
doubled effect can be traced to the kill that caused it; and each handler call (``n attempt
consumer time``) goes to another list. ``fail_first: k`` makes the handler fail its first ``k``
delivery attempts of every message (they are nacked with the retry backoff, ``backoff``).
``health_every: s`` prints ``HEALTH <time.monotonic()> <1|0> <first problem>`` every ``s``
seconds while the Subscriber runs (``unhealthy_after`` as configured).

``sabotage: "ack-on-receive"`` acks every delivery as it arrives, before its handler ran (an
at-most-once consumer): the scenarios must then report lost messages, which shows that their
assertions can fail. ``sabotage: "no-extend"`` makes every ack-deadline extension a silent
no-op: the lease manager is effectively off.

It prints ``READY <consumer>`` once receiving, and ``STATS <json>`` after a graceful stop.
Nothing of the test suite is imported: only the installed package and its clients.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time
from typing import Any

import redis.asyncio as aioredis

from reliable_sub import (
    DeadLetterPolicy,
    FlowControl,
    LeasePolicy,
    Message,
    RetryPolicy,
    Subscriber,
)
from reliable_sub.ports import Adapter

cfg: dict[str, Any] = json.loads(sys.argv[1])
rng = random.Random(cfg["seed"])


def make_adapter() -> Adapter:
    base: type
    args: tuple[Any, ...]
    options: dict[str, Any]
    if cfg["adapter"] == "redis":
        from reliable_sub.adapters.redis_streams import RedisStreamsAdapter

        base, args = RedisStreamsAdapter, (cfg["broker_url"],)
        options = {"consumer": cfg["consumer"], "key_prefix": cfg["prefix"]}
    elif cfg["adapter"] == "kafka":
        from reliable_sub.adapters.kafka import KafkaAdapter

        base, args = KafkaAdapter, (cfg["broker_url"],)
        options = {"prefix": cfg["prefix"], "client_id": cfg["consumer"],
                   "consumer_config": {"session.timeout.ms": cfg["kafka_session_ms"],
                                       "heartbeat.interval.ms": 500}}
    else:
        from reliable_sub.adapters.pubsub import PubSubAdapter

        base, args, options = PubSubAdapter, (cfg["project"],), {}
    if cfg["adapter"] == "rabbitmq":
        from reliable_sub.adapters.rabbitmq import RabbitMQAdapter

        base, args = RabbitMQAdapter, (cfg["consumer_url"] or cfg["broker_url"],)
        options = {"prefix": cfg["prefix"], "name": cfg["consumer"]}
    sabotage = cfg.get("sabotage")
    if sabotage == "ack-on-receive":

        class AckOnReceive(base):  # type: ignore[misc,valid-type]
            async def receive(self, subscription: str, max_messages: int,
                              timeout: float) -> Any:
                deliveries = await super().receive(subscription, max_messages, timeout)
                if deliveries:
                    await super().ack(deliveries)
                return deliveries

        return AckOnReceive(*args, **options)  # type: ignore[no-any-return]
    if sabotage == "no-extend":

        class NeverExtends(base):  # type: ignore[misc,valid-type]
            async def extend(self, deliveries: Any, seconds: float) -> list[Any]:
                return []  # claims success: the lease manager is effectively off

        return NeverExtends(*args, **options)  # type: ignore[no-any-return]
    return base(*args, **options)  # type: ignore[no-any-return]


# Each pool of a consumer process: at most this many PostgreSQL connections (5).
POOL_BUDGET = {"pool_size": 2, "max_overflow": 3}


def make_store() -> Any:
    if cfg["dedup"] == "redis":
        from reliable_sub.dedup import RedisDedupStore

        return RedisDedupStore(cfg["dedup_url"], prefix=cfg["dedup_prefix"],
                               owner=cfg["consumer"])
    if cfg["dedup"] == "sql":
        from reliable_sub.dedup import SqlDedupStore

        # a connection budget: three of these processes (two pools each) and the rest of a
        # suite beside them, twice when two suites run side by side, under PostgreSQL's 100
        return SqlDedupStore(cfg["postgres"], table=cfg["processed_table"],
                             owner=cfg["consumer"], engine_options=POOL_BUDGET)
    return None


async def handler_pause() -> None:
    low, high = cfg["handler_ms"]
    await asyncio.sleep(rng.uniform(low, high) / 1000)


def payload_number(message: Message) -> int:
    return int(json.loads(message.data)["n"])


class HandlerFailure(Exception):
    """What the handler raises on the attempts ``fail_first`` makes it fail."""


async def record_effect(client: aioredis.Redis, message: Message) -> None:
    """The handler's effect: ``HINCRBY effects n 1``; with ``log``, in one transaction with its
    line in the effect log."""
    n = str(payload_number(message))
    if not cfg.get("log"):
        await client.hincrby(cfg["effects_key"], n, 1)
        return
    line = f"{n} {cfg['consumer']} {time.monotonic():.4f} {message.delivery_attempt}"
    async with client.pipeline(transaction=True) as both:
        both.hincrby(cfg["effects_key"], n, 1)
        both.rpush(f"{cfg['effects_key']}:log", line)
        await both.execute()


async def record_call(client: aioredis.Redis, message: Message) -> None:
    line = (f"{payload_number(message)} {message.delivery_attempt} {cfg['consumer']} "
            f"{time.monotonic():.4f}")
    await client.rpush(f"{cfg['effects_key']}:calls", line)


def build() -> Subscriber:
    store = make_store()
    dead_letter = (DeadLetterPolicy(cfg["dead_letter_topic"], max_delivery_attempts=5)
                   if cfg.get("dead_letter_topic") else None)
    min_backoff, max_backoff = cfg.get("backoff") or (0.1, 1.0)
    health = {"unhealthy_after": cfg["unhealthy_after"]} if cfg.get("unhealthy_after") else {}
    sub = Subscriber(
        make_adapter(), dedup=store, dead_letter=dead_letter,
        lease=LeasePolicy(min_extension=cfg["min_extension"],
                          max_extension=cfg["max_extension"]),
        retry=RetryPolicy(min_backoff=min_backoff, max_backoff=max_backoff),
        flow_control=FlowControl(max_messages=cfg["max_messages"]),
        stop_timeout=cfg["stop_timeout"], receive_timeout=1.0, **health,
    )
    if cfg["dedup"] == "sql":
        import sqlalchemy as sa  # only here: a third of a CPU-second of each process's start

        effects = sa.Table(cfg["effects_table"], sa.MetaData(),
                           sa.Column("n", sa.Integer), sa.Column("consumer", sa.String(100)))

        @sub.handler(cfg["subscription"], transactional=True)
        async def transactional_effect(message: Message, connection: Any) -> None:
            await handler_pause()
            await connection.execute(sa.insert(effects).values(
                n=payload_number(message), consumer=cfg["consumer"]))
    else:
        clients: list[aioredis.Redis] = []

        @sub.handler(cfg["subscription"])
        async def counted_effect(message: Message) -> None:
            if not clients:  # made in the Subscriber's event loop
                clients.append(aioredis.Redis.from_url(cfg["effects_url"]))
            if cfg.get("log"):
                await record_call(clients[0], message)
            await handler_pause()
            if message.delivery_attempt <= cfg.get("fail_first", 0):
                raise HandlerFailure(f"attempt {message.delivery_attempt} fails by design")
            await record_effect(clients[0], message)
    return sub


def announce_when_running(sub: Subscriber) -> None:
    """Print READY once the Subscriber runs; then, with ``health_every``, its health samples
    (polled: this thread is the probe, as a readiness endpoint's would be)."""
    give_up = time.monotonic() + 60
    while not sub.running:
        if time.monotonic() > give_up:
            print("NOT STARTED", flush=True)
            return
        time.sleep(0.01)
    print("READY", cfg["consumer"], flush=True)
    every = cfg.get("health_every")
    while every and sub.running:
        problems = sub.problems()
        first = problems[0].replace("\n", " ")[:200] if problems else ""
        print(f"HEALTH {time.monotonic():.4f} {0 if problems else 1} {first}", flush=True)
        time.sleep(every)  # the sampling period, not a synchronisation


def main() -> None:
    sub = build()
    threading.Thread(target=announce_when_running, args=(sub,), daemon=True).start()
    sub.run()  # until SIGTERM (graceful) or SIGKILL
    outcomes = {outcome.value: count for outcome, count in sub.stats.outcomes.items()}
    print("STATS", json.dumps(outcomes), flush=True)


if __name__ == "__main__":
    main()
