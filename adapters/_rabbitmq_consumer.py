"""One subscription's consumer on the RabbitMQ adapter's consuming connection.

A :class:`Consumer` is a channel of its own (its prefetch is ``basic.qos``) with a
``basic.consume`` on the subscription's queue. What the broker pushes waits in its buffer until
``receive`` hands it out.

RabbitMQ has no ack deadline: a delivery stays with its channel until acked, rejected, or the
channel closes. The consumer keeps the deadline itself. A handed-out delivery is *held* until a
loop time; when that passes without an ack or an extension, the consumer rejects it with
requeue, and the broker delivers it again (the quorum queue counting ``x-delivery-count``).
What the broker pushed and no ``receive`` took within the ack deadline (a Subscriber that stopped
asking: its workers all busy) is given back too, and the consumer cancelled until the next
``receive``: a message does not wait in one process while others could run it. Work given back
untaken goes with ``basic.nack``, which RabbitMQ 4.3 and later does not count as a delivery
(``basic.reject``, for a lease that ran out, counts); earlier versions count every return, so
the Subscriber sizes the prefetch by what its handlers can take (``set_prefetch``) and such
give-backs stay rare.

The broker may cancel a consumer itself (``basic.cancel``: its queue was deleted). The consumer
then gives back its buffer and consumes again at the next ``receive``; while the queue is
missing, that fails, so every receive fails and the Subscriber's health says so.

Delivery tags belong to a channel. Each consumer channel has a *generation*; an ack id is
``"<generation>.<tag>"``. An ack, nack or extend of an id whose channel is gone, or whose
delivery is no longer held (expired, nacked, acked), is refused here, never sent: on a new
channel it would ack another message, or close the channel.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import aiormq.abc
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from reliable_sub.message import Delivery

logger = logging.getLogger("reliable_sub.adapters.rabbitmq")

_generations = itertools.count(1)
# Given-back message ids remembered per consumer before the memory is cleared.
_MAX_GIVEN_BACK = 10_000
# Acks wait up to this long for others to share their frames, or until this many wait.
_ACK_DELAY = 0.005
_ACK_BATCH = 100
# Loop turns a receive waits, after a first arrival, while more keep arriving.
_GATHER_TURNS = 4


@dataclass
class Held:
    """A handed-out delivery: its message, and the loop time its lease ends."""

    message: AbstractIncomingMessage
    ends: float


class Consumer:
    """One subscription's consumer on its own channel (see the module's docstring)."""

    def __init__(self, queue: AbstractQueue, channel: AbstractChannel, prefetch: int,
                 idle_limit: float, stats: dict[str, int]) -> None:
        self.queue = queue
        self.channel = channel
        self.prefetch = prefetch
        self.generation = next(_generations)
        self.buffer: deque[AbstractIncomingMessage] = deque()
        self.arrived = asyncio.Event()
        self.held: dict[int, Held] = {}
        # tags no longer held or buffered whose ack or reject is not written yet: a basic.ack
        # with multiple must stay below them, or it would settle them first (an ack to come
        # would then close the channel; a reject to come would find its message acked)
        self.unsent: set[int] = set()
        # acked by the caller, written with the next flush (see ack)
        self.to_ack: set[int] = set()
        self._ack_timer: asyncio.TimerHandle | None = None
        # message id -> loop time this consumer gave it back (see take)
        self.given_back: dict[str, float] = {}
        self.consumer_tag: str | None = None
        self._idle_limit = idle_limit
        self._last_take = asyncio.get_running_loop().time()
        self._expiry: asyncio.TimerHandle | None = None
        self._idle_check: asyncio.TimerHandle | None = None
        self._resuming = asyncio.Lock()
        self.cancelled_by_broker = False  # until it consumes again
        self.heard = asyncio.get_running_loop().time()  # the broker's last push or reply
        self._stats = stats  # the adapter's counters

    @property
    def alive(self) -> bool:
        return not self.channel.is_closed

    async def watch_cancels(self) -> None:
        """Hear the broker's own ``basic.cancel`` of this consumer."""
        (await self._amqp()).on_consumer_cancel_callbacks.add(self._cancelled)

    async def _cancelled(self, frame: Any) -> None:
        if self.consumer_tag is None or frame.consumer_tag != self.consumer_tag:
            return
        self.consumer_tag = None
        self.cancelled_by_broker = True
        self._stats["consumers_cancelled"] += 1
        logger.warning("the broker cancelled the consumer of queue %r (was the queue deleted?); "
                       "consuming again at the next receive", self.queue.name)
        given_back = [message.delivery_tag or 0 for message in self.buffer]
        self.buffer.clear()
        self.arrived.set()  # a receive waiting on it looks again, and consumes anew
        await self._give_back(given_back)

    async def pushed(self, message: AbstractIncomingMessage) -> None:
        """basic.consume's callback: the broker pushed ``message`` (aiormq runs it as a task
        per message, whatever it is). One that comes after a pause began goes back."""
        if self.consumer_tag is None:
            await self._give_back([message.delivery_tag or 0])
            return
        self.buffer.append(message)
        self.arrived.set()
        self.heard = asyncio.get_running_loop().time()
        if self._idle_check is None:
            self._idle_check = asyncio.get_running_loop().call_later(
                self._idle_limit, self._check_idle)

    async def resume(self) -> None:
        """Consume again after a pause (a ``receive`` came)."""
        async with self._resuming:
            if self.consumer_tag is None and self.alive:
                self._last_take = asyncio.get_running_loop().time()
                self.consumer_tag = await self.queue.consume(self.pushed)
                self.cancelled_by_broker = False

    def take(self, count: int, lease: float, asked_at: float) -> list[AbstractIncomingMessage]:
        """Up to ``count`` buffered messages, held for ``lease`` seconds from now; not one this
        consumer gave back after ``asked_at`` (when the receive call began): the broker pushes
        a requeued message straight back, and a stopping Subscriber's receive call in flight
        must not get back what it gives back."""
        self._last_take = asyncio.get_running_loop().time()
        ends = self._last_take + lease
        taken: list[AbstractIncomingMessage] = []
        kept: list[AbstractIncomingMessage] = []
        given_back = self.given_back
        while self.buffer and len(taken) < count:
            message = self.buffer.popleft()
            if given_back:
                when = given_back.get(message.message_id or "")
                if when is not None:
                    if when >= asked_at:
                        kept.append(message)
                        continue
                    del given_back[message.message_id or ""]
            self.held[message.delivery_tag or 0] = Held(message, ends)
            taken.append(message)
        if kept:
            self.buffer.extendleft(reversed(kept))
        if not taken or not self.buffer:
            self.arrived.clear()  # only what this call may not take is left: wait for more
        if taken:
            self._arm(ends)
        return taken

    async def gather(self, wanted: int) -> None:
        """Let the deliveries the client has read but not yet handed over join the first: aiormq
        passes each to the consumer in a task of its own, so a receive woken by the first would
        otherwise return it alone, its batch following one call at a time."""
        for _ in range(_GATHER_TURNS):
            before = len(self.buffer)
            if not before or before >= wanted:
                return
            await asyncio.sleep(0)
            if len(self.buffer) == before:
                return

    def live(self, tag: int) -> Held | None:
        """The held delivery of ``tag`` if its lease has not ended (one that has is given back
        now)."""
        held = self.held.get(tag)
        if held is None:
            return None
        if held.ends <= asyncio.get_running_loop().time():
            self.expire_due()
            return None
        return held

    def extend(self, tag: int, seconds: float) -> None:
        ends = asyncio.get_running_loop().time() + seconds
        self.held[tag].ends = ends
        self._arm(ends)

    async def ack(self, tags: Iterable[int]) -> None:
        """Ack ``tags``: written with the acks of the next few milliseconds (or at once when
        ``_ACK_BATCH`` are waiting), as few ``basic.ack`` frames as the tags allow. AMQP acks
        have no reply either way: one lost with the connection means a redelivery, which the
        dedup store turns into a duplicate."""
        for tag in tags:
            self.held.pop(tag, None)
            self.to_ack.add(tag)
        if len(self.to_ack) >= _ACK_BATCH:
            await self.flush_acks()
        elif self._ack_timer is None and self.to_ack:
            self._ack_timer = asyncio.get_running_loop().call_later(
                _ACK_DELAY, self._flush_from_timer)

    def _flush_from_timer(self) -> None:
        self._ack_timer = None
        if self.to_ack:
            self._spawn(self.flush_acks())

    async def flush_acks(self) -> None:
        """Write the acks waiting: one ``basic.ack`` with ``multiple`` for the run of them
        below every other outstanding tag of the channel, one each for the rest."""
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        mine = sorted(self.to_ack)
        self.to_ack.clear()
        if not mine or not self.alive:
            return
        others = [m.delivery_tag or 0 for m in self.buffer]
        others.extend(self.held)
        others.extend(self.unsent)
        below = min(others, default=None)
        run = [t for t in mine if below is None or t < below]
        rest = mine[len(run):]
        self.unsent.update(mine)
        try:
            channel = await self._amqp()
            if len(run) > 1:
                await channel.basic_ack(run[-1], multiple=True)
            elif run:
                await channel.basic_ack(run[0])
            for tag in rest:
                await channel.basic_ack(tag)
        finally:
            self.unsent.difference_update(mine)

    async def requeue(self, tags: Iterable[int]) -> None:
        """Give held ``tags`` back at once (``basic.reject`` with requeue)."""
        tags = list(tags)
        now = asyncio.get_running_loop().time()
        if len(self.given_back) > _MAX_GIVEN_BACK:
            self.given_back.clear()  # a receive call lasts seconds: old entries mean nothing
        for tag in tags:
            held = self.held.pop(tag, None)
            if held is not None and held.message.message_id:
                self.given_back[held.message.message_id] = now
        await self._reject(tags)

    def expire_due(self) -> None:
        """Give back every held delivery whose lease has ended."""
        now = asyncio.get_running_loop().time()
        due = [tag for tag, held in self.held.items() if held.ends <= now]
        for tag in due:
            del self.held[tag]
        self.unsent.update(due)  # until _reject, spawned below, has written them
        if due:
            logger.debug("%d deliveries of %r outlived their lease: requeued", len(due),
                         self.queue.name)
            self._spawn(self._reject(due))
        if self.held:
            self._arm(min(held.ends for held in self.held.values()))

    def _check_idle(self) -> None:
        """The buffer has waited: if no receive took from it for the idle limit, pause."""
        self._idle_check = None
        if not self.buffer or not self.alive or self.consumer_tag is None:
            return
        loop = asyncio.get_running_loop()
        waited = loop.time() - self._last_take
        if waited < self._idle_limit:
            self._idle_check = loop.call_later(self._idle_limit - waited, self._check_idle)
            return
        self._spawn(self._pause())

    async def _pause(self) -> None:
        tag, self.consumer_tag = self.consumer_tag, None
        if tag is not None:
            await self.queue.cancel(tag)
        given_back = [message.delivery_tag or 0 for message in self.buffer]
        self.buffer.clear()
        self.arrived.clear()
        logger.debug("no receive took %d deliveries of %r within %gs: given back, consumer "
                     "paused until the next receive", len(given_back), self.queue.name,
                     self._idle_limit)
        await self._give_back(given_back)

    async def give_back_buffer(self) -> None:
        """Give back what was pushed and not taken (before the channel closes)."""
        given_back = [message.delivery_tag or 0 for message in self.buffer]
        self.buffer.clear()
        await self._give_back(given_back)

    async def _give_back(self, tags: list[int]) -> None:
        """Requeue ``tags`` that no handler took: ``basic.nack``, not counted as a delivery by
        RabbitMQ 4.3 and later."""
        await self._reject(tags, counted=False)

    async def _reject(self, tags: list[int], counted: bool = True) -> None:
        if not tags or not self.alive:
            self.unsent.difference_update(tags)
            return  # the broker requeued them with the channel
        self.unsent.update(tags)
        try:
            channel = await self._amqp()
            for tag in tags:
                if counted:
                    await channel.basic_reject(tag, requeue=True)
                else:
                    await channel.basic_nack(tag, multiple=False, requeue=True)
        finally:
            self.unsent.difference_update(tags)

    def _arm(self, ends: float) -> None:
        """Expire due leases at ``ends`` (or earlier, if armed earlier)."""
        loop = asyncio.get_running_loop()
        if self._expiry is not None:
            if self._expiry.when() <= ends:
                return
            self._expiry.cancel()
        self._expiry = loop.call_at(ends, self._expire_from_timer)

    def _expire_from_timer(self) -> None:
        self._expiry = None
        if self.alive:
            self.expire_due()

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        asyncio.ensure_future(coroutine).add_done_callback(_log_failure)

    async def _amqp(self) -> aiormq.abc.AbstractChannel:
        return await self.channel.get_underlay_channel()

    def forget(self) -> None:
        """The channel is gone: drop what it held (the broker requeued it)."""
        for timer in (self._expiry, self._idle_check, self._ack_timer):
            if timer is not None:
                timer.cancel()
        self._expiry = self._idle_check = self._ack_timer = None
        self.to_ack.clear()
        self.held.clear()
        self.buffer.clear()
        self.unsent.clear()
        self.arrived.set()  # a receive waiting on it looks again, and finds the channel gone


def held_tags(consumers: dict[str, Consumer], deliveries: Sequence[Delivery]
              ) -> tuple[dict[str, tuple[Consumer, list[int]]], list[Delivery]]:
    """The deliveries still held, by subscription (its consumer and their tags), and the
    others (stale: to be refused without being sent)."""
    live: dict[str, tuple[Consumer, list[int]]] = {}
    stale: list[Delivery] = []
    for delivery in deliveries:
        subscription = delivery.message.subscription
        consumer = consumers.get(subscription)
        generation, _, tag_text = delivery.ack_id.partition(".")
        tag = int(tag_text) if tag_text.isdigit() else -1
        if (consumer is None or not consumer.alive
                or str(consumer.generation) != generation or consumer.live(tag) is None):
            stale.append(delivery)
            continue
        live.setdefault(subscription, (consumer, []))[1].append(tag)
    return live, stale


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("giving deliveries back failed (the broker requeues them when the "
                       "channel closes): %s", task.exception())
