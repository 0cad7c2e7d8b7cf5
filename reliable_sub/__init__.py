"""reliable-sub: reliable message consumers for Pub/Sub, Redis Streams and in-memory brokers.

A Subscriber wraps a broker adapter and gives every handler the same guarantees: nothing acked
before its handler finished, duplicates turned into no-ops by a dedup store, ack deadlines kept
ahead of running handlers from a rolling p99, retries with backoff and dead-lettering.
"""

from ._runtime.current import current_claim
from ._runtime.lease import LeaseManager
from ._version import __version__
from .batches import BatchResult
from .clock import Clock, ManualClock, SystemClock
from .dedup import (
    Claimed,
    Completed,
    Completion,
    DedupKey,
    DedupStore,
    InProgress,
    MemoryDedupStore,
)
from .errors import (
    AccessDeniedError,
    AdapterError,
    BodyValidationError,
    ClaimLostError,
    ConfigurationError,
    CredentialsRefusedError,
    HandlerTimeoutError,
    IdempotencyInProgressError,
    IdempotencyKeyReuseError,
    InvalidMessageError,
    MalformedMessageError,
    MissingExtraError,
    Reject,
    ReliableSubError,
    ResultNotSerializableError,
    StoredResultError,
    UnknownSubscriptionError,
    UnknownTopicError,
    UnroutableError,
)
from .message import Delivery, Message
from .outcome import Outcome, SubscriberStats
from .policy import DeadLetterPolicy, FlowControl, LeasePolicy, RetryPolicy, TelemetryPolicy
from .subscriber import Subscriber

__all__ = [
    "AccessDeniedError",
    "AdapterError",
    "BatchResult",
    "BodyValidationError",
    "ClaimLostError",
    "Claimed",
    "Clock",
    "Completed",
    "Completion",
    "ConfigurationError",
    "CredentialsRefusedError",
    "DeadLetterPolicy",
    "DedupKey",
    "DedupStore",
    "Delivery",
    "FlowControl",
    "HandlerTimeoutError",
    "IdempotencyInProgressError",
    "IdempotencyKeyReuseError",
    "InProgress",
    "InvalidMessageError",
    "LeaseManager",
    "LeasePolicy",
    "MalformedMessageError",
    "ManualClock",
    "MemoryDedupStore",
    "Message",
    "MissingExtraError",
    "Outcome",
    "Reject",
    "ReliableSubError",
    "ResultNotSerializableError",
    "RetryPolicy",
    "StoredResultError",
    "Subscriber",
    "SubscriberStats",
    "SystemClock",
    "TelemetryPolicy",
    "UnknownSubscriptionError",
    "UnknownTopicError",
    "UnroutableError",
    "__version__",
    "current_claim",
]
