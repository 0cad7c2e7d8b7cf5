"""Receiving, acking, giving back and extending on SQS, with the leases this process holds.

A receive is one long poll (``WaitTimeSeconds``: whole seconds, so a timeout is rounded up;
past SQS's 20 s, one poll after another until the timeout); when it comes back full and more
were asked for, up to ``receive_calls`` short polls at once fetch the rest. Each asks for the
subscription's visibility timeout explicitly, so the lease this process records is the one SQS
applies. Acks, nacks and extensions go through ``_sqs_batches``; the stale ones are refused
without a call (``_sqs_leases``).

A nack without delay makes the message visible at once, so a receive of its queue in flight in
this process could take it straight back (a stopping Subscriber would receive what it gives
back). Such a nack goes between this event loop's receives of the queue: it waits for the one
in flight (at most its timeout), and the next waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError

from reliable_sub._loops import PerLoop
from reliable_sub.adapters._sqs_batches import Entry, PartialFailure, apply
from reliable_sub.adapters._sqs_client import QUEUE_DOES_NOT_EXIST, access_checked, error_code
from reliable_sub.adapters._sqs_leases import Lease, Leases, monotonic
from reliable_sub.adapters._sqs_messages import SYSTEM_ATTRIBUTES, incoming
from reliable_sub.adapters._sqs_topology import Subscription
from reliable_sub.entries import read_each
from reliable_sub.errors import UnknownSubscriptionError
from reliable_sub.message import Delivery, Message

if TYPE_CHECKING:
    from types_aiobotocore_sqs import SQSClient

logger = logging.getLogger("reliable_sub.adapters.sqs")

# One ReceiveMessage returns at most this many messages; SQS's longest poll (seconds).
MAX_RECEIVE = 10
MAX_WAIT = 20


def consumer_error(error: ClientError, sub: Subscription) -> Exception:
    if error_code(error) == QUEUE_DOES_NOT_EXIST:
        return UnknownSubscriptionError(
            f"the queue of subscription {sub.name!r} is gone; create it again with "
            "ensure_subscription")
    return access_checked(error, f"receiving from subscription {sub.name!r}")


class Consuming:
    """The consuming side of one adapter (every event loop's client shares its leases)."""

    def __init__(self, client: Callable[[], Awaitable[SQSClient]], stats: dict[str, int],
                 receive_calls: int) -> None:
        self._client = client
        self.stats = stats
        self.leases = Leases()
        self._receive_calls = receive_calls
        self._polling: PerLoop[dict[str, asyncio.Lock]] = PerLoop(dict)

    def _between_receives(self, queue_url: str) -> asyncio.Lock:
        """Held by this loop's receives of ``queue_url``, and by its nacks without delay."""
        return self._polling.get().setdefault(queue_url, asyncio.Lock())

    async def receive(self, sub: Subscription, max_messages: int, timeout: float
                      ) -> list[Delivery]:
        client = await self._client()
        async with self._between_receives(sub.queue.url):
            return await self._receive(client, sub, max_messages, timeout)

    async def _receive(self, client: SQSClient, sub: Subscription, max_messages: int,
                       timeout: float) -> list[Delivery]:
        give_up = monotonic() + max(0.0, timeout)
        while True:
            wait = min(MAX_WAIT, math.ceil(max(0.0, give_up - monotonic())))
            got = await self._receive_once(client, sub, min(MAX_RECEIVE, max_messages), wait)
            if got or wait == 0 or monotonic() >= give_up:
                break
        wanted = max_messages - len(got)
        if len(got) == MAX_RECEIVE and wanted > 0 and self._receive_calls > 1:
            calls = min(self._receive_calls - 1, math.ceil(wanted / MAX_RECEIVE))
            more = await asyncio.gather(*(
                self._receive_once(client, sub, min(MAX_RECEIVE, wanted - n * MAX_RECEIVE), 0)
                for n in range(calls)), return_exceptions=True)
            for result in more:
                if isinstance(result, BaseException):  # what the others brought is delivered
                    logger.warning("a receive call of %r failed: %r", sub.name, result)
                else:
                    got.extend(result)
        return got

    async def _receive_once(self, client: SQSClient, sub: Subscription, count: int,
                            wait: int) -> list[Delivery]:
        asked_at = monotonic()
        self.stats["receive_calls"] += 1
        try:
            reply = await client.receive_message(
                QueueUrl=sub.queue.url, MaxNumberOfMessages=count, WaitTimeSeconds=wait,
                VisibilityTimeout=sub.ack_deadline, MessageAttributeNames=["All"],
                MessageSystemAttributeNames=SYSTEM_ATTRIBUTES)
        except ClientError as error:
            raise consumer_error(error, sub) from error
        returned_at = monotonic()
        raw: list[Any] = list(reply.get("Messages", []))
        if not raw:
            return []
        for item in raw:
            self.leases.received(sub.queue.url, item["MessageId"], item["ReceiptHandle"],
                                 asked_at, returned_at, sub.ack_deadline)
        return read_each(raw, functools.partial(self._delivery, sub.name),
                         functools.partial(self._unreadable, sub.name))

    def _delivery(self, subscription: str, raw: dict[str, Any]) -> Delivery:
        message, problem = incoming(raw, subscription)
        if problem is not None:
            self.stats["malformed"] += 1
            logger.warning("message %s of subscription %r cannot be read as a message: %s",
                           message.id, subscription, problem)
        return Delivery(message, raw["ReceiptHandle"], malformed=problem)

    def _unreadable(self, subscription: str, raw: dict[str, Any], problem: str) -> Delivery:
        self.stats["malformed"] += 1
        message = Message(id=str(raw.get("MessageId")),
                          data=str(raw.get("Body", "")).encode("utf-8", "surrogatepass"),
                          subscription=subscription)
        return Delivery(message, str(raw["ReceiptHandle"]), malformed=problem)

    def _split(self, deliveries: Sequence[Delivery]
               ) -> tuple[list[tuple[Delivery, Lease]], list[Delivery], list[Delivery]]:
        live, deleted, stale = self.leases.split(list(deliveries), monotonic())
        self.stats["refused_as_stale"] += len(stale)
        return live, deleted, stale

    async def _apply(self, entries: list[Entry],
                     record: Callable[[list[Entry], list[Entry]], None]) -> list[Entry]:
        """Send ``entries``; ``record(done, refused)`` before returning the refused, and before
        raising when a chunk failed after others took effect."""
        if not entries:
            return []
        try:
            outcome = await apply(await self._client(), entries, self.stats)
        except PartialFailure as failure:
            record(failure.outcome.done, failure.outcome.refused)
            raise failure.error from failure
        record(outcome.done, outcome.refused)
        return outcome.refused

    async def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        live, _, stale = self._split(deliveries)

        def record(done: list[Entry], refused: list[Entry]) -> None:
            for item in done:
                self.leases.deleted(item.delivery.ack_id)
            for item in refused:
                self.leases.drop(item.delivery.ack_id)

        refused = await self._apply([Entry(d, lease.queue_url) for d, lease in live], record)
        return stale + [item.delivery for item in refused]

    async def nack(self, deliveries: Sequence[Delivery], delay: float) -> None:
        live, _, _ = self._split(deliveries)
        now = monotonic()
        entries = []
        for delivery, lease in live:
            seconds = Leases.allowed(lease, delay, now)
            if seconds < math.ceil(delay):
                self.stats["delays_cut"] += 1
                logger.warning(
                    "a nack delay of %gs is past SQS's limit (12 hours from the receive): "
                    "message %s comes back after %ds", delay, delivery.message.id, seconds)
            entries.append(Entry(delivery, lease.queue_url, seconds))

        def record(done: list[Entry], refused: list[Entry]) -> None:
            for item in done + refused:  # given back, or no longer ours: either way gone
                self.leases.drop(item.delivery.ack_id)

        at_once = sorted({e.queue_url for e in entries if e.seconds == 0})
        async with contextlib.AsyncExitStack() as between_receives:
            for queue_url in at_once:
                await between_receives.enter_async_context(self._between_receives(queue_url))
            await self._apply(entries, record)

    async def extend(self, deliveries: Sequence[Delivery], seconds: float) -> list[Delivery]:
        live, deleted, stale = self._split(deliveries)
        sent_at = monotonic()
        entries = []
        for delivery, lease in live:
            allowed = Leases.allowed(lease, seconds, sent_at)
            if allowed >= 1:  # at the cap: nothing to ask for; the lease ends on its own
                entries.append(Entry(delivery, lease.queue_url, allowed))

        def record(done: list[Entry], refused: list[Entry]) -> None:
            for item in done:
                self.leases.extended(item.delivery.ack_id, sent_at, int(item.seconds or 0))
            for item in refused:
                self.leases.drop(item.delivery.ack_id)
            self.stats["handles_extended"] += len(done)

        refused = await self._apply(entries, record)
        return stale + deleted + [item.delivery for item in refused]
