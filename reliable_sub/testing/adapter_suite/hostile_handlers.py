"""Handlers are real user code: timeouts, task groups, httpx, threads, and any exception.

Each test checks the handler saw what it should and that the subscription keeps consuming
afterwards (a message published later is handled): a handler must never be able to stop it.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from reliable_sub import Completed, DedupKey, MemoryDedupStore, Message, Outcome, Subscriber
from reliable_sub.testing.harness import Harness, Recorder


class Fatal(BaseException):
    """A custom BaseException, as some libraries raise."""


async def keeps_consuming(harness: Harness, topic: str, recorder: Recorder) -> None:
    """A message published now is acked: the subscription survived whatever came before."""
    acked = recorder.count(Outcome.ACKED)
    adapter = harness.adapters[0]
    await adapter.publish(topic, b"canary")
    await harness.wait_until(lambda: recorder.count(Outcome.ACKED) > acked,
                             3 * harness.ack_deadline, "the canary to be handled")


async def test_a_handlers_own_timeout_cancels_only_its_own_task(
    harness: Harness,
) -> None:
    harness.needs("subscriber_logic")
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    recorder = Recorder()
    subscriber = harness.subscriber(adapter, on_outcome=recorder)
    seen: list[str] = []

    @subscriber.handler(sub)
    async def bounded(message: Message) -> None:
        if message.data == b"canary":
            return
        try:
            await _with_timeout(0.05, asyncio.Event().wait())
        except asyncio.TimeoutError:  # the builtin TimeoutError from 3.11 on
            seen.append("timed out")

    await adapter.publish(topic, b"slow call")
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 1,
                                 3 * harness.ack_deadline, "the handler's own timeout")
        await keeps_consuming(harness, topic, recorder)
        assert subscriber.healthy()
    assert seen == ["timed out"]


async def _with_timeout(seconds: float, awaitable: Any) -> Any:
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.TaskGroup is 3.11+")
async def test_a_task_group_with_a_failing_child_fails_only_its_message(
    harness: Harness,
) -> None:
    harness.needs("subscriber_logic")
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    recorder = Recorder()
    subscriber = harness.subscriber(adapter, on_outcome=recorder)
    calls: Counter[bytes] = Counter()

    async def fail() -> None:
        raise ValueError("a child failed")

    @subscriber.handler(sub)
    async def fan_out(message: Message) -> None:
        calls[message.data] += 1
        if message.data == b"canary" or calls[message.data] > 1:
            return
        async with asyncio.TaskGroup() as group:  # type: ignore[attr-defined]
            group.create_task(fail())
            group.create_task(asyncio.Event().wait())

    message_id = await adapter.publish(topic, b"fan-out")
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 1,
                                 6 * harness.ack_deadline, "the retry")
        await keeps_consuming(harness, topic, recorder)
    assert [o for i, o in recorder.outcomes if i == message_id] == [Outcome.RETRY, Outcome.ACKED]


async def test_httpx_with_a_timeout_works_in_a_handler(harness: Harness) -> None:
    harness.needs("subscriber_logic")
    httpx = pytest.importorskip("httpx")
    server = await asyncio.start_server(_answer_ok, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    recorder = Recorder()
    store = MemoryDedupStore(clock=harness.clock)
    subscriber = harness.subscriber(adapter, on_outcome=recorder, dedup=store)

    @subscriber.handler(sub)
    async def call_api(message: Message) -> str:
        async with httpx.AsyncClient(timeout=5.0) as client:
            response = await client.get(f"http://127.0.0.1:{port}/charge")
            return str(response.text)

    try:
        await adapter.publish(topic, b"x", {"idempotency-key": "call-1"})
        async with harness.serving(subscriber):
            await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 1,
                                     3 * harness.ack_deadline, "the HTTP call")
    finally:
        server.close()
        await server.wait_closed()
    assert subscriber.stats.handler_errors == 0
    found = await store.claim(DedupKey(adapter.dedup_namespace(sub), "call-1"), 10)
    assert isinstance(found, Completed) and found.result == "ok"


async def _answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
    await writer.drain()
    writer.close()


def _raise_cancelled() -> None:
    raise asyncio.CancelledError()


RAISERS: dict[str, Callable[[], None]] = {
    "ValueError": lambda: (_ for _ in ()).throw(ValueError("bad order")),
    "CancelledError": _raise_cancelled,
    "KeyboardInterrupt": lambda: (_ for _ in ()).throw(KeyboardInterrupt()),
    "SystemExit": lambda: (_ for _ in ()).throw(SystemExit(3)),
    "custom BaseException": lambda: (_ for _ in ()).throw(Fatal("fatal")),
}


@pytest.mark.parametrize("when", ["sync", "async before await", "async after await"])
@pytest.mark.parametrize("kind", sorted(RAISERS))
async def test_anything_a_handler_raises_is_a_failed_attempt(
    harness: Harness, kind: str, when: str
) -> None:
    harness.needs("subscriber_logic")
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    recorder = Recorder()
    store = MemoryDedupStore(clock=harness.clock)
    subscriber = harness.subscriber(adapter, on_outcome=recorder, dedup=store)
    calls: Counter[str] = Counter()
    raise_it = RAISERS[kind]

    if when == "sync":
        @subscriber.handler(sub)
        def sync_handler(message: Message) -> None:
            calls[message.id] += 1
            if message.data != b"canary" and calls[message.id] == 1:
                raise_it()
    else:
        @subscriber.handler(sub)
        async def async_handler(message: Message) -> None:
            calls[message.id] += 1
            if when == "async after await":
                await asyncio.sleep(0)
            if message.data != b"canary" and calls[message.id] == 1:
                raise_it()

    message_id = await adapter.publish(topic, b"order")
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 1,
                                 6 * harness.ack_deadline, "the retry to succeed")
        await keeps_consuming(harness, topic, recorder)
        assert subscriber.healthy()
    assert calls[message_id] == 2, "failed once, retried once: no hot loop, no orphan"
    assert [o for i, o in recorder.outcomes if i == message_id] == [Outcome.RETRY, Outcome.ACKED]
    assert subscriber.stats.handler_errors == 1


async def test_a_handler_that_always_raises_a_base_exception_is_dead_lettered(
    harness: Harness,
) -> None:
    from reliable_sub import DeadLetterPolicy

    harness.needs("subscriber_logic")
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    dlq_topic, dlq_sub = await harness.topic_and_subscription()
    recorder = Recorder()
    subscriber = harness.subscriber(adapter, on_outcome=recorder,
                                    dead_letter=DeadLetterPolicy(dlq_topic, 2))
    calls: list[int] = []

    @subscriber.handler(sub)
    async def doomed(message: Message) -> None:
        calls.append(message.delivery_attempt)
        await asyncio.sleep(0)
        raise asyncio.CancelledError()

    await adapter.publish(topic, b"poison")
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: recorder.count(Outcome.DEAD_LETTERED) == 1,
                                 6 * harness.ack_deadline, "dead-lettering")
    assert len(calls) == 2
    [dead] = await harness.receive(adapter, dlq_sub, timeout=harness.ack_deadline)
    assert dead.message.attributes["error-type"] == "asyncio.exceptions.CancelledError"
    assert dead.message.attributes["handler-failures"] == "2"


async def test_handlers_that_never_wait_do_not_starve_the_event_loop(
    harness: Harness,
) -> None:
    harness.needs("subscriber_logic")
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    recorder = Recorder()
    subscriber: Subscriber = harness.subscriber(adapter, on_outcome=recorder)
    beats = 0
    beats_seen: list[int] = []

    @subscriber.handler(sub)
    async def busy(message: Message) -> None:
        beats_seen.append(beats)  # never awaits anything

    async def heartbeat() -> None:
        nonlocal beats
        while True:
            beats += 1
            await asyncio.sleep(0)

    async with harness.serving(subscriber):
        beating = asyncio.ensure_future(heartbeat())
        for i in range(1000):
            await adapter.publish(topic, f"{i}".encode())
        try:
            # real time: the heartbeat keeps the loop busy, so a ManualClock would never jump
            await harness.wait_real(lambda: recorder.count(Outcome.ACKED) == 1000, 30,
                                    "1000 acks")
        finally:
            beating.cancel()
    assert beats_seen[-1] - beats_seen[0] >= 5, "the loop never let another task run"


__all__ = [
    "keeps_consuming",
    "test_a_handler_that_always_raises_a_base_exception_is_dead_lettered",
    "test_a_handlers_own_timeout_cancels_only_its_own_task",
    "test_a_task_group_with_a_failing_child_fails_only_its_message",
    "test_anything_a_handler_raises_is_a_failed_attempt",
    "test_handlers_that_never_wait_do_not_starve_the_event_loop",
    "test_httpx_with_a_timeout_works_in_a_handler",
]
