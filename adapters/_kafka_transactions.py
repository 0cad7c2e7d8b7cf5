"""Kafka transactions on the Kafka adapter: a handler's output records and the consumed offsets
commit together, or not at all (opt-in: ``KafkaAdapter(transactional_id=...)``).

For handlers whose only effect is producing to Kafka. The handler's
``publish_in_transaction(message, ...)`` keeps its records with the delivery: nothing is sent
while it runs. When the delivery is acked, its records join the consumer's *batch*; given back,
or its lease over, they are dropped (the next attempt makes its own). Each commit of the
consumer (every ``commit_interval``, at a revocation, at the close) is then one transaction on
the consumer's poll thread: the batch's records are produced, the partitions' offsets and
metadata (:mod:`._kafka_offsets`) are sent to the transaction with the group's metadata
(``send_offsets_to_transaction``, KIP-447), and the transaction commits. A ``read_committed``
reader sees a record's output exactly when its offset is committed as settled, so a crash at any
point leaves either both or neither: the record runs again and its output appears once.

Fencing. The transactional id (``{transactional_id}.{subscription}``) fences an older producer
with the same id when the new one starts (its open transaction is aborted at once, and it can
commit nothing more), and the group's generation, sent with the offsets, fences a member the
group has moved on from, whatever its id. A stable id per process (a pod's name) makes a
restart abort what its predecessor left open; a new id leaves that transaction open until the
broker's ``transaction.timeout.ms`` and holds back ``read_committed`` readers of those
partitions until then.

Failures. An abortable error (a broker failing over, a partition moved) aborts the
transaction; the batch and the offsets are tried again with the next commit, while the
partitions are still this consumer's. A fatal one (fenced) ends the consumer, and its records
run again at their next owner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from reliable_sub.adapters._kafka_messages import Headers
from reliable_sub.message import Message

if TYPE_CHECKING:
    from reliable_sub.adapters._kafka_assignment import Assignment
from reliable_sub.errors import AdapterError, InvalidMessageError

logger = logging.getLogger("reliable_sub.adapters.kafka")

# Seconds one transactional call (init, send offsets, commit, abort) may take.
TRANSACTION_TIMEOUT = 30.0
# Seconds between tries while the producer's local queue is full.
QUEUE_FULL_WAIT = 0.01


@dataclass(frozen=True)
class Output:
    """One record a handler produces in the transaction of its message's offset."""

    topic: str
    value: bytes
    key: bytes | None
    headers: Headers


def output_of(topic: str, value: bytes, key: bytes | None, headers: Headers,
              producer_config: dict[str, Any]) -> Output:
    """The record to produce in a transaction; one the producer would refuse for its size is
    refused now (it would fail the whole transaction, every time it was tried)."""
    size = len(value) + len(key or b"") + sum(len(name) + len(v or b"") for name, v in headers)
    limit = int(producer_config.get("message.max.bytes", 1_000_000))
    if size > limit:
        raise InvalidMessageError(
            f"a record of {size} bytes for {topic!r} is over the producer's message.max.bytes "
            f"({limit}); it would fail the whole transaction")
    return Output(topic, value, key, headers)


def hold(consumers: Sequence[Assignment], message: Message, output: Output) -> None:
    """Keep ``output`` with ``message``'s delivery at the consumer holding it.

    Raises:
        StaleDeliveryError: no consumer of this adapter holds the delivery now.
    """
    _, partition, offset = message.id.rsplit("/", 2)
    for consumer in consumers:
        if consumer.hold_output(int(partition), int(offset), message.delivery_attempt, output):
            return
    raise StaleDeliveryError(
        f"message {message.id} (delivery {message.delivery_attempt}) is not held by this "
        "adapter any more (its lease ended, or its partition went to another member): its "
        "output is dropped and it runs again")


class StaleDeliveryError(AdapterError):
    """The delivery a transactional output was for is no longer held (its lease ended, it was
    given back, or its partition went to another member): the output is dropped, and the record
    runs again."""


class TransactionAborted(Exception):
    """A transaction was aborted on an abortable error: try its batch again."""


class Fenced(Exception):
    """The transactional producer can do nothing more (fenced, or another fatal error)."""


def transactional_config(producer_config: dict[str, Any], transactional_id: str
                         ) -> dict[str, Any]:
    """The transactional producer's configuration: the adapter's producer's, with the id, and
    a transaction timeout no shorter than the message timeout (librdkafka requires it)."""
    config = {**producer_config, "transactional.id": transactional_id}
    config.setdefault("transaction.timeout.ms",
                      max(60_000, int(config.get("message.timeout.ms", 0))))
    return config


class Transactions:
    """One consumer's transactional producer (see the module's docstring); its calls run on the
    consumer's poll thread."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = config
        self._producer: Producer | None = None
        self.transactional_id = str(config["transactional.id"])

    def commit(self, consumer: Consumer, offsets: list[TopicPartition],
               records: list[Output]) -> None:
        """Produce ``records`` and commit ``offsets`` in one transaction.

        Raises:
            TransactionAborted: aborted on an abortable error; try again.
            Fenced: the producer can do nothing more.
        """
        try:
            producer = self.start()
            producer.begin_transaction()
        except KafkaException as failure:
            self._producer = None
            raise self._failed(failure.args[0], "starting a transaction") from None
        try:
            for record in records:
                self._produce(producer, record)
            if offsets:
                producer.send_offsets_to_transaction(
                    offsets, consumer.consumer_group_metadata(), TRANSACTION_TIMEOUT)
            producer.commit_transaction(TRANSACTION_TIMEOUT)
        except KafkaException as failure:
            error: KafkaError = failure.args[0]
            if error.fatal() or (not error.txn_requires_abort() and not error.retriable()):
                self._producer = None
                raise self._failed(error, "committing a transaction") from None
            self._abort(producer)
            raise TransactionAborted(error.str()) from None

    def start(self) -> Producer:
        """The producer, made and initialised if it is not: that fences an older producer with
        this id and aborts the transaction it left open. The consumer calls it before it asks
        for its partitions' committed offsets, which the broker keeps unanswered while a
        transaction that wrote them is open (``UNSTABLE_OFFSET_COMMIT``): a successor that
        initialised only at its first commit would wait for the broker's transaction timeout."""
        if self._producer is None:
            producer = Producer(self._config)
            producer.init_transactions(TRANSACTION_TIMEOUT)
            self._producer = producer
        return self._producer

    def start_early(self) -> None:
        """:meth:`start`, at the consumer's start; a failure is logged, and the first commit
        tries again."""
        try:
            self.start()
        except KafkaException as failure:
            logger.warning("initialising the transactional producer %r failed (tried again at "
                           "the first commit): %s", self.transactional_id, failure.args[0].str())

    def _produce(self, producer: Producer, record: Output) -> None:
        give_up = time.monotonic() + TRANSACTION_TIMEOUT
        while True:
            try:
                producer.produce(record.topic, value=record.value, key=record.key,
                                 headers=record.headers)
                return
            except BufferError:
                if time.monotonic() > give_up:
                    raise
                producer.poll(QUEUE_FULL_WAIT)

    def _abort(self, producer: Producer) -> None:
        try:
            producer.abort_transaction(TRANSACTION_TIMEOUT)
        except KafkaException as failure:
            self._producer = None  # a new producer's init aborts what this one left open
            logger.warning("aborting a Kafka transaction of %r failed: %s",
                           self.transactional_id, failure.args[0].str())

    def _failed(self, error: KafkaError, what: str) -> Exception:
        if error.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                            KafkaError.INVALID_PRODUCER_EPOCH):
            return Fenced(
                f"the transactional producer {self.transactional_id!r} was fenced {what}: a "
                "newer producer with the same transactional_id started (give each process its "
                "own KafkaAdapter(transactional_id=...)), or this one was too slow; its records "
                f"run again at their next owner ({error.str()})")
        if error.fatal():
            return Fenced(f"the transactional producer {self.transactional_id!r} failed "
                          f"{what}: {error.str()}")
        return TransactionAborted(error.str())

    def close(self) -> None:
        """Drop the producer (nothing is open between two commits)."""
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.flush(TRANSACTION_TIMEOUT)


__all__ = ["Fenced", "Output", "StaleDeliveryError", "TransactionAborted", "Transactions",
           "hold", "output_of", "transactional_config"]
