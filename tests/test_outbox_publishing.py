"""publish_in_key_order: one round's rows go out in waves, each ordering key's strictly in order,
and a key stops at its first failure."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

from reliable_sub.outbox.publishing import NOT_SENT, publish_in_key_order
from reliable_sub.ports import Outgoing


class Broker:
    """Records each publish call (one list per call), in arrival order; refuses some data."""

    def __init__(self, refuse: frozenset[bytes] | set[bytes] = frozenset(),
                 batch: bool = False) -> None:
        self.refuse = refuse
        self.calls: list[list[bytes]] = []
        self.arrived: list[Outgoing] = []
        self.rng = random.Random(3)
        if batch:
            self.publish_many = self._publish_many  # the optional BatchPublisher capability

    async def publish(self, topic: str, data: bytes, attributes: dict[str, str] | None = None,
                      ordering_key: str | None = None) -> str:
        for _ in range(self.rng.randrange(4)):  # concurrent publishes finish in any order
            await asyncio.sleep(0)
        self.calls.append([data])
        if data in self.refuse:
            raise ConnectionError(f"refused {data!r}")
        self.arrived.append(Outgoing(topic, data, attributes, ordering_key))
        return data.decode()

    async def _publish_many(self, messages: Sequence[Outgoing]) -> list[str | Exception]:
        self.calls.append([m.data for m in messages])
        results: list[str | Exception] = []
        for message in messages:
            if message.data in self.refuse:
                results.append(ConnectionError(f"refused {message.data!r}"))
            else:
                self.arrived.append(message)
                results.append(message.data.decode())
        return results

    async def close(self) -> None:
        pass


def rows(*spec: tuple[str, str | None]) -> list[Outgoing]:
    return [Outgoing("orders", data.encode(), None, key) for data, key in spec]


def arrived_for(broker: Broker, key: str) -> list[bytes]:
    return [m.data for m in broker.arrived if m.ordering_key == key]


async def test_each_keys_rows_go_out_in_order_one_wave_per_position() -> None:
    broker = Broker(batch=True)
    batch = rows(("a1", "a"), ("n1", None), ("b1", "b"), ("a2", "a"), ("n2", None),
                 ("a3", "a"), ("b2", "b"))
    outcomes = await publish_in_key_order(broker, batch, timeout=5)
    assert outcomes == [None] * len(batch)
    assert broker.calls == [[b"a1", b"n1", b"b1", b"n2"], [b"a2", b"b2"], [b"a3"]]
    assert arrived_for(broker, "a") == [b"a1", b"a2", b"a3"]


async def test_a_failure_stops_its_key_and_no_other() -> None:
    for batch_capable in (True, False):
        broker = Broker(refuse={b"a2"}, batch=batch_capable)
        batch = rows(("a1", "a"), ("b1", "b"), ("a2", "a"), ("b2", "b"), ("a3", "a"),
                     ("b3", "b"))
        outcomes = await publish_in_key_order(broker, batch, timeout=5)
        assert outcomes[0] is None and outcomes[1] is None
        assert isinstance(outcomes[2], ConnectionError)
        assert outcomes[4] is NOT_SENT, "a3 must not overtake the failed a2"
        assert outcomes[3] is None and outcomes[5] is None
        assert arrived_for(broker, "a") == [b"a1"]
        assert arrived_for(broker, "b") == [b"b1", b"b2", b"b3"]


async def test_without_publish_many_a_wave_is_concurrent_publishes() -> None:
    broker = Broker()
    batch = rows(*((f"{k}{n}", k) for n in range(5) for k in "abcd"))
    outcomes = await publish_in_key_order(broker, batch, timeout=5)
    assert outcomes == [None] * len(batch)
    for key in "abcd":
        assert arrived_for(broker, key) == [f"{key}{n}".encode() for n in range(5)]


async def test_a_timeout_fails_the_wave_under_way_and_sends_nothing_after_it() -> None:
    hang = asyncio.Event()

    class Hangs(Broker):
        async def publish(self, topic, data, attributes=None, ordering_key=None):  # type: ignore[no-untyped-def]
            if data == b"a2":
                await hang.wait()
            return await super().publish(topic, data, attributes, ordering_key)

    broker = Hangs()
    outcomes = await publish_in_key_order(
        broker, rows(("a1", "a"), ("a2", "a"), ("a3", "a")), timeout=0.2)
    assert outcomes[0] is None
    assert isinstance(outcomes[1], TimeoutError) and "publish_timeout" in str(outcomes[1])
    assert outcomes[2] is NOT_SENT
    assert arrived_for(broker, "a") == [b"a1"]


async def test_a_whole_call_that_raises_fails_its_wave() -> None:
    class Down(Broker):
        async def _publish_many(self, messages):  # type: ignore[no-untyped-def]
            raise ConnectionError("the broker went away")

    broker = Down(batch=True)
    outcomes = await publish_in_key_order(broker, rows(("a1", "a"), ("a2", "a"), ("n", None)),
                                          timeout=5)
    assert isinstance(outcomes[0], ConnectionError) and outcomes[1] is NOT_SENT
    assert isinstance(outcomes[2], ConnectionError)
