"""Handlers are real user code: timeouts, task groups, httpx, threads, and any exception.

Each test checks the handler saw what it should and that the subscription keeps consuming
afterwards (a message published later is handled): a handler must never be able to stop it.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from reliable_sub import Completed, DedupKey, MemoryDedupStore, Message, Outcome, Subscriber
from reliable_sub.testing.harness import Harness, Recorder, drain


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


class _Unprintable(Exception):
    """An exception whose ``__str__`` and ``__repr__`` raise, as some libraries' do when a
    field they format is missing."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ failed")

    def __repr__(self) -> str:
        raise RuntimeError("__repr__ failed")


class _UnprintableNonString(Exception):
    def __str__(self) -> Any:
        return 42  # str() then raises TypeError: __str__ returned non-string


@pytest.mark.parametrize("kind", [_Unprintable, _UnprintableNonString])
async def test_an_exception_that_cannot_be_printed_is_dead_lettered_after_its_attempts(
    harness: Harness, kind: type[Exception]
) -> None:
    """Formatting the error (logs, span, dead-letter attributes) must never become a second
    failure: the message is dead-lettered after ``max_delivery_attempts`` like any other."""
    from reliable_sub import DeadLetterPolicy

    harness.needs("subscriber_logic")
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    dlq_topic, dlq_sub = await harness.topic_and_subscription()
    recorder = Recorder()
    subscriber = harness.subscriber(adapter, on_outcome=recorder,
                                    dead_letter=DeadLetterPolicy(dlq_topic, 3))
    calls: list[int] = []

    @subscriber.handler(sub)
    async def unlucky(message: Message) -> None:
        if message.data == b"canary":
            return
        calls.append(message.delivery_attempt)
        raise kind()

    await adapter.publish(topic, b"poison")
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: recorder.count(Outcome.DEAD_LETTERED) == 1,
                                 10 * harness.ack_deadline, "dead-lettering")
        await keeps_consuming(harness, topic, recorder)
        assert subscriber.healthy()
    assert len(calls) == 3
    [dead] = await harness.receive(adapter, dlq_sub, timeout=harness.ack_deadline)
    attributes = dead.message.attributes
    assert attributes["error-type"].endswith(kind.__qualname__)
    assert attributes["error-message"].startswith(f"<unprintable {kind.__qualname__}")
    assert attributes["handler-failures"] == "3"


async def test_a_result_nested_too_deeply_is_stored_as_null_and_not_rerun(
    harness: Harness,
) -> None:
    harness.needs("subscriber_logic")
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    recorder = Recorder()
    store = MemoryDedupStore(clock=harness.clock)
    subscriber = harness.subscriber(adapter, on_outcome=recorder, dedup=store)
    calls: list[str] = []

    @subscriber.handler(sub)
    async def deep(message: Message) -> list[Any]:
        calls.append(message.id)
        nested: list[Any] = []
        for _ in range(100_000):
            nested = [nested]
        return nested

    await adapter.publish(topic, b"x", {"idempotency-key": "deep-1"})
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 1,
                                 3 * harness.ack_deadline, "ack")
    assert len(calls) == 1
    found = await store.claim(DedupKey(adapter.dedup_namespace(sub), "deep-1"), 10)
    assert isinstance(found, Completed) and found.result is None
    assert await drain(harness, sub) == []


def _logged(function: Callable[..., Any]) -> Callable[..., Any]:
    """A plain sync decorator, as logging and tracing libraries write them."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return wrapper


class _CallableObject:
    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, message: Message) -> Any:  # sync, returning the coroutine
        return self.function(message)


AWAITABLE_RETURNERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "functools.wraps wrapper": _logged,
    "lambda returning a coroutine": lambda charge: (lambda message: charge(message)),
    "callable object returning a coroutine": _CallableObject,
    "partial of a wrapper": lambda charge: functools.partial(_logged(charge)),
    "async def returning a coroutine": lambda charge: _returning(charge),
}


def _returning(function: Callable[..., Any]) -> Callable[..., Any]:
    async def forgot_to_await(message: Message) -> Any:
        return function(message)

    return forgot_to_await


@pytest.mark.parametrize("shape", sorted(AWAITABLE_RETURNERS))
async def test_an_awaitable_a_handler_returns_is_run_once_before_the_ack(
    harness: Harness, shape: str
) -> None:
    """A handler whose call returns an awaitable (a sync decorator around ``async def``, a
    lambda) is acked only after that awaitable ran; its value is the stored result, and a
    duplicate does not run it again."""
    harness.needs("subscriber_logic")
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    recorder = Recorder()
    store = MemoryDedupStore(clock=harness.clock)
    subscriber = harness.subscriber(adapter, on_outcome=recorder, dedup=store)
    effects: list[bytes] = []

    async def charge(message: Message) -> dict[str, str]:
        await asyncio.sleep(0)
        effects.append(message.data)
        return {"charged": message.data.decode()}

    subscriber.handler(sub)(AWAITABLE_RETURNERS[shape](charge))
    for _ in range(2):
        await adapter.publish(topic, b"order-1", {"idempotency-key": "pay-1"})
    async with harness.serving(subscriber):
        await harness.wait_until(
            lambda: recorder.count(Outcome.ACKED) + recorder.count(Outcome.DUPLICATE) == 2,
            3 * harness.ack_deadline, "both copies settled")
    assert effects == [b"order-1"]
    assert recorder.count(Outcome.ACKED) == 1 and subscriber.stats.handler_errors == 0
    found = await store.claim(DedupKey(adapter.dedup_namespace(sub), "pay-1"), 10)
    assert isinstance(found, Completed) and found.result == {"charged": "order-1"}


class _LazyRow(dict):  # type: ignore[type-arg]
    """A mapping whose items cannot be read once its session is closed (an ORM's lazy row)."""

    def items(self) -> Any:
        raise RuntimeError("DetachedInstanceError: the session is closed")

    def keys(self) -> Any:
        raise RuntimeError("DetachedInstanceError: the session is closed")


@pytest.mark.parametrize("result", ["lazy row", "unprintable", "lazy row in a list"])
async def test_a_result_whose_encoding_raises_anything_is_stored_as_null_and_acked_once(
    harness: Harness, result: str
) -> None:
    """#24: only TypeError, ValueError and RecursionError from encoding were caught; anything
    else was settled as a retry after the effect had happened, and the handler re-ran for
    ever."""
    harness.needs("subscriber_logic")
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    recorder = Recorder()
    store = MemoryDedupStore(clock=harness.clock)
    subscriber = harness.subscriber(adapter, on_outcome=recorder, dedup=store)
    effects: list[str] = []
    values: dict[str, Callable[[], Any]] = {
        "lazy row": lambda: _LazyRow(amount=1), "unprintable": lambda: _Unprintable(),
        "lazy row in a list": lambda: [1, _LazyRow(amount=1)]}

    @subscriber.handler(sub)
    async def charge(message: Message) -> Any:
        effects.append(message.id)
        return values[result]()

    await adapter.publish(topic, b"x", {"idempotency-key": "lazy-1"})
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 1,
                                 3 * harness.ack_deadline, "ack")
        await keeps_consuming(harness, topic, recorder)
    assert len(effects) == 2  # the message and the canary: no re-run
    assert recorder.count(Outcome.RETRY) == 0
    found = await store.claim(DedupKey(adapter.dedup_namespace(sub), "lazy-1"), 10)
    assert isinstance(found, Completed) and found.result is None


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
