"""A NATS server SIGKILLed and restarted under a running Subscriber: nothing published is lost,
no effect runs twice, and the consumer goes on by itself.

Runs its own ``nats-server -js`` (the session's is shared with other tests): the store is kept
across the kill, as a restarted production server keeps its disk. Effects are counted in the
test, outside the consumer. nats-server writes consumer state lazily: the acks of the moments
before the kill are forgotten (here, all 150 of the first batch) and those messages come back;
the dedup store catches them.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from reliable_sub import MemoryDedupStore, Message, Outcome, Subscriber
from tests.nats_processes import NatsServer
from tests.redis_processes import poll_until

pytest.importorskip("nats", reason='the NATS tests need "reliable-sub[nats]"')
from reliable_sub.adapters.nats_jetstream import NatsJetStreamAdapter

ACK_DEADLINE = 1.0
BEFORE, AFTER = 150, 150
# Handlers of the first batch's later messages wait for the kill: it lands with them in flight.
HELD_FROM = 100
# The Subscriber's own share of the recovery (first message published after the restart ->
# its effect) stays under this; the client reconnects every 0.5 s, a fetch lasts receive_timeout.
RECOVERY_BOUND = 10.0
WITHIN = 30.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    made = NatsServer(tmp_path)
    made.start()
    try:
        yield made
    finally:
        made.kill()


async def publish_retrying(adapter: NatsJetStreamAdapter, topic: str, n: int) -> str:
    """Publish ``n`` with its idempotency key, retrying while the server is away (a retry of a
    publish that did land is dropped by the stream's duplicate window)."""
    give_up = time.monotonic() + WITHIN
    while True:
        try:
            return await adapter.publish(topic, f"order-{n}".encode(),
                                         {"idempotency-key": f"order-{n}"})
        except Exception:
            if time.monotonic() > give_up:
                raise
            await asyncio.sleep(0.1)


async def test_a_server_killed_and_restarted_loses_nothing_and_doubles_nothing(
    server: NatsServer,
) -> None:
    adapter = NatsJetStreamAdapter(server.url, prefix="restart")
    await adapter.ensure_subscription("orders", "billing", ack_deadline=ACK_DEADLINE)
    effects: Counter[str] = Counter()
    outcomes: list[tuple[float, str, Outcome]] = []
    subscriber = Subscriber(
        adapter, dedup=MemoryDedupStore(), receive_timeout=0.5,
        on_outcome=lambda m, o: outcomes.append((time.monotonic(), m.data.decode(), o)))
    killed = asyncio.Event()

    @subscriber.handler("billing")
    async def charge(message: Message) -> None:
        if int(message.data.decode().split("-")[1]) in range(HELD_FROM, BEFORE):
            await killed.wait()
        effects[message.data.decode()] += 1

    for n in range(BEFORE):
        await adapter.publish("orders", f"order-{n}".encode(), {"idempotency-key": f"order-{n}"})
    async with subscriber:
        await poll_until(lambda: len(effects) == HELD_FROM, "the first ones handled", WITHIN)
        server.kill()
        killed.set()
        server.start()
        back_at = time.monotonic()
        for n in range(BEFORE, BEFORE + AFTER):
            await publish_retrying(adapter, "orders", n)
            if n == BEFORE:
                first_published = time.monotonic()
        await poll_until(lambda: len(effects) == BEFORE + AFTER, "every message handled",
                         WITHIN)
        assert subscriber.running
    new_ones = {f"order-{n}" for n in range(BEFORE, BEFORE + AFTER)}
    first_new = min(t for t, data, o in outcomes if data in new_ones and o is Outcome.ACKED)
    caught = Counter(o for _, _, o in outcomes)
    duplicates = [data for _, data, o in outcomes if o is Outcome.DUPLICATE]
    print(f"server healthy again -> first publish acked {first_published - back_at:.2f}s -> "
          f"first new effect {first_new - first_published:.2f}s; outcomes: {dict(caught)}")
    assert effects == Counter({f"order-{n}": 1 for n in range(BEFORE + AFTER)}), (
        "every message's effect exactly once")
    # A publish written to the dying connection is lost with it and times out (REQUEST_TIMEOUT,
    # 5 s) before its retry; the consumer's own share is from the first new publish on.
    assert first_new - first_published < RECOVERY_BOUND
    # nats-server writes consumer state lazily: acks of the last moments before a SIGKILL are
    # forgotten and their messages come back, to be caught by the dedup store
    assert set(duplicates) <= {f"order-{n}" for n in range(BEFORE)}
    leftover = await adapter.receive("billing", 100, timeout=2 * ACK_DEADLINE)
    assert leftover == [], "nothing left unacked"
    await adapter.close()
