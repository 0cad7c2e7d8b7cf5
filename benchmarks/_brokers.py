"""What the broker benchmarks (Redis Streams, NATS JetStream, RabbitMQ) share.

Each of them times the same kinds of consumer on a pre-published backlog: a raw client loop (the
floor), FastStream's subscriber, and our :class:`~reliable_sub.Subscriber` with and without a
dedup store, each with the same counting no-op handler. A :class:`Consumer` is one variant for
one run: ``prepare`` (connect, untimed), ``start`` (on the clock), ``stop``, ``check``,
``close``. :func:`drain` runs the clock from ``start`` until :func:`wait_drained` sees every
message handled (a counter in this process, polled every ``POLL_INTERVAL``) and then the broker
reports them settled (the benchmark's own ``settled`` check); a consumer that died fails the run
instead of looking slow, and a run that has not drained after ``RUN_DEADLINE`` is a hang.
"""

from __future__ import annotations

import asyncio
import cProfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from benchmarks._harness import Clock, Run
from reliable_sub import Message, Subscriber
from reliable_sub.outcome import Outcome

# How often the drain poller looks at the counter and then at the broker; bounds the timing error.
POLL_INTERVAL = 0.001
# A run that has not drained after this many seconds is a hang, not a slow result.
RUN_DEADLINE = 120.0
# Keys per SCAN step and per UNLINK while deleting a run's Redis keys.
SCAN_COUNT = 1_000


class Tally:
    """How many messages the handler has seen in the current run."""

    __slots__ = ("handled",)

    def __init__(self) -> None:
        self.handled = 0


def count_in(subscriber: Subscriber, subscription: str, tally: Tally, *, batch: bool) -> None:
    """Register the handler under test on ``subscription``: a no-op that counts in ``tally``,
    one message per call or (``batch``) a batch handler."""

    async def handle_message(message: Message) -> None:
        tally.handled += 1

    async def handle_batch(messages: list[Message]) -> None:
        tally.handled += len(messages)

    if batch:
        subscriber.handler(subscription, batch=True)(handle_batch)
    else:
        subscriber.handler(subscription)(handle_message)


def faststream_handler(tally: Tally, *, batch: bool) -> Callable[[Any], Awaitable[None]]:
    """FastStream's handler under test: does nothing but count (a body, or a list of them)."""

    async def handle_one(body: Any) -> None:
        tally.handled += 1

    async def handle_batch(body: list[Any]) -> None:
        tally.handled += len(body)

    return handle_batch if batch else handle_one


class Consumer:
    """One variant's consumer for one run: prepared (untimed), started, stopped, closed."""

    def __init__(self, tally: Tally, total: int) -> None:
        self.tally, self.total = tally, total

    async def prepare(self) -> None:
        """Connect (and set up what the variant needs), outside the clock."""

    async def start(self) -> None:
        raise NotImplementedError

    def check_alive(self) -> None:
        """Raise if the consumer died before the backlog was drained."""

    async def stop(self) -> None:
        """Stop consuming (after the clock)."""

    async def close(self) -> None:
        """Release connections (after stop, or after a failed prepare)."""

    def check(self) -> None:
        if self.tally.handled != self.total:
            raise RuntimeError(f"the handler saw {self.tally.handled} messages, not {self.total}")


class LoopConsumer(Consumer):
    """A raw client loop, :meth:`loop`, run as a task of its own."""

    task: asyncio.Task[None] | None = None

    async def loop(self) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        self.task = asyncio.create_task(self.loop())

    def check_alive(self) -> None:
        if self.task is not None and self.task.done():
            self.task.result()
            if self.tally.handled < self.total:
                raise RuntimeError("the raw loop stopped before the backlog drained")

    async def stop(self) -> None:
        if self.task is not None:
            await self.task


class FastStreamConsumer(Consumer):
    """FastStream's subscriber on ``self.broker`` (set up by the subclass): started with
    ``await broker.start()``, stopped with ``await broker.stop()``."""

    broker: Any
    stopped = False

    async def start(self) -> None:
        await self.broker.start()

    async def stop(self) -> None:
        await self.broker.stop()
        self.stopped = True

    async def close(self) -> None:
        if not self.stopped:  # connected (and perhaps started), but a run failed
            await self.broker.stop()


class SubscriberConsumer(Consumer):
    """Our Subscriber, run as ``asyncio.create_task(sub.serve())`` and stopped with
    ``await sub.shutdown(shutdown_timeout)``; every message must end ``acked``."""

    def __init__(self, tally: Tally, total: int, subscriber: Subscriber,
                 shutdown_timeout: float) -> None:
        super().__init__(tally, total)
        self.subscriber, self.shutdown_timeout = subscriber, shutdown_timeout
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.subscriber.serve())

    def check_alive(self) -> None:
        if self.task is not None and self.task.done():
            self.task.result()
            raise RuntimeError("the Subscriber stopped before the backlog drained")

    async def stop(self) -> None:
        await self.subscriber.shutdown(self.shutdown_timeout)
        if self.task is not None:
            await self.task

    async def close(self) -> None:
        if self.subscriber.running:
            await self.subscriber.shutdown(self.shutdown_timeout)
        await self.release()

    async def release(self) -> None:
        """Close the adapter and the store (after the Subscriber stopped)."""

    def check(self) -> None:
        super().check()
        outcomes = dict(self.subscriber.stats.outcomes)
        if outcomes != {Outcome.ACKED: self.total}:
            raise RuntimeError(f"outcomes {outcomes}, expected {self.total} acked")


async def wait_drained(consumer: Consumer, settled: Callable[[], Awaitable[bool]],
                       give_up_at: float, interval: float = POLL_INTERVAL) -> float:
    """Poll every ``interval`` seconds until every message was handled and ``settled()``;
    ``time.perf_counter()`` then. (A profiled run polls less often: the poller's own calls would
    crowd the profile.)"""
    while consumer.tally.handled < consumer.total:
        consumer.check_alive()  # a consumer that died would otherwise look like a slow one
        if time.perf_counter() > give_up_at:
            raise TimeoutError(f"{consumer.tally.handled} of {consumer.total} handled after "
                               f"{RUN_DEADLINE}s")
        await asyncio.sleep(interval)
    while True:
        done = await settled()
        now = time.perf_counter()
        if done:
            return now
        consumer.check_alive()
        if now > give_up_at:
            raise TimeoutError(f"handled, but not settled after {RUN_DEADLINE}s")
        await asyncio.sleep(interval)


async def drain(consumer: Consumer, settled: Callable[[], Awaitable[bool]],
                profiler: cProfile.Profile | None = None, *, gc_off: bool = True) -> Run:
    """Start ``consumer`` on the clock; stop the clock when the backlog is drained."""
    with Clock(profiler, gc_off=gc_off) as clock:
        await consumer.start()
        clock.stop(await wait_drained(consumer, settled, clock.started + RUN_DEADLINE))
    return clock.run()


async def delete_keys(control: aioredis.Redis, pattern: str) -> int:
    """UNLINK every key matching ``pattern``; returns how many there were."""
    deleted = 0
    batch: list[bytes] = []
    async for key in control.scan_iter(match=pattern, count=SCAN_COUNT):
        batch.append(key)
        if len(batch) >= SCAN_COUNT:
            deleted += await control.unlink(*batch)
            batch = []
    if batch:
        deleted += await control.unlink(*batch)
    return deleted
