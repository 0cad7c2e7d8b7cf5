"""reliable-sub: reliable message consumers for Pub/Sub, Redis Streams and in-memory brokers.

A Subscriber wraps a broker adapter and gives every handler the same guarantees: nothing acked
before its handler finished, duplicates turned into no-ops by a dedup store, ack deadlines kept
ahead of running handlers from a rolling p99, retries with backoff and dead-lettering.
"""

from .clock import Clock, ManualClock, SystemClock
from .dedup import Claimed, Completed, DedupStore, InProgress, MemoryDedupStore
from .errors import (
    AdapterError,
    ConfigurationError,
    MissingExtraError,
    ReliableSubError,
    ResultNotSerializableError,
    UnknownSubscriptionError,
)
from .lease import LeaseManager
from .message import Delivery, Message
from .outcome import Outcome, SubscriberStats
from .policy import DeadLetterPolicy, FlowControl, LeasePolicy, RetryPolicy
from .subscriber import Subscriber

__version__ = "0.1.0"

__all__ = [
    "AdapterError",
    "Claimed",
    "Clock",
    "Completed",
    "ConfigurationError",
    "DeadLetterPolicy",
    "DedupStore",
    "Delivery",
    "FlowControl",
    "InProgress",
    "LeaseManager",
    "LeasePolicy",
    "ManualClock",
    "MemoryDedupStore",
    "Message",
    "MissingExtraError",
    "Outcome",
    "ReliableSubError",
    "ResultNotSerializableError",
    "RetryPolicy",
    "Subscriber",
    "SubscriberStats",
    "SystemClock",
    "UnknownSubscriptionError",
    "__version__",
]
