"""The names reliable-sub's spans, events and metrics use.

``messaging.*`` and ``error.type`` follow the OpenTelemetry semantic conventions for messaging,
**v1.27.0** (the first version with ``messaging.operation.type``,
``messaging.destination.subscription.name`` and ``messaging.consumer.group.name``); names of
our own live under ``reliable_sub.*``. The conventions name no ``messaging.system`` for Redis or
an in-process broker: ours are ``redis`` (Redis Streams) and ``memory``.
"""

from __future__ import annotations

SEMCONV_VERSION = "1.27.0"
SCHEMA_URL = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"
# The instrumentation scope of our tracer and meter.
SCOPE = "reliable_sub"

# -- messaging.* (semantic conventions) -----------------------------------------------------------
MESSAGING_SYSTEM = "messaging.system"
OPERATION_TYPE = "messaging.operation.type"
OPERATION_NAME = "messaging.operation.name"
DESTINATION_NAME = "messaging.destination.name"
SUBSCRIPTION_NAME = "messaging.destination.subscription.name"
CONSUMER_GROUP_NAME = "messaging.consumer.group.name"
MESSAGE_ID = "messaging.message.id"
BODY_SIZE = "messaging.message.body.size"
GCP_DELIVERY_ATTEMPT = "messaging.gcp_pubsub.message.delivery_attempt"
GCP_ACK_DEADLINE = "messaging.gcp_pubsub.message.ack_deadline"
GCP_ORDERING_KEY = "messaging.gcp_pubsub.message.ordering_key"
ERROR_TYPE = "error.type"

# values of messaging.system
GCP_PUBSUB = "gcp_pubsub"
REDIS = "redis"
MEMORY = "memory"
# Systems whose subscription is a consumer group (messaging.consumer.group.name); the others
# name it messaging.destination.subscription.name.
GROUP_SYSTEMS = frozenset({REDIS, "kafka", "nats"})

# values of messaging.operation.type / .name
PROCESS = "process"
SEND = "send"

# -- reliable_sub.* (ours) ------------------------------------------------------------------------
DELIVERY_ATTEMPT = "reliable_sub.delivery_attempt"
OUTCOME = "reliable_sub.outcome"
IDEMPOTENCY_KEY = "reliable_sub.idempotency_key"
HANDLER = "reliable_sub.handler"
DEDUP_VERDICT = "reliable_sub.dedup.verdict"
DEDUP_FAILURES = "reliable_sub.dedup.failures"
LEASE_EXTENSION = "reliable_sub.lease.extension"
LEASE_OBSERVED = "reliable_sub.lease.observed_percentile"
RETRY_ATTEMPT = "reliable_sub.retry.attempt"
DEAD_LETTER_TOPIC = "reliable_sub.dead_letter.topic"
DEAD_LETTER_REASON = "reliable_sub.dead_letter.reason"
REDELIVERY_DELAY = "reliable_sub.redelivery.delay"
OUTBOX_ROW = "reliable_sub.outbox.row_id"

# span events
EVENT_DEDUP = "reliable_sub.dedup"
EVENT_LEASE_EXTENDED = "reliable_sub.lease.extended"
EVENT_RETRY = "reliable_sub.retry"
EVENT_DEAD_LETTER = "reliable_sub.dead_letter.published"

# metrics
PROCESS_DURATION = "messaging.process.duration"
CONSUMED_MESSAGES = "messaging.client.consumed.messages"
SENT_MESSAGES = "messaging.client.sent.messages"
OPERATION_DURATION = "messaging.client.operation.duration"
LEASE_EXTENSIONS = "reliable_sub.lease.extensions"
LEASE_DEADLINE_METRIC = "reliable_sub.lease.deadline"
INFLIGHT = "reliable_sub.inflight.messages"
DUPLICATES = "reliable_sub.dedup.duplicates"
DEAD_LETTERED = "reliable_sub.dead_lettered"
ATTEMPTS = "reliable_sub.delivery.attempts"
CONSUMER_HEALTHY = "reliable_sub.consumer.healthy"
SUBSCRIPTION_BACKLOG = "reliable_sub.subscription.backlog"
SUBSCRIPTION_UNACKED = "reliable_sub.subscription.unacked"
SUBSCRIPTION_OLDEST_AGE = "reliable_sub.subscription.oldest_age"
OUTBOX_BACKLOG = "reliable_sub.outbox.backlog"
OUTBOX_OLDEST_AGE = "reliable_sub.outbox.oldest_age"
OUTBOX_PARKED = "reliable_sub.outbox.parked"
OUTBOX_PUBLISHED = "reliable_sub.outbox.published"

# messaging.process.duration's buckets, as the conventions advise
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0)
# reliable_sub.delivery.attempts counts acked messages by the attempt on which they succeeded:
# its attribute holds the attempt up to this, then one value for all later ones
ATTEMPT = "reliable_sub.delivery.attempt"
MAX_ATTEMPT_VALUE = 10
LATER_ATTEMPTS = f">{MAX_ATTEMPT_VALUE}"


def subscription_attribute(system: str) -> str:
    """Which attribute names a subscription on ``system`` in spans. Metrics carry
    ``messaging.consumer.group.name`` on every system (and this one as well)."""
    return CONSUMER_GROUP_NAME if system in GROUP_SYSTEMS else SUBSCRIPTION_NAME


__all__ = [
    "ATTEMPT",
    "ATTEMPTS",
    "BODY_SIZE",
    "CONSUMED_MESSAGES",
    "CONSUMER_GROUP_NAME",
    "CONSUMER_HEALTHY",
    "DEAD_LETTERED",
    "DEAD_LETTER_REASON",
    "DEAD_LETTER_TOPIC",
    "DEDUP_FAILURES",
    "DEDUP_VERDICT",
    "DELIVERY_ATTEMPT",
    "DESTINATION_NAME",
    "DUPLICATES",
    "DURATION_BUCKETS",
    "ERROR_TYPE",
    "EVENT_DEAD_LETTER",
    "EVENT_DEDUP",
    "EVENT_LEASE_EXTENDED",
    "EVENT_RETRY",
    "GCP_ACK_DEADLINE",
    "GCP_DELIVERY_ATTEMPT",
    "GCP_ORDERING_KEY",
    "GCP_PUBSUB",
    "GROUP_SYSTEMS",
    "HANDLER",
    "IDEMPOTENCY_KEY",
    "INFLIGHT",
    "LATER_ATTEMPTS",
    "LEASE_DEADLINE_METRIC",
    "LEASE_EXTENSION",
    "LEASE_EXTENSIONS",
    "LEASE_OBSERVED",
    "MAX_ATTEMPT_VALUE",
    "MEMORY",
    "MESSAGE_ID",
    "MESSAGING_SYSTEM",
    "OPERATION_DURATION",
    "OPERATION_NAME",
    "OPERATION_TYPE",
    "OUTBOX_BACKLOG",
    "OUTBOX_OLDEST_AGE",
    "OUTBOX_PARKED",
    "OUTBOX_PUBLISHED",
    "OUTBOX_ROW",
    "OUTCOME",
    "PROCESS",
    "PROCESS_DURATION",
    "REDELIVERY_DELAY",
    "REDIS",
    "RETRY_ATTEMPT",
    "SCHEMA_URL",
    "SCOPE",
    "SEMCONV_VERSION",
    "SEND",
    "SENT_MESSAGES",
    "SUBSCRIPTION_BACKLOG",
    "SUBSCRIPTION_NAME",
    "SUBSCRIPTION_OLDEST_AGE",
    "SUBSCRIPTION_UNACKED",
    "subscription_attribute",
]
