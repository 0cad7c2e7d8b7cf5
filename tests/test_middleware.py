"""The per-message middleware chain: order, decisions seen from outside, short cuts, errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from reliable_sub import (
    ConfigurationError,
    DeadLetterPolicy,
    ManualClock,
    MemoryDedupStore,
    Message,
    Outcome,
    Subscriber,
)
from reliable_sub.middleware import CallNext, Context, Decision, Verdict
from reliable_sub.outcome import DeliveryEvent
from reliable_sub.testing.timing import drive_until
from tests.memory_world import serving, setup

REPO = Path(__file__).resolve().parent.parent


async def run_until(sub: Subscriber, clock: ManualClock, done, what: str) -> None:
    task = await serving(sub, clock)
    try:
        await drive_until(clock, done, 120, what=what)
    finally:
        await sub.shutdown(timeout=1)
        await task


class Recording:
    """A middleware that records the decisions coming back up to it."""

    def __init__(self, name: str, trail: list[str]) -> None:
        self.name = name
        self.trail = trail
        self.decisions: list[Decision] = []

    async def __call__(self, context: Context, call_next: CallNext) -> Decision:
        self.trail.append(f"{self.name} in")
        decision = await call_next(context)
        self.trail.append(f"{self.name} out")
        self.decisions.append(decision)
        return decision


async def test_subscriber_middleware_wraps_the_handlers_own_and_sees_every_verdict() -> None:
    trail: list[str] = []
    outer = Recording("subscriber-wide", trail)
    inner = Recording("handler", trail)
    clock, broker, sub = setup(middleware=[outer],
                               dead_letter=DeadLetterPolicy("orders-dlq", 3))

    @sub.handler("billing", middleware=[inner])
    async def charge(message: Message) -> None:
        trail.append("handler")
        raise ValueError("no amount")

    broker.publish_sync("orders", b"x")
    await run_until(sub, clock, lambda: sub.stats[Outcome.DEAD_LETTERED] == 1, "dead letter")
    assert trail[:5] == ["subscriber-wide in", "handler in", "handler", "handler out",
                         "subscriber-wide out"]
    # the outer one sees what became of each attempt, the dead letter included
    assert [d.verdict for d in outer.decisions] == [
        Verdict.REDELIVER, Verdict.REDELIVER, Verdict.DEAD_LETTERED]
    assert [d.failures for d in outer.decisions] == [1, 2, 3]
    assert all(isinstance(d.error, ValueError) for d in outer.decisions)
    # the handler's own one is inside the Subscriber-wide one, outside the built-ins
    assert [d.verdict for d in inner.decisions] == [d.verdict for d in outer.decisions]


async def test_a_middleware_may_answer_without_calling_the_handler() -> None:
    async def maintenance_mode(context: Context, call_next: CallNext) -> Decision:
        if context.message.attributes.get("skip") == "yes":
            return Decision.ack({"skipped": True})
        return await call_next(context)

    store = MemoryDedupStore()
    clock, broker, sub = setup(middleware=[maintenance_mode], dedup=store)
    handled: list[bytes] = []
    sub.handler("billing")(lambda message: handled.append(message.data))
    broker.publish_sync("orders", b"a", {"skip": "yes", "idempotency-key": "a"})
    broker.publish_sync("orders", b"b")
    await run_until(sub, clock, lambda: sub.stats[Outcome.ACKED] == 2, "two acks")
    assert handled == [b"b"]


async def test_a_middleware_that_raises_fails_the_attempt_like_a_handler() -> None:
    calls: list[int] = []

    async def flaky(context: Context, call_next: CallNext) -> Decision:
        calls.append(context.failures)
        if context.failures == 0:
            raise RuntimeError("the middleware's own bug")
        return await call_next(context)

    clock, broker, sub = setup(middleware=[flaky])
    sub.handler("billing")(lambda message: None)
    broker.publish_sync("orders", b"x")
    await run_until(sub, clock, lambda: sub.stats[Outcome.ACKED] == 1, "ack")
    assert calls == [0, 1]
    assert sub.stats[Outcome.RETRY] == 1


async def test_on_event_reports_error_duration_delay_and_attempts() -> None:
    events: list[DeliveryEvent] = []
    clock, broker, sub = setup(on_event=events.append)

    @sub.handler("billing")
    async def charge(message: Message) -> None:
        await clock.sleep(2.5)
        if message.delivery_attempt == 1:
            raise ValueError("declined")

    broker.publish_sync("orders", b"x")
    await run_until(sub, clock, lambda: sub.stats[Outcome.ACKED] == 1, "ack")
    retry, acked = events
    assert (retry.outcome, retry.attempt, retry.failures) == (Outcome.RETRY, 1, 1)
    assert isinstance(retry.error, ValueError) and retry.duration == pytest.approx(2.5)
    assert 1 <= retry.delay <= 2
    assert (acked.outcome, acked.attempt, acked.error) == (Outcome.ACKED, 2, None)


def test_middleware_must_be_callables() -> None:
    _, broker, sub = setup()
    with pytest.raises(ConfigurationError, match="not a middleware"):
        sub.handler("billing", middleware=["log"])  # type: ignore[list-item]
    with pytest.raises(ConfigurationError, match="list of middleware"):
        Subscriber(broker, middleware=print)  # type: ignore[arg-type]


def test_the_slow_handler_example_runs() -> None:
    result = subprocess.run([sys.executable, "examples/slow_handler_middleware.py"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "slow handler" in result.stdout and "report-2" in result.stdout
