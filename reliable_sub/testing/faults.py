"""Faults on purpose, for testing your own handlers: duplicates, lost acks, interruptions.

A broker delivers a message twice, an ack is lost on the way, a process dies between a handler's
effect and the record of it, a dedup store times out. These tools make each of those happen in a
test, at a rate you choose, on any adapter and store, so you can check that your handler's effects
still happen once::

    from reliable_sub.testing.faults import FaultInjector, Faults

    faults = FaultInjector(Faults(duplicate=1.0, interrupt=0.2, fail_store=0.1), seed=7)
    sub = Subscriber(faults.adapter(broker), dedup=faults.store(MemoryDedupStore()),
                     middleware=[faults.middleware])

* ``duplicate``: after an ack, the message is delivered again (as a redelivery of a message the
  broker believes unacked would be: same id, ``delivery_attempt`` one higher);
* ``lose_ack``: an ack is reported done but never sent; the broker redelivers the message when
  its ack deadline passes;
* ``repeat``: a delivery is handed out a second time while the first may still be running;
* ``interrupt``: the handler finishes its work, then the attempt fails before its result is
  recorded (a crash in the worst place); the message is redelivered;
* ``fail_store``: a dedup store call (claim, renew, complete, release) raises.

A connection that hangs without closing (a stalled broker or store) is made by
:class:`reliable_sub.testing.tcp_proxy.TcpProxy`, between your consumer and a real server.

:data:`DUPLICATE_DELIVERY` is the common case: every message handed to the handler twice.
Injected failures raise :class:`InjectedFault`; :attr:`FaultInjector.injected` counts what was
injected, so a test can check the faults happened. The same seed repeats the same faults only
when the order of calls repeats (a ManualClock and a single worker make it do so).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from typing import Any

from reliable_sub.errors import ConfigurationError
from reliable_sub.message import Delivery
from reliable_sub.middleware import CallNext, Context, Decision, Verdict
from reliable_sub.ports import (
    Adapter,
    Claimed,
    ClaimResult,
    Completion,
    DedupKey,
    DedupStore,
)

# The names a wrapper does not pass through: the one-call ack-and-complete path and the blocking
# twins would go around the injected faults.
_NOT_PASSED_THROUGH = frozenset({
    "ack_with_completions", "shares_store",
    "claim_many_sync", "renew_sync", "complete_many_sync", "release_many_sync",
})


class InjectedFault(Exception):
    """A failure put there by a :class:`FaultInjector`, not by your code or a service."""


@dataclasses.dataclass(frozen=True)
class Faults:
    """How often each fault happens: the chance, from 0 to 1, at each opportunity.

    Attributes:
        duplicate: an acked message is delivered again.
        lose_ack: an ack never reaches the broker (redelivered after its ack deadline).
        repeat: a received delivery is handed out again with the next receive call.
        interrupt: a handler attempt that succeeded fails before its result is recorded.
        fail_store: a dedup store call raises :class:`InjectedFault`.
    """

    duplicate: float = 0.0
    lose_ack: float = 0.0
    repeat: float = 0.0
    interrupt: float = 0.0
    fail_store: float = 0.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not (isinstance(value, int | float) and math.isfinite(value) and 0 <= value <= 1):
                raise ConfigurationError(
                    f"Faults.{field.name} must be a chance in [0, 1], got {value!r}")


DUPLICATE_DELIVERY = Faults(duplicate=1.0)
"""Every message handed to the handler twice: does your handler survive a duplicate?"""


class FaultInjector:
    """Injects :class:`Faults` into an adapter, a dedup store and the handler calls.

    Args:
        faults: the chance of each fault.
        seed: seed of the random choices (None: a random seed, kept in :attr:`seed`).
    """

    def __init__(self, faults: Faults, *, seed: int | None = None) -> None:
        self.faults = faults
        self.seed = random.randrange(2**32) if seed is None else seed
        self._rng = random.Random(self.seed)
        self.injected: Counter[str] = Counter()
        """How many times each fault was injected, by the name of its :class:`Faults` field."""
        self._adapters: list[FaultyAdapter] = []

    def happens(self, fault: str) -> bool:
        """Roll the dice for ``fault`` (a :class:`Faults` field name); count it if it happens."""
        chance: float = getattr(self.faults, fault)
        if chance <= 0 or self._rng.random() >= chance:
            return False
        self.injected[fault] += 1
        return True

    def adapter(self, adapter: Adapter) -> FaultyAdapter:
        """``adapter`` with duplicates, lost acks and repeats injected."""
        faulty = FaultyAdapter(adapter, self)
        self._adapters.append(faulty)
        return faulty

    def store(self, store: DedupStore) -> FaultyDedupStore:
        """``store`` with failing calls injected."""
        return FaultyDedupStore(store, self)

    async def middleware(self, context: Context, call_next: CallNext) -> Decision:
        """Subscriber middleware: a succeeded attempt fails, now and then, before it is recorded.

        Give it as the last of the Subscriber's ``middleware`` so yours sees the failure.
        """
        decision = await call_next(context)
        if decision.verdict is Verdict.ACK and self.happens("interrupt"):
            raise InjectedFault(
                f"interrupted after the handler of message {context.message.id} returned, "
                "before its result was recorded"
            )
        return decision

    @property
    def pending(self) -> int:
        """Injected deliveries not handed out yet (duplicates and repeats waiting for a receive)."""
        return sum(adapter.pending for adapter in self._adapters)


class FaultyAdapter:
    """An adapter that delivers duplicates and loses acks as a :class:`FaultInjector` decides.

    Everything else passes through to the adapter it wraps. An injected copy of a delivery is
    not a broker delivery: acking, nacking or extending it does nothing at the broker. Copies
    are handed out by the next ``receive`` call, which returns them at once. Acks and
    completions go in two calls, never through the adapter's one-call path.
    """

    def __init__(self, adapter: Adapter, injector: FaultInjector) -> None:
        self.wrapped = adapter
        self._injector = injector
        self._copies: dict[str, deque[Delivery]] = defaultdict(deque)
        self._copy_ids: set[str] = set()
        self._numbers = itertools.count(1)

    def __getattr__(self, name: str) -> Any:
        if name in _NOT_PASSED_THROUGH:
            raise AttributeError(name)
        return getattr(self.wrapped, name)

    @property
    def pending(self) -> int:
        """Copies waiting to be handed out."""
        return sum(len(queue) for queue in self._copies.values())

    async def receive(
        self, subscription: str, max_messages: int, timeout: float
    ) -> list[Delivery]:
        """Queued copies first (at once); otherwise the broker's deliveries, some repeated."""
        queue = self._copies[subscription]
        if queue:
            return [queue.popleft() for _ in range(min(max_messages, len(queue)))]
        deliveries = await self.wrapped.receive(subscription, max_messages, timeout)
        for delivery in deliveries:
            if self._injector.happens("repeat"):
                self._queue_copy(delivery, attempt=delivery.message.delivery_attempt)
        return deliveries

    async def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """Ack at the broker, but for lost acks; queue a duplicate of some acked messages."""
        sent = []
        for delivery in self._real(deliveries):
            if self._injector.happens("lose_ack"):
                continue  # the broker redelivers it when its deadline passes
            sent.append(delivery)
        refused = await self.wrapped.ack(sent) if sent else []
        refused_ids = {delivery.ack_id for delivery in refused}
        for delivery in sent:
            if delivery.ack_id not in refused_ids and self._injector.happens("duplicate"):
                self._queue_copy(delivery, attempt=delivery.message.delivery_attempt + 1)
        return refused

    async def nack(self, deliveries: Sequence[Delivery], delay: float = 0.0) -> None:
        real = self._real(deliveries)
        if real:
            await self.wrapped.nack(real, delay)

    async def extend(self, deliveries: Sequence[Delivery], seconds: float) -> list[Delivery]:
        real = self._real(deliveries)
        return await self.wrapped.extend(real, seconds) if real else []

    def _real(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        return [delivery for delivery in deliveries if delivery.ack_id not in self._copy_ids]

    def _queue_copy(self, delivery: Delivery, *, attempt: int) -> None:
        message = dataclasses.replace(delivery.message, delivery_attempt=attempt)
        copy = Delivery(message, f"{delivery.ack_id}~injected-copy-{next(self._numbers)}")
        self._copy_ids.add(copy.ack_id)
        self._copies[message.subscription].append(copy)


class FaultyDedupStore:
    """A dedup store whose batch calls raise :class:`InjectedFault` as a :class:`FaultInjector`
    decides (before the call reaches the store: nothing is written). Everything else passes
    through to the store it wraps."""

    def __init__(self, store: DedupStore, injector: FaultInjector) -> None:
        self.wrapped = store
        self._injector = injector

    def __getattr__(self, name: str) -> Any:
        if name in _NOT_PASSED_THROUGH:
            raise AttributeError(name)
        return getattr(self.wrapped, name)

    def _maybe_fail(self, call: str, count: int) -> None:
        if self._injector.happens("fail_store"):
            raise InjectedFault(f"injected dedup store failure: {call} of {count} records")

    async def claim_many(
        self, keys: Sequence[DedupKey], lease_ttl: float, tokens: Sequence[str] | None = None
    ) -> list[ClaimResult]:
        self._maybe_fail("claim_many", len(keys))
        return await self.wrapped.claim_many(keys, lease_ttl, tokens)

    async def renew(self, claims: Sequence[Claimed], lease_ttl: float) -> list[Claimed]:
        self._maybe_fail("renew", len(claims))
        return await self.wrapped.renew(claims, lease_ttl)

    async def complete_many(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        self._maybe_fail("complete_many", len(completions))
        return await self.wrapped.complete_many(completions, ttl)

    async def release_many(self, claims: Sequence[Claimed], retention: float) -> None:
        self._maybe_fail("release_many", len(claims))
        await self.wrapped.release_many(claims, retention)

    async def claim(self, key: DedupKey, lease_ttl: float) -> ClaimResult:
        [verdict] = await self.claim_many([key], lease_ttl)
        return verdict

    async def complete(self, claim: Claimed, result: Any, ttl: float) -> bool:
        self._maybe_fail("complete", 1)
        return await self.wrapped.complete(claim, result, ttl)

    async def release(self, claim: Claimed, retention: float = 0.0) -> None:
        await self.release_many([claim], retention)

    async def close(self) -> None:
        await self.wrapped.close()


__all__ = [
    "DUPLICATE_DELIVERY",
    "FaultInjector",
    "Faults",
    "FaultyAdapter",
    "FaultyDedupStore",
    "InjectedFault",
]
