"""The contracts of the core: what a broker adapter and a dedup store must do.

The core talks to brokers and stores only through these protocols; adapters and stores written
elsewhere (``adapters/``, a third party's package) implement them using public names only.

* :class:`Consumer` -- what the Subscriber needs: receive, ack, nack, extend.
* :class:`Publisher` -- what a publisher (and the outbox relay) needs.
* :class:`Admin` -- creating and checking topics and subscriptions (the CLI's side).
* :class:`Adapter` -- all three: what every broker adapter of this package implements.
* :class:`AcksWithCompletions` -- an optional, typed capability: record dedup completions in the
  same call as the acks.
* :class:`BatchPublisher` -- an optional capability: publish many messages (:class:`Outgoing`)
  in one broker call (the outbox relay's rounds).
* :class:`Capabilities` -- what a broker offers, read by the core and the conformance suite.
* :class:`DedupStore` and its records (:class:`DedupKey`, :class:`Claimed`, :class:`Completed`,
  :class:`InProgress`, :class:`Completion`) -- the idempotent-consumer store.
* :class:`SyncDedupStore` -- an optional capability of a store: blocking twins of its batch
  methods, for callers on threads without an event loop (sync ``@idempotent`` functions).
* :class:`DedupEpochs` -- an optional capability of a store: an epoch per namespace, so a
  replay can run already processed messages again (``reliable_sub.replay``).
* :class:`Seekable` and :class:`Snapshot` -- an optional capability of an adapter: seek a
  subscription to a time or a snapshot, and keep snapshots (``Capabilities.seek``).
* :class:`Inspectable` and :class:`SubscriptionStats` -- an optional capability of an adapter:
  what a subscription holds (the ``reliable-sub stats`` command).
* :class:`ReportsProblems` -- an optional capability of an adapter: trouble it sees that no call
  fails on, for the Subscriber's ``healthy()``.
* :class:`PublishesRouted` and :class:`ListsSubscriptions` -- optional capabilities of an adapter
  whose broker drops what no subscription gets: a publish that fails then (dead letters use it),
  and a topic's subscriptions (the start-up warning for a dead-letter topic with none).

Every method that takes deliveries takes a batch and should cost one broker round trip per batch
where the broker allows it.
"""

from __future__ import annotations

from ._broker import (
    CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    LAYOUT_ATTRIBUTES,
    REDIS_DATA_FIELD_ATTRIBUTE,
    REDIS_ENTRY_ATTRIBUTE,
    REDIS_FIELDS_ATTRIBUTE,
    AcksWithCompletions,
    Adapter,
    Admin,
    BatchPublisher,
    Capabilities,
    Consumer,
    Outgoing,
    Payload,
    Publisher,
    attributes_from_json,
    checked_message,
    names_from_json,
)
from ._capabilities import (
    DescribesConnection,
    Inspectable,
    InstrumentsPublishes,
    ListsSubscriptions,
    Prefetches,
    PublishesRouted,
    ReportsProblems,
    Seekable,
    Snapshot,
    SubscriptionStats,
)
from ._dedup import (
    Claimed,
    ClaimResult,
    Completed,
    Completion,
    DedupEpochs,
    DedupKey,
    DedupStore,
    InProgress,
    SyncDedupStore,
)

__all__ = [
    "CONTENT_TYPE",
    "JSON_CONTENT_TYPE",
    "LAYOUT_ATTRIBUTES",
    "REDIS_DATA_FIELD_ATTRIBUTE",
    "REDIS_ENTRY_ATTRIBUTE",
    "REDIS_FIELDS_ATTRIBUTE",
    "AcksWithCompletions",
    "Adapter",
    "Admin",
    "BatchPublisher",
    "Capabilities",
    "ClaimResult",
    "Claimed",
    "Completed",
    "Completion",
    "Consumer",
    "DedupEpochs",
    "DedupKey",
    "DedupStore",
    "DescribesConnection",
    "InProgress",
    "Inspectable",
    "InstrumentsPublishes",
    "ListsSubscriptions",
    "Outgoing",
    "Payload",
    "Prefetches",
    "Publisher",
    "PublishesRouted",
    "ReportsProblems",
    "Seekable",
    "Snapshot",
    "SubscriptionStats",
    "SyncDedupStore",
    "attributes_from_json",
    "checked_message",
    "names_from_json",
]
