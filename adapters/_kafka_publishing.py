"""Publishing on the Kafka adapter: librdkafka's producer, its delivery reports handed to the
caller's future.

One :class:`ProducerLink` per event loop (and one for the blocking twins, on the adapter's
background loop): a ``confluent_kafka.Producer``, idempotent with ``acks=all``, and a thread that
serves its delivery reports (``poll``) while any record is in flight, and ends when none is, so an
idle link costs no thread. ``send`` returns a ``concurrent.futures.Future`` the report resolves:
the record's message id, or the error the broker or the client gave, as one of ours naming what
was wrong. A full local queue (``BufferError``) waits for room, up to the publish timeout.

Records of one key keep their order: the client sends them in the order ``send`` was called, to
one partition, and the idempotent producer keeps that order across its retries.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from reliable_sub.adapters._kafka_messages import Headers, message_id, outgoing
from reliable_sub.errors import AccessDeniedError, InvalidMessageError, UnknownTopicError
from reliable_sub.ports import Outgoing, checked_message

logger = logging.getLogger("reliable_sub.adapters.kafka")

# Seconds each poll for delivery reports waits before looking whether any record is in flight.
POLL_INTERVAL = 0.05
# Seconds between tries while the client's local queue is full.
QUEUE_FULL_WAIT = 0.005


def producer_config_of(base: dict[str, Any], publish_timeout: float,
                       overrides: dict[str, Any]) -> dict[str, Any]:
    """The producer's configuration over the clients' ``base``: idempotent, every in-sync
    replica acknowledging, and keys partitioned as the Java client does (murmur2), so a key
    lands where other producers put it."""
    return {
        **base,
        "enable.idempotence": True,
        "acks": "all",
        "partitioner": "murmur2_random",
        "allow.auto.create.topics": False,  # a topic is made by ensure_topic, never by a typo
        "message.timeout.ms": int(publish_timeout * 1000),
        **overrides,
    }


async def publish_each(link: ProducerLink, messages: Sequence[Outgoing],
                       known: Callable[[str], Awaitable[None]]) -> list[str | Exception]:
    """Send ``messages`` in order on ``link`` (so one key's keep theirs) and await their
    delivery reports together: each one's message id, or its error (``known`` refuses a topic
    that does not exist)."""
    pending: list[concurrent.futures.Future[str] | Exception] = []
    for message in messages:
        try:
            payload, checked = checked_message(message.data, message.attributes)
            await known(message.topic)
            key, headers = outgoing(checked, message.ordering_key)
            pending.append(await link.queue(message.topic, payload, key, headers))
        except Exception as error:
            pending.append(error)
    results: list[str | Exception] = []
    for item in pending:
        if isinstance(item, Exception):
            results.append(item)
            continue
        try:
            found: str = await asyncio.wrap_future(item)
        except Exception as error:
            results.append(error)
        else:
            results.append(found)
    return results


class ProducerLink:
    """One producer and its delivery-report thread (see the module's docstring)."""

    def __init__(self, config: dict[str, Any], publish_timeout: float) -> None:
        self._producer = Producer(config)
        self._timeout = publish_timeout
        self._bootstrap = config.get("bootstrap.servers", "")
        self._lock = threading.Lock()
        self._in_flight = 0
        self._poller: threading.Thread | None = None
        self.closed = False

    def send(self, topic: str, value: bytes | None, key: bytes | None, headers: Headers
             ) -> concurrent.futures.Future[str]:
        """Queue one record (a None value: a tombstone); raises ``BufferError`` when the local
        queue is full."""
        future: concurrent.futures.Future[str] = concurrent.futures.Future()

        def report(error: KafkaError | None, record: Any) -> None:
            self._done()
            if error is not None:
                future.set_exception(self._error(error, topic, len(value or b"")))
            else:
                future.set_result(message_id(record.topic(), record.partition(),
                                             record.offset()))

        with self._lock:
            self._in_flight += 1
        try:
            self._producer.produce(topic, value=value, key=key, headers=headers,
                                   on_delivery=report)
        except BaseException as error:
            self._done()
            if isinstance(error, KafkaException):
                raise self._error(error.args[0], topic, len(value or b"")) from None
            raise
        self._serve()
        return future

    async def publish(self, topic: str, value: bytes | None, key: bytes | None,
                      headers: Headers) -> str:
        """Send one record and wait for its delivery report (on the running loop)."""
        return await asyncio.wrap_future(await self.queue(topic, value, key, headers))

    async def queue(self, topic: str, value: bytes | None, key: bytes | None,
                    headers: Headers) -> concurrent.futures.Future[str]:
        """Send one record (waiting for room in a full local queue); its report's future."""
        give_up = time.monotonic() + self._timeout
        while True:
            try:
                return self.send(topic, value, key, headers)
            except BufferError:
                if time.monotonic() > give_up:
                    raise TimeoutError(
                        f"the Kafka producer's local queue stayed full for {self._timeout:g}s "
                        f"(is {self._bootstrap} reachable?); raise queue.buffering.max.messages "
                        "or publish more slowly") from None
                await asyncio.sleep(QUEUE_FULL_WAIT)

    def _done(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _serve(self) -> None:
        """Make sure a thread serves delivery reports while records are in flight."""
        with self._lock:
            if self._poller is not None:
                return
            self._poller = threading.Thread(target=self._poll, name="reliable-sub-kafka-producer",
                                            daemon=True)
            self._poller.start()

    def _poll(self) -> None:
        while True:
            self._producer.poll(POLL_INTERVAL)
            with self._lock:
                if self._in_flight <= 0:
                    self._poller = None
                    return

    def _error(self, error: KafkaError, topic: str, size: int) -> Exception:
        code = error.code()
        if code == KafkaError.MSG_SIZE_TOO_LARGE:
            return InvalidMessageError(
                f"publish to {topic!r}: a record of {size} bytes is larger than the producer's "
                "message.max.bytes or the topic's max.message.bytes allows; send less, or raise "
                "both limits")
        if code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
            return UnknownTopicError(
                f"topic {topic!r} does not exist; create it with ensure_topic or "
                "ensure_subscription")
        if code == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            return AccessDeniedError(f"publish to {topic!r} was refused: {error.str()}")
        if code == KafkaError._MSG_TIMED_OUT:
            return TimeoutError(
                f"publish to {topic!r} got no acknowledgement within {self._timeout:g}s (is "
                f"{self._bootstrap} reachable, and are enough replicas in sync?)")
        return ConnectionError(f"publish to {topic!r} failed: {error.str()}")

    def close(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for what is in flight; returns how many records are
        still unsent (their futures fail with the client's error as it gives up on them)."""
        self.closed = True
        left: int = self._producer.flush(timeout)
        return left


__all__ = ["ProducerLink", "producer_config_of", "publish_each"]
