"""Subscriber lifecycle, error recovery and options (the guarantees are in conformance/)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from reliable_sub import (
    Completed,
    ConfigurationError,
    DedupKey,
    FlowControl,
    LeasePolicy,
    MemoryDedupStore,
    Message,
    Outcome,
    RetryPolicy,
    Subscriber,
    UnknownSubscriptionError,
)
from reliable_sub._runtime.settler import quantize_delay
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.clock import ManualClock
from reliable_sub.message import Delivery
from reliable_sub.testing.timing import drive_until


def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` (real time) until it holds or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class FlakyBroker(MemoryAdapter):
    """A memory broker whose calls fail a given number of times first."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failures = {"receive": 0, "ack": 0}
        self.ack_calls = 0

    def _maybe_fail(self, call: str) -> None:
        if self.failures[call] > 0:
            self.failures[call] -= 1
            raise ConnectionError(f"{call}: connection reset by broker")

    async def receive(self, subscription: str, max_messages: int, timeout: float):
        self._maybe_fail("receive")
        return await super().receive(subscription, max_messages, timeout)

    async def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        self.ack_calls += 1
        self._maybe_fail("ack")
        return await super().ack(deliveries)


def test_start_and_stop_in_a_background_thread_with_a_sync_handler() -> None:
    broker = MemoryAdapter()
    broker.ensure_subscription_sync("orders", "billing")
    handled: list[bytes] = []
    threads: set[str] = set()
    sub = Subscriber(broker, dedup=MemoryDedupStore())

    @sub.handler("billing")
    def charge(message: Message) -> None:
        threads.add(threading.current_thread().name)
        handled.append(message.data)

    sub.start()
    assert sub.running
    for i in range(20):
        broker.publish_sync("orders", f"order-{i}".encode())
    wait_for(lambda: sub.stats[Outcome.ACKED] == 20, what="20 acks")
    sub.stop(timeout=5)

    assert not sub.running
    assert sorted(handled) == sorted(f"order-{i}".encode() for i in range(20))
    assert all(name.startswith("reliable-sub") for name in threads)
    assert broker.backlog("billing") == 0
    sub.stop()  # a second stop is a no-op


def test_run_stops_gracefully_on_sigterm(tmp_path) -> None:
    script = tmp_path / "consumer.py"
    script.write_text(textwrap.dedent("""
        import os, signal, threading
        from reliable_sub import Subscriber, Message
        from reliable_sub.adapters.memory import MemoryAdapter

        broker = MemoryAdapter()
        broker.ensure_subscription_sync("t", "s")
        sub = Subscriber(broker)
        done = threading.Event()

        @sub.handler("s")
        def handle(message: Message) -> None:
            print("handled", message.data.decode(), flush=True)
            done.set()

        def publish_then_terminate() -> None:
            broker.publish_sync("t", b"hello")
            done.wait(10)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=publish_then_terminate).start()
        sub.run()
        print("stopped; backlog", broker.backlog("s"), flush=True)
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["handled hello", "stopped; backlog 0"]


def test_start_reports_a_missing_subscription_in_the_callers_thread() -> None:
    sub = Subscriber(MemoryAdapter())
    sub.handler("nowhere")(lambda m: None)
    with pytest.raises(UnknownSubscriptionError, match="'nowhere' does not exist"):
        sub.start()
    assert not sub.running


def test_registration_errors_are_clear() -> None:
    sub = Subscriber(MemoryAdapter())
    with pytest.raises(ConfigurationError, match="no handlers"):
        sub.start()
    sub.handler("s")(lambda m: None)
    with pytest.raises(ConfigurationError, match="'s' already has a handler"):
        sub.handler("s")(lambda m: None)
    with pytest.raises(ConfigurationError, match="non-empty str"):
        sub.handler("")


async def serve(sub: Subscriber, clock: ManualClock):
    task = asyncio.ensure_future(sub.serve())
    await drive_until(clock, lambda: sub.running, 1.0)
    return task


async def stop(sub: Subscriber, task: asyncio.Future) -> None:
    await sub.shutdown(timeout=1)
    await task


async def test_receive_and_ack_failures_are_retried_and_nothing_is_lost() -> None:
    clock = ManualClock()
    broker = FlakyBroker(clock=clock)
    broker.ensure_subscription_sync("t", "s")
    broker.failures.update(receive=3, ack=2)
    sub = Subscriber(broker, clock=clock)
    handled: list[str] = []
    sub.handler("s")(lambda m: handled.append(m.id))
    ids = [broker.publish_sync("t", f"{i}".encode()) for i in range(5)]

    task = await serve(sub, clock)
    await drive_until(clock, lambda: broker.backlog("s") == 0, 60, what="backlog drained")
    await stop(sub, task)

    assert sorted(handled) == sorted(ids)
    assert sub.stats.receive_errors == 3
    assert sub.stats.ack_errors == 2, "each failed ack call is counted, then retried"
    assert sub.stats[Outcome.ACKED] == 5
    assert broker.ack_calls >= 3


async def test_in_process_retries_only_for_listed_exceptions() -> None:
    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("t", "transient")
    broker.ensure_subscription_sync("u", "permanent")
    retry = RetryPolicy(min_backoff=5, max_backoff=5, in_process_attempts=3,
                        retry_on=(ConnectionError,))
    sub = Subscriber(broker, clock=clock, retry=retry)
    calls: dict[str, list[int]] = {"transient": [], "permanent": []}

    @sub.handler("transient")
    async def transient(message: Message) -> None:
        calls["transient"].append(message.delivery_attempt)
        if len(calls["transient"]) < 3:
            raise ConnectionError("database connection reset")

    @sub.handler("permanent")
    async def permanent(message: Message) -> None:
        calls["permanent"].append(message.delivery_attempt)
        if message.delivery_attempt == 1:
            raise ValueError("invalid amount")

    broker.publish_sync("t", b"x")
    broker.publish_sync("u", b"y")
    task = await serve(sub, clock)
    await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 2, 60, what="both acked")
    await stop(sub, task)

    assert calls["transient"] == [1, 1, 1], "retried in process, no redelivery"
    assert calls["permanent"] == [1, 2], "not retried in process; redelivered after backoff"
    assert sub.stats[Outcome.RETRY] == 1


async def test_a_failing_dedup_store_redelivers_instead_of_losing() -> None:
    class BrokenStore(MemoryDedupStore):
        broken = 2

        async def claim_many(self, keys, lease_ttl: float, tokens=None):
            if self.broken:
                self.broken -= 1
                raise ConnectionError("dedup store unreachable")
            return await super().claim_many(keys, lease_ttl, tokens)

    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("t", "s")
    sub = Subscriber(broker, clock=clock, dedup=BrokenStore(clock=clock),
                     retry=RetryPolicy(min_backoff=1, max_backoff=2))
    attempts: list[int] = []
    sub.handler("s")(lambda m: attempts.append(m.delivery_attempt))
    broker.publish_sync("t", b"x")
    task = await serve(sub, clock)
    await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 1, 60, what="ack")
    await stop(sub, task)
    assert attempts == [3]
    assert sub.stats.store_errors == 2
    assert sub.stats[Outcome.RETRY] == 2


async def test_a_result_that_is_not_json_is_stored_as_null_and_acked() -> None:
    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("t", "s")
    store = MemoryDedupStore(clock=clock)
    sub = Subscriber(broker, clock=clock, dedup=store)
    sub.handler("s")(lambda m: {1, 2, 3})
    broker.publish_sync("t", b"x", {"idempotency-key": "k"})
    task = await serve(sub, clock)
    await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 1, 60, what="ack")
    await stop(sub, task)
    found = await store.claim(DedupKey(broker.dedup_namespace("s"), "k"), 10)
    assert isinstance(found, Completed) and found.result is None


async def test_flow_control_bounds_messages_in_flight() -> None:
    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("t", "s")
    sub = Subscriber(broker, clock=clock, flow_control=FlowControl(max_messages=3))
    running = 0
    peak = 0
    release = asyncio.Event()

    @sub.handler("s")
    async def handle(message: Message) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await release.wait()
        running -= 1

    for i in range(10):
        broker.publish_sync("t", f"{i}".encode())
    task = await serve(sub, clock)
    await drive_until(clock, lambda: running == 3, 5, what="three handlers")
    assert broker.backlog("s") == 10
    release.set()
    await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 10, 60, what="all acked")
    await stop(sub, task)
    assert peak == 3


async def test_max_bytes_lets_one_big_message_run_alone() -> None:
    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("t", "s")
    sub = Subscriber(broker, clock=clock, flow_control=FlowControl(max_bytes=100))
    concurrent: list[int] = []
    running = 0

    @sub.handler("s")
    async def handle(message: Message) -> None:
        nonlocal running
        running += 1
        concurrent.append(running)
        await clock.sleep(1)
        running -= 1

    broker.publish_sync("t", b"x" * 500)
    for _ in range(4):
        broker.publish_sync("t", b"y" * 40)
    task = await serve(sub, clock)
    await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 5, 60, what="all acked")
    await stop(sub, task)
    assert max(concurrent) == 2, "100 bytes allow two 40-byte handlers, the 500-byte one alone"


async def test_past_max_lease_a_sync_handler_keeps_its_claim_and_is_not_run_twice() -> None:
    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("t", "s", ack_deadline=10)
    store = MemoryDedupStore(clock=clock)
    sub = Subscriber(broker, clock=clock, dedup=store,
                     lease=LeasePolicy(max_lease_duration=60),
                     retry=RetryPolicy(min_backoff=5, max_backoff=20),
                     dead_letter=None)
    runs: list[int] = []
    release = threading.Event()

    @sub.handler("s")
    def long_job(message: Message) -> str:
        runs.append(message.delivery_attempt)
        release.wait(30)  # a thread cannot be interrupted
        return "done"

    broker.publish_sync("t", b"report")
    task = await serve(sub, clock)
    await drive_until(clock, lambda: sub.stats[Outcome.DEFERRED] >= 2, 400,
                      what="the redelivered copy to be deferred behind the live claim")
    assert sub.lease_manager("s").stats.max_lease_reached >= 1
    release.set()
    await drive_until(clock, lambda: sub.stats[Outcome.DUPLICATE] == 1, 400,
                      what="the copy to be recognised as a duplicate")
    await stop(sub, task)

    assert runs == [1], "the handler ran twice"
    assert sub.stats[Outcome.ACK_REFUSED] == 1, "its own ack came after the redelivery"
    assert broker.backlog("s") == 0


async def test_past_max_lease_an_async_handler_is_cancelled_as_a_failed_attempt() -> None:
    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("t", "s", ack_deadline=10)
    sub = Subscriber(broker, clock=clock, dedup=MemoryDedupStore(clock=clock),
                     lease=LeasePolicy(max_lease_duration=60),
                     retry=RetryPolicy(min_backoff=5, max_backoff=20))
    runs: list[int] = []
    cancelled: list[int] = []

    @sub.handler("s")
    async def long_job(message: Message) -> str:
        runs.append(message.delivery_attempt)
        if len(runs) == 1:
            try:
                await clock.sleep(1000)
            except asyncio.CancelledError:
                cancelled.append(message.delivery_attempt)
                raise
        return "done"

    broker.publish_sync("t", b"report")
    task = await serve(sub, clock)
    await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 1, 400, what="the retry")
    await stop(sub, task)
    assert cancelled == [1]
    assert runs == [1, 2]
    assert sub.stats[Outcome.RETRY] == 1
    assert sub.stats.handler_errors == 1


async def test_stop_inside_the_loop_points_to_shutdown() -> None:
    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("t", "s")
    sub = Subscriber(broker, clock=clock)
    sub.handler("s")(lambda m: None)
    task = await serve(sub, clock)
    with pytest.raises(RuntimeError, match=r"await sub\.shutdown"):
        sub.stop()
    await stop(sub, task)


async def test_acks_are_batched() -> None:
    clock = ManualClock()
    broker = FlakyBroker(clock=clock)
    broker.ensure_subscription_sync("t", "s")
    sub = Subscriber(broker, clock=clock)

    @sub.handler("s")
    async def handle(message: Message) -> None:
        return None

    for i in range(300):
        broker.publish_sync("t", f"{i}".encode())
    task = await serve(sub, clock)
    await drive_until(clock, lambda: broker.backlog("s") == 0, 60, what="drained")
    await stop(sub, task)
    assert broker.ack_calls <= 10, f"{broker.ack_calls} ack calls for 300 messages"


@pytest.mark.parametrize(
    ("delay", "expected"),
    [(0, 0), (-1, 0), (12.34, 13), (187.5, 190), (0.123, 0.13), (600, 600), (5.0, 5.0),
     (5e-324, 5e-324), (1e-7, 1e-7), (float("nan"), 0), (float("inf"), float("inf"))],
)
def test_nack_delays_are_rounded_up_to_two_significant_digits(delay, expected) -> None:
    assert quantize_delay(delay) == pytest.approx(expected)


async def test_cancelling_serve_stops_gracefully() -> None:
    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("t", "s")
    sub = Subscriber(broker, clock=clock, stop_timeout=0.1)
    started = asyncio.Event()

    @sub.handler("s")
    async def handle(message: Message) -> None:
        started.set()
        await asyncio.Event().wait()

    broker.publish_sync("t", b"x")
    task = await serve(sub, clock)
    await drive_until(clock, started.is_set, 5, what="handler start")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not sub.running
    assert sub.stats[Outcome.STOPPED] == 1
    [again] = await broker.receive("s", 1, 0)
    assert again.message.delivery_attempt == 2


async def test_without_dedup_a_handler_past_max_lease_does_not_stall_other_leases() -> None:
    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("t", "s", ack_deadline=10)
    sub = Subscriber(broker, clock=clock, lease=LeasePolicy(max_lease_duration=30))
    runs: list[bytes] = []

    @sub.handler("s")
    async def handle(message: Message) -> None:
        runs.append(message.data)
        first_marathon = message.data == b"marathon" and runs.count(b"marathon") == 1
        await clock.sleep(100 if first_marathon else 25)

    broker.publish_sync("t", b"marathon")
    task = await serve(sub, clock)
    await drive_until(clock, lambda: sub.lease_manager("s").stats.max_lease_reached == 1, 60,
                      what="max lease reached")
    broker.publish_sync("t", b"later")
    await drive_until(clock, lambda: b"later" in runs, 5, what="later starts")
    await drive_until(clock, lambda: sub.stats[Outcome.ACKED] >= 2, 200, what="acks")
    await stop(sub, task)
    assert runs.count(b"later") == 1, "a 25 s handler was redelivered: its lease was not extended"


async def test_a_failing_broker_is_retried_and_stop_still_returns() -> None:
    clock = ManualClock()
    broker = FlakyBroker(clock=clock)
    broker.ensure_subscription_sync("t", "s")
    broker.failures["receive"] = 10**9
    sub = Subscriber(broker, clock=clock)
    sub.handler("s")(lambda m: None)
    task = await serve(sub, clock)
    await drive_until(clock, lambda: sub.stats.receive_errors >= 3, 60, what="receive retries")
    await stop(sub, task)
    assert not sub.running


async def test_a_handler_calling_sys_exit_fails_like_any_error() -> None:
    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("t", "s")
    sub = Subscriber(broker, clock=clock, retry=RetryPolicy(min_backoff=1, max_backoff=1))

    @sub.handler("s")
    def handle(message: Message) -> None:
        if message.delivery_attempt == 1:
            raise SystemExit(3)

    broker.publish_sync("t", b"x")
    task = await serve(sub, clock)
    await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 1, 60, what="ack")
    await stop(sub, task)
    assert sub.stats[Outcome.RETRY] == 1


def test_every_counter_reads_the_same_way() -> None:
    """#24: ``sub.stats["store_errors"]`` raised ValueError ('not a valid Outcome') right after
    the README showed ``sub.stats["acked"]``."""
    sub = Subscriber(MemoryAdapter())
    sub.stats.outcomes[Outcome.ACKED] += 2
    sub.stats.store_errors += 3
    assert sub.stats["acked"] == sub.stats[Outcome.ACKED] == 2
    assert sub.stats["store_errors"] == 3 and sub.stats["ack_errors"] == 0
    assert sub.stats["dead_lettered"] == 0
    counts = sub.stats.as_dict()
    assert counts["acked"] == 2 and counts["store_errors"] == 3
    assert set(counts) == {o.value for o in Outcome} | {
        "handler_errors", "receive_errors", "ack_errors", "store_errors", "acks_refused",
        "lost_claims", "malformed", "purged_records", "rejected"}
    with pytest.raises(KeyError, match=r"'acks' is neither an outcome nor a counter.*acks_refused"):
        sub.stats["acks"]


async def test_healthy_means_handling_a_broker_failing_for_long_is_reported() -> None:
    """#24: a consumer whose every receive (or ack) failed stayed healthy() while handling
    nothing. A streak of failures lasting unhealthy_after makes it unhealthy, naming the call and
    its last error; the next success makes it healthy again."""
    clock = ManualClock()
    broker = FlakyBroker(clock=clock)
    broker.ensure_subscription_sync("t", "s")
    sub = Subscriber(broker, clock=clock, unhealthy_after=30)
    sub.handler("s")(lambda message: None)
    task = await serve(sub, clock)
    try:
        broker.failures["receive"] = 10_000
        await drive_until(clock, lambda: sub.stats.receive_errors >= 3, 60.0)
        assert sub.healthy(), "a few failures are not an outage"
        await drive_until(clock, lambda: not sub.healthy(), 60.0, what="unhealthy")
        [problem] = sub.problems()
        assert problem.startswith("receiving from 's' has failed")
        assert "ConnectionError: receive: connection reset by broker" in problem
        broker.failures["receive"] = 0
        await drive_until(clock, sub.healthy, 60.0, what="healthy again")

        broker.failures["ack"] = 10_000
        broker.publish_sync("t", b"x")
        await drive_until(clock, lambda: not sub.healthy(), 120.0, what="unhealthy acks")
        assert sub.problems()[0].startswith("acking at the broker has failed")
        broker.failures["ack"] = 0
        await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 1 and sub.healthy(), 60.0)
    finally:
        await stop(sub, task)


async def test_a_claim_slower_than_max_lease_duration_does_not_run_a_given_back_message() -> None:
    """#24 item 14: the delivery was given back (max_lease_duration passed while its claim call
    ran); when the late claim returned, the handler ran for a message the broker had been told
    to redeliver. Now it is not run, and the late claim is released."""

    class SlowFirstClaim(MemoryDedupStore):
        slow = True

        async def claim_many(self, keys, lease_ttl, tokens=None):  # type: ignore[no-untyped-def]
            results = await super().claim_many(keys, lease_ttl, tokens)
            if self.slow:  # the claim is taken; its reply comes late
                self.slow = False
                await clock.sleep(8)
            return results

    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("t", "s")  # ack deadline 10 s: the claim's bound
    outcomes: list[Outcome] = []
    store = SlowFirstClaim(clock=clock)
    sub = Subscriber(broker, clock=clock, dedup=store, lease=LeasePolicy(max_lease_duration=5),
                     retry=RetryPolicy(min_backoff=1, max_backoff=2),
                     on_outcome=lambda m, o: outcomes.append(o))
    runs: list[int] = []
    sub.handler("s")(lambda message: runs.append(message.delivery_attempt))
    broker.publish_sync("t", b"x")
    task = await serve(sub, clock)
    try:
        await drive_until(clock, lambda: Outcome.ACKED in outcomes, 120.0, what="the ack")
    finally:
        await stop(sub, task)
    assert runs == [runs[0]] and runs[0] >= 2, "run once, on a redelivery"
    assert Outcome.ACK_REFUSED not in outcomes and Outcome.DUPLICATE not in outcomes
    assert outcomes[0] is Outcome.REQUEUED


async def test_a_stop_gives_back_a_keys_queued_messages_only_after_the_running_one() -> None:
    """#24 item 14: a stop nacked the messages queued behind a running one of the same ordering
    key at once, so a peer could run them before the running one had finished. They now go back
    after it is settled."""

    class Recording(MemoryAdapter):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.calls: list[tuple[str, bytes]] = []

        async def ack(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
            self.calls += [("ack", d.message.data) for d in deliveries]
            return await super().ack(deliveries)

        async def nack(self, deliveries: Sequence[Delivery], delay: float = 0.0) -> None:
            self.calls += [("nack", d.message.data) for d in deliveries]
            await super().nack(deliveries, delay)

    clock = ManualClock()
    broker = Recording(clock=clock)
    # not ordered at the broker: it hands out both at once, as Pub/Sub may; the Subscriber
    # runs them one at a time
    broker.ensure_subscription_sync("t", "s")
    sub = Subscriber(broker, clock=clock)
    first_running, finish = asyncio.Event(), asyncio.Event()

    @sub.handler("s")
    async def charge(message: Message) -> None:
        if message.data == b"k1":
            first_running.set()
            await finish.wait()

    broker.publish_sync("t", b"k1", ordering_key="k")
    broker.publish_sync("t", b"k2", ordering_key="k")
    task = await serve(sub, clock)
    await drive_until(clock, first_running.is_set, 10.0)
    stopping = asyncio.ensure_future(sub.shutdown(timeout=30))
    await drive_until(clock, lambda: sub.stopping, 10.0)
    await drive_until(clock, lambda: bool(broker.calls) or clock.now() > 5, 10.0)
    assert broker.calls == [], "k2 went back while k1 still ran"
    finish.set()
    await stopping
    await task
    assert broker.calls == [("ack", b"k1"), ("nack", b"k2")]


@pytest.mark.parametrize("returned", [
    "subnormal delay", "NaN delay", "str delay", "inf delay", "None", "a dict"])
async def test_whatever_a_middleware_returns_the_message_is_settled_and_nothing_leaks(
    returned: str,
) -> None:
    """#24 item 14: a redelivery delay of 5e-324 divided by zero in the settler, outside its
    retries: the batch's task died, its flow slots and leases were held for good (the message
    extended for ever, never redelivered). A middleware may return anything."""
    from reliable_sub.middleware import Decision, Verdict

    answers: dict[str, Any] = {
        "subnormal delay": Decision(Verdict.REDELIVER, delay=5e-324, failures=1),
        "NaN delay": Decision(Verdict.REDELIVER, delay=float("nan"), failures=1),
        "str delay": Decision(Verdict.REDELIVER, delay="5", failures=1),  # type: ignore[arg-type]
        "inf delay": Decision(Verdict.REDELIVER, delay=float("inf"), failures=1),
        "None": None,
        "a dict": {"verdict": "redeliver"},
    }
    calls: list[int] = []

    async def odd(context: Any, call_next: Any) -> Any:
        calls.append(context.message.delivery_attempt)
        if len(calls) == 1:
            return answers[returned]
        return await call_next(context)

    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("t", "s")
    sub = Subscriber(broker, clock=clock, middleware=[odd], flow_control=FlowControl(1),
                     retry=RetryPolicy(min_backoff=1, max_backoff=2))
    sub.handler("s")(lambda message: None)
    broker.publish_sync("t", b"x")
    broker.publish_sync("t", b"y")
    task = await serve(sub, clock)
    try:
        await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 2, 60.0, what="both acks")
    finally:
        await stop(sub, task)
    assert sub.stats[Outcome.RETRY] == 1
    assert len(calls) == 3


async def test_a_settle_batch_that_fails_unexpectedly_lets_its_deliveries_go() -> None:
    """A bug in settling (here an adapter whose ack returns None rather than a list) used to
    kill the batch's task with its deliveries' flow slots and leases held for good."""

    class OddAck(MemoryAdapter):
        odd = True

        async def ack(self, deliveries: Sequence[Delivery]) -> Any:
            refused = await super().ack(deliveries)
            if self.odd:
                self.odd = False
                return None
            return refused

    clock = ManualClock()
    broker = OddAck(clock=clock)
    broker.ensure_subscription_sync("t", "s")
    sub = Subscriber(broker, clock=clock, flow_control=FlowControl(1))
    handled: list[bytes] = []
    sub.handler("s")(lambda message: handled.append(message.data))
    broker.publish_sync("t", b"x")
    broker.publish_sync("t", b"y")
    task = await serve(sub, clock)
    try:
        await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 1, 60.0, what="y's ack")
        assert sub.stats[Outcome.STOPPED] == 1 and handled == [b"x", b"y"]
        assert len(sub.lease_manager("s")) == 0
    finally:
        await stop(sub, task)
