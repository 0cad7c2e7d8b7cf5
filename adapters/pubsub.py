"""Google Cloud Pub/Sub behind the Adapter contract (google-cloud-pubsub).

Receiving is unary pull on the asyncio GAPIC client: our lease manager owns every deadline, so
none of the Google client's own lease management (its streaming pull manager) runs beside it.
Acks and deadline changes are ``acknowledge`` / ``modify_ack_deadline`` calls of at most
``MAX_ACK_IDS_PER_REQUEST`` ack ids each. Publishing goes through the Google client's batching
publisher (ordering enabled, so ``ordering_key`` works on subscriptions with ordering).

``PUBSUB_EMULATOR_HOST`` is honoured as the Google client does (plain-text gRPC to that host,
no credentials); otherwise application default credentials are used.

``delivery_attempt`` is the server's count when the subscription has a dead-letter policy. Pub/Sub
reports none otherwise, so the adapter counts deliveries per message id itself: that count lives
in this process only (a restart or another consumer starts again from 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from datetime import datetime, timedelta, timezone
from typing import Any

from reliable_sub._loops import PerLoop
from reliable_sub.entries import read_each
from reliable_sub.errors import (
    ConfigurationError,
    InvalidMessageError,
    MissingExtraError,
    UnknownTopicError,
)
from reliable_sub.message import Delivery, Message
from reliable_sub.policy import DeadLetterPolicy, RetryPolicy
from reliable_sub.ports import (
    Capabilities,
    Payload,
    Snapshot,
    SubscriptionStats,
    checked_message,
)
from reliable_sub.replay import check_target
from reliable_sub.telemetry.publishing import InstrumentedPublishing

try:
    import grpc
    from google.api_core import exceptions as google_errors
    from google.cloud import pubsub_v1
    from google.cloud.pubsub_v1.publisher.exceptions import MessageTooLargeError
    from google.pubsub_v1.services.publisher import PublisherClient as GapicPublisherClient
    from google.pubsub_v1.services.subscriber import SubscriberAsyncClient
    from google.pubsub_v1.services.subscriber.transports import SubscriberGrpcAsyncIOTransport
    from google.pubsub_v1.types import DeadLetterPolicy as NativeDeadLetterPolicy
    from google.pubsub_v1.types import PubsubMessage, Subscription
    from google.pubsub_v1.types import RetryPolicy as NativeRetryPolicy

    from reliable_sub.adapters._pubsub_errors import (
        failed_ack_ids,
        named,
        named_errors,
        snapshot_errors,
    )
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise MissingExtraError("PubSubAdapter", "pubsub", "google-cloud-pubsub") from error

logger = logging.getLogger(__name__)

# The service's range for a subscription's ack deadline and for one modifyAckDeadline.
MIN_ACK_DEADLINE = 10.0
MAX_ACK_DEADLINE = 600.0
# A subscription's message retention, in seconds: ten minutes to 31 days.
MIN_RETENTION, MAX_RETENTION = 600.0, 31 * 24 * 3600.0
# The label that names the subscription a snapshot was taken of (Pub/Sub does not keep it).
SNAPSHOT_SUBSCRIPTION_LABEL = "reliable-sub-subscription"
# acknowledge / modifyAckDeadline accept this many ack ids per request (as the Google client).
MAX_ACK_IDS_PER_REQUEST = 2500
# One pull returns at most this many messages.
MAX_PULL_MESSAGES = 1000
# Per-process delivery counts are kept for this many recent message ids.
ATTEMPT_MEMORY = 100_000
# The shortest deadline given to one pull call.
MIN_PULL_TIMEOUT = 0.1
# No further pull once less than this is left of a receive's timeout: the server answers an
# empty pull about a second before its deadline, so a shorter one returns empty at once.
MIN_PULL_WINDOW = 1.5
# The service's limits on one message's attributes (https://cloud.google.com/pubsub/quotas);
# the emulator does not enforce them. The service refuses a whole publish request over them, so
# they are checked before a message joins the client's batch with other callers' messages.
MAX_ATTRIBUTES = 100
MAX_ATTRIBUTE_KEY_BYTES = 256
MAX_ATTRIBUTE_VALUE_BYTES = 1024
# google-cloud-pubsub's PublisherClient.publish(topic, data, ordering_key, retry, timeout,
# **attrs) takes attributes as keyword arguments: an attribute of one of these names would
# collide with a parameter (a TypeError), or be taken as retry/timeout and dropped from the
# message. Such a message is published on its own with the Publish call itself.
PUBLISH_PARAMETERS = frozenset({"self", "topic", "data", "ordering_key", "retry", "timeout"})
# As Google's own transports: no cap on message size. gRPC's default 4 MiB receive limit would
# make every pull that returns a larger message fail (the emulator channel is made here).
CHANNEL_OPTIONS = (("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1))

CAPABILITIES = Capabilities(
    min_ack_deadline=MIN_ACK_DEADLINE,
    max_ack_deadline=MAX_ACK_DEADLINE,
    native_dead_letter=True,
    native_retry_backoff=True,
    exactly_once=True,
    seek=True,
    ordering=True,
    delivery_attempt_exact=False,
    refuses_stale_acks=False,
    messaging_system="gcp_pubsub",
)


# Where google-cloud-pubsub's clients go without an emulator or client options.
_ENDPOINT = "pubsub.googleapis.com:443"


class PubSubAdapter(InstrumentedPublishing):
    """Google Cloud Pub/Sub (or its emulator) as an Adapter.

    Args:
        project_id: the Google Cloud project (the emulator needs 6+ characters).
        subscriber_client: an asyncio ``SubscriberAsyncClient`` you own, used in every loop
            (default: one made per event loop on first use, closed by :meth:`close`).
        publisher_client: a ``pubsub_v1.PublisherClient`` you own (default: one with ordering
            enabled, made on first use and stopped by :meth:`close`).
        admin_client: a sync ``pubsub_v1.SubscriberClient`` for creating and reading
            subscriptions (default: one made on first use, closed by :meth:`close`).

    Not-found and permission errors of the service are raised as ``UnknownSubscriptionError``,
    ``UnknownTopicError`` and ``AccessDeniedError`` naming the resource. ``publish`` refuses
    with ``InvalidMessageError``, before anything is sent, a message the service would refuse
    (neither data nor attributes, over 10 MB, attributes beyond Pub/Sub's limits): the service
    would refuse its whole batch, other callers' messages included.
    """

    def __init__(
        self,
        project_id: str,
        *,
        subscriber_client: SubscriberAsyncClient | None = None,
        publisher_client: pubsub_v1.PublisherClient | None = None,
        admin_client: pubsub_v1.SubscriberClient | None = None,
    ) -> None:
        if not isinstance(project_id, str) or len(project_id) < 6:
            raise ConfigurationError(
                f"PubSubAdapter.project_id must be a project id of 6+ characters, "
                f"got {project_id!r}"
            )
        self.project_id = project_id
        self._given_subscriber = subscriber_client
        self._subscribers: PerLoop[SubscriberAsyncClient] = PerLoop(_new_subscriber_client)
        self._given_publisher = publisher_client
        self._own_publisher: pubsub_v1.PublisherClient | None = None
        self._given_admin = admin_client
        self._own_admin: pubsub_v1.SubscriberClient | None = None
        self._deadlines: dict[str, float] = {}
        self._topics_of: dict[str, str] = {}  # subscription path -> topic (short name)
        self._native_attempts: dict[str, bool] = {}
        self._attempts: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.stats = {"pull_calls": 0, "ack_calls": 0, "modack_calls": 0, "ack_ids_extended": 0}

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def connection_attributes(self) -> dict[str, str | int]:
        """The endpoint its own clients use, for spans: the emulator's
        (``PUBSUB_EMULATOR_HOST``) or Google's; nothing when given a client (its endpoint is
        the caller's)."""
        if self._given_subscriber is not None:
            return {}
        host, _, port = (os.environ.get("PUBSUB_EMULATOR_HOST") or _ENDPOINT).rpartition(":")
        found: dict[str, str | int] = {"server.address": host.strip("[]")}
        if port.isdigit():
            found["server.port"] = int(port)
        return found

    @property
    def _publisher(self) -> pubsub_v1.PublisherClient:
        if self._given_publisher is not None:
            return self._given_publisher
        if self._own_publisher is None:
            self._own_publisher = pubsub_v1.PublisherClient(
                publisher_options=pubsub_v1.types.PublisherOptions(enable_message_ordering=True)
            )
        return self._own_publisher

    @property
    def _admin(self) -> pubsub_v1.SubscriberClient:
        if self._given_admin is not None:
            return self._given_admin
        if self._own_admin is None:
            self._own_admin = pubsub_v1.SubscriberClient()
        return self._own_admin

    # -- names -------------------------------------------------------------------------------

    def topic_path(self, topic: str) -> str:
        if topic.startswith("projects/"):
            return topic
        return f"projects/{self.project_id}/topics/{topic}"

    def subscription_path(self, subscription: str) -> str:
        if subscription.startswith("projects/"):
            return subscription
        return f"projects/{self.project_id}/subscriptions/{subscription}"

    def dedup_namespace(self, subscription: str) -> str:
        """``gcp-pubsub:`` + the full subscription path (short and full names agree)."""
        return "gcp-pubsub:" + self.subscription_path(subscription)

    # -- administration -------------------------------------------------------------------

    def ensure_topic_sync(self, topic: str) -> None:
        """Create ``topic`` if it does not exist."""
        with contextlib.suppress(google_errors.AlreadyExists), named_errors(topic=topic):
            self._publisher.create_topic(name=self.topic_path(topic))

    async def ensure_topic(self, topic: str) -> None:
        await asyncio.to_thread(self.ensure_topic_sync, topic)

    async def topic_exists(self, topic: str) -> bool:
        def exists() -> bool:
            try:
                with named_errors(topic=topic):
                    self._publisher.get_topic(topic=self.topic_path(topic))
            except UnknownTopicError:
                return False
            return True

        return await asyncio.to_thread(exists)

    async def topic_subscriptions(self, topic: str) -> list[str] | None:
        """The names of ``topic``'s subscriptions (a topic keeps nothing without one)."""
        def listed() -> list[str]:
            with named_errors(topic=topic):
                paths = self._publisher.list_topic_subscriptions(topic=self.topic_path(topic))
                return [str(path).rsplit("/", 1)[-1] for path in paths]

        return await asyncio.to_thread(listed)

    def ensure_subscription_sync(
        self,
        topic: str,
        subscription: str,
        *,
        ack_deadline: float = MIN_ACK_DEADLINE,
        dead_letter: DeadLetterPolicy | None = None,
        retry: RetryPolicy | None = None,
        exactly_once: bool = False,
        ordering: bool = False,
        retain_acked_messages: bool = False,
        message_retention: float | None = None,
        **options: Any,
    ) -> None:
        """Create the topic and the subscription if missing (an existing one is left as is).

        Args:
            ack_deadline: the subscription's ack deadline, 10..600 seconds.
            dead_letter: give the subscription a *native* dead-letter policy (the broker
                forwards after ``max_delivery_attempts``, 5..100). Leave it None to dead-letter
                client-side with the Subscriber's ``DeadLetterPolicy`` (the default, the same on
                every adapter).
            retry: give the subscription a *native* retry policy (``min_backoff`` and
                ``max_backoff``, 0..600 s, applied by the broker on nack and expiry).
            exactly_once: enable exactly-once delivery (acks are confirmed).
            ordering: enable message ordering by ``ordering_key``.
            retain_acked_messages: keep acked messages, so a seek to a time can replay them.
            message_retention: seconds messages are kept (Pub/Sub: 600 to 2,678,400; its
                default is seven days).
        """
        if options:
            raise ConfigurationError(
                f"PubSubAdapter.ensure_subscription got unknown options {sorted(options)}; "
                "allowed: ack_deadline, dead_letter, retry, exactly_once, ordering, "
                "retain_acked_messages, message_retention"
            )
        if not MIN_ACK_DEADLINE <= ack_deadline <= MAX_ACK_DEADLINE:
            raise ConfigurationError(
                f"ensure_subscription: ack_deadline must be in [10, 600] on Pub/Sub, "
                f"got {ack_deadline!r}"
            )
        request: dict[str, Any] = {
            "name": self.subscription_path(subscription),
            "topic": self.topic_path(topic),
            "ack_deadline_seconds": math.ceil(ack_deadline),
            "enable_exactly_once_delivery": exactly_once,
            "enable_message_ordering": ordering,
            "retain_acked_messages": retain_acked_messages,
        }
        if message_retention is not None:
            if not MIN_RETENTION <= message_retention <= MAX_RETENTION:
                raise ConfigurationError(
                    f"ensure_subscription: message_retention must be in [{MIN_RETENTION:g}, "
                    f"{MAX_RETENTION:g}] seconds on Pub/Sub, got {message_retention!r}")
            request["message_retention_duration"] = timedelta(seconds=message_retention)
        if dead_letter is not None:
            if not 5 <= dead_letter.max_delivery_attempts <= 100:
                raise ConfigurationError(
                    "a native Pub/Sub dead-letter policy needs max_delivery_attempts in "
                    f"[5, 100], got {dead_letter.max_delivery_attempts}"
                )
            self.ensure_topic_sync(dead_letter.topic)
            request["dead_letter_policy"] = NativeDeadLetterPolicy(
                dead_letter_topic=self.topic_path(dead_letter.topic),
                max_delivery_attempts=dead_letter.max_delivery_attempts,
            )
        if retry is not None:
            request["retry_policy"] = NativeRetryPolicy(
                minimum_backoff=f"{min(retry.min_backoff, MAX_ACK_DEADLINE)}s",
                maximum_backoff=f"{min(retry.max_backoff, MAX_ACK_DEADLINE)}s",
            )
        self.ensure_topic_sync(topic)
        with contextlib.suppress(google_errors.AlreadyExists), named_errors(
            topic=topic, subscription=subscription
        ):
            self._admin.create_subscription(request=request)
        with named_errors(subscription=subscription):
            found = self._admin.get_subscription(subscription=request["name"])
        if found.topic != request["topic"]:
            raise ConfigurationError(
                f"subscription {subscription!r} already exists on topic {found.topic!r}, not "
                f"{request['topic']!r}; choose another subscription name"
            )
        self._remember(found)

    async def ensure_subscription(self, topic: str, subscription: str, **options: Any) -> None:
        await asyncio.to_thread(self.ensure_subscription_sync, topic, subscription, **options)

    async def subscription_ack_deadline(self, subscription: str) -> float:
        path = self.subscription_path(subscription)
        if path not in self._deadlines:
            with named_errors(subscription=subscription):
                found = await asyncio.to_thread(self._admin.get_subscription, subscription=path)
            self._remember(found)
        return self._deadlines[path]

    async def subscription_topic(self, subscription: str) -> str:
        path = self.subscription_path(subscription)
        if path not in self._topics_of:
            with named_errors(subscription=subscription):
                found = await asyncio.to_thread(self._admin.get_subscription, subscription=path)
            self._remember(found)
        return self._topics_of[path]

    def _remember(self, subscription: Subscription) -> None:
        self._deadlines[subscription.name] = float(subscription.ack_deadline_seconds)
        self._topics_of[subscription.name] = subscription.topic.rsplit("/", 1)[-1]
        self._native_attempts[subscription.name] = bool(
            subscription.dead_letter_policy and subscription.dead_letter_policy.dead_letter_topic
        )

    # -- seek and snapshots (the Seekable capability) ---------------------------------------

    def snapshot_path(self, name: str) -> str:
        if name.startswith("projects/"):
            return name
        return f"projects/{self.project_id}/snapshots/{name}"

    async def seek(
        self, subscription: str, *, to: datetime | None = None, snapshot: str | None = None
    ) -> None:
        """Pub/Sub's own Seek (see :class:`~reliable_sub.ports.Seekable`); a seek to a time
        replays acked messages only on a subscription made with ``retain_acked_messages``."""
        check_target(to, snapshot)
        request: dict[str, Any] = {"subscription": self.subscription_path(subscription)}
        if to is not None:
            request["time"] = to
        else:
            request["snapshot"] = self.snapshot_path(snapshot or "")
        with named_errors(subscription=subscription), snapshot_errors(snapshot):
            await asyncio.to_thread(self._admin.seek, request=request)

    async def create_snapshot(self, subscription: str, name: str) -> Snapshot:
        """Pub/Sub's CreateSnapshot; the subscription's name is kept in a label where it fits
        a label's rules (lower-case letters, digits, ``-`` and ``_``, up to 63)."""
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"a snapshot needs a non-empty name, got {name!r}")
        request: dict[str, Any] = {"name": self.snapshot_path(name),
                                   "subscription": self.subscription_path(subscription)}
        if _label_safe(subscription):
            request["labels"] = {SNAPSHOT_SUBSCRIPTION_LABEL: subscription}
        with named_errors(subscription=subscription), snapshot_errors(name):
            made = await asyncio.to_thread(self._admin.create_snapshot, request=request)
        return dataclasses.replace(_snapshot_of(made), subscription=subscription,
                                   created=datetime.now(timezone.utc))

    async def delete_snapshot(self, name: str) -> None:
        with snapshot_errors(name):
            await asyncio.to_thread(self._admin.delete_snapshot,
                                    request={"snapshot": self.snapshot_path(name)})

    async def list_snapshots(self, subscription: str | None = None) -> list[Snapshot]:
        """The project's snapshots; with ``subscription``, those labelled with it (or, without
        the label, taken on its topic)."""

        def listed() -> list[Any]:
            return list(self._admin.list_snapshots(
                request={"project": f"projects/{self.project_id}"}))

        found = [_snapshot_of(raw) for raw in await asyncio.to_thread(listed)]
        if subscription is not None:
            topic = await self.subscription_topic(subscription)
            found = [snap for snap in found if snap.subscription == subscription
                     or (snap.subscription is None and snap.topic == topic)]
        return sorted(found, key=lambda snap: snap.name)

    async def subscription_stats(self, subscription: str) -> SubscriptionStats:
        """The ack deadline only: Pub/Sub reports a subscription's backlog through Cloud
        Monitoring (``subscription/num_undelivered_messages``,
        ``oldest_unacked_message_age``), not through its own API."""
        return SubscriptionStats(None, None, None,
                                 await self.subscription_ack_deadline(subscription))

    # -- publishing ------------------------------------------------------------------------

    def _publish_future(
        self,
        topic: str,
        payload: bytes,
        attributes: dict[str, str],
        ordering_key: str | None,
    ) -> Future[str]:
        try:
            future: Future[str] = self._publisher.publish(
                self.topic_path(topic), payload, ordering_key=ordering_key or "", **attributes
            )
        except MessageTooLargeError as error:
            raise InvalidMessageError(
                f"publish to {topic!r}: a message of {len(payload)} bytes of data (and "
                f"{len(attributes)} attributes) is over Pub/Sub's limit of 10 MB per publish "
                "request; put the payload in storage and publish a reference to it"
            ) from error
        return future

    def _publish_alone(self, topic: str, payload: bytes, attributes: dict[str, str]) -> str:
        """One message with attributes named like ``PUBLISH_PARAMETERS``: the Publish call of
        the client's GAPIC base class, which takes attributes as a mapping (blocking)."""
        with named_errors(topic=topic):
            response = GapicPublisherClient.publish(
                self._publisher, topic=self.topic_path(topic),
                messages=[PubsubMessage(data=payload, attributes=attributes)],
            )
        return str(response.message_ids[0])

    async def publish(
        self,
        topic: str,
        data: Payload,
        attributes: dict[str, str] | None = None,
        ordering_key: str | None = None,
    ) -> str:
        with self._publishing.send(topic, attributes) as attributes:
            payload, checked = _publishable(topic, data, attributes, ordering_key)
            if not PUBLISH_PARAMETERS.isdisjoint(checked):
                return await asyncio.to_thread(self._publish_alone, topic, payload, checked)
            future = self._publish_future(topic, payload, checked, ordering_key)
            try:
                with named_errors(topic=topic):
                    return await asyncio.wrap_future(future)
            except Exception:
                self._resume(topic, ordering_key)
                raise

    def publish_sync(
        self,
        topic: str,
        data: Payload,
        attributes: dict[str, str] | None = None,
        ordering_key: str | None = None,
    ) -> str:
        with self._publishing.send(topic, attributes) as attributes:
            payload, checked = _publishable(topic, data, attributes, ordering_key)
            if not PUBLISH_PARAMETERS.isdisjoint(checked):
                return self._publish_alone(topic, payload, checked)
            future = self._publish_future(topic, payload, checked, ordering_key)
            try:
                with named_errors(topic=topic):
                    return future.result()
            except Exception:
                self._resume(topic, ordering_key)
                raise

    def _resume(self, topic: str, ordering_key: str | None) -> None:
        """After a failed ordered publish the key is paused; let the caller's retry through."""
        if ordering_key:
            self._publisher.resume_publish(self.topic_path(topic), ordering_key)

    # -- consuming -------------------------------------------------------------------------

    def _client(self) -> SubscriberAsyncClient:
        if self._given_subscriber is not None:
            return self._given_subscriber
        return self._subscribers.get()

    async def receive(
        self, subscription: str, max_messages: int, timeout: float
    ) -> list[Delivery]:
        if max_messages < 1:
            raise ConfigurationError(f"receive: max_messages must be >= 1, got {max_messages}")
        path = self.subscription_path(subscription)
        await self.subscription_ack_deadline(subscription)
        client = self._client()
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + max(0.0, timeout)
        while True:
            remaining = give_up_at - loop.time()
            self.stats["pull_calls"] += 1
            try:
                with named_errors(subscription=subscription):
                    response = await client.pull(
                        subscription=path,
                        max_messages=min(max_messages, MAX_PULL_MESSAGES),
                        timeout=max(MIN_PULL_TIMEOUT, remaining),
                        retry=None,
                    )
            except google_errors.DeadlineExceeded:
                response = None
            if response is not None:
                # the raw protobuf, not proto-plus wrappers: several times cheaper per message
                received = response._pb.received_messages
                if received:
                    native = self._native_attempts.get(path, False)
                    return read_each(
                        received, functools.partial(self._delivery, subscription, path,
                                                    native=native),
                        lambda r, problem: self._unreadable(subscription, r, problem))
            # The server holds an empty pull until shortly before its deadline; with less than
            # MIN_PULL_WINDOW left another pull would come back empty at once, again and again.
            if give_up_at - loop.time() < MIN_PULL_WINDOW:
                return []

    def _delivery(self, subscription: str, path: str, received: Any, native: bool) -> Delivery:
        message = received.message
        attempt = received.delivery_attempt
        if not native or attempt < 1:
            attempt = self._count_attempt(path, message.message_id)
        stamp = message.publish_time
        return Delivery(
            Message.received(
                message.message_id,
                message.data,
                dict(message.attributes),
                attempt,
                datetime.fromtimestamp(stamp.seconds + stamp.nanos / 1e9, tz=timezone.utc),
                message.ordering_key or None,
                subscription,
            ),
            received.ack_id,
        )

    def _unreadable(self, subscription: str, received: Any, problem: str) -> Delivery:
        """The delivery of a received message whose reading raised ``problem`` (marked
        malformed: the Subscriber dead-letters it): its id and data."""
        message = received.message
        logger.warning("message %s of %r cannot be read as a message: %s", message.message_id,
                       subscription, problem)
        return Delivery(Message(id=message.message_id, data=message.data,
                                delivery_attempt=max(1, received.delivery_attempt),
                                subscription=subscription),
                        received.ack_id, malformed=problem)

    def _count_attempt(self, path: str, message_id: str) -> int:
        # keyed by subscription too: a message fanned out to several keeps one id on all of them
        attempts = self._attempts
        key = (path, message_id)
        count = attempts.pop(key, 0) + 1
        attempts[key] = count
        if len(attempts) > ATTEMPT_MEMORY:
            attempts.popitem(last=False)
        return count

    async def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        refused = await self._in_chunks(deliveries, self._acknowledge)
        stale = {d.ack_id for d in refused}
        for delivery in deliveries:
            if delivery.ack_id not in stale:
                path = self.subscription_path(delivery.message.subscription)
                self._attempts.pop((path, delivery.message.id), None)
        return refused

    async def nack(self, deliveries: Sequence[Delivery], delay: float = 0.0) -> None:
        seconds = math.ceil(min(MAX_ACK_DEADLINE, max(0.0, delay)))
        await self._in_chunks(deliveries, self._modify_deadline, seconds)

    async def extend(self, deliveries: Sequence[Delivery], seconds: float) -> list[Delivery]:
        deadline = math.ceil(min(MAX_ACK_DEADLINE, max(MIN_ACK_DEADLINE, seconds)))
        refused = await self._in_chunks(deliveries, self._modify_deadline, deadline)
        self.stats["ack_ids_extended"] += len(deliveries) - len(refused)
        return refused

    async def _acknowledge(self, path: str, ack_ids: list[str]) -> None:
        self.stats["ack_calls"] += 1
        await self._client().acknowledge(subscription=path, ack_ids=ack_ids, retry=None)

    async def _modify_deadline(self, path: str, ack_ids: list[str], seconds: int) -> None:
        self.stats["modack_calls"] += 1
        await self._client().modify_ack_deadline(
            subscription=path, ack_ids=ack_ids, ack_deadline_seconds=seconds, retry=None
        )

    async def _in_chunks(
        self, deliveries: Sequence[Delivery], call: Any, *args: Any, retry_transient: bool = True
    ) -> list[Delivery]:
        """``call(path, ack_ids, *args)`` per subscription and chunk; returns the refused.

        A chunk the service rejects as invalid (a stale or unknown ack id in it) is retried one
        ack id at a time, so the valid ones still go through and only the stale are refused.
        """
        refused: list[Delivery] = []
        for path, group in self._by_subscription(deliveries).items():
            for chunk in _chunks(group, MAX_ACK_IDS_PER_REQUEST):
                try:
                    await call(path, [d.ack_id for d in chunk], *args)
                except (google_errors.NotFound, google_errors.PermissionDenied) as error:
                    raise named(error, subscription=path) from error
                except google_errors.GoogleAPICallError as error:
                    failed = failed_ack_ids(error)
                    if failed is None:
                        if not isinstance(error, google_errors.InvalidArgument):
                            raise
                    else:  # exactly-once: the rest of the chunk went through
                        permanent, transient = failed
                        refused.extend(d for d in chunk if d.ack_id in permanent)
                        retry = [d for d in chunk if d.ack_id in transient]
                        if retry and retry_transient:  # once more; then it comes back
                            refused.extend(
                                await self._in_chunks(retry, call, *args, retry_transient=False)
                            )
                        else:
                            refused.extend(retry)
                        continue
                    if len(chunk) == 1:
                        refused.extend(chunk)
                        continue
                    for delivery in chunk:
                        try:
                            await call(path, [delivery.ack_id], *args)
                        except google_errors.InvalidArgument:
                            refused.append(delivery)
        return refused

    def _by_subscription(self, deliveries: Sequence[Delivery]) -> dict[str, list[Delivery]]:
        groups: dict[str, list[Delivery]] = {}
        for delivery in deliveries:
            path = self.subscription_path(delivery.message.subscription)
            groups.setdefault(path, []).append(delivery)
        return groups

    async def close(self) -> None:
        """Close this loop's subscriber client and the clients this adapter made; the adapter
        makes new ones on next use."""
        client = self._subscribers.pop()
        if client is not None:
            await client.transport.close()
        await asyncio.to_thread(self.close_sync)

    def close_sync(self) -> None:
        """Stop the publisher (flushing what it batched) and close the admin client, if this
        adapter made them."""
        publisher, self._own_publisher = self._own_publisher, None
        if publisher is not None:
            publisher.stop()
        admin, self._own_admin = self._own_admin, None
        if admin is not None:
            admin.close()


def _new_subscriber_client() -> SubscriberAsyncClient:
    """An asyncio subscriber client for the running loop (the emulator's when configured)."""
    host = os.environ.get("PUBSUB_EMULATOR_HOST")
    if host:
        channel = grpc.aio.insecure_channel(host, options=CHANNEL_OPTIONS)
        return SubscriberAsyncClient(transport=SubscriberGrpcAsyncIOTransport(channel=channel))
    return SubscriberAsyncClient()


def _publishable(
    topic: str,
    data: Payload,
    attributes: dict[str, str] | None,
    ordering_key: str | None,
) -> tuple[bytes, dict[str, str]]:
    """``checked_message``, then what Pub/Sub refuses for one message, as InvalidMessageError:
    refused alone here rather than by the service with every message of its batch."""
    payload, checked = checked_message(data, attributes)
    where = f"publish to {topic!r}"
    if not payload and not checked:
        raise InvalidMessageError(
            f"{where}: Pub/Sub refuses a message with neither data nor attributes; send "
            "non-empty data or at least one attribute"
        )
    if len(checked) > MAX_ATTRIBUTES:
        raise InvalidMessageError(
            f"{where}: {len(checked)} attributes, Pub/Sub allows at most {MAX_ATTRIBUTES}"
        )
    for name, value in checked.items():
        for part, text, limit in (("name", name, MAX_ATTRIBUTE_KEY_BYTES),
                                  ("value", value, MAX_ATTRIBUTE_VALUE_BYTES)):
            try:
                size = len(text.encode())
            except UnicodeEncodeError as error:
                raise InvalidMessageError(
                    f"{where}: the {part} of attribute {name!r} is not valid Unicode text "
                    f"({error.reason}); Pub/Sub carries UTF-8 only"
                ) from None
            if size > limit:
                raise InvalidMessageError(
                    f"{where}: the {part} of attribute {name[:40]!r} is {size} bytes of UTF-8, "
                    f"Pub/Sub allows at most {limit}"
                )
    if ordering_key and not PUBLISH_PARAMETERS.isdisjoint(checked):
        clashing = sorted(PUBLISH_PARAMETERS.intersection(checked))
        raise InvalidMessageError(
            f"{where}: attributes named {clashing} cannot be published with an ordering key "
            "(google-cloud-pubsub takes them as its publish() arguments, and publishing them "
            "apart from its batches could reorder the key); rename them"
        )
    return payload, checked


def _label_safe(value: str) -> bool:
    return 0 < len(value) <= 63 and all(c.islower() or c.isdigit() or c in "-_" for c in value)


def _snapshot_of(raw: Any) -> Snapshot:
    expires = raw.expire_time if raw.expire_time else None
    return Snapshot(
        name=raw.name.rsplit("/", 1)[-1],
        subscription=raw.labels.get(SNAPSHOT_SUBSCRIPTION_LABEL),
        topic=raw.topic.rsplit("/", 1)[-1],
        expires=expires,
    )


def _chunks(items: list[Delivery], size: int) -> list[list[Delivery]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


__all__ = ["CAPABILITIES", "PubSubAdapter"]
