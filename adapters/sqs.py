"""Amazon SQS behind the Adapter contract (aiobotocore; boto3 for the blocking twins).

Layout (``_sqs_topology``). A topic is a queue, and that queue is the topic's one subscription:
SQS has no fan-out, declared absent. A subscription named otherwise than its topic is recorded
on the queue and by an empty queue of its name, so every consumer finds it from the name alone.
``ordering=True`` makes the topic's queue a FIFO queue (``.fifo`` is added to its name).

Leases. The queue's ``VisibilityTimeout`` is the subscription's ack deadline, and every receive
asks for it explicitly. ``extend`` is ``ChangeMessageVisibilityBatch`` (``_sqs_batches``: 10
entries a call, the chunks together, judged entry by entry), cut to SQS's cap of 12 hours from
the receive; ``nack(delay)`` sets the visibility to the delay (rounded up to whole seconds, cut
to the same cap: a longer backoff comes back sooner than asked, with a warning), ``nack(0)`` to
0. Acks are ``DeleteMessageBatch``. The adapter keeps each receipt handle's lease
(``_sqs_leases``) and refuses, without a call, an ack, nack or extend of a handle whose lease
ran out or whose message it received again (AWS would delete with a stale handle).

Messages (``_sqs_messages``): text bodies as text, other data base64 with an attribute saying
so; attributes as SQS attributes while they fit SQS's rules, else as one JSON attribute; the
ordering key is the ``MessageGroupId``; on FIFO queues the idempotency key is the
``MessageDeduplicationId`` (SQS drops a copy sent within 5 minutes: the dedup store catches
those that come later). ``delivery_attempt`` is ``ApproximateReceiveCount``; the message id is
SQS's ``MessageId``; the publish time its ``SentTimestamp``. Figures: SQS's approximate counts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from reliable_sub._loops import PerLoop
from reliable_sub.errors import (
    AdapterError,
    ConfigurationError,
    MissingExtraError,
    UnknownSubscriptionError,
    UnknownTopicError,
)
from reliable_sub.message import Delivery
from reliable_sub.policy import DeadLetterPolicy
from reliable_sub.ports import Capabilities, Outgoing, Payload, SubscriptionStats, checked_message
from reliable_sub.telemetry.publishing import InstrumentedPublishing

try:
    from botocore.exceptions import ClientError

    from reliable_sub.adapters import _sqs_topology as topology
    from reliable_sub.adapters._sqs_client import (
        QUEUE_DOES_NOT_EXIST,
        AsyncClient,
        Steps,
        SyncClient,
        error_code,
        run_async,
        run_sync,
        settings_of,
    )
    from reliable_sub.adapters._sqs_consuming import Consuming, consumer_error
    from reliable_sub.adapters._sqs_leases import MAX_VISIBILITY
    from reliable_sub.adapters._sqs_messages import MAX_MESSAGE_SIZE, entry
    from reliable_sub.adapters._sqs_publishing import publish_error, send_batches
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise MissingExtraError("SqsAdapter", "sqs", "aiobotocore") from error

logger = logging.getLogger(__name__)

DEFAULT_ACK_DEADLINE = 30.0
# One receive asks SQS for at most 10 messages; a receive for more makes up to this many calls
# at once (after a first one came back full).
DEFAULT_RECEIVE_CALLS = 5

CAPABILITIES = Capabilities(
    min_ack_deadline=1.0,
    max_ack_deadline=float(MAX_VISIBILITY),
    native_dead_letter=True,
    native_retry_backoff=False,
    exactly_once=False,
    seek=False,
    ordering=True,  # on subscriptions made with ordering=True (FIFO queues)
    delivery_attempt_exact=False,  # ApproximateReceiveCount: kept by SQS, approximate by name
    refuses_stale_acks=True,
    extension_limited_to_ack_deadline=False,
    cancel_safe_receive=False,
    messaging_system="aws_sqs",
    max_lease_duration=float(MAX_VISIBILITY),
    fan_out=False,  # a topic is a queue, with one subscription
)


class SqsAdapter(InstrumentedPublishing):
    """Amazon SQS (or a server of its API) as an Adapter: see the module's docstring.

    Args:
        endpoint_url: the SQS endpoint (default: botocore's, from ``AWS_ENDPOINT_URL_SQS``,
            ``AWS_ENDPOINT_URL``, the profile, else AWS's for the region).
        region_name: the AWS region (default: ``AWS_DEFAULT_REGION`` or the profile's, else
            ``AWS_REGION``); none at all is a ConfigurationError.
        profile_name: the AWS profile (default: ``AWS_PROFILE`` or ``default``).
        aws_access_key_id: credentials (with the next two; default: the usual chain:
            environment, profile, instance or task role).
        aws_secret_access_key: the key's secret.
        aws_session_token: a temporary credential's token.
        queue_prefix: put before every topic's and subscription's queue name (``prod-``),
            and in the dedup namespaces.
        max_pool_connections: HTTP connections per event loop's client.
        max_message_size: the largest message (body and attributes, bytes) ``publish`` sends;
            lower it to a queue's own ``MaximumMessageSize``.
        receive_calls: receive calls one ``receive`` makes at once when a backlog waits.
    """

    def __init__(self, *, endpoint_url: str | None = None, region_name: str | None = None,
                 profile_name: str | None = None, aws_access_key_id: str | None = None,
                 aws_secret_access_key: str | None = None, aws_session_token: str | None = None,
                 queue_prefix: str = "", max_pool_connections: int = 50,
                 max_message_size: int = MAX_MESSAGE_SIZE,
                 receive_calls: int = DEFAULT_RECEIVE_CALLS) -> None:
        credentials = {k: v for k, v in (("aws_access_key_id", aws_access_key_id),
                                         ("aws_secret_access_key", aws_secret_access_key),
                                         ("aws_session_token", aws_session_token)) if v}
        self._settings = settings_of(endpoint_url, region_name, profile_name, credentials,
                                     max_pool_connections)
        self._names = topology.Names(queue_prefix)
        if not (isinstance(max_message_size, int) and 1 <= max_message_size <= MAX_MESSAGE_SIZE):
            raise ConfigurationError(f"SqsAdapter.max_message_size must be in [1, "
                                     f"{MAX_MESSAGE_SIZE}] bytes, got {max_message_size!r}")
        if not (isinstance(receive_calls, int) and receive_calls >= 1):
            raise ConfigurationError(f"SqsAdapter.receive_calls must be an int >= 1, got "
                                     f"{receive_calls!r}")
        self._max_size = max_message_size
        self.stats = {"requests": 0, "receive_calls": 0, "delete_calls": 0,
                      "visibility_calls": 0, "send_calls": 0, "handles_extended": 0,
                      "refused_as_stale": 0, "malformed": 0, "delays_cut": 0}
        self._clients: PerLoop[AsyncClient] = PerLoop(
            lambda: AsyncClient(self._settings, self.stats))
        self._sync = SyncClient(self._settings)
        self._consuming = Consuming(self._client, self.stats, receive_calls)
        self._topics: dict[str, topology.Queue] = {}
        self._subscriptions: dict[str, topology.Subscription] = {}

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    @property
    def queue_prefix(self) -> str:
        return self._names.prefix

    def connection_attributes(self) -> dict[str, str | int]:
        """The endpoint's host and port, for spans."""
        parts = urlsplit(self._settings.endpoint())
        found: dict[str, str | int] = {}
        if parts.hostname:
            found["server.address"] = parts.hostname
        found["server.port"] = parts.port or (80 if parts.scheme == "http" else 443)
        return found

    def dedup_namespace(self, subscription: str) -> str:
        """``sqs:<queue prefix><subscription>``: a subscription has one queue, and SQS message
        ids are unique only within a queue."""
        return f"sqs:{self._names.prefix}{subscription}"

    async def _client(self) -> Any:
        return await self._clients.get().get()

    async def _steps(self, steps: Steps[Any]) -> Any:
        return await run_async(steps, await self._client())

    # -- administration -------------------------------------------------------------------

    async def ensure_topic(self, topic: str) -> None:
        """Create the queue of ``topic`` if missing (a standard queue; ``.fifo`` names a FIFO
        one)."""
        self._topics[topic] = await self._steps(topology.ensure_topic(self._names, topic))

    def ensure_topic_sync(self, topic: str) -> None:
        """Blocking twin of :meth:`ensure_topic` (boto3)."""
        self._topics[topic] = run_sync(topology.ensure_topic(self._names, topic),
                                       self._sync.get())

    async def topic_exists(self, topic: str) -> bool:
        """Whether ``topic``'s queue exists (a name that marks a subscription is no topic)."""
        self._names.check("topic", topic)
        try:
            self._topics[topic] = await self._steps(topology.topic_queue(self._names, topic))
        except UnknownTopicError:
            return False
        return True

    def _subscription_steps(self, topic: str, subscription: str, ack_deadline: float,
                            ordering: bool, dead_letter: DeadLetterPolicy | None,
                            message_retention: float | None, options: dict[str, Any]
                            ) -> Steps[topology.Subscription]:
        options.pop("retain_acked_messages", None)
        if options:
            raise ConfigurationError(
                f"SqsAdapter.ensure_subscription got unknown options {sorted(options)}; "
                "allowed: ack_deadline, ordering, dead_letter, message_retention, "
                "retain_acked_messages")
        if dead_letter is not None and not isinstance(dead_letter, DeadLetterPolicy):
            raise ConfigurationError("ensure_subscription: dead_letter must be a "
                                     f"DeadLetterPolicy, got {dead_letter!r}")
        return topology.ensure_subscription(
            self._names, topic, subscription, ack_deadline=ack_deadline, ordering=ordering,
            backstop=dead_letter, retention=message_retention)

    async def ensure_subscription(self, topic: str, subscription: str, *,
                                  ack_deadline: float = DEFAULT_ACK_DEADLINE,
                                  ordering: bool = False,
                                  dead_letter: DeadLetterPolicy | None = None,
                                  message_retention: float | None = None,
                                  **options: Any) -> None:
        """Create ``topic``'s queue if missing and record ``subscription`` as its one
        subscription (a second one is refused: SQS has no fan-out).

        Args:
            ack_deadline: the queue's ``VisibilityTimeout`` (1 s to 12 h, rounded up to whole
                seconds), set when the queue is made; an existing queue keeps its own (a
                different one asked for is warned about).
            ordering: a FIFO queue (``<topic>.fifo``): messages of one ordering key (its
                ``MessageGroupId``) are delivered in order, and SQS drops a copy with the same
                idempotency key sent within five minutes.
            dead_letter: SQS's own ``RedrivePolicy`` to that topic's queue after
                ``max_delivery_attempts`` receives, as a backstop: the Subscriber dead-letters
                after its ``DeadLetterPolicy.max_delivery_attempts`` itself, so set this one
                higher (a message it moves was never dead-lettered by the Subscriber: no
                error attributes). Set when the queue is made.
            message_retention: the queue's ``MessageRetentionPeriod`` in seconds (60 to
                1,209,600; SQS's default is 4 days), set when the queue is made.
            **options: ``retain_acked_messages`` is accepted for portability; SQS deletes
                what is acked.
        """
        found = await self._steps(self._subscription_steps(
            topic, subscription, ack_deadline, ordering, dead_letter, message_retention,
            options))
        self._subscriptions[subscription] = found
        self._topics[topic] = found.queue

    def ensure_subscription_sync(self, topic: str, subscription: str, *,
                                 ack_deadline: float = DEFAULT_ACK_DEADLINE,
                                 ordering: bool = False,
                                 dead_letter: DeadLetterPolicy | None = None,
                                 message_retention: float | None = None,
                                 **options: Any) -> None:
        """Blocking twin of :meth:`ensure_subscription` (boto3)."""
        found = run_sync(self._subscription_steps(
            topic, subscription, ack_deadline, ordering, dead_letter, message_retention,
            options), self._sync.get())
        self._subscriptions[subscription] = found
        self._topics[topic] = found.queue

    async def _subscription(self, name: str) -> topology.Subscription:
        found = self._subscriptions.get(name)
        if found is None:
            found = self._subscriptions[name] = await self._steps(
                topology.subscription(self._names, name))
        return found

    async def subscription_ack_deadline(self, subscription: str) -> float:
        """The queue's ``VisibilityTimeout`` (read once per process)."""
        return float((await self._subscription(subscription)).ack_deadline)

    async def subscription_topic(self, subscription: str) -> str:
        return (await self._subscription(subscription)).topic

    async def subscription_stats(self, subscription: str) -> SubscriptionStats:
        """SQS's approximate counts (``approximate=True``): visible and delayed messages plus
        those in flight make the backlog; in flight is ``NotVisible``, which counts messages
        given back with a delay too. No age: SQS keeps it in CloudWatch only."""
        sub = await self._subscription(subscription)
        client = await self._client()
        try:
            reply = await client.get_queue_attributes(QueueUrl=sub.queue.url, AttributeNames=[
                "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
                "ApproximateNumberOfMessagesDelayed"])
        except ClientError as error:
            raise self._consumer_error(error, sub) from error
        figures = reply.get("Attributes", {})
        visible, hidden, delayed = (int(figures.get(name, 0)) for name in (
            "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
            "ApproximateNumberOfMessagesDelayed"))
        return SubscriptionStats(visible + hidden + delayed, hidden, None,
                                 float(sub.ack_deadline), approximate=True)

    # -- publishing ------------------------------------------------------------------------

    async def _topic(self, topic: str) -> topology.Queue:
        found = self._topics.get(topic)
        if found is None:
            self._names.check("topic", topic)
            found = self._topics[topic] = await self._steps(
                topology.topic_queue(self._names, topic))
        return found

    def _entry(self, topic: str, queue: topology.Queue, data: Payload,
               attributes: dict[str, str] | None, ordering_key: str | None) -> dict[str, Any]:
        payload, checked = checked_message(data, attributes)
        return entry(payload, checked, ordering_key, fifo=queue.fifo, max_size=self._max_size,
                     where=f"publish to {topic!r}")

    def _publish_error(self, error: ClientError, topic: str) -> Exception:
        if error_code(error) == QUEUE_DOES_NOT_EXIST:
            self._topics.pop(topic, None)
        return publish_error(error, topic)

    async def publish(self, topic: str, data: Payload, attributes: dict[str, str] | None = None,
                      ordering_key: str | None = None) -> str:
        with self._publishing.send(topic, attributes) as attributes:
            queue = await self._topic(topic)
            params = self._entry(topic, queue, data, attributes, ordering_key)
            client = await self._client()
            self.stats["send_calls"] += 1
            try:
                reply = await client.send_message(QueueUrl=queue.url, **params)
            except ClientError as error:
                raise self._publish_error(error, topic) from error
            return str(reply["MessageId"])

    def publish_sync(self, topic: str, data: Payload, attributes: dict[str, str] | None = None,
                     ordering_key: str | None = None) -> str:
        """Blocking twin of :meth:`publish` (boto3), safe from any thread."""
        with self._publishing.send(topic, attributes) as attributes:
            client = self._sync.get()
            queue = self._topics.get(topic)
            if queue is None:
                self._names.check("topic", topic)
                queue = self._topics[topic] = run_sync(
                    topology.topic_queue(self._names, topic), client)
            params = self._entry(topic, queue, data, attributes, ordering_key)
            try:
                reply = client.send_message(QueueUrl=queue.url, **params)
            except ClientError as error:
                raise self._publish_error(error, topic) from error
            return str(reply["MessageId"])

    async def publish_many(self, messages: Sequence[Outgoing]) -> list[str | Exception]:
        """``SendMessageBatch`` calls of up to 10 messages (and 1 MiB), each queue's in the
        order given (FIFO queues' one after another); each message's id or the error that
        refused it."""
        began = time.perf_counter()
        results: list[str | Exception | None] = [None] * len(messages)
        entries: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        queues: dict[str, topology.Queue] = {}
        for n, message in enumerate(messages):
            try:
                queue = queues.get(message.topic) or await self._topic(message.topic)
                queues[message.topic] = queue
                entries.setdefault(message.topic, []).append((n, self._entry(
                    message.topic, queue, message.data, message.attributes,
                    message.ordering_key)))
            except Exception as error:  # this message alone is refused
                results[n] = error
        client = await self._client()
        await asyncio.gather(*(
            send_batches(client, queues[topic], topic, found, results, self.stats,
                         self._publish_error, self._max_size)
            for topic, found in entries.items()))
        sent = [r if r is not None else AdapterError("not sent") for r in results]
        self._publishing.sent_many(messages, sent, began)
        return sent

    # -- consuming -------------------------------------------------------------------------

    def _consumer_error(self, error: ClientError, sub: topology.Subscription) -> Exception:
        if error_code(error) == QUEUE_DOES_NOT_EXIST:
            self._subscriptions.pop(sub.name, None)
        return consumer_error(error, sub)

    async def receive(self, subscription: str, max_messages: int, timeout: float
                      ) -> list[Delivery]:
        """One long poll of up to ``timeout`` seconds (whole seconds, rounded up: SQS's
        granularity; past 20 s, several); when it comes back full and more were asked for,
        up to ``receive_calls`` short polls at once for the rest."""
        if max_messages < 1:
            raise ConfigurationError(f"receive: max_messages must be >= 1, got {max_messages}")
        sub = await self._subscription(subscription)
        try:
            return await self._consuming.receive(sub, max_messages, timeout)
        except UnknownSubscriptionError:
            self._subscriptions.pop(subscription, None)
            raise

    async def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """``DeleteMessageBatch``; refused: the stale (without a call) and what SQS refused."""
        return await self._consuming.ack(deliveries)

    async def nack(self, deliveries: Sequence[Delivery], delay: float = 0.0) -> None:
        """Visibility ``delay`` (whole seconds, rounded up; cut to 12 hours from the receive,
        with a warning); 0: at once."""
        await self._consuming.nack(deliveries, delay)

    async def extend(self, deliveries: Sequence[Delivery], seconds: float) -> list[Delivery]:
        """Each delivery's visibility ``seconds`` (whole, rounded up) from now, cut to 12 hours
        from its receive; the stale ones are refused."""
        return await self._consuming.extend(deliveries, seconds)

    async def close(self) -> None:
        """Close this loop's client; the adapter makes a new one on next use."""
        client = self._clients.pop()
        if client is not None:
            await client.close()

    def close_sync(self) -> None:
        """Close the blocking twins' boto3 client (made again on next use)."""
        self._sync.close()


__all__ = ["CAPABILITIES", "SqsAdapter"]
