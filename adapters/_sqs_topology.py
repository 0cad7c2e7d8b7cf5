"""Topics and subscriptions as SQS queues: names, creation, and resolution from a name alone.

A topic is a queue: ``{queue_prefix}{topic}`` (``.fifo`` added for a subscription made with
``ordering=True``). It is its topic's one subscription too: SQS has no fan-out, so a second
subscription of one topic is refused (an SNS topic in front of several queues is the way to fan
out on AWS; the adapter does not make one). The subscription's name is kept on the queue, in the
tag ``reliable-sub:subscription``. A subscription named like its topic is nothing more. One
named otherwise is also an empty queue of its own name, tagged ``reliable-sub:topic`` with its
topic, so that a consumer finds the topic's queue from the subscription's name alone, as on
every adapter; the adapter never sends to it, nor receives from it.

Every step is an SQS call yielded to a driver (``_sqs_client.Steps``): the same code runs on
the aiobotocore client and, for the blocking twins, on boto3's.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from reliable_sub.adapters._sqs_client import (
    QUEUE_DOES_NOT_EXIST,
    QUEUE_EXISTS,
    Steps,
    access_checked,
    error_code,
)
from reliable_sub.adapters._sqs_leases import MAX_VISIBILITY
from reliable_sub.errors import ConfigurationError, UnknownSubscriptionError, UnknownTopicError
from reliable_sub.policy import DeadLetterPolicy

logger = logging.getLogger("reliable_sub.adapters.sqs")

FIFO = ".fifo"
SUBSCRIPTION_TAG = "reliable-sub:subscription"
TOPIC_TAG = "reliable-sub:topic"
# SQS's rules for a queue name, and for a redrive policy's receive count.
MAX_QUEUE_NAME = 80
MAX_RECEIVE_COUNT = 1000
# A queue's MessageRetentionPeriod: one minute to 14 days.
MIN_RETENTION, MAX_RETENTION = 60, 1_209_600
_NAME = re.compile(r"[A-Za-z0-9_-]+")
_QUEUE_ATTRIBUTES = ["VisibilityTimeout", "FifoQueue", "QueueArn"]


@dataclass(frozen=True)
class Queue:
    """A queue this adapter found or made."""

    url: str
    fifo: bool


@dataclass(frozen=True)
class Subscription:
    """What a subscription is: its topic and the topic's queue, whose visibility timeout is the
    subscription's ack deadline."""

    name: str
    topic: str
    queue: Queue
    ack_deadline: int


class Names:
    """Queue names under one prefix."""

    def __init__(self, prefix: str) -> None:
        if not isinstance(prefix, str) or (prefix and not _NAME.fullmatch(prefix)):
            raise ConfigurationError(
                f"SqsAdapter.queue_prefix must be letters, digits, '-' and '_' (or empty), got "
                f"{prefix!r}")
        self.prefix = prefix

    def check(self, kind: str, name: str) -> str:
        """``name`` (a topic or subscription) if a queue can be named after it, or a
        ConfigurationError naming SQS's rules."""
        if not isinstance(name, str):
            raise ConfigurationError(f"SQS {kind} name must be a str, got {name!r}")
        base = name.removesuffix(FIFO)
        queue = self.prefix + name
        if not base or not _NAME.fullmatch(base) or len(queue) > MAX_QUEUE_NAME:
            raise ConfigurationError(
                f"SQS {kind} name {name!r} cannot name a queue: SQS queue names are 1-80 "
                f"letters, digits, '-' and '_' (a FIFO queue's ending in '.fifo'), the queue "
                f"prefix {self.prefix!r} included")
        return name

    def queue(self, name: str, fifo: bool = False) -> str:
        queue = self.prefix + name
        if fifo and not queue.endswith(FIFO):
            queue += FIFO
            if len(queue) > MAX_QUEUE_NAME:
                raise ConfigurationError(
                    f"SQS topic {name!r} is too long for a FIFO queue: {queue!r} is over "
                    f"{MAX_QUEUE_NAME} characters")
        return queue

    def candidates(self, name: str) -> list[str]:
        """The queues a name may be: as it is, and its FIFO queue."""
        plain = self.prefix + name
        return [plain] if name.endswith(FIFO) else [plain, plain + FIFO]


def find(names: Names, name: str, kind: str) -> Steps[Queue | None]:
    """The queue of ``name`` (a topic's, or a subscription's marker), or None."""
    for candidate in names.candidates(name):
        try:
            reply = yield ("get_queue_url", {"QueueName": candidate})
        except ClientError as error:
            if error_code(error) == QUEUE_DOES_NOT_EXIST:
                continue
            raise access_checked(error, f"finding the queue of {kind} {name!r}") from error
        return Queue(str(reply["QueueUrl"]), candidate.endswith(FIFO))
    return None


def tags(queue: Queue) -> Steps[dict[str, str]]:
    reply = yield ("list_queue_tags", {"QueueUrl": queue.url})
    return dict(reply.get("Tags") or {})


def attributes(queue: Queue) -> Steps[dict[str, str]]:
    reply = yield ("get_queue_attributes", {"QueueUrl": queue.url,
                                            "AttributeNames": _QUEUE_ATTRIBUTES})
    return dict(reply.get("Attributes") or {})


def topic_queue(names: Names, topic: str) -> Steps[Queue]:
    """The queue to publish ``topic`` to, or UnknownTopicError naming the fix."""
    queue = yield from find(names, topic, "topic")
    if queue is None:
        raise UnknownTopicError(f"topic {topic!r} does not exist (no SQS queue "
                                f"{names.prefix + topic!r}); create it with ensure_topic or "
                                "ensure_subscription")
    marked = (yield from tags(queue)).get(TOPIC_TAG)
    if marked is not None and marked != topic:
        raise UnknownTopicError(
            f"{topic!r} is a subscription of topic {marked!r}, not a topic (its queue only "
            f"marks the name); publish to {marked!r}")
    return queue


def ensure_topic(names: Names, topic: str) -> Steps[Queue]:
    """The queue of ``topic``, made if missing (a name that marks a subscription is refused)."""
    names.check("topic", topic)
    queue = yield from find(names, topic, "topic")
    if queue is None:
        queue = yield from _create(names.queue(topic), {})
    marked = (yield from tags(queue)).get(TOPIC_TAG)
    if marked is not None and marked != topic:
        raise ConfigurationError(
            f"{topic!r} names a subscription of topic {marked!r}; choose another topic name")
    return queue


def _create(name: str, queue_attributes: dict[str, str],
            queue_tags: dict[str, str] | None = None) -> Steps[Queue]:
    """Create queue ``name``; one made meanwhile with other attributes is returned as it is."""
    parameters: dict[str, Any] = {"QueueName": name, "Attributes": queue_attributes}
    if name.endswith(FIFO):
        parameters["Attributes"] = {**queue_attributes, "FifoQueue": "true"}
    if queue_tags:
        parameters["tags"] = queue_tags
    try:
        reply = yield ("create_queue", parameters)
    except ClientError as error:
        if error_code(error) not in QUEUE_EXISTS:
            raise access_checked(error, f"creating queue {name!r}") from error
        reply = yield ("get_queue_url", {"QueueName": name})
    return Queue(str(reply["QueueUrl"]), name.endswith(FIFO))


def ensure_subscription(names: Names, topic: str, subscription: str, *, ack_deadline: float,
                        ordering: bool, backstop: DeadLetterPolicy | None,
                        retention: float | None) -> Steps[Subscription]:
    """Make the topic's queue (if missing) and record ``subscription`` as its one subscription;
    see :meth:`SqsAdapter.ensure_subscription`."""
    names.check("topic", topic)
    names.check("subscription", subscription)
    visibility = checked_visibility(ack_deadline)
    fifo = ordering or topic.endswith(FIFO)
    queue = yield from find(names, topic, "topic")
    owner = None
    if queue is not None:
        if queue.fifo != fifo:
            raise ConfigurationError(
                f"topic {topic!r} has the {'FIFO' if queue.fifo else 'standard'} queue "
                f"{queue.url.rsplit('/', 1)[-1]!r}; a subscription with ordering={ordering} "
                f"needs a {'FIFO' if fifo else 'standard'} one: a queue's type cannot change, "
                "so use another topic name")
        recorded = yield from tags(queue)
        if recorded.get(TOPIC_TAG) not in (None, topic):
            raise ConfigurationError(f"{topic!r} names a subscription of topic "
                                     f"{recorded[TOPIC_TAG]!r}; choose another topic name")
        owner = recorded.get(SUBSCRIPTION_TAG)
        if owner is not None and owner != subscription:
            raise ConfigurationError(
                f"topic {topic!r} already has the subscription {owner!r}: SQS has no fan-out "
                f"(a queue's messages go to one subscription), so {subscription!r} cannot "
                f"have them too; give {subscription!r} a topic of its own, or publish to both "
                "topics")
    if subscription != topic:
        yield from _mark(names, topic, subscription)
    if queue is None:
        created: dict[str, str] = {"VisibilityTimeout": str(visibility)}
        if retention is not None:
            if not MIN_RETENTION <= retention <= MAX_RETENTION:
                raise ConfigurationError(
                    f"ensure_subscription: message_retention must be in [{MIN_RETENTION}, "
                    f"{MAX_RETENTION}] seconds on SQS, got {retention!r}")
            created["MessageRetentionPeriod"] = str(int(retention))
        if backstop is not None:
            created["RedrivePolicy"] = yield from _redrive(names, backstop, fifo)
        queue = yield from _create(names.queue(topic, fifo), created,
                                   {SUBSCRIPTION_TAG: subscription})
        owner = (yield from tags(queue)).get(SUBSCRIPTION_TAG)  # made meanwhile by a peer?
        if owner is not None and owner != subscription:
            raise ConfigurationError(
                f"topic {topic!r} was just given the subscription {owner!r} by another "
                "process: SQS has no fan-out; choose another topic")
    if owner is None:
        yield ("tag_queue", {"QueueUrl": queue.url, "Tags": {SUBSCRIPTION_TAG: subscription}})
    found = yield from attributes(queue)
    deadline = int(found.get("VisibilityTimeout", visibility))
    if deadline != visibility:
        logger.warning("subscription %r keeps its queue's visibility timeout of %ds (asked: "
                       "%ds); change it on the queue (SetQueueAttributes VisibilityTimeout)",
                       subscription, deadline, visibility)
    return Subscription(subscription, topic, queue, deadline)


def _mark(names: Names, topic: str, subscription: str) -> Steps[None]:
    """The empty queue that names ``subscription``'s topic (see the module's docstring)."""
    marker = yield from find(names, subscription, "subscription")
    if marker is None:
        marker = yield from _create(names.queue(subscription), {}, {TOPIC_TAG: topic})
    marked = (yield from tags(marker)).get(TOPIC_TAG)
    if marked is None:
        raise ConfigurationError(
            f"subscription name {subscription!r} is taken by the queue of a topic (or a queue "
            f"not made by reliable-sub); choose another name, or subscribe as {topic!r}")
    if marked != topic:
        raise ConfigurationError(
            f"subscription {subscription!r} already exists on topic {marked!r}, not "
            f"{topic!r}; a subscription name belongs to one topic: choose another name")


def _redrive(names: Names, backstop: DeadLetterPolicy, fifo: bool) -> Steps[str]:
    count = backstop.max_delivery_attempts
    if not 1 <= count <= MAX_RECEIVE_COUNT:
        raise ConfigurationError(
            f"a native SQS redrive policy needs max_delivery_attempts in [1, "
            f"{MAX_RECEIVE_COUNT}], got {count}")
    target = yield from ensure_topic(names, backstop.topic)
    if target.fifo != fifo:
        raise ConfigurationError(
            f"the redrive queue of topic {backstop.topic!r} must be "
            f"{'a FIFO' if fifo else 'a standard'} queue like its source")
    arn = (yield from attributes(target))["QueueArn"]
    return json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": count})


def subscription(names: Names, name: str) -> Steps[Subscription]:
    """``name``'s subscription from the broker alone, or UnknownSubscriptionError."""
    names.check("subscription", name)
    missing = UnknownSubscriptionError(
        f"subscription {name!r} does not exist; create it with ensure_subscription")
    queue = yield from find(names, name, "subscription")
    if queue is None:
        raise missing
    topic = (yield from tags(queue)).get(TOPIC_TAG) or name
    if topic != name:
        queue = yield from find(names, topic, "topic")
        if queue is None:
            raise UnknownSubscriptionError(
                f"subscription {name!r} is of topic {topic!r}, whose queue is gone; create it "
                "again with ensure_subscription")
    owner = (yield from tags(queue)).get(SUBSCRIPTION_TAG)
    if owner is not None and owner != name:
        raise UnknownSubscriptionError(
            f"{name!r} is no subscription: its queue's messages go to subscription {owner!r}")
    found = yield from attributes(queue)
    return Subscription(name, topic, queue, int(found.get("VisibilityTimeout", 30)))


def checked_visibility(ack_deadline: float) -> int:
    """An ack deadline as a visibility timeout: whole seconds, 1 to 12 hours."""
    if not (isinstance(ack_deadline, int | float) and 1 <= ack_deadline <= MAX_VISIBILITY
            and math.isfinite(ack_deadline)):
        raise ConfigurationError(
            f"ensure_subscription: ack_deadline must be in [1, {MAX_VISIBILITY}] seconds on "
            f"SQS (a queue's visibility timeout), got {ack_deadline!r}")
    return math.ceil(ack_deadline)
