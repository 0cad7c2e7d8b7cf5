"""The Subscriber's guarantees, checked the same way on every adapter."""

from __future__ import annotations

import asyncio
from collections import Counter

from reliable_sub import (
    DeadLetterPolicy,
    FlowControl,
    MemoryDedupStore,
    Message,
    Outcome,
    Subscriber,
)
from reliable_sub.testing.harness import Harness, Recorder, drain
from reliable_sub.testing.timing import LoopStalls

# Seconds the event loop must have been kept from running for a refused lease extension to be
# put down to the machine (half of MIN_SAFETY_MARGIN, the least margin a lease is renewed with).
STALL_EXCUSE = 0.5


async def test_every_published_message_is_handled_and_acked(harness: Harness) -> None:
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    recorder = Recorder()
    subscriber = harness.subscriber(adapter, on_outcome=recorder)

    @subscriber.handler(sub)
    async def handle(message: Message) -> None:
        recorder.handled.append(message)

    payloads = {f"msg-{i}".encode() for i in range(60)}
    for payload in sorted(payloads):
        await adapter.publish(topic, payload)
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 60,
                                 within=harness.ack_deadline, what="60 acks")

    assert {m.data for m in recorder.handled} == payloads
    assert len(recorder.handled) == 60
    assert await drain(harness, sub) == []


async def test_sync_and_async_handlers_both_run(harness: Harness) -> None:
    adapter = await harness.adapter()
    harness.needs("fan_out")
    topic, sub_sync = await harness.topic_and_subscription()
    sub_async = harness.name_for("sub")
    await adapter.ensure_subscription(topic, sub_async, ack_deadline=harness.ack_deadline)
    recorder = Recorder()
    subscriber = harness.subscriber(adapter, on_outcome=recorder)
    seen: dict[str, list[bytes]] = {"sync": [], "async": []}

    @subscriber.handler(sub_sync)
    def in_thread(message: Message) -> None:
        seen["sync"].append(message.data)

    @subscriber.handler(sub_async)
    async def in_loop(message: Message) -> None:
        seen["async"].append(message.data)

    for i in range(5):
        await adapter.publish(topic, f"x{i}".encode())
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 10,
                                 within=harness.ack_deadline, what="both fan-out handlers")
    assert sorted(seen["sync"]) == sorted(seen["async"]) == [f"x{i}".encode() for i in range(5)]


async def test_lease_keeps_a_long_handler_from_being_redelivered(harness: Harness) -> None:
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    recorder = Recorder()
    subscriber = harness.subscriber(adapter, on_outcome=recorder)
    runtime = 3.5 * harness.ack_deadline

    @subscriber.handler(sub)
    async def slow(message: Message) -> None:
        recorder.handled.append(message)
        await harness.clock.sleep(runtime)

    await adapter.publish(topic, b"slow")
    async with LoopStalls(harness.clock) as stalls, harness.serving(subscriber):
        await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 1,
                                 within=runtime + harness.ack_deadline, what="the slow ack")
        lease_stats = subscriber.lease_manager(sub).stats

    assert [m.delivery_attempt for m in recorder.handled] == [1]
    assert lease_stats.extend_calls >= 2
    # An extension is sent with a second (or half a short lease) to spare. Only a process kept
    # from running that long (a loaded machine) lets the lease lapse and the extension be
    # refused; then the entry may be taken back meanwhile, by a peer or this consumer's own
    # receive. Half that margin excuses a refusal; without such a stall it fails the test. (The
    # handler's run is a whole number of extension periods: an extension that crosses the
    # message's own ack is refused as often as not, and counted apart, in refused_after_settle.)
    assert lease_stats.refused == 0 or stalls.longest >= STALL_EXCUSE, (
        f"{lease_stats.refused} extensions refused; the loop never stalled over "
        f"{stalls.longest:.3f}s")
    assert await drain(harness, sub) == []


async def test_poison_message_is_dead_lettered_after_max_attempts(harness: Harness) -> None:
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    dlq_topic, dlq_sub = await harness.topic_and_subscription()
    recorder = Recorder()
    subscriber = harness.subscriber(
        adapter,
        on_outcome=recorder,
        dead_letter=DeadLetterPolicy(dlq_topic, max_delivery_attempts=3),
        dedup=MemoryDedupStore(clock=harness.clock),
    )

    @subscriber.handler(sub)
    async def handle(message: Message) -> None:
        recorder.handled.append(message)
        if message.data == b"poison":
            raise ValueError("cannot parse order: b'poison'")

    # a publisher's attributes named like the dead-letter ones are kept, renamed (#19)
    poison_id = await adapter.publish(topic, b"poison", {
        "tenant": "t1", "delivery-attempts": "from the publisher", "error-type": "none",
    })
    await adapter.publish(topic, b"fine")
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: recorder.count(Outcome.DEAD_LETTERED) == 1,
                                 within=20 * harness.ack_deadline, what="dead-lettering")

    attempts = [m.delivery_attempt for m in recorder.handled if m.data == b"poison"]
    assert attempts == [1, 2, 3]
    assert recorder.count(Outcome.RETRY) == 2
    [dead] = await harness.receive(adapter, dlq_sub, timeout=harness.ack_deadline)
    assert dead.message.data == b"poison"
    attrs = dead.message.attributes
    assert attrs["tenant"] == "t1"
    assert attrs["original-message-id"] == poison_id
    assert attrs["original-subscription"] == sub
    assert attrs["delivery-attempts"] == "3"
    assert attrs["handler-failures"] == "3"
    assert attrs["error-type"] == "builtins.ValueError"
    assert attrs["error-message"] == "cannot parse order: b'poison'"
    assert attrs["publisher-delivery-attempts"] == "from the publisher"
    assert attrs["publisher-error-type"] == "none"
    await adapter.ack([dead])
    assert await drain(harness, sub) == []


async def test_duplicate_publish_with_one_idempotency_key_is_handled_once(
    harness: Harness,
) -> None:
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    recorder = Recorder()
    subscriber = harness.subscriber(
        adapter, on_outcome=recorder, dedup=MemoryDedupStore(clock=harness.clock)
    )

    @subscriber.handler(sub)
    async def charge(message: Message) -> dict[str, str]:
        recorder.handled.append(message)
        await harness.clock.sleep(harness.tick)
        return {"charged": message.attributes["idempotency-key"]}

    for _ in range(3):
        await adapter.publish(topic, b"charge 10 EUR", {"idempotency-key": "payment-42"})
    await adapter.publish(topic, b"charge 5 EUR", {"idempotency-key": "payment-43"})
    async with harness.serving(subscriber):
        await harness.wait_until(
            lambda: recorder.count(Outcome.ACKED) + recorder.count(Outcome.DUPLICATE) == 4,
            within=20 * harness.ack_deadline, what="all four copies settled",
        )

    keys = Counter(m.attributes["idempotency-key"] for m in recorder.handled)
    assert keys == {"payment-42": 1, "payment-43": 1}
    assert recorder.count(Outcome.DUPLICATE) == 2
    assert await drain(harness, sub) == []


async def test_two_subscribers_share_a_subscription_without_double_handling(
    harness: Harness,
) -> None:
    first_adapter = await harness.adapter()
    second_adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    recorder = Recorder()
    handled_by: dict[str, list[str]] = {"first": [], "second": []}
    subscribers = []
    for name, adapter in (("first", first_adapter), ("second", second_adapter)):
        subscriber = harness.subscriber(
            adapter, on_outcome=recorder, flow_control=FlowControl(max_messages=5)
        )

        def make(who: str):
            async def handle(message: Message) -> None:
                handled_by[who].append(message.id)
                await harness.clock.sleep(harness.tick)

            return handle

        subscriber.handler(sub)(make(name))
        subscribers.append(subscriber)

    ids = {await adapter.publish(topic, f"w{i}".encode()) for i in range(40)}
    async with harness.serving(subscribers[0]), harness.serving(subscribers[1]):
        await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 40,
                                 within=20 * harness.ack_deadline, what="40 acks")

    everything = handled_by["first"] + handled_by["second"]
    assert sorted(everything) == sorted(ids), "a message was handled twice or not at all"
    assert handled_by["first"] and handled_by["second"], "one consumer got no work"


async def test_stop_with_a_slow_handler_in_flight_loses_nothing(harness: Harness) -> None:
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    recorder = Recorder()
    dedup = MemoryDedupStore(clock=harness.clock)
    blocked = asyncio.Event()
    completed: list[bytes] = []

    def make_subscriber() -> Subscriber:
        subscriber = harness.subscriber(adapter, on_outcome=recorder, dedup=dedup)

        @subscriber.handler(sub)
        async def handle(message: Message) -> None:
            if message.data == b"slow" and message.delivery_attempt == 1:
                blocked.set()
                await asyncio.Event().wait()  # never finishes: the stop must give it back
            completed.append(message.data)

        return subscriber

    payloads = [b"slow"] + [f"p{i}".encode() for i in range(9)]
    for payload in payloads:
        await adapter.publish(topic, payload)

    first = make_subscriber()
    async with harness.serving(first):
        await harness.wait_until(lambda: blocked.is_set() and len(completed) == 9,
                                 within=harness.ack_deadline, what="slow handler in flight")
    assert first.stats[Outcome.STOPPED] == 1

    second = make_subscriber()
    async with harness.serving(second):
        await harness.wait_until(lambda: b"slow" in completed,
                                 within=2 * harness.ack_deadline, what="redelivery of slow")
    assert sorted(completed) == sorted(payloads)
    assert await drain(harness, sub) == []


async def test_a_failing_handler_never_stops_the_consumer(harness: Harness) -> None:
    adapter = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    recorder = Recorder()
    subscriber = harness.subscriber(adapter, on_outcome=recorder)

    @subscriber.handler(sub)
    def flaky(message: Message) -> None:
        if message.delivery_attempt == 1:
            raise RuntimeError(f"transient failure of {message.data!r}")
        recorder.handled.append(message)

    for i in range(10):
        await adapter.publish(topic, f"f{i}".encode())
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 10,
                                 within=10 * harness.ack_deadline, what="retries to succeed")
    assert recorder.count(Outcome.RETRY) == 10
    assert {m.delivery_attempt for m in recorder.handled} == {2}
    assert subscriber.stats.handler_errors == 10


async def test_handlers_see_each_ordering_key_in_order_one_at_a_time(harness: Harness) -> None:
    adapter = await harness.adapter()
    harness.needs("ordering")
    topic, sub = await harness.topic_and_subscription(ordering=True)
    recorder = Recorder()
    subscriber = harness.subscriber(adapter, on_outcome=recorder)
    running: dict[str, int] = {"A": 0, "B": 0}
    overlaps: list[str] = []
    done: dict[str, list[bytes]] = {"A": [], "B": []}
    failed_once: set[bytes] = set()

    @subscriber.handler(sub)
    async def handle(message: Message) -> None:
        key = message.ordering_key or ""
        running[key] += 1
        if running[key] > 1:
            overlaps.append(key)
        try:
            await harness.clock.sleep(harness.tick / 10)
            if message.data == b"a2" and b"a2" not in failed_once:
                failed_once.add(b"a2")
                raise RuntimeError("a2 fails once")
            if message.data not in done[key]:
                done[key].append(message.data)
        finally:
            running[key] -= 1

    for i in range(5):
        await adapter.publish(topic, f"a{i}".encode(), ordering_key="A")
        await adapter.publish(topic, f"b{i}".encode(), ordering_key="B")
    async with harness.serving(subscriber):
        await harness.wait_until(lambda: len(done["A"]) + len(done["B"]) == 10,
                                 within=6 * harness.ack_deadline, what="all ten handled")

    assert overlaps == [], "two handlers of one ordering key ran at once"
    # those behind a2 were given back, not "deferred": no peer held them
    assert recorder.count(Outcome.DEFERRED) == 0
    assert done["A"] == [f"a{i}".encode() for i in range(5)]
    assert done["B"] == [f"b{i}".encode() for i in range(5)]


__all__ = [
    "test_a_failing_handler_never_stops_the_consumer",
    "test_duplicate_publish_with_one_idempotency_key_is_handled_once",
    "test_every_published_message_is_handled_and_acked",
    "test_handlers_see_each_ordering_key_in_order_one_at_a_time",
    "test_lease_keeps_a_long_handler_from_being_redelivered",
    "test_poison_message_is_dead_lettered_after_max_attempts",
    "test_stop_with_a_slow_handler_in_flight_loses_nothing",
    "test_sync_and_async_handlers_both_run",
    "test_two_subscribers_share_a_subscription_without_double_handling",
]
