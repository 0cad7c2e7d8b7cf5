"""What handlers give back, and what they raise, that a consumer must still handle: an
exception that cannot be printed, a result JSON cannot hold or whose encoding raises anything,
an awaitable returned by a sync wrapper or a lambda. Each is handled once, recorded or
dead-lettered, and the subscription keeps consuming.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import pytest

from reliable_sub import Completed, DedupKey, MemoryDedupStore, Message, Outcome
from reliable_sub.testing.adapter_suite.hostile_handlers import keeps_consuming
from reliable_sub.testing.harness import Harness, Recorder, drain


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
    # Built here, not in the handler: in a process holding many objects the garbage collector
    # makes building it take over a second, which would block the loop past the harness's ack
    # deadline, and a redelivery would run the handler again however its result was stored.
    nested: list[Any] = []
    for _ in range(100_000):
        nested = [nested]

    @subscriber.handler(sub)
    async def deep(message: Message) -> list[Any]:
        calls.append(message.id)
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


__all__ = [
    "test_a_result_nested_too_deeply_is_stored_as_null_and_not_rerun",
    "test_a_result_whose_encoding_raises_anything_is_stored_as_null_and_acked_once",
    "test_an_awaitable_a_handler_returns_is_run_once_before_the_ack",
    "test_an_exception_that_cannot_be_printed_is_dead_lettered_after_its_attempts",
]
