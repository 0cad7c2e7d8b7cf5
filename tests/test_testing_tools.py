"""The testing tools users get (reliable_sub.testing.faults and .recorded) do what they promise.

Each fault must really happen (the injector's counts), must be survived where the guarantees
say so, and must show up where they say it does not (an interrupted plain handler runs twice:
the tool has to catch that, or it would hide the very bug it is for).
"""

from __future__ import annotations

import asyncio
import collections
import json
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import sqlalchemy as sa

from reliable_sub import DeadLetterPolicy, Message, Outcome, RetryPolicy, Subscriber
from reliable_sub.dedup import MemoryDedupStore, SqlDedupStore
from reliable_sub.testing import Harness, memory_harness, pubsub_harness, redis_harness
from reliable_sub.testing.faults import (
    DUPLICATE_DELIVERY,
    FaultInjector,
    Faults,
    InjectedFault,
)
from reliable_sub.testing.recorded import load_recorded, run_recorded
from reliable_sub.testing.services import postgres_url
from reliable_sub.testing.timing import drive_until

MESSAGES = 20
# Real seconds a real broker gets to deliver everything (and the copies) in these tests.
WITHIN = 60.0
FAST_RETRY = RetryPolicy(min_backoff=0.1, max_backoff=1.0)


def orders(count: int = MESSAGES, *, prefix: str = "order") -> list[Message]:
    return [Message(id=f"rec-{n}", data=f"{prefix}-{n}".encode(),
                    attributes={"idempotency-key": f"{prefix}-{n}"}) for n in range(count)]


class Ledger:
    """Effects, counted outside the consumer: one entry per time a handler did its work."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.effects: collections.Counter[str] = collections.Counter()

    def plain(self, message: Message) -> None:
        """A handler that adds an effect every time it runs (not idempotent by itself)."""
        with self.lock:
            self.effects[message.data.decode()] += 1

    def keyed(self, message: Message) -> None:
        """A handler that makes its effect idempotent by key (an upsert, a conditional write)."""
        with self.lock:
            self.effects[message.data.decode()] = 1

    def of(self, message: Message) -> int:
        return self.effects[message.data.decode()]


# -- Faults ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.5"])
def test_a_chance_outside_zero_to_one_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"Faults.interrupt must be a chance in \[0, 1\]"):
        Faults(interrupt=bad)


def test_the_same_seed_makes_the_same_choices() -> None:
    faults = Faults(duplicate=0.5, lose_ack=0.3)
    first, second = FaultInjector(faults, seed=11), FaultInjector(faults, seed=11)
    rolls = [(first.happens("duplicate"), first.happens("lose_ack")) for _ in range(200)]
    assert rolls == [(second.happens("duplicate"), second.happens("lose_ack")) for _ in range(200)]
    assert first.injected == second.injected and 0 < first.injected["duplicate"] < 200
    assert FaultInjector(faults).seed is not None, "a random seed is kept to repeat a run"


# -- duplicate delivery, on every adapter ---------------------------------------------------------


@pytest_asyncio.fixture(params=["memory", "redis", "pubsub"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    made = {"memory": memory_harness, "redis": redis_harness, "pubsub": pubsub_harness}
    harness = made[request.param]()
    await harness.adapter()
    try:
        yield harness
    finally:
        await harness.close()


@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "no-dedup"])
async def test_duplicate_delivery_hands_every_message_to_the_handler_again(
    harness: Harness, dedup: bool
) -> None:
    """With a dedup store the copies are duplicates; without one the handler runs twice: the
    mode shows a user which of the two their set-up does."""
    topic, subscription = await harness.topic_and_subscription()
    injector = FaultInjector(DUPLICATE_DELIVERY, seed=1)
    ledger = Ledger()
    outcomes: collections.Counter[Outcome] = collections.Counter()
    attempts: dict[str, list[int]] = collections.defaultdict(list)

    def on_outcome(message: Message, outcome: Outcome) -> None:
        outcomes[outcome] += 1
        attempts[message.data.decode()].append(message.delivery_attempt)

    adapter = await harness.adapter()
    sub = Subscriber(injector.adapter(adapter), dedup=harness.dedup_store() if dedup else None,
                     clock=harness.clock, on_outcome=on_outcome, receive_timeout=0.5)
    sub.handler(subscription)(ledger.plain)
    for message in orders():
        await adapter.publish(topic, message.data, message.attributes)

    async with sub:
        await drive_until(harness.clock, lambda: sum(outcomes.values()) == 2 * MESSAGES,
                          WITHIN, what="every message and its copy settled")
    assert injector.injected == {"duplicate": MESSAGES}
    assert injector.pending == 0
    if dedup:
        assert outcomes == {Outcome.ACKED: MESSAGES, Outcome.DUPLICATE: MESSAGES}
        assert set(ledger.effects.values()) == {1}, "every effect once"
    else:
        assert outcomes == {Outcome.ACKED: 2 * MESSAGES}
        assert set(ledger.effects.values()) == {2}, "the copy ran the handler again"
    assert len(ledger.effects) == MESSAGES
    assert all(seen == [seen[0], seen[0] + 1] for seen in attempts.values()), (
        "a copy comes as the next delivery attempt"
    )


# -- random faults, through run_recorded ----------------------------------------------------------


async def test_lost_acks_come_back_after_the_ack_deadline_as_duplicates() -> None:
    ledger = Ledger()
    report = await run_recorded(ledger.plain, orders(), faults=Faults(lose_ack=0.5),
                                ack_deadline=10.0)
    lost_acks = report.injected["lose_ack"]
    assert lost_acks > 0
    duplicates = sum(entry.outcomes.count(Outcome.DUPLICATE) for entry in report.messages)
    assert duplicates == lost_acks, "each lost ack brought its message back once more"
    assert report.doubled() == [] and report.lost() == [], report.table()
    assert set(ledger.effects.values()) == {1}


async def test_repeated_deliveries_run_the_handler_once_with_a_dedup_store() -> None:
    ledger = Ledger()
    report = await run_recorded(ledger.plain, orders(), faults=Faults(repeat=1.0))
    assert report.injected["repeat"] == MESSAGES
    assert all(entry.calls == 1 for entry in report.messages), report.table()
    assert set(ledger.effects.values()) == {1}


async def test_an_interrupt_after_the_work_doubles_a_plain_handlers_effect() -> None:
    """The window between an effect and its record: the tool must show it, not hide it."""
    ledger = Ledger()
    report = await run_recorded(ledger.plain, orders(), faults=Faults(interrupt=0.5),
                                retry=FAST_RETRY, effects=ledger.of)
    interrupts = report.injected["interrupt"]
    assert interrupts > 0
    assert sum(entry.returned for entry in report.messages) == MESSAGES + interrupts
    assert sum(entry.effects for entry in report.messages) == MESSAGES + interrupts
    assert len(report.doubled()) > 0 and report.lost() == []
    assert all(Outcome.RETRY in entry.outcomes for entry in report.doubled())


async def test_an_idempotent_effect_survives_every_fault_at_once() -> None:
    faults = Faults(duplicate=0.3, lose_ack=0.2, repeat=0.2, interrupt=0.3, fail_store=0.2)
    for seed in range(3):
        ledger = Ledger()
        injector = FaultInjector(faults, seed=seed)
        report = await run_recorded(ledger.keyed, orders(), faults=injector, retry=FAST_RETRY,
                                    effects=ledger.of)
        assert report.seed == seed
        assert report.doubled() == [] and report.lost() == [], report.table()
        assert all(entry.final in (Outcome.ACKED, Outcome.DUPLICATE)
                   for entry in report.messages)
    assert set(injector.injected) == {"duplicate", "lose_ack", "repeat", "interrupt",
                                      "fail_store"}, "every fault happened"


async def test_store_failures_are_retried_and_nothing_is_lost_or_doubled() -> None:
    ledger = Ledger()
    # one message per receive: a claim call per message, so some claims fail (all but surely)
    report = await run_recorded(ledger.plain, orders(), faults=Faults(fail_store=0.3),
                                retry=FAST_RETRY, effects=ledger.of, receive_batch=1)
    assert report.injected["fail_store"] > 0
    assert report.doubled() == [] and report.lost() == [], report.table()
    assert any(Outcome.RETRY in entry.outcomes for entry in report.messages), (
        "a failed claim sends its batch back for a later delivery"
    )


async def test_a_faulty_store_raises_injected_faults_and_writes_nothing() -> None:
    injector = FaultInjector(Faults(fail_store=1.0), seed=3)
    inner = MemoryDedupStore()
    store = injector.store(inner)
    key = ("ns", "k")
    from reliable_sub.ports import DedupKey
    with pytest.raises(InjectedFault, match="claim_many of 1 records"):
        await store.claim_many([DedupKey(*key)], 30)
    assert (await inner.claim(DedupKey(*key), 30)).__class__.__name__ == "Claimed", (
        "the failed call never reached the store"
    )
    assert not hasattr(store, "claim_many_sync"), "no way around the faults"


# -- transactional handlers under faults (PostgreSQL) ---------------------------------------------


async def test_a_transactional_handler_keeps_every_effect_once_under_interrupts() -> None:
    """The fix the interrupt test points to: effect and record in one transaction."""
    store = SqlDedupStore(postgres_url(), table=f"tools_processed_{uuid.uuid4().hex[:8]}")
    effects = sa.Table(f"tools_effects_{uuid.uuid4().hex[:8]}", store.metadata,
                       sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
                       sa.Column("order_id", sa.String(40), nullable=False))
    await store.create_schema()

    async def charge(message: Message, connection: Any) -> None:
        await connection.execute(sa.insert(effects).values(order_id=message.data.decode()))

    async def rows_of(message: Message) -> int:
        async with store.engine.connect() as connection:
            query = sa.select(sa.func.count()).where(effects.c.order_id == message.data.decode())
            return int((await connection.execute(query)).scalar_one())

    try:
        report = await run_recorded(charge, orders(), dedup=store, transactional=True,
                                    faults=Faults(interrupt=0.5, duplicate=0.3),
                                    retry=FAST_RETRY, effects=rows_of)
        assert report.injected["interrupt"] > 0
        assert report.doubled() == [] and report.lost() == [], report.table()
    finally:
        async with store.engine.begin() as connection:
            await connection.run_sync(store.metadata.drop_all)
        await store.close()


# -- the report -----------------------------------------------------------------------------------


async def test_the_report_follows_each_recorded_message() -> None:
    recorded = [
        *orders(3),
        Message(id="rec-again", data=b"order-1", attributes={"idempotency-key": "order-1"}),
        Message(id="rec-poison", data=b"poison", attributes={"idempotency-key": "poison"}),
    ]
    calls: collections.Counter[str] = collections.Counter()

    async def handler(message: Message) -> None:
        calls[message.data.decode()] += 1
        await asyncio.sleep(0)
        if message.data == b"poison":
            raise ValueError("cannot parse order")

    report = await run_recorded(
        handler, recorded, retry=FAST_RETRY,
        dead_letter=DeadLetterPolicy("recorded-dead-letter", max_delivery_attempts=3),
    )
    by_id = {entry.message.id: entry for entry in report.messages}
    assert [entry.index for entry in report.messages] == list(range(5))
    assert by_id["rec-1"].outcomes == [Outcome.ACKED] and by_id["rec-1"].effects == 1
    again = by_id["rec-again"]  # received beside rec-1: deferred while it runs, then skipped
    assert again.final is Outcome.DUPLICATE and again.calls == 0, report.table()
    assert again.effects == 1, "its key's effect happened, through rec-1"
    poison = by_id["rec-poison"]
    assert poison.outcomes == [Outcome.RETRY, Outcome.RETRY, Outcome.DEAD_LETTERED]
    assert poison.calls == 3 == calls["poison"] and poison.returned == 0
    assert poison.errors == ["ValueError: cannot parse order"] * 3
    assert report.dead_lettered() == [poison] and report.lost() == []
    assert report.doubled() == [] and report.injected == {} and report.seed is None
    table = report.table().splitlines()
    assert table[0].split() == ["#", "key", "calls", "returned", "effects", "outcomes",
                                "last", "error"]
    assert table[5].split()[:6] == ["4", "poison", "3", "0", "0",
                                    "retried,retried,dead_lettered"]


def test_recorded_messages_load_from_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "orders.jsonl"
    path.write_text("\n".join([
        json.dumps({"id": "m-1", "data": "order-1", "attributes": {"idempotency-key": "o-1"}}),
        "",
        json.dumps({"data_base64": "AP8=", "ordering_key": "customer-7"}),
    ]))
    first, second = load_recorded(path)
    assert (first.id, first.data, first.attributes) == ("m-1", b"order-1",
                                                        {"idempotency-key": "o-1"})
    assert (second.id, second.data, second.ordering_key) == ("line-3", b"\x00\xff", "customer-7")


@pytest.mark.parametrize(("line", "problem"), [
    ("[1, 2]", "expected a JSON object"),
    ('{"attributes": {}}', '"data" \\(text\\) or "data_base64"'),
    ('{"data": "x", "attributes": {"n": 1}}', "map strings to strings"),
    ('{"data_base64": "not base64!"}', "Only base64 data|Incorrect padding"),
    ("{not json", "Expecting property name"),
])
def test_a_bad_recorded_line_names_the_file_and_line(
    tmp_path: Path, line: str, problem: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"data": "fine"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*({problem})"):
        load_recorded(path)


def test_the_example_test_file_passes() -> None:
    """examples/test_handler_under_faults.py: what the README shows users, run as they would."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "examples/test_handler_under_faults.py", "-n", "0",
         "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "7 passed" in done.stdout, done.stdout
