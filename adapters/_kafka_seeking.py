"""Seek and snapshots on the Kafka adapter.

A seek's target is, per partition, an offset and what is settled above it (the form of the
commit metadata, :mod:`._kafka_offsets`): for a time, the first offset whose record is stamped at
or after it (``ListOffsets`` by timestamp; the end where none is), with nothing settled above;
for a snapshot, what the snapshot recorded.

Kafka lets a live group's position move only through its members: a partition's owner holds its
position in memory and commits over anything written beside it, and the broker lets offsets be
altered from outside only for a group with no members (as ``kafka-consumer-groups
--reset-offsets`` requires). So a seek moves the partitions this adapter's own consumers own,
on their poll threads, and writes the others' offsets only when the group has no member at all;
a partition owned by a consumer elsewhere is refused with a :class:`SeekRefusedError` that says
what to do.

Snapshots are records of the compacted topic ``{prefix}-snapshots``, keyed by name: the
subscription, its topic, when it was taken and, per partition, the offset and what was settled
above it (from this adapter's consumers where they own the partition, fresher than the group's
last commit; from the group's commits otherwise). Deleting one writes a tombstone.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from confluent_kafka import TopicPartition

from reliable_sub.adapters._kafka_admin import Admin, Settings
from reliable_sub.adapters._kafka_assignment import Assignment, Targets
from reliable_sub.adapters._kafka_offsets import decode, encode
from reliable_sub.errors import (
    ConfigurationError,
    SnapshotExistsError,
    UnknownSnapshotError,
)
from reliable_sub.ports import Snapshot
from reliable_sub.replay import check_target

if TYPE_CHECKING:
    from reliable_sub.adapters._kafka_receiving import Consumers

# The snapshots topic: one partition, compacted (the last record of a name is what holds).
SNAPSHOTS_CONFIG = {"cleanup.policy": "compact"}
# Seconds a seek waits for this adapter's consumers to move their partitions.
MOVE_TIMEOUT = 30.0

Publish = Callable[[str, bytes, bytes | None], Awaitable[str]]


class SeekRefusedError(ConfigurationError):
    """A seek that Kafka does not allow now: partitions of the group are owned by consumers
    outside this adapter."""


class Seeking:
    """Seek and the snapshots of one adapter (see the module's docstring)."""

    def __init__(self, admin: Admin, topic: str, publish: Publish) -> None:
        self._admin = admin
        self.topic = topic
        self._publish = publish

    # -- snapshots --------------------------------------------------------------------------

    async def _records(self) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        for name, value in await self._admin.read_records(self.topic):
            if value is None:
                found.pop(name, None)
                continue
            try:
                record = json.loads(value)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("partitions"), dict):
                found[name] = record
        return found

    async def create(self, subscription: str, settings: Settings, name: str,
                     local: Sequence[Assignment]) -> Snapshot:
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"a snapshot needs a non-empty name, got {name!r}")
        if name in await self._records():
            raise SnapshotExistsError(f"snapshot {name!r} already exists")
        state = await self._state(subscription, settings.topic, local)
        created = datetime.now(timezone.utc)
        record = {"subscription": subscription, "topic": settings.topic,
                  "created": created.isoformat(),
                  "partitions": {str(p): [offset, runs] for p, (offset, runs) in state.items()}}
        if await self._admin.partitions(self.topic) is None:
            await self._admin.create_topic(self.topic, 1, None, SNAPSHOTS_CONFIG)
        await self._publish(self.topic, name.encode(), json.dumps(record).encode())
        return _snapshot_of(name, record)

    async def _state(self, subscription: str, topic: str, local: Sequence[Assignment]
                     ) -> Targets:
        partitions = await self._admin.partitions(topic) or []
        state: Targets = {}
        for consumer in local:
            for partition, figures in consumer.figures().items():
                if figures.mark >= 0:
                    state[partition] = (figures.mark, figures.runs)
        rest = [p for p in partitions if p not in state]
        committed = await self._admin.group_offsets(subscription, topic) if rest else {}
        ends = await self._admin.offsets(topic, [p for p in rest if p not in committed])
        for partition in rest:
            if partition in committed:
                offset, metadata = committed[partition]
                state[partition] = (offset, decode(metadata))
            else:
                state[partition] = (ends[partition], [])
        return state

    async def delete(self, name: str) -> None:
        if name not in await self._records():
            raise UnknownSnapshotError(f"snapshot {name!r} does not exist")
        await self._publish(self.topic, name.encode(), None)

    async def list(self, subscription: str | None = None) -> list[Snapshot]:
        return [_snapshot_of(name, record) for name, record in sorted((await self._records())
                                                                      .items())
                if subscription is None or record.get("subscription") == subscription]

    # -- seeking ----------------------------------------------------------------------------

    async def targets(self, subscription: str, settings: Settings, to: datetime | None,
                      snapshot: str | None) -> Targets:
        """Per partition, where the seek moves it (see the module's docstring)."""
        partitions = await self._admin.partitions(settings.topic) or []
        if to is not None:
            at = await self._admin.offsets_at(settings.topic, partitions,
                                              int(to.timestamp() * 1000))
            return {p: (at[p], []) for p in partitions}
        record = (await self._records()).get(snapshot or "")
        if record is None:
            raise UnknownSnapshotError(f"snapshot {snapshot!r} does not exist")
        if record.get("subscription") != subscription:
            raise ConfigurationError(f"snapshot {snapshot!r} was taken of "
                                     f"{record.get('subscription')!r}, not {subscription!r}")
        kept = record["partitions"]
        ends = await self._admin.offsets(settings.topic,
                                         [p for p in partitions if str(p) not in kept])
        targets: Targets = {}
        for partition in partitions:
            offset, runs = kept.get(str(partition), (ends.get(partition, 0), []))
            targets[partition] = (int(offset), [(int(n), int(code)) for n, code in runs])
        return targets

    async def move(self, subscription: str, settings: Settings, targets: Targets,
                   local: Sequence[Assignment]) -> None:
        """Move the group to ``targets``: through this adapter's consumers for the partitions
        they own, by altering the group's offsets for the others when it has no member."""
        owned = set().union(*(consumer.owned() for consumer in local))
        rest = {p: target for p, target in targets.items() if p not in owned}
        if rest:
            members = await self._admin.group_members(subscription)
            if members:
                raise SeekRefusedError(
                    f"cannot seek subscription {subscription!r}: partitions {sorted(rest)} of "
                    f"{settings.topic!r} are owned by consumers outside this adapter (the "
                    f"group has {len(members)} member(s)), and Kafka lets only a partition's "
                    "owner move a live group; stop those consumers (or scale them to zero), "
                    "seek, and start them again -- or seek from the one consumer left")
            await self._admin.set_group_offsets(subscription, [
                TopicPartition(settings.topic, p, offset, encode(runs))
                for p, (offset, runs) in sorted(rest.items())])
        if not owned:
            return
        done = [asyncio.wrap_future(consumer.seek(targets)) for consumer in local]
        try:
            moved = await asyncio.wait_for(asyncio.gather(*done), MOVE_TIMEOUT)
        except asyncio.TimeoutError:
            raise ConnectionError(f"the consumers of {subscription!r} did not move within "
                                  f"{MOVE_TIMEOUT:g}s; seek again") from None
        missed = owned - set().union(*map(set, moved))
        if missed:
            raise ConnectionError(
                f"a rebalance took partitions {sorted(missed)} of {subscription!r} away during "
                "the seek; they may not have moved: seek again")


class SeekableKafka:
    """The Seekable capability of :class:`~reliable_sub.adapters.kafka.KafkaAdapter` (its base
    class): the adapter provides the attributes and the lookup named here."""

    _seeking: Seeking
    _consumers: Consumers

    async def _subscription(self, name: str) -> Settings:
        raise NotImplementedError  # the adapter's: its recorded settings

    async def seek(self, subscription: str, *, to: datetime | None = None,
                   snapshot: str | None = None) -> None:
        """Seek ``subscription`` to a time or a snapshot (see
        :class:`~reliable_sub.ports.Seekable`; deliveries out become stale). The partitions
        this adapter's consumers own move on their poll threads; the others only while the
        group has no member (Kafka lets only an owner move a live group's partition).

        Raises:
            SeekRefusedError: a partition is owned by a consumer outside this adapter.
        """
        check_target(to, snapshot)
        settings = await self._subscription(subscription)
        targets = await self._seeking.targets(subscription, settings, to, snapshot)
        await self._seeking.move(subscription, settings, targets,
                                 self._consumers.all_of(subscription))

    async def create_snapshot(self, subscription: str, name: str) -> Snapshot:
        """Take a snapshot of ``subscription`` named ``name``: per partition, the offset and
        what is settled above it (this adapter's consumers' state where they own it, the
        group's commit otherwise), a record of the topic ``{prefix}-snapshots``."""
        settings = await self._subscription(subscription)
        return await self._seeking.create(subscription, settings, name,
                                          self._consumers.all_of(subscription))

    async def delete_snapshot(self, name: str) -> None:
        """Delete the snapshot ``name`` (a tombstone in ``{prefix}-snapshots``)."""
        await self._seeking.delete(name)

    async def list_snapshots(self, subscription: str | None = None) -> list[Snapshot]:
        """The snapshots, all or those of ``subscription``, by name."""
        return await self._seeking.list(subscription)


def _snapshot_of(name: str, record: dict[str, Any]) -> Snapshot:
    created = record.get("created")
    return Snapshot(name, record.get("subscription"), str(record.get("topic", "")),
                    datetime.fromisoformat(created) if isinstance(created, str) else None)


__all__ = ["SNAPSHOTS_CONFIG", "SeekRefusedError", "SeekableKafka", "Seeking"]
