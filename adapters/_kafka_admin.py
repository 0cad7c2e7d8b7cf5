"""The Kafka adapter's administration: topics, a group's committed offsets, the end offsets,
and the settings topic where subscriptions are recorded.

Every call goes through librdkafka's ``AdminClient`` (thread-safe, no event loop of its own:
its futures are awaited from whichever loop asks) with a bound on how long it may take.

Settings. A consumer group cannot say which topic it is for before it has committed, nor hold
an ack deadline at all, so each subscription's settings (topic, ack deadline, ordering) are one
record in the compacted topic ``{prefix}-subscriptions``, keyed by the subscription. A fresh
adapter reads the topic from the start (it holds one small record per subscription). The first
record of a subscription wins: a second ``ensure_subscription`` with other settings is refused,
and one that lost a race writes the winner's record again, so the record compaction keeps (the
last) is still the first one.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from confluent_kafka import (
    OFFSET_BEGINNING,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka import Consumer as _Consumer
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._listoffsets import OffsetSpec
from confluent_kafka.cimpl import NewTopic

from reliable_sub.adapters._kafka_records import ORDERINGS
from reliable_sub.errors import AccessDeniedError

logger = logging.getLogger("reliable_sub.adapters.kafka")
T = TypeVar("T")

# Seconds one administrative call may take in all, and one request of it.
REQUEST_TIMEOUT = 15.0
ATTEMPT_TIMEOUT = 5.0
# Errors that mean the client lost its way rather than that the cluster said no: a request that
# timed out (a node it still thinks is the controller or a coordinator died), a connection that
# failed. librdkafka's admin client keeps the controller it cached until its next metadata
# refresh (minutes): the call is asked again on a new client, which bootstraps afresh.
_LOST = frozenset({KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN})
# Clients given up on, kept a while rather than destroyed with their requests still in flight.
_RETIRED = 4
# The settings topic: one partition (one writer order), compacted (one record per subscription).
SETTINGS_TOPIC_CONFIG = {"cleanup.policy": "compact"}
# Errors a request meets while the cluster settles, asked again (with a doubling wait between
# RETRY_MIN and RETRY_MAX seconds) until REQUEST_TIMEOUT.
_SETTLING = frozenset({
    KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.REQUEST_TIMED_OUT,
})
RETRY_MIN, RETRY_MAX = 0.02, 0.5
# Seconds reading the settings topic may take.
SETTINGS_READ_TIMEOUT = 15.0


@dataclass(frozen=True)
class Settings:
    """A subscription's recorded settings."""

    topic: str
    ack_deadline: float
    ordering: str

    def to_json(self) -> bytes:
        return json.dumps({"topic": self.topic, "ack_deadline": self.ack_deadline,
                           "ordering": self.ordering}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Settings | None:
        """The settings a record holds, None if it holds none we can read."""
        try:
            value = json.loads(raw)
            topic, deadline, ordering = value["topic"], value["ack_deadline"], value["ordering"]
        except (ValueError, TypeError, KeyError):
            return None
        if (not isinstance(topic, str) or not isinstance(deadline, int | float)
                or not math.isfinite(deadline) or deadline <= 0 or ordering not in ORDERINGS):
            return None
        return cls(topic, float(deadline), ordering)


class Admin:
    """Administrative calls on one cluster (see the module's docstring)."""

    def __init__(self, config: dict[str, Any], settings_topic: str) -> None:
        self._config = config
        self._client: AdminClient | None = None
        self._retired: deque[AdminClient] = deque(maxlen=_RETIRED)
        self.settings_topic = settings_topic
        self.bootstrap = str(config.get("bootstrap.servers", ""))

    @property
    def client(self) -> AdminClient:
        if self._client is None:
            self._client = AdminClient(self._config)
        return self._client

    def _renew(self) -> None:
        """Ask the next request on a new client (see ``_LOST``)."""
        if self._client is not None:
            self._retired.append(self._client)
            self._client = None

    async def _call(self, make: Callable[[], Any], what: str,
                    accept: dict[int, Any] | None = None, retry: bool = True) -> Any:
        """Await the future ``make()`` returns; asked again while the cluster settles (a
        partition just created has no leader yet, a coordinator is loading), up to
        REQUEST_TIMEOUT (without ``retry``: ``_Settling`` is raised for the caller to ask
        again); a request the client lost its way on (``_LOST``) is asked again on a new
        client. An error whose code is in ``accept`` gives that value instead."""
        give_up = time.monotonic() + REQUEST_TIMEOUT
        wait = RETRY_MIN
        while True:
            remaining = max(0.001, give_up - time.monotonic())
            try:
                return await asyncio.wait_for(asyncio.wrap_future(make()),
                                              min(remaining, ATTEMPT_TIMEOUT + 1.0))
            except asyncio.TimeoutError:
                self._renew()
                if not retry:
                    raise _Settling(f"{what} did not answer") from None
                if time.monotonic() >= give_up:
                    raise ConnectionError(
                        f"Kafka at {self.bootstrap} did not answer {what} within "
                        f"{REQUEST_TIMEOUT:g}s; is it reachable?") from None
                continue
            except KafkaException as failure:
                error: KafkaError = failure.args[0]
                if accept is not None and error.code() in accept:
                    return accept[error.code()]
                if error.code() in _LOST:
                    self._renew()
                settling = (error.code() in _SETTLING or error.code() in _LOST
                            or error.retriable())
                if settling and not retry:
                    raise _Settling(error.str()) from None
                if not settling or time.monotonic() + wait >= give_up:
                    raise self._error(error, what) from None
            await asyncio.sleep(wait)
            wait = min(RETRY_MAX, 2 * wait)

    def _error(self, error: KafkaError, what: str) -> Exception:
        if error.code() in (KafkaError.TOPIC_AUTHORIZATION_FAILED,
                            KafkaError.GROUP_AUTHORIZATION_FAILED,
                            KafkaError.CLUSTER_AUTHORIZATION_FAILED):
            return AccessDeniedError(f"Kafka refused {what}: {error.str()}")
        return ConnectionError(f"Kafka at {self.bootstrap} failed {what}: {error.str()}")

    # -- topics ------------------------------------------------------------------------------

    async def _description(self, topic: str) -> Any:
        return await self._call(
            lambda: self.client.describe_topics(TopicCollection([topic]),
                                                request_timeout=ATTEMPT_TIMEOUT)[topic],
            f"describing topic {topic!r}", {KafkaError.UNKNOWN_TOPIC_OR_PART: None})

    async def partitions(self, topic: str) -> list[int] | None:
        """The partitions of ``topic``, None if it does not exist."""
        description = await self._description(topic)
        if description is None:
            return None
        return sorted(partition.id for partition in description.partitions)

    async def create_topic(self, topic: str, partitions: int | None,
                           replication_factor: int | None,
                           config: dict[str, str] | None = None) -> bool:
        """Create ``topic`` (the broker's defaults for what is None) and wait until each of its
        partitions has a leader; False if it existed."""
        new = NewTopic(topic, -1 if partitions is None else partitions,
                       -1 if replication_factor is None else replication_factor,
                       config=dict(config or {}))
        created = await self._call(
            lambda: self.client.create_topics([new], operation_timeout=ATTEMPT_TIMEOUT,
                                              request_timeout=ATTEMPT_TIMEOUT)[topic],
            f"creating topic {topic!r}", {KafkaError.TOPIC_ALREADY_EXISTS: False})
        give_up = time.monotonic() + REQUEST_TIMEOUT
        wait = RETRY_MIN
        while True:  # the controller elects the new partitions' leaders a moment later
            description = await self._description(topic)
            if description is not None and all(p.leader is not None
                                               for p in description.partitions):
                break
            if time.monotonic() > give_up:
                raise ConnectionError(f"topic {topic!r} on {self.bootstrap} has partitions "
                                      f"without a leader {REQUEST_TIMEOUT:g}s after creation")
            await asyncio.sleep(wait)
            wait = min(RETRY_MAX, 2 * wait)
        return created is not False

    # -- offsets -----------------------------------------------------------------------------

    async def group_offsets(self, group: str, topic: str) -> dict[int, tuple[int, str | None]]:
        """The group's committed offsets (and their metadata) on ``topic``, by partition."""
        found = await self._call(
            lambda: self.client.list_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(group)], request_timeout=ATTEMPT_TIMEOUT)[group],
            f"listing group {group!r}'s offsets")
        return {tp.partition: (tp.offset, tp.metadata) for tp in found.topic_partitions
                if tp.topic == topic and tp.offset >= 0 and tp.error is None}

    async def set_group_offsets(self, group: str, offsets: list[TopicPartition]) -> None:
        await self._call(
            lambda: self.client.alter_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(group, offsets)],
                request_timeout=ATTEMPT_TIMEOUT)[group],
            f"setting group {group!r}'s offsets")

    async def group_members(self, group: str) -> list[str]:
        """The member ids of ``group`` now ([] for an empty group, or none by that name)."""
        found = await self._call(
            lambda: self.client.describe_consumer_groups(
                [group], request_timeout=ATTEMPT_TIMEOUT)[group],
            f"describing group {group!r}")
        return [member.member_id for member in found.members]

    async def offsets_at(self, topic: str, partitions: list[int], millis: int
                         ) -> dict[int, int]:
        """Per partition of ``topic``, the first offset whose record's timestamp is at or
        after ``millis`` (the end offset where there is none)."""
        at = await self.offsets(topic, partitions, spec=OffsetSpec.for_timestamp(millis))
        missing = [p for p in partitions if at.get(p, -1) < 0]
        return {**at, **(await self.offsets(topic, missing) if missing else {})}

    async def offsets(self, topic: str, partitions: list[int], latest: bool = True,
                      spec: Any = None) -> dict[int, int]:
        """The end offsets (last stable offset, as a read_committed consumer sees it), or the
        earliest ones, or those ``spec`` (an ``OffsetSpec``) names, of ``topic``'s
        ``partitions``."""
        if not partitions:
            return {}
        if spec is None:
            spec = (OffsetSpec.latest() if latest  # type: ignore[no-untyped-call]
                    else OffsetSpec.earliest())  # type: ignore[no-untyped-call]
        found: dict[int, int] = {}
        pending, give_up, wait = list(partitions), time.monotonic() + REQUEST_TIMEOUT, RETRY_MIN
        while pending:
            futures = self.client.list_offsets(
                {TopicPartition(topic, p): spec for p in pending},
                isolation_level=_read_committed(), request_timeout=ATTEMPT_TIMEOUT)
            again = []
            for tp, future in futures.items():
                try:
                    found[tp.partition] = (await self._call(
                        functools.partial(_given, future), f"listing {topic!r}'s offsets",
                        retry=False)).offset
                except _Settling:
                    again.append(tp.partition)
            pending = again
            if pending:
                if time.monotonic() + wait >= give_up:
                    raise ConnectionError(f"Kafka at {self.bootstrap} kept refusing to list "
                                          f"{topic!r}'s offsets of partitions {pending}")
                await asyncio.sleep(wait)
                wait = min(RETRY_MAX, 2 * wait)
        return found

    async def start_at_end(self, group: str, topic: str) -> None:
        """Commit the end offsets for the group on every partition of ``topic`` it has none
        for, so that the subscription starts with what is published from now on (a group
        with members, already consuming, is left alone)."""
        partitions = await self.partitions(topic) or []
        committed = await self.group_offsets(group, topic)
        missing = [p for p in partitions if p not in committed]
        if not missing:
            return
        ends = await self.offsets(topic, missing)
        try:
            await self.set_group_offsets(group, [TopicPartition(topic, p, ends[p])
                                                 for p in missing])
        except ConnectionError as error:  # a group with members refuses: it already consumes
            logger.debug("group %r keeps its own start: %s", group, error)

    # -- settings ----------------------------------------------------------------------------

    async def read_settings(self) -> dict[str, Settings]:
        """Every subscription's recorded settings (the first record of each)."""
        found: dict[str, Settings] = {}
        for name, value in await self.read_records(self.settings_topic):
            settings = None if value is None else Settings.from_json(value)
            if settings is not None:
                found.setdefault(name, settings)
        return found

    async def read_records(self, topic: str) -> list[tuple[str, bytes | None]]:
        """Every keyed record of the one-partition ``topic`` (a compacted one of this
        adapter's), from the start, in order: (key, value; None for a tombstone)."""
        if await self.partitions(topic) is None:
            return []
        return await asyncio.to_thread(self._read_records, topic)

    def _read_records(self, topic: str) -> list[tuple[str, bytes | None]]:
        reader = _Consumer({**self._config, "group.id": f"{topic}-reader",
                            "enable.auto.commit": False, "enable.partition.eof": True})
        found: list[tuple[str, bytes | None]] = []
        try:
            partition = TopicPartition(topic, 0, OFFSET_BEGINNING)
            _, high = reader.get_watermark_offsets(partition, timeout=SETTINGS_READ_TIMEOUT)
            reader.assign([partition])
            position = 0
            give_up = time.monotonic() + SETTINGS_READ_TIMEOUT
            while position < high:
                first = reader.poll(min(1.0, max(0.0, give_up - time.monotonic())))
                if first is None:
                    if time.monotonic() < give_up:
                        continue
                    raise ConnectionError(
                        f"reading {topic!r} from {self.bootstrap} stalled at offset "
                        f"{position} of {high}")
                for record in [first, *reader.consume(500, 0)]:
                    error = record.error()
                    if error is not None:
                        if error.code() == KafkaError._PARTITION_EOF:
                            position = high
                        continue
                    position = (record.offset() or 0) + 1
                    name = record.key()
                    if name is not None:
                        found.append((name.decode("utf-8", "replace"), record.value()))
        finally:
            reader.close()
        return found

    async def record_settings(self, subscription: str, settings: Settings,
                              publish: Callable[[str, bytes, bytes], Awaitable[str]]
                              ) -> Settings:
        """Record ``settings`` unless the subscription has some; returns those that hold."""
        if await self.partitions(self.settings_topic) is None:
            await self.create_topic(self.settings_topic, 1, None, SETTINGS_TOPIC_CONFIG)
        held = (await self.read_settings()).get(subscription)
        if held is not None:
            return held
        await publish(self.settings_topic, subscription.encode(), settings.to_json())
        held = (await self.read_settings()).get(subscription, settings)
        if held != settings:  # another recorded first: keep its record the last one too
            await publish(self.settings_topic, subscription.encode(), held.to_json())
        return held


def _given(future: T) -> T:
    return future


class _Settling(Exception):
    """A request refused while the cluster settles (see Admin._call)."""


def _read_committed() -> Any:
    from confluent_kafka import IsolationLevel

    return IsolationLevel.READ_COMMITTED


__all__ = ["Admin", "Settings"]
