"""Redis Streams: a topic is a stream, a subscription is a consumer group on it.

Layout of a stream entry (all values bytes):

* ``data`` -- the payload;
* ``attributes`` -- the attributes as a JSON object of strings (absent when there are none);
* ``ordering-key`` -- the publisher's ordering key (absent when none; Redis does not order by it).

The message id is the entry id; the publish time is read from its milliseconds part.

Leasing. Redis has no per-message deadline: an entry is *due* once it has been idle (unacked and
not re-claimed) for the subscription's ack deadline. Every consumer's ``receive`` reclaims due
entries of the group -- so a killed consumer's messages are handled by a live one -- before it
reads new ones. ``extend`` resets the idle time of this consumer's own pending entries (XCLAIM to
itself with JUSTID, which leaves the delivery counter alone), after checking in the same script
that each entry is still ours: XCLAIM with min-idle 0 ignores the owner, so a stalled consumer's
renewal could otherwise snatch back an entry a peer has already reclaimed. ``ack`` checks
ownership the same way before XACK.

An ack id is ``"<entry id>/<delivery count>"``: a delivery is stale once the entry was reclaimed
(the counter moved), given to another consumer, or nacked (nacked entries are parked under the
pseudo-consumer ``NACKED_CONSUMER`` until reclaimed).

``nack(delay)``: the entry's idle time is set to the ack deadline (reclaimable at once), and when
``delay`` > 0 its due time goes into a sorted set that the reclaim script consults: no second
copy of the message is written. ``delivery_attempt`` is Redis's delivery counter.

Subscription settings (topic, ack deadline) are kept in the hash ``{key_prefix}:subscriptions``
so every consumer of a group agrees on the deadline. A group name belongs to one stream: using it
for a second stream is refused (as Pub/Sub refuses a second subscription of one name).

Fields beside these (another producer's ``correlation_id``) are attributes of their own names.
An entry this adapter cannot read as a message (no ``data`` field, attributes that are not a JSON
object of strings, a non-UTF-8 ordering key, or anything else its parse raises) is still
delivered, marked malformed and with every field kept (adapters/_redis_entries.py), so the
Subscriber dead-letters it whole; the rest of its batch is delivered as usual
(:func:`reliable_sub.entries.read_each`). An entry id past the year 9999 (an
id given by hand) leaves the publish time None; a delivery counter past 2**53 or below 0 (set by
hand with XCLAIM RETRYCOUNT, or wrapped around) is reset to 1 by the reclaim, as Lua cannot
count it exactly and the ack could never match it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import math
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from reliable_sub.adapters._redis_entries import (
    LAYOUTS,
    Entry,
    entries_of,
    field_map,
    publish_time,
    read_foreign,
    unreadable,
    written_fields,
)
from reliable_sub.entries import read_each
from reliable_sub.errors import (
    ConfigurationError,
    MissingExtraError,
    SnapshotExistsError,
    UnknownSnapshotError,
    UnknownSubscriptionError,
)
from reliable_sub.message import Delivery, Message
from reliable_sub.ports import (
    Capabilities,
    Claimed,
    Completion,
    DedupStore,
    Outgoing,
    Payload,
    Snapshot,
    SubscriptionStats,
    attributes_from_json,
    checked_message,
)
from reliable_sub.replay import check_target
from reliable_sub.telemetry.publishing import InstrumentedPublishing

try:
    import redis
    import redis.asyncio as aioredis
    from redis.crc import key_slot
    from redis.exceptions import ResponseError

    from reliable_sub._redis_clients import (
        AsyncClient,
        RedisClients,
        SyncClient,
        lua_source,
        script,
    )
    from reliable_sub.adapters._redis_groups import (
        create_group,
        create_group_sync,
        raise_unless_group_exists,
        skipped_warning,
    )
    from reliable_sub.dedup._redis import COMPLETE_LUA, RedisDedupStore
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise MissingExtraError("RedisStreamsAdapter", "redis", "redis") from error

logger = logging.getLogger(__name__)

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_ACK_DEADLINE = 30.0
DEFAULT_KEY_PREFIX = "reliable-sub"
# Nacked entries are parked under this consumer name, so the nacking consumer's later ack or
# extend of the same delivery is refused as stale, as on every other broker.
NACKED_CONSUMER = "reliable-sub:nacked"
# Reclaim due entries at least this often while receiving (and after a full page, at once):
# a tenth of the ack deadline, within these bounds, keeps redelivery prompt without a round trip
# per receive call.
RECLAIM_INTERVAL_MIN = 0.02
RECLAIM_INTERVAL_MAX = 1.0
RECLAIM_FRACTION = 0.1
# ensure_topic makes an empty stream by creating, then destroying, a group of this name.
TOPIC_PROBE_GROUP = "reliable-sub:ensure-topic"

CAPABILITIES = Capabilities(
    min_ack_deadline=0.0,
    max_ack_deadline=math.inf,
    native_dead_letter=False,
    native_retry_backoff=False,
    exactly_once=True,
    seek=True,
    ordering=False,
    delivery_attempt_exact=True,
    extension_limited_to_ack_deadline=True,
    messaging_system="redis",
)

# The scripts live in adapters/lua/ (package data of reliable_sub.adapters), each opening with
# what its KEYS and ARGV are. Times are the server's (TIME), so clients with skewed clocks agree.
_RECLAIM = lua_source(__package__, "now_ms", "streams_reclaim")
_EXTEND = lua_source(__package__, "owned", "streams_extend")
_ACK = lua_source(__package__, "owned", "ack_owned", "streams_ack")
# completions fenced as RedisDedupStore.complete_many fences them (COMPLETE_LUA)
_ACK_COMPLETE = lua_source(__package__, "owned", "ack_owned") + COMPLETE_LUA + lua_source(
    __package__, "streams_ack_complete"
)
_NACK = lua_source(__package__, "owned", "now_ms", "streams_nack")
_SEEK = lua_source(__package__, "now_ms", "streams_seek")
# The largest sequence number of an entry id: "<ms>-MAX_SEQUENCE" is the last id of a millisecond.
MAX_SEQUENCE = 2**64 - 1


@dataclass(eq=False)
class _Subscription:
    name: str
    stream: str
    ack_deadline: float
    start: str
    delayed_key: str
    next_reclaim: float = 0.0
    reclaim_from: str = "-"

    @property
    def reclaim_interval(self) -> float:
        interval = self.ack_deadline * RECLAIM_FRACTION
        return min(RECLAIM_INTERVAL_MAX, max(RECLAIM_INTERVAL_MIN, interval))


def default_consumer_name() -> str:
    """A stable, unique consumer name for this process: host and pid."""
    return f"{socket.gethostname()}-{os.getpid()}"


class RedisStreamsAdapter(InstrumentedPublishing):
    """Redis Streams consumer groups behind the Adapter contract.

    Args:
        url_or_client: a ``redis://`` URL (a client is made per event loop, retrying commands
            that meet a dropped connection), or a ``redis.asyncio.Redis`` client (bytes
            responses) that you own: it is used in every loop, and closing the adapter only
            releases its connections.
        consumer: this consumer's name in its groups (default: host and pid).
        key_prefix: prefix of the keys this adapter keeps besides the streams.
        max_len: cap streams at about this many entries on publish (XADD MAXLEN ~), or None.
        sync_client: the ``redis.Redis`` client for the blocking twins (default: one built from
            the URL or from the async client's connection settings).
    """

    def __init__(
        self,
        url_or_client: str | aioredis.Redis = DEFAULT_URL,
        *,
        consumer: str | None = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        max_len: int | None = None,
        sync_client: redis.Redis | None = None,
    ) -> None:
        # redis-py 8's asyncio client does not retry by default: after a Redis restart the first
        # command on each pooled connection would fail although Redis is back; ours do.
        self.clients = RedisClients(
            url_or_client, owner="RedisStreamsAdapter", sync_client=sync_client
        )
        if max_len is not None and max_len < 1:
            raise ConfigurationError(f"RedisStreamsAdapter.max_len must be >= 1, got {max_len!r}")
        self.consumer = consumer or default_consumer_name()
        self._prefix = key_prefix
        self._max_len = max_len
        self._settings_key = f"{key_prefix}:subscriptions"
        self._subscriptions: dict[str, _Subscription] = {}
        self._reclaim = script(_RECLAIM)
        self._extend = script(_EXTEND)
        self._ack = script(_ACK)
        self._nack = script(_NACK)
        self._ack_complete = script(_ACK_COMPLETE)
        self._seek = script(_SEEK)
        self._snapshots_key = f"{key_prefix}:snapshots"
        self.stats = {"reclaimed": 0, "gone": 0, "malformed": 0}

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def connection_attributes(self) -> dict[str, str | int]:
        """The server (a cluster's first seed node) and this consumer's name, for spans."""
        found: dict[str, str | int] = {"messaging.client.id": self.consumer}
        host, port = (self.clients.connection_kwargs.get(k) for k in ("host", "port"))
        if host:
            found["server.address"] = str(host)
        if port:
            found["server.port"] = int(port)
        return found

    @property
    def client(self) -> AsyncClient:
        """The asyncio client of the running event loop."""
        return self.clients.get()

    @property
    def _sync(self) -> SyncClient:
        return self.clients.sync

    # -- administration -------------------------------------------------------------------

    def _delayed_key(self, stream: str, group: str) -> str:
        # the stream's hash tag keeps the set in the stream's cluster slot
        return f"{self._prefix}:delayed:{{{hash_tag(stream)}}}:{group}"

    def _settings(
        self, topic: str, ack_deadline: float, start: str, options: dict[str, Any]
    ) -> bytes:
        # A stream keeps its entries, acked or not, until max_len trims them: a seek can always
        # replay them, so retain_acked_messages (as on Pub/Sub and memory) asks for nothing more.
        options.pop("retain_acked_messages", None)
        if options:
            raise ConfigurationError(
                f"RedisStreamsAdapter.ensure_subscription got unknown options {sorted(options)}; "
                "allowed: ack_deadline, start, retain_acked_messages"
            )
        if not ack_deadline > 0:
            raise ConfigurationError(
                f"ensure_subscription: ack_deadline must be in (0, inf), got {ack_deadline!r}"
            )
        if start not in ("$", "0"):
            raise ConfigurationError(
                f"ensure_subscription: start must be '$' (new entries) or '0' (the whole "
                f"stream), got {start!r}"
            )
        return _settings_json(topic, ack_deadline, start)

    async def ensure_subscription(
        self,
        topic: str,
        subscription: str,
        *,
        ack_deadline: float = DEFAULT_ACK_DEADLINE,
        start: str = "$",
        **options: Any,
    ) -> None:
        """Create the consumer group ``subscription`` on stream ``topic`` (idempotent).

        Args:
            ack_deadline: seconds an entry may stay idle before another consumer reclaims it.
            start: ``"$"`` (the default) to deliver entries added from now on, as a new Pub/Sub
                subscription gets only later messages; ``"0"`` for the whole stream. It counts
                only when the group is created: a group made at ``"$"`` never delivers what
                the stream held before it (a first trial that publishes, then starts the
                consumer, handles nothing), so creating one on a stream that holds entries
                logs a WARNING with their count and the fix (``start="0"``, or a seek of
                the existing group to 1970).
            **options: ``retain_acked_messages`` is accepted for portability; a stream always
                keeps acked entries until ``max_len`` trims them, so a seek can replay them.
        """
        settings = self._settings(topic, ack_deadline, start, options)
        client = self.client
        _check_same_topic(subscription, topic,
                          await _record_settings(client, self._settings_key, subscription,
                                                 settings))
        skipped = await create_group(client, topic, subscription, start,
                                     cluster=self.clients.cluster)
        if skipped:
            logger.warning("%s", skipped_warning(topic, subscription, skipped))
        self._subscriptions.pop(subscription, None)
        await self._subscription(subscription)

    def ensure_subscription_sync(
        self,
        topic: str,
        subscription: str,
        *,
        ack_deadline: float = DEFAULT_ACK_DEADLINE,
        start: str = "$",
        **options: Any,
    ) -> None:
        settings = self._settings(topic, ack_deadline, start, options)
        sync = self._sync
        sync.hsetnx(self._settings_key, subscription, settings)
        recorded: Any = sync.hget(self._settings_key, subscription)
        _check_same_topic(subscription, topic, recorded)
        skipped = create_group_sync(sync, topic, subscription, start,
                                    cluster=self.clients.cluster)
        if skipped:
            logger.warning("%s", skipped_warning(topic, subscription, skipped))
        self._subscriptions.pop(subscription, None)

    async def ensure_topic(self, topic: str) -> None:
        """Create ``topic`` as an empty stream if it does not exist."""
        client = self.client
        try:
            await client.xgroup_create(topic, TOPIC_PROBE_GROUP, id="$", mkstream=True)
        except ResponseError as error:
            raise_unless_group_exists(error)
        await client.xgroup_destroy(topic, TOPIC_PROBE_GROUP)

    def ensure_topic_sync(self, topic: str) -> None:
        """Blocking twin of :meth:`ensure_topic`."""
        try:
            self._sync.xgroup_create(topic, TOPIC_PROBE_GROUP, id="$", mkstream=True)
        except ResponseError as error:
            raise_unless_group_exists(error)
        self._sync.xgroup_destroy(topic, TOPIC_PROBE_GROUP)

    async def topic_exists(self, topic: str) -> bool:
        """Whether stream ``topic`` exists (a key of another type raises a clear error)."""
        kind = _text(await self.client.type(topic))
        if kind not in ("stream", "none"):
            raise ConfigurationError(f"topic {topic!r} is a Redis {kind}, not a stream")
        return kind == "stream"

    def dedup_namespace(self, subscription: str) -> str:
        """``redis:<key prefix>:<group>``: a group name belongs to one stream per key prefix
        (see ``ensure_subscription``), and Redis entry ids are unique only within a stream."""
        return f"redis:{self._prefix}:{subscription}"

    async def subscription_ack_deadline(self, subscription: str) -> float:
        return (await self._subscription(subscription)).ack_deadline

    async def subscription_topic(self, subscription: str) -> str:
        return (await self._subscription(subscription)).stream

    async def _subscription(self, name: str) -> _Subscription:
        sub = self._subscriptions.get(name)
        if sub is not None:
            return sub
        raw = await self.client.hget(self._settings_key, name)
        if raw is None:
            raise UnknownSubscriptionError(
                f"subscription {name!r} does not exist; create it with ensure_subscription"
            )
        settings = json.loads(raw)
        sub = _Subscription(
            name=name,
            stream=settings["topic"],
            ack_deadline=float(settings["ack_deadline"]),
            start=settings.get("start", "$"),
            delayed_key=self._delayed_key(settings["topic"], name),
        )
        self._subscriptions[name] = sub
        return sub

    async def _recreate_group(self, sub: _Subscription) -> None:
        """After a Redis restart without persistence: the group (and stream) are gone.

        The group is recreated at the start of the stream, not at ``start``: whatever the
        stream holds now was published after the loss, and "$" would skip it.
        """
        logger.warning("consumer group %r on stream %r is gone (Redis restarted?); recreating "
                       "it at the start of the stream", sub.name, sub.stream)
        settings = _settings_json(sub.stream, sub.ack_deadline, sub.start)
        await self._create_group(sub.stream, sub.name, "0", settings)

    async def _create_group(self, stream: str, group: str, start: str, settings: bytes) -> None:
        """Create ``group`` at ``start`` (idempotent) and record its settings if none are."""
        client = self.client
        try:
            await client.xgroup_create(stream, group, id=start, mkstream=True)
        except ResponseError as error:
            raise_unless_group_exists(error)
        await client.hsetnx(self._settings_key, group, settings)

    # -- seek and snapshots (the Seekable capability) ---------------------------------------

    async def seek(
        self, subscription: str, *, to: datetime | None = None, snapshot: str | None = None
    ) -> None:
        """Seek ``subscription``'s group to a time or a snapshot (see
        :class:`~reliable_sub.ports.Seekable`): the group is recreated, in one script, with its
        last-delivered id before the time (entry ids carry their millisecond) and no pending
        entries. Entries trimmed from the stream (``max_len``) cannot come back."""
        check_target(to, snapshot)
        sub = await self._subscription(subscription)
        if to is not None:
            target = ["time", str(math.ceil(to.timestamp() * 1000))]
        else:
            record = await self._snapshot_record(snapshot or "")
            if record["subscription"] != subscription:
                raise ConfigurationError(
                    f"snapshot {snapshot!r} was taken of {record['subscription']!r}, not "
                    f"{subscription!r}")
            target = ["id", record["resume_after"]]
        await self._seek(keys=[sub.stream, sub.delayed_key], args=[subscription, *target],
                         client=self.client)
        sub.reclaim_from = "-"

    async def create_snapshot(self, subscription: str, name: str) -> Snapshot:
        """Take a snapshot of ``subscription``: the id before its oldest pending entry (or its
        last-delivered id when none is pending), kept in the hash ``{key_prefix}:snapshots``.
        A seek to it delivers again every entry after that id: the ones unacked when it was
        taken, those published since, and also any acked between them."""
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"a snapshot needs a non-empty name, got {name!r}")
        sub = await self._subscription(subscription)
        group, pending, now_ms = await self._group_state(sub)
        oldest = pending.get("min") if pending.get("pending") else None
        resume_after = _id_before(_text(oldest)) if oldest else _text(group["last-delivered-id"])
        created = datetime.fromtimestamp(now_ms / 1000, tz=timezone.utc)
        record = {"subscription": subscription, "topic": sub.stream,
                  "created": created.isoformat(), "resume_after": resume_after}
        if not await self.client.hsetnx(self._snapshots_key, name, json.dumps(record)):
            raise SnapshotExistsError(f"snapshot {name!r} already exists")
        return _snapshot_of(name, record)

    async def delete_snapshot(self, name: str) -> None:
        if not await self.client.hdel(self._snapshots_key, name):
            raise UnknownSnapshotError(f"snapshot {name!r} does not exist")

    async def list_snapshots(self, subscription: str | None = None) -> list[Snapshot]:
        raw = await self.client.hgetall(self._snapshots_key)
        found = [_snapshot_of(_text(name), json.loads(value)) for name, value in raw.items()]
        return sorted((snap for snap in found
                       if subscription is None or snap.subscription == subscription),
                      key=lambda snap: snap.name)

    async def subscription_stats(self, subscription: str) -> SubscriptionStats:
        """From XINFO GROUPS (the group's lag: entries not yet delivered) and XPENDING (the
        pending entries and the oldest one's id, whose milliseconds date it). The backlog is
        unknown (None) when Redis cannot count the lag (after entries were deleted)."""
        sub = await self._subscription(subscription)
        group, pending, now_ms = await self._group_state(sub)
        in_flight = int(pending.get("pending") or 0)
        lag = group.get("lag")
        oldest = pending.get("min") if in_flight else None
        if oldest is None and lag:  # nothing pending: the oldest unacked is the next to deliver
            last = _text(group["last-delivered-id"])
            after = await self.client.xrange(sub.stream, min=f"({last}", count=1)
            oldest = after[0][0] if after else None
        age = None if oldest is None else max(0.0, (now_ms - int(_text(oldest).split("-")[0]))
                                              / 1000)
        backlog = None if lag is None else int(lag) + in_flight
        return SubscriptionStats(backlog, in_flight, age, sub.ack_deadline)

    async def _group_state(self, sub: _Subscription) -> tuple[dict[str, Any], dict[str, Any], int]:
        """The group's XINFO GROUPS entry, its XPENDING summary and the server's time in ms,
        read together (on a cluster one after the other: its pipelines carry no TIME)."""
        client = self.client
        if self.clients.cluster:
            groups = await client.xinfo_groups(sub.stream)
            pending = await client.xpending(sub.stream, sub.name)
            seconds, micros = await client.time()
        else:
            async with client.pipeline(transaction=True) as pipe:
                pipe.xinfo_groups(sub.stream)
                pipe.xpending(sub.stream, sub.name)
                pipe.time()
                groups, pending, (seconds, micros) = await pipe.execute()
        found = [g for g in groups if _text(g["name"]) == sub.name]
        if not found:
            raise UnknownSubscriptionError(
                f"consumer group {sub.name!r} is gone from stream {sub.stream!r} (Redis "
                "restarted without persistence?); a consumer recreates it on its next receive")
        return found[0], pending, int(seconds) * 1000 + int(micros) // 1000

    async def _snapshot_record(self, name: str) -> dict[str, str]:
        raw = await self.client.hget(self._snapshots_key, name)
        if raw is None:
            raise UnknownSnapshotError(f"snapshot {name!r} does not exist")
        record: dict[str, str] = json.loads(raw)
        return record

    # -- publishing ------------------------------------------------------------------------

    def _fields(
        self, data: Payload, attributes: dict[str, str] | None, ordering_key: str | None
    ) -> dict[str | bytes, bytes]:
        payload, checked = checked_message(data, attributes)
        if checked and not LAYOUTS.isdisjoint(checked):  # another producer's layout, again
            foreign = written_fields(payload, checked, ordering_key)
            if foreign is not None:
                return foreign  # type: ignore[return-value]  # bytes keys: a dict is invariant
        fields: dict[str | bytes, bytes] = {"data": payload}
        if checked:
            fields["attributes"] = json.dumps(checked, separators=(",", ":")).encode()
        if ordering_key:
            fields["ordering-key"] = ordering_key.encode()
        return fields

    async def publish(
        self,
        topic: str,
        data: Payload,
        attributes: dict[str, str] | None = None,
        ordering_key: str | None = None,
    ) -> str:
        with self._publishing.send(topic, attributes) as attributes:
            fields = self._fields(data, attributes, ordering_key)
            entry_id = await self.client.xadd(
                topic, fields, maxlen=self._max_len, approximate=True  # type: ignore[arg-type]
            )
        return _text(entry_id)

    async def publish_many(self, messages: Sequence[Outgoing]) -> list[str | Exception]:
        """Publish ``messages`` in one pipelined round trip (XADDs in the order given); returns
        each one's entry id or the error that refused it. (No spans of its own: the caller,
        such as the outbox relay, makes them.)"""
        started = time.perf_counter()
        results: list[str | Exception] = []
        pipe = self.client.pipeline(transaction=False)
        queued = []
        for message in messages:
            try:
                fields = self._fields(message.data, message.attributes, message.ordering_key)
            except (TypeError, ValueError) as error:
                results.append(error)
                continue
            results.append("")  # the entry id, once the pipeline has run
            queued.append(len(results) - 1)
            pipe.xadd(message.topic, fields,  # type: ignore[arg-type]
                      maxlen=self._max_len, approximate=True)
        if queued:
            try:
                replies = await pipe.execute(raise_on_error=False)
            except Exception as error:  # the connection: none of the queued ones is known sent
                self._publishing.sent_many(
                    messages, [error if r == "" else r for r in results], started)
                raise
            for index, reply in zip(queued, replies, strict=True):
                results[index] = reply if isinstance(reply, Exception) else _text(reply)
        self._publishing.sent_many(messages, results, started)
        return results

    def publish_sync(
        self,
        topic: str,
        data: Payload,
        attributes: dict[str, str] | None = None,
        ordering_key: str | None = None,
    ) -> str:
        with self._publishing.send(topic, attributes) as attributes:
            fields = self._fields(data, attributes, ordering_key)
            entry_id = self._sync.xadd(
                topic, fields, maxlen=self._max_len, approximate=True  # type: ignore[arg-type]
            )
        return _text(entry_id)

    # -- consuming -------------------------------------------------------------------------

    async def receive(
        self, subscription: str, max_messages: int, timeout: float
    ) -> list[Delivery]:
        if max_messages < 1:
            raise ConfigurationError(f"receive: max_messages must be >= 1, got {max_messages}")
        sub = await self._subscription(subscription)
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + max(0.0, timeout)
        while True:
            now = loop.time()
            if now >= sub.next_reclaim:
                reclaimed, more = await self._reclaim_due(sub, max_messages)
                sub.next_reclaim = now if more else now + sub.reclaim_interval
                if reclaimed:
                    return reclaimed
            remaining = give_up_at - now
            block = min(remaining, sub.next_reclaim - now)
            fresh = await self._read_new(sub, max_messages, block)
            if fresh or loop.time() >= give_up_at:
                return fresh

    async def _read_new(
        self, sub: _Subscription, max_messages: int, block: float
    ) -> list[Delivery]:
        block_ms = int(block * 1000)
        try:
            reply = await self.client.xreadgroup(
                sub.name,
                self.consumer,
                {sub.stream: ">"},
                count=max_messages,
                block=block_ms if block_ms >= 1 else None,  # 0 would block forever
            )
        except ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
            await self._recreate_group(sub)
            return []
        if not reply:
            return []
        return read_each(entries_of(reply), functools.partial(self._delivery, sub),
                         functools.partial(self._unreadable, sub))

    async def _reclaim_due(
        self, sub: _Subscription, max_messages: int
    ) -> tuple[list[Delivery], bool]:
        min_idle_ms = int(sub.ack_deadline * 1000)
        try:
            claimed, counts, gone, next_start = await self._reclaim(
                keys=[sub.stream, sub.delayed_key],
                args=[sub.name, self.consumer, min_idle_ms, max_messages, sub.reclaim_from],
                client=self.client,
            )
        except ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
            await self._recreate_group(sub)
            return [], False
        sub.reclaim_from = _text(next_start)
        self._count_gone(sub, len(gone), [_text(g) for g in gone])
        entries = [(_text(entry[0]), field_map(entry[1]), int(count))
                   for entry, count in zip(claimed, counts, strict=True)]
        deliveries = read_each(entries, functools.partial(self._delivery, sub),
                               functools.partial(self._unreadable, sub))
        self.stats["reclaimed"] += len(deliveries)
        return deliveries, sub.reclaim_from != "-"

    def _delivery(self, sub: _Subscription, entry: Entry) -> Delivery:
        entry_id, fields, attempt = entry
        problem = None
        attributes: dict[str, str] = {}
        raw_attributes = fields.get(b"attributes")
        if raw_attributes:
            try:
                attributes = attributes_from_json(raw_attributes)
            except ValueError as error:
                problem = f"attributes field: {error}"
        ordering_key = None
        raw_key = fields.get(b"ordering-key")
        if raw_key:
            try:
                ordering_key = raw_key.decode()
            except UnicodeDecodeError as error:
                problem = f"ordering-key field is not UTF-8 ({error})"
        data = fields.get(b"data")
        if (problem is not None or data is None
                or len(fields) > 1 + (raw_attributes is not None) + (raw_key is not None)):
            data, attributes, problem = read_foreign(fields, attributes, problem)
        message = Message.received(entry_id, data, attributes, attempt,
                                   publish_time(entry_id), ordering_key, sub.name)
        if problem is not None:
            return self._malformed(sub, message, attempt, problem)
        return Delivery(message, f"{entry_id}/{attempt}")

    def _unreadable(self, sub: _Subscription, entry: Entry, problem: str) -> Delivery:
        """The delivery of an entry whose parse raised ``problem``: all its fields, unread
        (adapters/_redis_entries.py)."""
        entry_id, fields, attempt = entry
        data, attributes = unreadable(fields)
        message = Message(id=entry_id, data=data, attributes=attributes,
                          delivery_attempt=attempt, subscription=sub.name)
        return self._malformed(sub, message, attempt, problem)

    def _malformed(
        self, sub: _Subscription, message: Message, attempt: int, problem: str
    ) -> Delivery:
        self.stats["malformed"] += 1
        logger.warning("entry %s of stream %r cannot be read as a message: %s", message.id,
                       sub.stream, problem)
        return Delivery(message, f"{message.id}/{attempt}", malformed=problem)

    async def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        refused: list[Delivery] = []
        for sub, group in self._by_subscription(deliveries).items():
            stale = await self._ack(
                keys=[sub.stream], args=[sub.name, self.consumer, *_ack_ids(group)],
                client=self.client,
            )
            refused.extend(group[int(i) - 1] for i in stale)
        return refused

    def shares_store(self, store: DedupStore) -> bool:
        """True when ``store`` is a RedisDedupStore on this adapter's Redis (the fast path)."""
        return isinstance(store, RedisDedupStore) and store.same_server(self.clients)

    async def ack_with_completions(
        self,
        deliveries: Sequence[Delivery],
        store: DedupStore,
        completions: Sequence[Completion],
        ttl: float,
    ) -> tuple[list[Delivery], list[Claimed]]:
        """Record ``completions`` in ``store`` and ack ``deliveries``: one script call per
        subscription in the batch (usually one), instead of a store call and then a script.

        Completions are fenced as ``complete_many`` fences them; returns the refused deliveries
        and the claims of refused completions.
        """
        assert isinstance(store, RedisDedupStore)
        keys, args = store.completion_records(completions, ttl)
        ttl_ms, pairs = args[0], args[1:]
        refused: list[Delivery] = []
        lost: list[Claimed] = []
        client = self.client
        for sub, group in self._by_subscription(deliveries).items():
            stale, refused_completions = await self._ack_complete(
                keys=[sub.stream, *keys],
                args=[sub.name, self.consumer, len(keys), ttl_ms, *pairs, *_ack_ids(group)],
                client=client,
            )
            lost.extend(completions[int(i) - 1].claim for i in refused_completions)
            keys, pairs = [], []  # written with the first call
            refused.extend(group[int(i) - 1] for i in stale)
        return refused, lost

    async def nack(self, deliveries: Sequence[Delivery], delay: float = 0.0) -> None:
        for sub, group in self._by_subscription(deliveries).items():
            gone = await self._nack(
                keys=[sub.stream, sub.delayed_key],
                args=[sub.name, self.consumer, NACKED_CONSUMER, int(sub.ack_deadline * 1000),
                      max(0, int(delay * 1000)), *_ack_ids(group)],
                client=self.client,
            )
            self._count_gone(sub, int(gone))

    async def extend(self, deliveries: Sequence[Delivery], seconds: float) -> list[Delivery]:
        refused: list[Delivery] = []
        for sub, group in self._by_subscription(deliveries).items():
            idle_ms = max(0, int((sub.ack_deadline - seconds) * 1000))
            stale, gone = await self._extend(
                keys=[sub.stream], args=[sub.name, self.consumer, idle_ms, *_ack_ids(group)],
                client=self.client,
            )
            self._count_gone(sub, int(gone))
            refused.extend(group[int(i) - 1] for i in stale)
        return refused

    def _count_gone(self, sub: _Subscription, count: int, ids: Sequence[str] = ()) -> None:
        if not count:
            return
        self.stats["gone"] += count
        logger.warning(
            "%d pending entries of %r were deleted or trimmed from stream %r before they were "
            "acked; dropped from the group %s", count, sub.name, sub.stream, list(ids)[:10],
        )

    def _by_subscription(
        self, deliveries: Sequence[Delivery]
    ) -> dict[_Subscription, list[Delivery]]:
        groups: dict[_Subscription, list[Delivery]] = {}
        for delivery in deliveries:
            name = delivery.message.subscription
            sub = self._subscriptions.get(name)
            if sub is None:
                raise UnknownSubscriptionError(
                    f"subscription {name!r} is not known to this adapter; receive from it first"
                )
            groups.setdefault(sub, []).append(delivery)
        return groups

    async def close(self) -> None:
        """Release this loop's connections and the blocking client's; reconnects on next use."""
        await self.clients.close()

    def close_sync(self) -> None:
        """Release the blocking client's connections."""
        self.clients.close_sync()


@functools.lru_cache(maxsize=4096)
def hash_tag(key: str) -> str:
    """A hash tag for keys that must share ``key``'s Redis Cluster slot (``...{tag}...``):
    what the cluster hashes of ``key`` (the text of its first non-empty ``{...}``, else all of
    it), or, when that text holds a ``}`` and so cannot sit between braces, a short stand-in
    of the same slot."""
    hashed = key
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            hashed = key[start + 1 : end]
    if "}" not in hashed:
        return hashed
    slot = key_slot(key.encode())
    return next(f"slot-{n}" for n in itertools.count() if key_slot(f"slot-{n}".encode()) == slot)


def _id_before(entry_id: str) -> str:
    """The greatest entry id below ``entry_id``."""
    ms, sequence = (int(part) for part in entry_id.split("-"))
    if sequence > 0:
        return f"{ms}-{sequence - 1}"
    return f"{ms - 1}-{MAX_SEQUENCE}" if ms > 0 else "0-0"


def _snapshot_of(name: str, record: dict[str, str]) -> Snapshot:
    return Snapshot(name, record["subscription"], record["topic"],
                    datetime.fromisoformat(record["created"]), None)


def _settings_json(topic: str, ack_deadline: float, start: str) -> bytes:
    return json.dumps({"topic": topic, "ack_deadline": ack_deadline, "start": start}).encode()


async def _record_settings(
    client: AsyncClient, key: str, group: str, settings: bytes
) -> bytes | None:
    """Record ``group``'s settings unless some are; return what is recorded now."""
    async with client.pipeline(transaction=True) as pipe:
        pipe.hsetnx(key, group, settings)
        pipe.hget(key, group)
        _, recorded = await pipe.execute()
    return recorded  # type: ignore[no-any-return]


def _check_same_topic(group: str, topic: str, recorded: bytes | None) -> None:
    """Refuse a group name that is already the subscription of another stream."""
    if recorded is None:
        return
    existing = json.loads(recorded).get("topic")
    if existing != topic:
        raise ConfigurationError(
            f"subscription {group!r} already exists on topic {existing!r}, not {topic!r}; "
            "a subscription (consumer group) name belongs to one stream: choose another name"
        )


def _ack_ids(deliveries: Sequence[Delivery]) -> list[str]:
    return [delivery.ack_id for delivery in deliveries]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


__all__ = ["CAPABILITIES", "DEFAULT_URL", "RedisStreamsAdapter", "hash_tag"]
