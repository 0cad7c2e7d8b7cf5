"""The outbox relay under random interleavings (hypothesis), on the shared PostgreSQL and
MariaDB.

Rules: transactions that commit or roll back rows on a few ordering keys; rounds of two relays,
alone or at the same time; a relay that "crashes" after its publish reached the broker and
before its commit; keys the broker refuses; time passing (backoffs); re-queues of parked rows.

Invariants, checked after every step on what the broker received (counted outside the relays):

* nothing rolled back is ever published;
* a row reaches the broker more than once only if a crashed round had published it (two relays
  never publish one row: SKIP LOCKED for rows without a key, a key's lock for the others);
* for every ordering key, the first copy of each row arrives in the order the rows were
  written (what a consumer with a dedup store sees);
* a row marked published was published;
* at the end, with every fault healed: every committed row was published, none is left.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from collections.abc import Sequence

import sqlalchemy as sa
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from reliable_sub import ManualClock
from reliable_sub.outbox import Outbox, OutboxRelay
from reliable_sub.ports import Outgoing
from reliable_sub.testing.services import sql_url

KEYS = [None, "a", "b", "c"]
TOPIC = "orders"


class Crash(BaseException):
    """The relay process dies here: nothing after the publish happens (its transaction rolls
    back, as PostgreSQL does when a connection drops)."""


class Broker:
    """Records every published row's number, in arrival order; refuses keys; can crash."""

    def __init__(self) -> None:
        self.received: list[tuple[str | None, int]] = []
        self.refused: set[str | None] = set()
        self.crash_next = False

    async def publish_many(self, messages: Sequence[Outgoing]) -> list[str | Exception]:
        results: list[str | Exception] = []
        for message in messages:
            if message.ordering_key in self.refused:
                results.append(ConnectionError(f"refused {message.ordering_key}"))
                continue
            self.received.append((message.ordering_key, int(message.data)))
            results.append(message.data.decode())
        if self.crash_next:
            self.crash_next = False
            raise Crash
        return results

    async def publish(self, topic: str, data: bytes, attributes: dict[str, str] | None = None,
                      ordering_key: str | None = None) -> str:
        [result] = await self.publish_many([Outgoing(topic, data, attributes, ordering_key)])
        if isinstance(result, Exception):
            raise result
        return result

    async def close(self) -> None:
        pass


class RelayMachine(RuleBasedStateMachine):
    database = "postgresql"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.outbox = Outbox(sql_url(self.database), table=f"outbox_sm_{uuid.uuid4().hex[:10]}")
        self.run(self.outbox.create_schema())
        self.clock = ManualClock(wall_offset=time.time())
        self.broker = Broker()
        self.relays = [OutboxRelay(self.outbox, self.broker, max_attempts=3, min_backoff=1,
                                   max_backoff=4, clock=self.clock, batch_size=4,
                                   rng=random.Random(n))  # replayable backoffs
                       for n in range(2)]
        self.written: dict[int, str | None] = {}  # number -> key, committed
        self.discarded: set[int] = set()  # rolled back
        self.may_repeat: set[int] = set()  # published by a round that crashed
        self.next_number = 0

    def run(self, coroutine):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coroutine)

    # -- rules -----------------------------------------------------------------------------

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5), commit=st.booleans())
    def write(self, keys: list[str | None], commit: bool) -> None:
        numbers = list(range(self.next_number, self.next_number + len(keys)))
        self.next_number += len(keys)

        async def transaction() -> None:
            async with self.outbox.engine.connect() as connection, connection.begin() as tx:
                for number, key in zip(numbers, keys, strict=True):
                    await self.outbox.add(connection, TOPIC, str(number).encode(),
                                          ordering_key=key)
                if not commit:
                    await tx.rollback()

        self.run(transaction())
        target = self.written if commit else None
        for number, key in zip(numbers, keys, strict=True):
            if target is not None:
                target[number] = key
            else:
                self.discarded.add(number)

    @rule(which=st.integers(0, 1))
    def round(self, which: int) -> None:
        self.run(self.relays[which].relay_once())

    @rule()
    def rounds_at_once(self) -> None:
        async def both() -> None:
            await asyncio.gather(*(relay.relay_once() for relay in self.relays))

        self.run(both())

    @rule(which=st.integers(0, 1))
    def crash_after_publishing(self, which: int) -> None:
        self.broker.crash_next = True
        before = len(self.broker.received)
        try:
            self.run(self.relays[which].relay_once())
        except Crash:
            self.may_repeat |= {number for _, number in self.broker.received[before:]}
        self.broker.crash_next = False  # (a round with nothing to publish never crashed)

    @rule(key=st.sampled_from(KEYS[1:]))
    def refuse(self, key: str) -> None:
        self.broker.refused.add(key)

    @rule(key=st.sampled_from(KEYS[1:]))
    def accept(self, key: str) -> None:
        self.broker.refused.discard(key)

    @rule(seconds=st.sampled_from([0.5, 1.0, 5.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @precondition(lambda self: self.next_number > 0)
    @rule()
    def requeue(self) -> None:
        self.run(self.relays[0].requeue_parked())

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def nothing_rolled_back_is_published(self) -> None:
        assert not {number for _, number in self.broker.received} & self.discarded

    @invariant()
    def only_a_crashed_rounds_rows_are_published_twice(self) -> None:
        counts = Counter(number for _, number in self.broker.received)
        twice = {number for number, count in counts.items() if count > 1}
        assert twice <= self.may_repeat, f"published twice without a crash: {sorted(twice)}"

    @invariant()
    def each_key_first_arrives_in_write_order(self) -> None:
        first: dict[str | None, list[int]] = {}
        seen: set[int] = set()
        for key, number in self.broker.received:
            if number not in seen:
                seen.add(number)
                first.setdefault(key, []).append(number)
        for key, numbers in first.items():
            if key is not None:
                assert numbers == sorted(numbers), f"key {key}: {numbers}"

    @invariant()
    def marked_rows_were_published(self) -> None:
        t = self.outbox.table

        async def marked() -> set[int]:
            async with self.outbox.engine.connect() as connection:
                rows = await connection.execute(
                    sa.select(t.c.data).where(t.c.published_at.is_not(None)))
                return {int(data) for data in rows.scalars()}

        assert self.run(marked()) <= {number for _, number in self.broker.received}

    def teardown(self) -> None:
        try:
            self.broker.refused.clear()
            self.run(self.relays[0].requeue_parked())
            self.clock.advance(60)
            self.run(self._drain())
            published = {number for _, number in self.broker.received}
            assert set(self.written) <= published, \
                f"never published: {sorted(set(self.written) - published)}"
            backlog = self.run(self.relays[0].backlog())
            assert (backlog.pending, backlog.parked) == (0, 0)
        finally:
            async def drop() -> None:
                async with self.outbox.engine.begin() as connection:
                    await connection.run_sync(self.outbox.metadata.drop_all)
                await self.outbox.close()

            self.run(drop())
            self.loop.close()

    async def _drain(self) -> None:
        while await self.relays[0].relay_once():
            pass


class MariaDbRelayMachine(RelayMachine):
    """Named locks (GET_LOCK) for keys, READ COMMITTED rounds."""

    database = "mariadb"


TestRelayMachine = RelayMachine.TestCase
TestMariaDbRelayMachine = MariaDbRelayMachine.TestCase
