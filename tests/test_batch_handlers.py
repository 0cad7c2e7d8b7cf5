"""Batch handlers on the in-memory broker: one call for the messages received together, and
everything after it per message (claims, acks, retries, dead letters). The shipped adapter suite
runs a typed batch with a partial failure on every adapter."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
import threading
from typing import Any

import pydantic
import pytest

from reliable_sub import (
    BatchResult,
    ConfigurationError,
    DeadLetterPolicy,
    HandlerTimeoutError,
    MemoryDedupStore,
    Message,
    Outcome,
    Reject,
    RetryPolicy,
    Subscriber,
    SystemClock,
    current_claim,
)
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.dead_letters import DeadLetter
from reliable_sub.outcome import DeliveryEvent
from reliable_sub.testing.timing import drive_until
from tests.memory_world import serve_until, serving, setup


class Order(pydantic.BaseModel):
    sku: str
    quantity: int = pydantic.Field(gt=0)


@dataclasses.dataclass
class Refund:
    cents: int


def publish(broker: MemoryAdapter, count: int, **options: Any) -> list[str]:
    return [broker.publish_sync("orders", f"m{i}".encode(), **options) for i in range(count)]


def settled(sub: Subscriber, count: int) -> Any:
    return lambda: sum(sub.stats[o] for o in (Outcome.ACKED, Outcome.DEAD_LETTERED,
                                             Outcome.DUPLICATE)) >= count


async def test_what_one_receive_brought_is_one_call_of_at_most_max_batch() -> None:
    clock, broker, sub = setup(receive_batch=10)
    calls: list[list[bytes]] = []

    @sub.handler("billing", batch=True, max_batch=4)
    async def handle(messages: list[Message]) -> None:
        calls.append([m.data for m in messages])

    publish(broker, 10)
    await serve_until(sub, settled(sub, 10), "ten acks", 60, clock)
    assert calls == [[b"m0", b"m1", b"m2", b"m3"], [b"m4", b"m5", b"m6", b"m7"], [b"m8", b"m9"]]
    assert sub.stats[Outcome.ACKED] == 10 and sub.stats[Outcome.RETRY] == 0


async def test_max_wait_gathers_what_several_receives_brought() -> None:
    clock, broker, sub = setup(receive_batch=2)
    calls: list[int] = []

    @sub.handler("billing", batch=True, max_batch=5, max_wait=3)
    async def handle(messages: list[Message]) -> None:
        calls.append(len(messages))

    publish(broker, 5)
    await serve_until(sub, settled(sub, 5), "five acks", 60, clock)
    assert calls == [5]


async def test_max_wait_ends_a_batch_that_does_not_fill() -> None:
    clock, broker, sub = setup()
    calls: list[tuple[float, int]] = []

    @sub.handler("billing", batch=True, max_batch=50, max_wait=3)
    async def handle(messages: list[Message]) -> None:
        calls.append((clock.now(), len(messages)))

    publish(broker, 2)
    started = clock.now()
    await serve_until(sub, settled(sub, 2), "two acks", 60, clock)
    assert len(calls) == 1 and calls[0][1] == 2
    assert 3 <= calls[0][0] - started < 4  # it waited max_wait for more, then ran


async def test_typed_bodies_with_messages_and_a_bad_body_rejected_alone() -> None:
    clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", 5))
    broker.ensure_subscription_sync("orders-dlq", "dlq")
    calls: list[tuple[list[Order], list[str]]] = []

    @sub.handler("billing", batch=True)
    def handle(orders: list[Order], messages: list[Message]) -> None:  # in a worker thread
        assert threading.current_thread() is not threading.main_thread()
        calls.append((orders, [m.id for m in messages]))

    ids = [broker.publish_sync("orders", data) for data in (
        b'{"sku": "a", "quantity": 1}', b'{"sku": "b", "quantity": 0}',
        b'{"sku": "c", "quantity": 3}')]
    await serve_until(sub, settled(sub, 3), "three settled", 60, clock)
    assert calls == [([Order(sku="a", quantity=1), Order(sku="c", quantity=3)],
                      [ids[0], ids[2]])]
    assert (sub.stats["rejected"], sub.stats[Outcome.DEAD_LETTERED]) == (1, 1)
    (letter,) = [DeadLetter.of(d) for d in await broker.receive("dlq", 10, 0)]
    assert letter.reason == "rejected" and "is not a valid Order" in letter.error_message


async def test_a_batch_result_fails_only_the_messages_it_names() -> None:
    clock, broker, sub = setup()
    calls: list[list[bytes]] = []

    @sub.handler("billing", batch=True)
    async def handle(messages: list[Message]) -> BatchResult:
        calls.append([m.data for m in messages])
        return BatchResult(failed={m.id: ConnectionError("later") for m in messages
                                   if m.data == b"m1" and m.delivery_attempt == 1})

    publish(broker, 3)
    await serve_until(sub, settled(sub, 3), "three acks", 60, clock)
    assert calls == [[b"m0", b"m1", b"m2"], [b"m1"]]
    assert (sub.stats[Outcome.ACKED], sub.stats[Outcome.RETRY]) == (3, 1)


async def test_a_raised_exception_fails_every_message_up_to_the_dead_letter() -> None:
    clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", 2))
    broker.ensure_subscription_sync("orders-dlq", "dlq")
    calls: list[list[bytes]] = []

    @sub.handler("billing", batch=True)
    async def handle(messages: list[Message]) -> None:
        calls.append([m.data for m in messages])
        raise RuntimeError("the warehouse is down")

    publish(broker, 3)
    await serve_until(sub, settled(sub, 3), "three dead letters", 60, clock)
    # the batch, then its halves (nothing returned: the two fail together, as the batch did)
    assert calls[:3] == [[b"m0", b"m1", b"m2"], [b"m0"], [b"m1", b"m2"]]
    # (the redeliveries' jittered backoffs differ) and the last failure of each was alone
    assert all([c for c in calls if data in c][-1] == [data] for data in (b"m0", b"m1", b"m2"))
    assert (sub.stats[Outcome.RETRY], sub.stats[Outcome.DEAD_LETTERED]) == (3, 3)
    letters = [DeadLetter.of(d) for d in await broker.receive("dlq", 10, 0)]
    assert sorted(letter.data for letter in letters) == [b"m0", b"m1", b"m2"]
    assert {(letter.reason, letter.handler_failures) for letter in letters} == {
        ("max-delivery-attempts", 2)}


async def test_a_reject_in_a_batch_result_dead_letters_that_message_at_once() -> None:
    clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", 5))

    @sub.handler("billing", batch=True)
    async def handle(messages: list[Message]) -> BatchResult:
        return BatchResult(failed={messages[0].id: Reject("no such sku")})

    publish(broker, 2)
    await serve_until(sub, settled(sub, 2), "two settled", 60, clock)
    assert (sub.stats[Outcome.ACKED], sub.stats[Outcome.DEAD_LETTERED]) == (1, 1)
    assert sub.stats["rejected"] == 1 and sub.stats[Outcome.RETRY] == 0


async def test_a_batch_result_naming_a_stranger_fails_the_whole_call() -> None:
    clock, broker, sub = setup()
    calls: list[int] = []

    @sub.handler("billing", batch=True)
    async def handle(messages: list[Message]) -> BatchResult | None:
        calls.append(len(messages))
        if len(calls) == 1:
            return BatchResult(failed={"no-such-id": ValueError("typo")})
        return None

    publish(broker, 2)
    await serve_until(sub, settled(sub, 2), "two acks", 60, clock)
    assert calls == [2, 1, 1]  # never acked on a result it could not read: called again
    assert (sub.stats[Outcome.ACKED], sub.stats[Outcome.RETRY]) == (2, 0)


async def test_duplicates_are_filtered_out_before_the_call() -> None:
    clock, broker, sub = setup()
    sub = Subscriber(broker, clock=clock, dedup=MemoryDedupStore(clock=clock))
    calls: list[list[bytes]] = []

    @sub.handler("billing", batch=True)
    async def handle(messages: list[Message]) -> None:
        calls.append([m.data for m in messages])

    broker.publish_sync("orders", b"a", attributes={"idempotency-key": "k1"})
    await serve_until(sub, settled(sub, 1), "one ack", 60, clock)
    broker.publish_sync("orders", b"a again", attributes={"idempotency-key": "k1"})
    broker.publish_sync("orders", b"b", attributes={"idempotency-key": "k2"})
    await serve_until(sub, settled(sub, 3), "a duplicate and an ack", 60, clock)
    assert calls == [[b"a"], [b"b"]]
    assert sub.stats[Outcome.DUPLICATE] == 1


async def test_transient_errors_are_retried_in_process_for_the_whole_batch() -> None:
    clock, broker, sub = setup()
    calls: list[int] = []

    @sub.handler("billing", batch=True,
                 retry=RetryPolicy(min_backoff=1, max_backoff=2, in_process_attempts=3))
    async def handle(messages: list[Message]) -> None:
        calls.append(len(messages))
        if len(calls) == 1:
            raise ConnectionError("blip")

    publish(broker, 2)
    await serve_until(sub, settled(sub, 2), "two acks", 60, clock)
    assert calls == [2, 2] and sub.stats[Outcome.RETRY] == 0


async def test_a_batch_past_its_timeout_fails_every_message() -> None:
    events: list[DeliveryEvent] = []
    clock, broker, sub = setup(on_event=events.append)
    calls: list[int] = []

    @sub.handler("billing", batch=True, timeout=5)
    async def handle(messages: list[Message]) -> None:
        calls.append(len(messages))
        if len(calls) == 1:
            await asyncio.Event().wait()  # never returns

    publish(broker, 2)
    await serve_until(sub, settled(sub, 2), "two acks after a timeout", 120, clock)
    assert calls[0] == 2 and sum(calls) == 4 and sub.stats[Outcome.RETRY] == 2
    assert {type(e.error) for e in events if e.outcome is Outcome.RETRY} == {HandlerTimeoutError}


async def test_a_stop_gives_back_a_running_batch_and_one_still_gathering() -> None:
    clock, broker, sub = setup()
    started = asyncio.Event()

    @sub.handler("billing", batch=True, max_wait=30)
    async def handle(messages: list[Message]) -> None:
        started.set()
        await asyncio.Event().wait()

    publish(broker, 2)
    task = await serving(sub, clock)
    await drive_until(clock, lambda: len(sub._runtime.items) == 2 if sub._runtime else False,
                      10, what="two in flight")
    await sub.shutdown(timeout=1)
    await task
    assert not started.is_set()  # still gathering when the stop came
    assert sub.stats[Outcome.STOPPED] == 2 and sub.stats[Outcome.ACKED] == 0
    assert len(await broker.receive("billing", 10, 0)) == 2  # given back, not lost


def test_registration_refuses_what_a_batch_handler_cannot_be() -> None:
    _, _, sub = setup()

    async def passthrough(context: Any, call_next: Any) -> Any:
        return await call_next(context)

    cases: list[tuple[dict[str, Any], Any, str]] = [
        ({"batch": True, "middleware": [passthrough]}, lambda ms: None, "no middleware"),
        ({"max_batch": 5}, lambda m: None, "pass batch=True"),
        ({"batch": True, "max_batch": 0}, lambda ms: None, "max_batch"),
        ({"batch": True, "max_wait": -1}, lambda ms: None, "max_wait"),
        ({"batch": True, "timeout": 5, "max_wait": 5}, lambda ms: None, "max_wait"),
        ({"batch": "yes"}, lambda ms: None, "batch must be True or False"),
        ({"batch": True, "transactional": True}, lambda ms, c: None, "cannot be transactional"),
    ]

    def bare(refund: Refund) -> None: ...

    def no_parameter() -> None: ...

    cases.append(({"batch": True}, bare, "annotate its parameter list[Refund]"))
    cases.append(({"batch": True}, no_parameter, "handler(messages)"))
    for options, function, says in cases:
        with pytest.raises(ConfigurationError, match=re.escape(says)):
            sub.handler("billing", **options)(function)


def test_a_batch_handler_cannot_be_transactional_or_under_subscriber_middleware() -> None:
    async def passthrough(context: Any, call_next: Any) -> Any:
        return await call_next(context)

    _, broker, _ = setup()
    sub = Subscriber(broker, middleware=[passthrough])
    with pytest.raises(ConfigurationError, match="no middleware"):
        sub.handler("billing", batch=True)(lambda messages: None)


async def test_a_batch_holds_one_message_of_an_ordering_key_at_a_time() -> None:
    clock, broker, sub = setup()
    calls: list[list[bytes]] = []

    @sub.handler("billing", batch=True)
    async def handle(messages: list[Message]) -> None:
        calls.append([m.data for m in messages])

    for data, key in ((b"k-1", "k"), (b"k-2", "k"), (b"free", None), (b"k-3", "k")):
        broker.publish_sync("orders", data, ordering_key=key)
    await serve_until(sub, settled(sub, 4), "four acks", 60, clock)
    assert calls == [[b"k-1", b"free"], [b"k-2"], [b"k-3"]]


async def test_a_stop_waits_for_a_sync_batch_and_acks_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, broker, _ = setup()
    sub = Subscriber(broker)  # the real clock: the stop waits for a real thread
    running, release = threading.Event(), threading.Event()

    @sub.handler("billing", batch=True)
    def handle(messages: list[Message]) -> None:
        running.set()
        release.wait(30)

    publish(broker, 3)
    task = asyncio.ensure_future(sub.serve())
    await asyncio.to_thread(running.wait, 30)
    stopping = asyncio.ensure_future(sub.shutdown(timeout=0.1))
    # past the stop's timeout: a thread cannot be interrupted, so the stop waits for it
    await drive_until(SystemClock(), lambda: "still running at the stop deadline" in caplog.text,
                      10, what="the stop's warning")
    release.set()
    await stopping
    await task
    assert sub.stats[Outcome.ACKED] == 3 and sub.stats[Outcome.STOPPED] == 0


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ failed")


async def test_hostile_batch_handlers_are_run_and_their_failures_dead_lettered() -> None:
    clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", 1))
    broker.ensure_subscription_sync("orders-dlq", "dlq")
    calls: list[int] = []

    async def body(messages: list[Message]) -> BatchResult:
        calls.append(len(messages))
        return BatchResult(failed={messages[0].id: _Unprintable()})

    @sub.handler("billing", batch=True)
    @functools.wraps(body)
    def handle(messages: list[Message]) -> Any:  # a sync wrapper returning a coroutine
        return body(messages)

    publish(broker, 2)
    await serve_until(sub, settled(sub, 2), "an ack and a dead letter", 60, clock)
    assert calls == [2]  # the coroutine was run, once
    assert (sub.stats[Outcome.ACKED], sub.stats[Outcome.DEAD_LETTERED]) == (1, 1)
    (letter,) = [DeadLetter.of(d) for d in await broker.receive("dlq", 10, 0)]
    assert letter.error_message.startswith("<unprintable _Unprintable")


async def test_current_claim_of_a_message_in_a_batch() -> None:
    clock, broker, _ = setup()
    sub = Subscriber(broker, clock=clock, dedup=MemoryDedupStore(clock=clock))
    seen: dict[str, tuple[str | None, str | None]] = {}

    @sub.handler("billing", batch=True)
    def handle(messages: list[Message]) -> None:  # in a thread: the context goes with it
        for message in messages:
            claim = current_claim(message)
            seen[message.data.decode()] = (claim.key.key if claim else None,
                                           None if current_claim() is None else "a claim")

    broker.publish_sync("orders", b"a", attributes={"idempotency-key": "k-a"})
    broker.publish_sync("orders", b"b", attributes={"idempotency-key": "k-b"})
    await serve_until(sub, settled(sub, 2), "two acks", 60, clock)
    assert seen == {"a": ("k-a", None), "b": ("k-b", None)}


def slow_dead_letters(broker: MemoryAdapter, clock: Any) -> list[float]:
    """Subscription ``dlq`` on ``orders-dlq``, whose publishes (dead letters go by
    ``publish_routed``) take 1.5 s of ``clock``; returns the clock times they began at."""
    broker.ensure_subscription_sync("orders-dlq", "dlq")
    publish_now = broker.publish_routed
    began: list[float] = []

    async def slow_publish(topic: str, *args: Any, **kwargs: Any) -> str:
        if topic == "orders-dlq":
            began.append(clock.now())
            await clock.sleep(1.5)
        return await publish_now(topic, *args, **kwargs)

    broker.publish_routed = slow_publish  # type: ignore[method-assign]
    return began


async def test_a_stop_while_a_timed_out_batch_is_decided_cuts_no_decision_short() -> None:
    """A batch past its timeout is decided message by message (here: dead letters, slow to
    publish). A stop that cancels the batch's task meanwhile must not leave a message
    undecided."""
    clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", 1))
    dead_letters_began = slow_dead_letters(broker, clock)

    @sub.handler("billing", batch=True, timeout=5)
    async def handle(messages: list[Message]) -> None:
        await asyncio.Event().wait()  # never returns

    publish(broker, 2)
    started = clock.now()
    task = await serving(sub, clock)
    # past the timeout (5 s), while the first dead letter is published (1.5 s each)
    await drive_until(clock, lambda: bool(dead_letters_began), 60, what="the timeout")
    assert dead_letters_began[0] - started == pytest.approx(5.0, abs=0.1)
    assert sub.stats[Outcome.DEAD_LETTERED] == 0
    stopping = asyncio.ensure_future(sub.shutdown(timeout=0))
    await drive_until(clock, stopping.done, 60, what="the stop")
    await task
    assert (sub.stats[Outcome.DEAD_LETTERED], sub.stats[Outcome.ACK_REFUSED]) == (2, 0)
    assert sorted(d.message.data for d in await broker.receive("dlq", 10, 0)) == [b"m0", b"m1"]


# -- found by review (each failed before its fix) ---------------------------------------------


async def test_a_batch_cancelled_before_its_first_step_gives_back_and_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch's task may be cancelled before it ran at all (a stop, max_lease_duration in the
    same loop turn as its first delivery): Python raises at the coroutine's entry, so its own
    handling never runs. Its deliveries are given back, and the lane opens a new batch."""
    from reliable_sub._runtime import batches as runtime_batches
    from reliable_sub._runtime.decisions import cancel
    from reliable_sub._runtime.inflight import CancelReason

    clock, broker, sub = setup()
    calls: list[int] = []

    @sub.handler("billing", batch=True)
    async def handle(messages: list[Message]) -> None:
        calls.append(len(messages))

    add, cancelled = runtime_batches.Batches.add, []

    def add_then_cancel(self: Any, item: Any) -> None:
        add(self, item)
        if not cancelled:  # the lease manager's report, in the same loop turn
            cancelled.append(item)
            cancel(item, CancelReason.EXPIRED)

    monkeypatch.setattr(runtime_batches.Batches, "add", add_then_cancel)
    publish(broker, 1)
    task = await serving(sub, clock)
    try:
        await drive_until(clock, lambda: bool(cancelled), 10, what="the first delivery")
        publish(broker, 3)
        await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 4, 120, what="four acks")
    finally:
        await sub.shutdown(timeout=1)
        await task
    assert sub.stats[Outcome.REQUEUED] == 1 and sum(calls) == 4


async def test_in_process_retries_get_fresh_lists() -> None:
    clock, broker, sub = setup()
    attempts: list[list[bytes]] = []

    @sub.handler("billing", batch=True, in_process_retry=3)
    async def handle(messages: list[Message]) -> None:
        attempts.append([m.data for m in messages])
        while messages:  # a handler may consume its list
            if messages.pop(0).data == b"m1" and len(attempts) == 1:
                raise ConnectionError("blip")

    publish(broker, 3)
    await serve_until(sub, settled(sub, 3), "three acks", 60, clock)
    assert attempts == [[b"m0", b"m1", b"m2"]] * 2


async def test_decisions_after_the_call_are_not_cut_short_by_the_timeout() -> None:
    """Rejected before its timeout, a batch's dead letters are published one by one (slowly):
    the timeout passing meanwhile must not re-decide them as timed out. (By a BatchResult:
    raised, the Reject would be confirmed for each message alone first, 3 s a call.)"""
    clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", 5))
    slow_dead_letters(broker, clock)

    @sub.handler("billing", batch=True, timeout=5)
    async def handle(messages: list[Message]) -> BatchResult:
        await clock.sleep(3)
        return BatchResult(failed={m.id: Reject("no such sku") for m in messages})

    publish(broker, 5)
    await serve_until(sub, settled(sub, 5), "five dead letters", 120, clock)
    assert (sub.stats[Outcome.DEAD_LETTERED], sub.stats[Outcome.RETRY]) == (5, 0)
    letters = [DeadLetter.of(d) for d in await broker.receive("dlq", 10, 0)]
    assert {letter.reason for letter in letters} == {"rejected"}


class _Fatal(BaseException):
    pass


@dataclasses.dataclass
class _Picky:
    sku: str

    def __post_init__(self) -> None:
        if self.sku == "boom":
            raise _Fatal("a validator raising a BaseException")


async def test_a_validator_raising_a_base_exception_fails_its_message_alone() -> None:
    clock, broker, sub = setup()
    seen: list[str] = []

    @sub.handler("billing", batch=True)
    async def handle(orders: list[_Picky]) -> None:
        seen.extend(order.sku for order in orders)

    broker.publish_sync("orders", b'{"sku": "boom"}')
    broker.publish_sync("orders", b'{"sku": "ok"}')
    task = await serving(sub, clock)
    try:
        await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 1
                          and sub.stats[Outcome.RETRY] >= 1, 60, what="an ack and a retry")
    finally:
        await sub.shutdown(timeout=1)
        await task
    assert seen[0] == "ok"


async def test_a_batch_handler_returning_something_else_fails_the_batch() -> None:
    clock, broker, sub = setup()
    calls: list[int] = []

    @sub.handler("billing", batch=True)
    async def handle(messages: list[Message]) -> Any:
        calls.append(len(messages))
        return [messages[0].id] if len(calls) == 1 else None  # "the failed ones"? not read

    publish(broker, 2)
    await serve_until(sub, settled(sub, 2), "two acks", 60, clock)
    assert calls == [2, 1, 1]  # a failed call (not acked on what it returned): halved
    assert (sub.stats[Outcome.ACKED], sub.stats[Outcome.RETRY]) == (2, 0)


def test_a_tuple_or_optional_list_of_bodies_is_refused() -> None:
    _, _, sub = setup()

    def as_tuple(refunds: tuple[Refund, ...]) -> None: ...

    def optional(refunds: list[Refund] | None) -> None: ...

    for function in (as_tuple, optional):
        with pytest.raises(ConfigurationError, match=r"gets a list: annotate its parameter"):
            sub.handler("billing", batch=True)(function)


async def test_a_batch_call_is_one_processing_time_sample_whatever_its_failures() -> None:
    clock, broker, sub = setup()
    samples: list[int] = []

    @sub.handler("billing", batch=True)
    async def handle(messages: list[Message]) -> BatchResult:
        samples.append(len(sub.lease_manager("billing").histogram))
        return BatchResult(failed={m.id: ConnectionError("later") for m in messages
                                   if m.data == b"m1" and m.delivery_attempt == 1})

    publish(broker, 2)
    await serve_until(sub, settled(sub, 2), "two acks", 60, clock)
    assert samples == [0, 1]  # the first call's, once (not again for its failed message)
