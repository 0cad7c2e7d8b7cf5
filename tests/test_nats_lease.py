"""No adapter call made from the lease tick may wait on the receive path (#24 item 13).

On NATS a nack without delay waits for the subscription's fetch lock (a redelivery must not land
in the fetch in flight), which a receive holds for a whole fetch (``receive_timeout``). Giving
back a sync handler that ran past ``max_lease_duration`` is such a nack, and the lease tick used
to await it: every other delivery then missed its extension and was redelivered while still
running. Here a 6 s sync handler passes a 3 s ``max_lease_duration`` beside a 2.5 s one, on the
session's private nats-server: the 2.5 s one must run once.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from reliable_sub import LeasePolicy, Message, Outcome, Subscriber
from reliable_sub.testing.harness import delete_nats_streams
from tests.nats_processes import NatsServer

nats = pytest.importorskip("nats", reason='the NATS tests need "reliable-sub[nats]"')
from reliable_sub.adapters.nats_jetstream import NatsJetStreamAdapter  # noqa: E402

ACK_DEADLINE = 1.0
LEASE = LeasePolicy(min_extension=0.5, max_extension=ACK_DEADLINE, max_lease_duration=3.0)
WITHIN = 20.0


@pytest.fixture
async def adapter(nats_server: NatsServer) -> AsyncIterator[NatsJetStreamAdapter]:
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    made = NatsJetStreamAdapter(nats_server.url, prefix=prefix)
    try:
        yield made
    finally:
        await made.close()
        await delete_nats_streams(nats_server.url, prefix)


async def wait_until(predicate: object, what: str, within: float = WITHIN) -> None:
    deadline = time.monotonic() + within
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within:g}s waiting for {what}")
        await asyncio.sleep(0.01)


async def test_giving_back_an_overrunning_sync_handler_does_not_stall_other_leases(
    adapter: NatsJetStreamAdapter,
) -> None:
    topic, subscription = f"{uuid.uuid4().hex[:8]}-orders", f"{uuid.uuid4().hex[:8]}-billing"
    await adapter.ensure_subscription(topic, subscription, ack_deadline=ACK_DEADLINE)
    runs: Counter[bytes] = Counter()
    outcomes: list[tuple[bytes, Outcome]] = []
    long_started = threading.Event()
    started_at: list[float] = []
    done = threading.Event()

    sub = Subscriber(adapter, lease=LEASE, stop_timeout=10,
                     on_outcome=lambda m, o: outcomes.append((m.data, o)))

    @sub.handler(subscription)
    def work(message: Message) -> None:
        runs[message.data] += 1
        if message.data == b"long":
            started_at.append(time.monotonic())
            long_started.set()
            done.wait(6.0)
        elif message.data == b"short":
            done.wait(2.5)

    serving = asyncio.ensure_future(sub.serve())
    try:
        await wait_until(lambda: sub.running, "the Subscriber to start")
        await adapter.publish(topic, b"long")
        await wait_until(long_started.is_set, "the long handler")
        # the schedule, not a synchronisation: the short one then runs from about 1.5 s to 4 s
        # after the long one began, across its give-back at 3 s, and within its own 3 s
        await wait_until(lambda: time.monotonic() >= started_at[0] + 1.5, "1.5 s to pass")
        await adapter.publish(topic, b"short")
        await wait_until(lambda: any(data == b"short" for data, _ in outcomes),
                         "the short one to settle")
        assert runs[b"short"] == 1, (
            "the short handler ran again while it still ran: its lease lapsed while the lease "
            "tick waited on the long one's give-back")
        assert (b"short", Outcome.ACKED) in outcomes
        assert sub.lease_manager(subscription).stats.max_lease_reached >= 1
    finally:
        done.set()
        await sub.shutdown(timeout=10)
        await serving
