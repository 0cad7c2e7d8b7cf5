"""A consumer process for tests/test_kafka_transaction_processes.py: ``python
tests/kafka_transaction_consumer.py CFG`` (JSON). One Subscriber on Kafka with transactions on
(``transactional_id``), whose handler publishes ``<input>-out`` in its message's transaction.
Prints ``READY`` once receiving; runs until SIGTERM or SIGKILL.

``hold`` stops the first transaction that produced records just before its commit, after
flushing them to the broker (open, uncommitted records), and prints ``IN-TRANSACTION``:
``"kill"`` then waits for ever (for the test's SIGKILL); ``"zombie"`` waits until the file
``go`` names exists, then commits and prints ``ZOMBIE-COMMIT`` with what the commit did. The
hold is the test's, in this script only: it replaces the producer class the adapter's
transactions module makes (``_kafka_transactions.Producer``) with a subclass.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import confluent_kafka
from child_run import run_announcing_ready  # this script's folder: tests/

from reliable_sub import Message, Subscriber
from reliable_sub.adapters import _kafka_transactions
from reliable_sub.adapters.kafka import KafkaAdapter

cfg: dict[str, Any] = json.loads(sys.argv[1])


class HoldingProducer(confluent_kafka.Producer):
    """The transactional producer, stopped once before a commit (see the module's docstring)."""

    held = False

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.produced = 0

    def produce(self, *args: Any, **kwargs: Any) -> None:
        super().produce(*args, **kwargs)
        self.produced += 1

    def commit_transaction(self, *args: Any) -> None:
        if HoldingProducer.held or not self.produced:
            super().commit_transaction(*args)
            return
        HoldingProducer.held = True
        assert self.flush(30) == 0, "the open transaction's records did not reach the broker"
        print(f"IN-TRANSACTION {self.produced}", flush=True)
        if cfg["hold"] == "kill":
            threading.Event().wait()
        while not os.path.exists(cfg["go"]):
            time.sleep(0.05)
        try:
            super().commit_transaction(*args)
        except confluent_kafka.KafkaException as error:
            print(f"ZOMBIE-COMMIT failed: {error.args[0].str()}", flush=True)
            raise
        print("ZOMBIE-COMMIT committed", flush=True)


def build() -> Subscriber:
    if cfg.get("hold"):
        _kafka_transactions.Producer = HoldingProducer  # type: ignore[misc]
    adapter = KafkaAdapter(cfg["bootstrap"], prefix=cfg["prefix"], client_id=cfg["consumer"],
                           transactional_id=cfg["transactional_id"],
                           # the broker's longest: a restart that waited for a transaction to
                           # time out would run past the test's deadline
                           producer_config={"transaction.timeout.ms": 900_000},
                           consumer_config={"session.timeout.ms": 6000,
                                            "heartbeat.interval.ms": 500,
                                            "max.poll.interval.ms": 6000})
    sub = Subscriber(adapter, receive_timeout=0.2)

    @sub.handler(cfg["subscription"])
    async def enrich(message: Message) -> None:
        await adapter.publish_in_transaction(message, cfg["output"], message.data + b"-out",
                                             ordering_key=message.ordering_key)

    return sub


def main() -> None:
    run_announcing_ready(build())


if __name__ == "__main__":
    main()
