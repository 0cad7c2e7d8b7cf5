from __future__ import annotations

from collections.abc import Sequence

from reliable_sub import InProgress, LeasePolicy, MemoryDedupStore
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.clock import ManualClock
from reliable_sub.lease import LeaseManager
from reliable_sub.message import Delivery
from tests.timing import pass_time

DEADLINE = 10.0


class RecordingBroker(MemoryAdapter):
    """The memory broker, counting extend calls (and failing them on request)."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock=clock)
        self.extend_calls: list[tuple[list[str], float]] = []
        self.fail_extends = 0

    async def extend(self, deliveries: Sequence[Delivery], seconds: float) -> list[Delivery]:
        if self.fail_extends:
            self.fail_extends -= 1
            raise ConnectionError("broker unreachable")
        self.extend_calls.append(([d.ack_id for d in deliveries], seconds))
        return await super().extend(deliveries, seconds)


async def setup(policy: LeasePolicy | None = None, dedup: MemoryDedupStore | None = None):
    clock = ManualClock()
    broker = RecordingBroker(clock)
    await broker.ensure_subscription("t", "s", ack_deadline=DEADLINE)
    lease = LeaseManager(broker, policy or LeasePolicy(), clock=clock,
                         initial_deadline=DEADLINE, dedup=dedup)
    return clock, broker, lease


async def receive(broker: RecordingBroker, clock: ManualClock, count: int) -> list[Delivery]:
    for i in range(count):
        await broker.publish("t", f"m{i}".encode())
    deliveries = await broker.receive("s", count, 0)
    for delivery in deliveries:
        delivery.received_at = clock.now()
    return deliveries


async def test_a_tick_extends_only_due_deliveries_in_one_call() -> None:
    clock, broker, lease = await setup()
    early = await receive(broker, clock, 5)
    lease.add(early)
    clock.advance(5)
    late = await receive(broker, clock, 3)
    lease.add(late)

    clock.advance(1)  # t=6: the early ones have 4 s (40%) left; the late ones 9 s
    await lease.tick()

    assert len(broker.extend_calls) == 1
    ack_ids, seconds = broker.extend_calls[0]
    assert sorted(ack_ids) == sorted(d.ack_id for d in early)
    assert seconds == 10.0  # no data yet: the initial deadline, clamped to min_extension
    assert lease.stats.extended_ack_ids == 5


async def test_extension_is_the_p99_of_processing_time_from_handler_start() -> None:
    clock, broker, lease = await setup(LeasePolicy(min_extension=10, max_extension=100))
    deliveries = await receive(broker, clock, 100)
    lease.add(deliveries)
    clock.advance(30)  # queued behind flow control: must not count
    for i, delivery in enumerate(deliveries):
        lease.started(delivery)
        clock.advance(0.5 if i < 98 else 50)
        lease.finish(delivery)
    assert lease.histogram.percentile(99) == 50
    assert lease.extension() == 50
    lease.histogram.add(500.0)
    lease.histogram.add(500.0)
    assert lease.extension() == 100  # clamped to max_extension


async def test_the_loop_keeps_a_long_handler_leased_with_few_calls() -> None:
    clock, broker, lease = await setup()
    [delivery] = await receive(broker, clock, 1)
    lease.add([delivery])
    lease.start()
    lease.started(delivery)
    await pass_time(clock, 95)
    lease.finish(delivery)
    await lease.stop()

    assert await broker.receive("s", 10, 0) == [], "the message was redelivered under its handler"
    assert await broker.ack([delivery]) == []
    # extends at ~6-8 s of every 10 s lease: about one call per 7 s
    assert 10 <= len(broker.extend_calls) <= 16


async def test_a_refused_extend_drops_the_delivery() -> None:
    clock, broker, lease = await setup()
    [delivery] = await receive(broker, clock, 1)
    lease.add([delivery])
    await broker.ack([delivery])  # acked elsewhere: its ack id is now stale
    clock.advance(7)
    assert await lease.tick() is None
    assert lease.stats.refused == 1
    assert len(lease) == 0


async def test_extend_errors_are_retried_not_fatal() -> None:
    clock, broker, lease = await setup()
    [delivery] = await receive(broker, clock, 1)
    lease.add([delivery])
    lease.start()
    lease.started(delivery)
    broker.fail_extends = 3
    await pass_time(clock, 30)
    assert lease.stats.extend_errors == 3
    assert lease.stats.extend_calls >= 2
    assert await broker.receive("s", 10, 0) == []
    await lease.stop()


async def test_max_lease_duration_nacks_but_keeps_the_claim_while_the_handler_runs() -> None:
    clock, broker, lease = await setup(LeasePolicy(max_lease_duration=30))
    store = MemoryDedupStore(clock=clock)
    lease = LeaseManager(broker, LeasePolicy(max_lease_duration=30), clock=clock,
                         initial_deadline=DEADLINE, dedup=store)
    [delivery] = await receive(broker, clock, 1)
    await store.claim("key", lease.claim_ttl())
    lease.add([delivery], ["key"], lease.claim_ttl())
    lease.started(delivery)
    lease.start()

    await pass_time(clock, 60)

    assert lease.stats.max_lease_nacks == 1
    [again] = await broker.receive("s", 10, 0)
    assert again.message.delivery_attempt == 2
    assert isinstance(await store.claim("key", 10), InProgress), "claim lapsed under a live handler"
    assert lease.stats.claim_renew_calls >= 4
    lease.finish(delivery)
    await lease.stop()


async def test_a_new_delivery_due_before_the_planned_wakeup_is_not_missed() -> None:
    """The loop sleeps until a far-extended lease falls due; a newcomer must wake it."""
    clock, broker, lease = await setup()
    for _ in range(50):
        lease.histogram.add(60.0)  # p99 of 60 s: extensions go far ahead
    [long_job] = await receive(broker, clock, 1)
    lease.add([long_job])
    lease.start()
    lease.started(long_job)
    await pass_time(clock, 9)  # extended at ~8 s to ~68 s; the loop now sleeps until ~56 s
    [newcomer] = await receive(broker, clock, 1)
    lease.add([newcomer])
    lease.started(newcomer)
    await pass_time(clock, 30)

    assert await broker.receive("s", 10, 0) == [], "the newcomer's deadline ran out"
    assert await broker.ack([long_job, newcomer]) == []
    await lease.stop()
