"""Hostile handlers (#13), on the in-memory broker and a ManualClock: a handler that never
returns, one that always raises a ``BaseException``, one that blocks the event loop. The consumer
stays healthy and a canary beside each is handled.

Apart from ``tests/test_hostile_input.py`` on purpose: that module keeps a Subscriber running on
a real broker for its whole length, and a real-time receive timer due within
``drive_until``'s ``REAL_TIMER_HORIZON`` keeps the ManualClock from jumping.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from reliable_sub import (
    DeadLetterPolicy,
    LeasePolicy,
    MemoryDedupStore,
    Message,
    Outcome,
    RetryPolicy,
)
from reliable_sub.outcome import DeliveryEvent
from reliable_sub.testing.timing import drive_until
from tests.memory_world import serving, setup

# Handler failures after which a message is dead-lettered: retried once, then dead.
MAX_ATTEMPTS = 2

# -- handler behaviour (in-memory broker, ManualClock) -------------------------------------------

MEMORY_WITHIN = 600.0


def dead_letter_subscription(broker: Any) -> str:
    """A subscription on the memory world's dead-letter topic, so its copies can be read."""
    broker.ensure_subscription_sync("orders-dlq", "dead")
    return "dead"


async def test_a_handler_that_never_returns_is_ended_by_max_lease_duration() -> None:
    """An async handler is cancelled at ``max_lease_duration`` (its task ends: nothing is left
    running), which is a failed attempt (``HandlerTimeoutError``): retried, then dead-lettered.
    The canary runs while it hangs. (The sync case: see the module docstring.)"""
    events: list[DeliveryEvent] = []
    clock, broker, sub = setup(lease=LeasePolicy(max_lease_duration=30),
                               dead_letter=DeadLetterPolicy("orders-dlq", MAX_ATTEMPTS),
                               dedup=MemoryDedupStore(), on_event=events.append)
    dead = dead_letter_subscription(broker)
    starts: list[float] = []
    ended: list[float] = []
    hanging = asyncio.Event()

    @sub.handler("billing")
    async def forever(message: Message) -> None:
        if message.data != b"hang":
            return
        starts.append(clock.now())
        hanging.set()
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(clock.now())

    hung = broker.publish_sync("orders", b"hang")
    task = await serving(sub, clock)
    try:
        await drive_until(clock, hanging.is_set, MEMORY_WITHIN, what="the hang")
        canary = broker.publish_sync("orders", b"canary")
        await drive_until(clock, lambda: outcomes(events, canary) == [Outcome.ACKED],
                          MEMORY_WITHIN, what="the canary, while the handler hangs")
        assert ended == [], "the canary was handled during the hang"
        await drive_until(clock, lambda: len(outcomes(events, hung)) == 2, MEMORY_WITHIN,
                          what="the hung message to be settled twice")
        assert outcomes(events, hung) == [Outcome.RETRY, Outcome.DEAD_LETTERED]
        assert sub.healthy()
        assert sub.lease_manager("billing").stats.max_lease_reached == 2
    finally:
        await sub.shutdown(timeout=1)
        await task
    assert len(starts) == len(ended) == 2, "each attempt's task was cancelled and ended"
    # Ended at max_lease_duration after receipt, within one of the manual clock's steps (the
    # lease manager used to look only when a lease fell due: up to 40 % of a lease early).
    for start, end in zip(starts, ended, strict=True):
        assert 30 - 0.1 <= end - start <= 30 + 0.05, (starts, ended)
    [copy] = await broker.receive(dead, 10, 0)
    assert copy.message.attributes["error-type"] == "reliable_sub.errors.HandlerTimeoutError"
    assert "max_lease_duration=30s" in copy.message.attributes["error-message"]


def outcomes(events: list[DeliveryEvent], message_id: str) -> list[Outcome]:
    return [e.outcome for e in events if e.message.id == message_id]


def _raise_cancelled() -> None:
    raise asyncio.CancelledError()


def _raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt()


def _raise_system_exit() -> None:
    raise SystemExit(3)


RAISERS: dict[str, tuple[Callable[[], None], str]] = {
    "KeyboardInterrupt": (_raise_keyboard_interrupt, "builtins.KeyboardInterrupt"),
    "SystemExit": (_raise_system_exit, "builtins.SystemExit"),
    "CancelledError": (_raise_cancelled, "asyncio.exceptions.CancelledError"),
}


@pytest.mark.parametrize("style", ["sync", "async"])
@pytest.mark.parametrize("kind", sorted(RAISERS))
async def test_a_handler_that_always_raises_a_base_exception_is_dead_lettered_naming_it(
    kind: str, style: str
) -> None:
    """Neither the process nor the Subscriber's loop is interrupted: it is the message's failure
    (retried, then dead-lettered with the exception's type), and the canary is handled."""
    raise_it, error_type = RAISERS[kind]
    events: list[DeliveryEvent] = []
    clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", MAX_ATTEMPTS),
                               on_event=events.append)
    dead = dead_letter_subscription(broker)
    calls: list[int] = []

    def behave(message: Message) -> None:
        if message.data == b"poison":
            calls.append(message.delivery_attempt)
            raise_it()

    if style == "sync":
        sub.handler("billing")(behave)
    else:
        @sub.handler("billing")
        async def handle(message: Message) -> None:
            await asyncio.sleep(0)
            behave(message)

    poison = broker.publish_sync("orders", b"poison")
    canary = broker.publish_sync("orders", b"canary")
    task = await serving(sub, clock)
    try:
        await drive_until(clock, lambda: len(outcomes(events, poison)) == 2
                          and outcomes(events, canary) == [Outcome.ACKED],
                          MEMORY_WITHIN, what="the poison to be settled twice")
        assert not task.done(), "the exception escaped into serve()"
        assert sub.healthy()
    finally:
        await sub.shutdown(timeout=1)
        await task
    assert outcomes(events, poison) == [Outcome.RETRY, Outcome.DEAD_LETTERED]
    assert calls == [1, 2]
    [copy] = await broker.receive(dead, 10, 0)
    assert copy.message.attributes["error-type"] == error_type
    assert copy.message.attributes["handler-failures"] == "2"


async def test_an_async_handler_blocking_the_loop_with_time_sleep(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing else runs while it blocks (not even the lease manager), but it is not a failure:
    the message is acked, the loop-lag watchdog names the handler in a WARNING, and the canary
    published behind it is handled once the loop is free."""
    events: list[DeliveryEvent] = []
    clock, broker, sub = setup(on_event=events.append, loop_lag_warning=0.1,
                               retry=RetryPolicy(min_backoff=1, max_backoff=2))
    blocking = threading.Event()

    @sub.handler("billing")
    async def blocker(message: Message) -> None:
        if message.data == b"block":
            blocking.set()
            time.sleep(0.4)  # noqa: ASYNC251 - blocking the loop is the mistake under test

    caplog.set_level(logging.INFO, logger="reliable_sub")
    blocked = broker.publish_sync("orders", b"block")
    task = await serving(sub, clock)
    try:
        await drive_until(clock, blocking.is_set, MEMORY_WITHIN, what="the block")
        canary = broker.publish_sync("orders", b"canary")
        await drive_until(clock, lambda: outcomes(events, blocked) == [Outcome.ACKED]
                          and outcomes(events, canary) == [Outcome.ACKED],
                          MEMORY_WITHIN, what="both acked")
        await drive_until(clock, lambda: "the event loop is free again" in caplog.text,
                          MEMORY_WITHIN, what="the watchdog to see the loop free")
        assert sub.healthy()
    finally:
        await sub.shutdown(timeout=1)
        await task
    [warning] = [r for r in caplog.records if "event loop has been blocked" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert "blocker" in warning.getMessage() and blocked in warning.getMessage()
    assert sub.stats.handler_errors == 0
