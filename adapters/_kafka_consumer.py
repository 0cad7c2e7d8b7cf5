"""One subscription's consumer on the Kafka adapter: a group member whose poll loop never stops.

A :class:`SubscriptionConsumer` owns one ``confluent_kafka.Consumer`` and the thread that runs
its poll loop: a poll with a short timeout, again and again, so the group never sees a
member that stopped polling (``max.poll.interval.ms``) however slow the handlers are. Everything
the client is asked -- pause, resume, commit, the rebalance callbacks -- happens on that thread,
between two polls (the client makes a call from another thread wait while one
runs). Fetched records go into the partitions' queues (:mod:`._kafka_records`); ``receive``, on
the event loop, takes from them under the consumer's lock and waits for the thread to wake it.

Backpressure pauses partitions, never the loop: a partition whose records wait untaken past
``buffer`` is paused, and resumed when half of them are gone.

Commits go every ``commit_interval`` seconds, asynchronously, for the partitions whose state
changed: the mark and the metadata of :mod:`._kafka_offsets`. A final one, synchronous, when a
partition is revoked and when the consumer closes; none when a partition is *lost* (the group
gave it away without asking: what this member would commit could overwrite the new owner's).

Rebalances. On revocation (eager, or cooperative-sticky's incremental one) the revoked
partitions hand out nothing more; the thread waits up to ``revoke_timeout`` for their deliveries
out to be settled, commits what is settled, and lets them go. A delivery still out then becomes
stale (its ack is refused); the handler's dedup claim, still held, makes the new owner defer to
it rather than run it twice.

A consumer with records waiting whose receives stopped coming (no receive for an ack deadline,
none out) leaves the group, so its partitions go to members that are asking: the Subscriber
stops receiving when its worker threads are all hung. The next receive joins again. So does one
whose event loop closed without closing it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, TopicPartition

from reliable_sub.adapters._kafka_assignment import Assignment, ConsumerOptions, PartitionFigures
from reliable_sub.adapters._kafka_offsets import PartitionOffsets, decode
from reliable_sub.adapters._kafka_records import KEY, Entry, PartitionQueue
from reliable_sub.adapters._kafka_transactions import (
    Fenced,
    Output,
    TransactionAborted,
    Transactions,
)
from reliable_sub.errors import UnknownTopicError

logger = logging.getLogger("reliable_sub.adapters.kafka")

_generations = itertools.count(1)
# Seconds one poll may wait for a record: the longest a pause, a commit or a stop waits for its
# turn. (``consume`` waits out its whole timeout unless its batch fills, so the thread polls for
# the first record and then takes what else is queued with a timeout of 0.)
POLL_TIMEOUT = 0.05
# Seconds after an assignment a first receive waits at most for every new partition's first
# fetch to answer (see _accept): librdkafka may have a fetch of the others in flight, which the
# broker holds for fetch.wait.max.ms (500 ms) when they have nothing new.
PRIME_TIMEOUT = 2.0
# Records taken at a time.
FETCH_BATCH = 500
# Seconds the rebalance callback may wait for the group's committed offsets.
COMMITTED_TIMEOUT = 10.0


class SubscriptionConsumer(Assignment):
    """One group member of ``options.subscription`` (see the module's docstring)."""

    def __init__(self, options: ConsumerOptions, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(options, loop)
        self._transactions = (None if options.transactions is None
                              else Transactions(options.transactions))
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"reliable-sub-kafka-{options.subscription}")
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to commit, leave the group and end (see :meth:`wait_closed`)."""
        self.stopping = True

    async def wait_closed(self, timeout: float) -> None:
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            logger.warning("the Kafka consumer of %r did not close within %gs",
                           self.options.subscription, timeout)

    # -- the poll thread -----------------------------------------------------------------------

    def _run(self) -> None:
        options = self.options
        consumer: Consumer | None = None
        try:
            consumer = Consumer({**options.config, "on_commit": self._committed,
                                 "enable.partition.eof": True})  # primes partitions
            if self._transactions is not None:
                self._transactions.start_early()  # before any committed offsets are read
            consumer.subscribe([options.topic], on_assign=self._assigned,
                               on_revoke=self._revoked, on_lost=self._lost)
            while not self.stopping and not self._loop.is_closed():
                if not self.joined and self._priming_until and (
                        time.monotonic() > self._priming_until):
                    self._primed()
                if self._seeks:
                    self._move(consumer)
                self._pause_or_resume(consumer)
                self._commit(consumer)
                if self._idle():
                    logger.info("no receive of %r took its waiting records for %gs: leaving the "
                                "group so that its partitions go to members that ask; the next "
                                "receive joins again", options.subscription,
                                options.ack_deadline)
                    break
                first = consumer.poll(POLL_TIMEOUT)  # returns at the first record
                if first is not None:  # then what else is queued, without waiting
                    self._accept([first, *consumer.consume(FETCH_BATCH - 1, 0)])
        except Exception as error:  # a fatal client error: receive raises it
            logger.warning("the Kafka consumer of %r failed: %s", options.subscription, error)
            self.failure = error
        finally:
            self.stopping = True
            if consumer is not None:
                self._close(consumer)
            with self._lock:
                self.finished = True
                for request in self._seeks:
                    request.done.set_exception(ConnectionError(
                        f"the consumer of {options.subscription!r} ended before the seek"))
                self._seeks.clear()
                self._queues.clear()
                self._generation.clear()
                self._settled.notify_all()
                self._wake()

    def _close(self, consumer: Consumer) -> None:
        try:
            self._commit(consumer, sync=True)
        except KafkaException as error:
            logger.warning("the final commit of %r failed: %s", self.options.subscription, error)
        if self._transactions is not None:
            self._transactions.close()
        try:
            consumer.close()  # leaves the group (revoking, in this thread, what it holds)
        except (KafkaException, RuntimeError) as error:
            logger.warning("closing the Kafka consumer of %r: %s", self.options.subscription,
                           error)

    def _accept(self, records: list[Any]) -> None:
        grouped = self.options.ordering == KEY
        with self._lock:
            for record in records:
                error = record.error()
                queue = self._queues.get(record.partition() or 0)
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF and queue is not None:
                        queue.primed = True
                    else:
                        self._record_error(error)
                    continue
                if queue is None or queue.revoking:
                    continue  # no longer ours: the next owner fetches it
                queue.primed = True
                offset = record.offset()
                found = queue.offsets.fetched(offset)
                if not found.settled:
                    queue.add(Entry(offset, record, record.key() if grouped else None,
                                    found.attempts))
            if not self.joined and all(q.primed for q in self._queues.values()):
                self.joined = True
            self._wake()

    def _primed(self) -> None:
        with self._lock:
            self.joined = True
            self._wake()

    def _record_error(self, error: KafkaError) -> None:
        if error.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
            self.failure = UnknownTopicError(
                f"topic {self.options.topic!r} of subscription {self.options.subscription!r} "
                "does not exist (any more); create it with ensure_subscription")
        else:
            logger.warning("Kafka consumer of %r: %s", self.options.subscription, error.str())

    def _pause_or_resume(self, consumer: Consumer) -> None:
        limit = self.options.buffer
        with self._lock:
            self._paused &= set(self._queues)
            pause = [p for p, q in self._queues.items()
                     if p not in self._paused and len(q.fresh) >= limit]
            resume = [p for p in self._paused if len(self._queues[p].fresh) <= limit // 2]
            self._paused.update(pause)
            self._paused.difference_update(resume)
        topic = self.options.topic
        if pause:
            consumer.pause([TopicPartition(topic, p) for p in pause])
        if resume:
            consumer.resume([TopicPartition(topic, p) for p in resume])

    def _idle(self) -> bool:
        now = time.monotonic()
        with self._lock:
            if self._asking or now - self._last_ask < self.options.ack_deadline:
                return False
            for queue in self._queues.values():
                queue.due(now)
            queues = self._queues.values()
            return (not any(q.held for q in queues)) and any(q.waiting for q in queues)

    # -- seeks -------------------------------------------------------------------------------

    def _move(self, consumer: Consumer) -> None:
        """Carry out the seeks asked: each owned partition of their targets gets a new queue
        (a new generation: what was out is stale) starting at its target, the client seeks
        there, and the new position is committed at once."""
        with self._lock:
            requests, self._seeks = self._seeks, []
        for request in requests:
            moved = []
            with self._lock:
                for partition, (offset, runs) in request.targets.items():
                    old = self._queues.get(partition)
                    if old is None or old.revoking:
                        continue
                    queue = PartitionQueue(next(_generations), PartitionOffsets(offset, runs),
                                           self.options.ordering)
                    queue.primed = True
                    queue.offsets.changed = True
                    self._generation.pop(old.generation, None)
                    self._queues[partition] = self._generation[queue.generation] = queue
                    moved.append(TopicPartition(self.options.topic, partition, offset))
                self._settled.notify_all()
                self._wake()
            try:
                for target in moved:
                    consumer.seek(target)
                self._commit(consumer, sync=True, partitions=[tp.partition for tp in moved])
            except KafkaException as error:
                request.done.set_exception(ConnectionError(
                    f"seeking {self.options.subscription!r} failed: {error}"))
            else:
                request.done.set_result([tp.partition for tp in moved])

    # -- commits -------------------------------------------------------------------------------

    def _commit(self, consumer: Consumer, sync: bool = False,
                partitions: Sequence[int] | None = None) -> None:
        now = time.monotonic()
        if not sync and now < self._next_commit:
            return
        transactions = self._transactions
        if transactions is not None:
            partitions = None  # a transaction commits every partition's state at once
        with self._lock:
            offsets = []
            for partition in self._queues if partitions is None else partitions:
                queue = self._queues.get(partition)
                if queue is None or not queue.offsets.changed or queue.offsets.mark < 0:
                    continue
                mark, metadata = queue.offsets.commit(self._metadata_limit)
                offsets.append(TopicPartition(self.options.topic, partition, mark, metadata))
            batch: list[tuple[int, Output]] = []
            if transactions is not None:
                self._prune_outputs()
                batch, self._batch = self._batch, []
        if not offsets and not batch:
            return
        self._next_commit = now + self.options.commit_interval
        if transactions is not None:
            self._transact(consumer, transactions, offsets, batch)
        elif not sync:
            consumer.commit(offsets=offsets, asynchronous=True)
            return
        else:
            try:
                results = consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as error:
                self._committed(error.args[0], offsets)
                raise
            self._committed(None, results)

    def _transact(self, consumer: Consumer, transactions: Transactions,
                  offsets: list[TopicPartition], batch: list[tuple[int, Output]]) -> None:
        """One transaction of ``batch``'s records and ``offsets``; on an abort, both wait for
        the next commit, for the partitions still owned; on a fatal error the consumer ends."""
        try:
            transactions.commit(consumer, offsets, [output for _, output in batch])
        except TransactionAborted as error:
            logger.info("a transaction of %r was aborted (tried again with the next commit): "
                        "%s", self.options.subscription, error)
            with self._lock:
                self._batch[:0] = [item for item in batch if item[0] in self._queues]
                for tp in offsets:
                    queue = self._queues.get(tp.partition)
                    if queue is not None:
                        queue.offsets.changed = True
        except Fenced as error:
            logger.error("%s", error)
            self.failure = error
            self.stopping = True

    def _committed(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """A commit's result (the client calls it on this thread): what failed is committed
        again with the next one."""
        failed = [tp.partition for tp in partitions if error is not None or tp.error]
        if not failed:
            return
        first = error or next(tp.error for tp in partitions if tp.error)
        if first.code() == KafkaError.OFFSET_METADATA_TOO_LARGE and self._metadata_limit > 64:
            self._metadata_limit //= 2  # the broker's offset.metadata.max.bytes is lower
        logger.info("commit of %r partitions %s failed (retried with the next): %s",
                    self.options.subscription, failed, first.str())
        with self._lock:
            for partition in failed:
                queue = self._queues.get(partition)
                if queue is not None:
                    queue.offsets.changed = True

    # -- rebalances (called by the client on this thread) --------------------------------------

    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        committed = partitions
        if partitions:
            try:
                committed = consumer.committed(partitions, timeout=COMMITTED_TIMEOUT)
            except KafkaException as error:
                logger.warning("reading the committed offsets of %r failed (%s): its "
                               "partitions start from the client's own view, what was settled "
                               "above them may run again", self.options.subscription, error)
        assign = []
        with self._lock:
            for tp in committed:
                known = tp.offset >= 0 and tp.error is None
                offsets = PartitionOffsets(tp.offset if known else -1,
                                           decode(tp.metadata) if known else [])
                queue = PartitionQueue(next(_generations), offsets, self.options.ordering)
                self._queues[tp.partition] = self._generation[queue.generation] = queue
                assign.append(TopicPartition(tp.topic, tp.partition,
                                             tp.offset if known else OFFSET_INVALID))
            if not assign:
                self.joined = True  # nothing to fetch first
            self._priming_until = time.monotonic() + PRIME_TIMEOUT
            self._wake()
        if self.options.eager:
            consumer.assign(assign)
        else:
            consumer.incremental_assign(assign)

    def _revoked(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        gone = [tp.partition for tp in partitions]
        with self._lock:
            queues = [q for p in gone if (q := self._queues.get(p)) is not None]
            for queue in queues:
                queue.revoking = True
            if not self.stopping:
                self._settled.wait_for(lambda: not any(q.held for q in queues),
                                       self.options.revoke_timeout)
            out = sum(q.held for q in queues)
        if out and not self.stopping:
            logger.warning("%d deliveries of %r were still out when partitions %s were "
                           "revoked after %gs: their acks will be refused, and the new owner "
                           "defers to their dedup claims", out, self.options.subscription,
                           gone, self.options.revoke_timeout)
        try:
            self._commit(consumer, sync=True, partitions=gone)
        except KafkaException as error:
            logger.warning("committing revoked partitions %s of %r failed: %s", gone,
                           self.options.subscription, error)
        self._drop(gone)
        if self.options.eager:
            consumer.unassign()
        else:
            consumer.incremental_unassign(partitions)

    def _lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        gone = [tp.partition for tp in partitions]
        logger.warning("partitions %s of %r were lost (the group gave them away): nothing of "
                       "theirs is committed, their deliveries out are stale",
                       gone, self.options.subscription)
        self._drop(gone)
        if self.options.eager:
            consumer.unassign()
        else:
            consumer.incremental_unassign(partitions)

    def _drop(self, partitions: list[int]) -> None:
        with self._lock:
            if self._batch:
                self._batch = [item for item in self._batch if item[0] not in partitions]
            for partition in partitions:
                queue = self._queues.pop(partition, None)
                if queue is not None:
                    self._generation.pop(queue.generation, None)
                self._paused.discard(partition)
            self._settled.notify_all()
            self._wake()


__all__ = ["ConsumerOptions", "PartitionFigures", "SubscriptionConsumer"]
