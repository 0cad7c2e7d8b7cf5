"""A consumer process for tests/test_kafka_processes.py: ``python tests/kafka_retry_consumer.py
CFG`` (JSON). One Subscriber on Kafka with a Redis dedup store, whose handler records every run
outside the consumer (``RPUSH {key}:runs:{n} <delivery_attempt>``) and fails the first
``fail_runs`` runs of each message; the run that succeeds records the effect (``HINCRBY
{key}:effects n 1``). Prints ``READY`` once receiving; runs until SIGTERM or SIGKILL."""

from __future__ import annotations

import json
import sys
from typing import Any

import redis.asyncio as aioredis
from child_run import run_announcing_ready  # this script's folder: tests/

from reliable_sub import DeadLetterPolicy, Message, RetryPolicy, Subscriber
from reliable_sub.adapters.kafka import KafkaAdapter
from reliable_sub.dedup import RedisDedupStore

cfg: dict[str, Any] = json.loads(sys.argv[1])


def build() -> Subscriber:
    adapter = KafkaAdapter(cfg["bootstrap"], prefix=cfg["prefix"], client_id=cfg["consumer"],
                           consumer_config={"session.timeout.ms": 6000,
                                            "heartbeat.interval.ms": 500})
    sub = Subscriber(
        adapter, dedup=RedisDedupStore(cfg["redis"], prefix=f"{cfg['key']}:dedup",
                                       owner=cfg["consumer"]),
        retry=RetryPolicy(min_backoff=cfg["backoff"], max_backoff=cfg["backoff"]),
        dead_letter=DeadLetterPolicy(cfg["dead_letter_topic"], max_delivery_attempts=5),
        receive_timeout=0.2)
    clients: list[aioredis.Redis] = []

    @sub.handler(cfg["subscription"])
    async def flaky(message: Message) -> None:
        if not clients:  # made in the Subscriber's event loop
            clients.append(aioredis.Redis.from_url(cfg["redis"]))
        n = json.loads(message.data)["n"]
        runs = await clients[0].rpush(f"{cfg['key']}:runs:{n}", message.delivery_attempt)
        if runs <= cfg["fail_runs"]:
            raise ConnectionError(f"run {runs} of message {n} fails")
        await clients[0].hincrby(f"{cfg['key']}:effects", str(n), 1)

    return sub


def main() -> None:
    run_announcing_ready(build())


if __name__ == "__main__":
    main()
