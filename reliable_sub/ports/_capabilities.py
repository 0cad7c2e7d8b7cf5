"""The optional capabilities of an adapter: seek and snapshots, telemetry, inspection (see
:mod:`reliable_sub.ports`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

# -- seek and snapshots ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """A subscription's acknowledgement state at one moment, to seek back to.

    Attributes:
        name: the snapshot's short name (unique per broker project or key prefix).
        subscription: the subscription it was taken of (None where the broker does not keep
            it: Pub/Sub keeps it in a label when the name fits a label's rules).
        topic: that subscription's topic.
        created: when it was taken (None where the broker does not say).
        expires: when the broker deletes it (None: kept until deleted).
    """

    name: str
    subscription: str | None
    topic: str
    created: datetime | None = None
    expires: datetime | None = None


@runtime_checkable
class Seekable(Protocol):
    """An optional capability of an adapter: replay or purge a subscription's messages.

    ``seek(subscription, to=time)``: messages published before ``time`` count as acknowledged,
    those published at or after it as unacknowledged, so they are delivered again (acked ones
    only where the subscription retains acked messages); a time in the future acknowledges
    everything published so far. ``seek(subscription, snapshot=name)``: the acknowledgement
    state of the snapshot comes back: what was unacknowledged when it was taken, and everything
    published since, is delivered again. Deliveries in flight at a seek become stale (their
    acks may be refused). Operators call it through :func:`reliable_sub.replay.seek`, which
    also decides what the dedup store does with the replayed messages.
    """

    async def seek(
        self, subscription: str, *, to: datetime | None = None, snapshot: str | None = None
    ) -> None:
        """Seek ``subscription`` to a time (timezone-aware) or to a snapshot (exactly one)."""
        ...

    async def create_snapshot(self, subscription: str, name: str) -> Snapshot:
        """Take a snapshot of ``subscription`` named ``name`` (refused if the name is taken)."""
        ...

    async def delete_snapshot(self, name: str) -> None:
        """Delete the snapshot ``name`` (``UnknownSnapshotError`` if there is none)."""
        ...

    async def list_snapshots(self, subscription: str | None = None) -> list[Snapshot]:
        """The snapshots, all or those of one subscription, by name."""
        ...


# -- telemetry ------------------------------------------------------------------------------------


@runtime_checkable
class DescribesConnection(Protocol):
    """An optional capability of an adapter: what its telemetry spans say of its connection."""

    def connection_attributes(self) -> dict[str, str | int]:
        """``server.address``, ``server.port`` and ``messaging.client.id``, those it knows."""
        ...


@runtime_checkable
class InstrumentsPublishes(Protocol):
    """An optional capability of an adapter: its publishes recorded on given providers (our
    adapters have it from :class:`~reliable_sub.telemetry.publishing.InstrumentedPublishing`)."""

    def instrument_publishes(self, tracer_provider: Any = None,
                             meter_provider: Any = None) -> None:
        """Record this adapter's publishes on these providers (None: leave that one)."""
        ...


@runtime_checkable
class Prefetches(Protocol):
    """An optional capability of a broker that pushes deliveries ahead (RabbitMQ): how many of
    a subscription's it may push before they are acked. A Subscriber sets what the subscription's
    handler can take at once (its ``max_concurrency``, at most ``FlowControl.max_messages``)
    when it starts, so the broker keeps the rest for the subscription's other consumers."""

    def set_prefetch(self, subscription: str, messages: int) -> None:
        """Push at most ``messages`` unacked deliveries of ``subscription`` from now on."""
        ...


@runtime_checkable
class PublishesRouted(Protocol):
    """An optional capability of a broker that drops what no subscription gets (RabbitMQ, and
    the in-process broker): a publish that fails instead. The Subscriber publishes dead
    letters with it, so a dead-letter topic with no subscription redelivers the message rather
    than lose it."""

    async def publish_routed(self, topic: str, data: bytes,
                             attributes: dict[str, str] | None = None) -> str:
        """Publish as ``publish`` does; ``UnroutableError`` when no subscription of ``topic``
        gets the message (then nothing was kept)."""
        ...


@runtime_checkable
class ListsSubscriptions(Protocol):
    """An optional capability of an adapter: the subscriptions of a topic, where the broker
    can tell (a Subscriber warns at start when its dead-letter topic has none)."""

    async def topic_subscriptions(self, topic: str) -> list[str] | None:
        """The names of ``topic``'s subscriptions, or None when the broker cannot tell."""
        ...


@runtime_checkable
class ReportsProblems(Protocol):
    """An optional capability of an adapter: trouble it sees that no call of the Subscriber's
    fails on (a broker that blocked the publishing connection, a delay path that cannot
    declare its queues). A Subscriber's ``healthy()`` is False while this list is not empty,
    and ``problems()`` includes it. Called from any thread: read state, do no I/O."""

    def problems(self) -> list[str]:
        """What is wrong now, one line each naming the cause (empty when nothing is)."""
        ...


# -- inspection -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SubscriptionStats:
    """What a subscription holds now; None where the broker does not say.

    Attributes:
        backlog: messages not yet acked (delivered or not).
        in_flight: messages delivered and not yet acked or given back.
        oldest_unacked_age: seconds since the oldest unacked message was published.
        ack_deadline: the subscription's ack deadline in seconds.
        approximate: ``backlog`` and ``in_flight`` are the broker's estimates, not exact
            counts (SQS's ``ApproximateNumberOf...`` figures, which AWS computes from a sample
            of its servers and may trail what happened by a minute).
        unknown_because: why figures the adapter would give are unknown this time (a source
            that did not answer), None when nothing failed: a figure the broker never gives
            is unknown without a reason.
    """

    backlog: int | None
    in_flight: int | None
    oldest_unacked_age: float | None
    ack_deadline: float | None
    approximate: bool = False
    unknown_because: str | None = None


@runtime_checkable
class Inspectable(Protocol):
    """An optional capability of an adapter: report what a subscription holds."""

    async def subscription_stats(self, subscription: str) -> SubscriptionStats:
        """The subscription's figures now (``UnknownSubscriptionError`` if there is none)."""
        ...
