"""The SQS server SIGKILLed and started again under a running Subscriber (#49), on an ElasticMQ
of the test's own that keeps its queues and messages on disk (H2), as SQS itself keeps them.

What must hold: nothing is lost (every message published before the kill is handled); with a
dedup store no effect runs twice (a message whose delete failed in the outage comes back when
its visibility timeout ends, and is a duplicate); ``healthy()`` turns False during the outage
and True again after; it resumes by itself. The CPU it spent while the server was gone is
reported (a spinning retry loop would show), not asserted: no timing threshold in a test.
Effects are counted by the test, outside the handler's own bookkeeping.
"""

from __future__ import annotations

import asyncio
import resource
import time
import uuid
from collections import Counter
from collections.abc import Callable

import pytest

from reliable_sub import MemoryDedupStore, Message, Outcome, Subscriber
from tests.sqs_processes import SqsServer

pytest.importorskip("aiobotocore", reason='the SQS tests need "reliable-sub[sqs]"')

from reliable_sub.adapters.sqs import SqsAdapter

MESSAGES = 200
# Seconds the server stays down: past unhealthy_after, and past a visibility timeout.
OUTAGE = 8.0
UNHEALTHY_AFTER = 2.0
WITHIN = 90.0


async def until(predicate: Callable[[], bool], what: Callable[[], str] | str,
                within: float = WITHIN) -> float:
    """Poll ``predicate`` until true; the seconds it took."""
    began = time.monotonic()
    while not predicate():
        assert time.monotonic() - began < within, what if isinstance(what, str) else what()
        await asyncio.sleep(0.02)
    return time.monotonic() - began


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def test_a_server_killed_and_restarted_loses_nothing_and_runs_nothing_twice(
        private_sqs_server: SqsServer) -> None:
    prefix = f"rs{uuid.uuid4().hex[:8]}-"
    adapter = SqsAdapter(**private_sqs_server.client_options, queue_prefix=prefix)
    topic = f"{prefix}orders"
    await adapter.ensure_subscription(topic, topic, ack_deadline=3.0)
    for number in range(MESSAGES):
        await adapter.publish(topic, f"m{number}".encode())

    effects: Counter[bytes] = Counter()
    outcomes: Counter[Outcome] = Counter()
    gate = asyncio.Event()  # held closed during the outage's start: work is in flight
    subscriber = Subscriber(adapter, dedup=MemoryDedupStore(), receive_timeout=1.0,
                            unhealthy_after=UNHEALTHY_AFTER,
                            on_outcome=lambda message, outcome: outcomes.update([outcome]))

    @subscriber.handler(topic)
    async def charge(message: Message) -> None:
        if len(effects) >= MESSAGES // 2:
            await gate.wait()
        effects[message.data] += 1

    task = asyncio.ensure_future(subscriber.serve())
    try:
        await until(lambda: len(effects) >= MESSAGES // 2 and subscriber.healthy(),
                    "half handled")
        await asyncio.to_thread(private_sqs_server.kill)
        killed = time.monotonic()
        gate.set()  # the handlers in flight finish: their deletes meet a dead server
        went_unhealthy = await until(lambda: not subscriber.healthy(), "unhealthy in the outage")
        cpu_before = cpu()
        await asyncio.sleep(max(0.0, OUTAGE - (time.monotonic() - killed)))  # the fault's length
        outage_cpu = cpu() - cpu_before
        await asyncio.to_thread(private_sqs_server.start)
        back = await until(subscriber.healthy, lambda: f"healthy again: {subscriber.problems()}")
        await until(lambda: len(effects) == MESSAGES,
                    lambda: f"every message handled: {len(effects)} of {MESSAGES}, {outcomes}")
        give_up = time.monotonic() + WITHIN
        while (stats := await adapter.subscription_stats(topic)).backlog:
            assert time.monotonic() < give_up, f"the queue never emptied: {stats}"
            await asyncio.sleep(0.1)
    finally:
        await subscriber.shutdown(timeout=10)
        await task
        await adapter.close()
    print(f"sqs restart: unhealthy {went_unhealthy:.1f}s into the outage, healthy "
          f"{back:.1f}s after the restart; {outage_cpu:.2f} CPU-s in the outage's last "
          f"{OUTAGE - went_unhealthy:.1f}s; {outcomes[Outcome.DUPLICATE]} duplicates caught")

    assert set(effects) == {f"m{n}".encode() for n in range(MESSAGES)}, "a message was lost"
    assert [data for data, count in effects.items() if count > 1] == [], "an effect ran twice"
    assert stats.backlog == 0, "every message deleted in the end"
