"""One partition's records on the Kafka adapter (adapters/_kafka_records.py), with no broker:
the three ordering modes, leases, delays, and which delivery an ack id still names."""

from __future__ import annotations

import pytest

pytest.importorskip("confluent_kafka", reason='the Kafka tests need "reliable-sub[kafka]"')

from reliable_sub.adapters._kafka_offsets import PartitionOffsets
from reliable_sub.adapters._kafka_records import (
    KEY,
    LEASE_SLACK,
    NONE,
    PARTITION,
    Entry,
    PartitionQueue,
)

LEASE = 10.0


def queue_of(ordering: str, keys: str) -> PartitionQueue:
    """A partition whose records 0, 1, ... have the keys in ``keys`` (one letter each)."""
    offsets = PartitionOffsets(0)
    queue = PartitionQueue(1, offsets, ordering)
    for offset, key in enumerate(keys):
        offsets.fetched(offset)
        queue.add(Entry(offset, f"record-{offset}", key.encode() if ordering == KEY else None,
                        0))
    return queue


def take(queue: PartitionQueue, now: float, count: int = 100) -> list[Entry]:
    out: list[Entry] = []
    queue.due(now)
    queue.take(count, now, LEASE, out)
    return out


def offsets(entries: list[Entry]) -> list[int]:
    return [entry.offset for entry in entries]


def test_one_record_of_a_key_is_out_at_a_time_and_the_others_keys_go_on() -> None:
    queue = queue_of(KEY, "ABAAB")
    a0, b1 = take(queue, 0.0)
    assert take(queue, 0.0) == [], "A's and B's later records wait for the ones out"
    queue.settle(a0)
    [a2] = take(queue, 0.0)
    queue.give_back(a2, 0.0, delay=0.0)  # given back unrun (say, at a stop)
    assert offsets(take(queue, 0.0)) == [2], "a2 again, before a3"
    assert a2.attempts == 2
    queue.settle(b1)
    assert offsets(take(queue, 0.0)) == [4]
    assert queue.offsets.mark == 2


def test_a_successor_never_out_beside_a_failing_record_counts_no_delivery() -> None:
    """#45: a record handed out beside an earlier one of its key was given back by the
    Subscriber whenever that one failed, a delivery each time its handler never saw."""
    queue = queue_of(KEY, "AA")
    for attempt in (1, 2, 3):
        [a0] = take(queue, float(attempt))
        assert a0.attempts == attempt
        queue.give_back(a0, float(attempt), delay=0.5)  # the handler failed: a backoff
        assert take(queue, attempt + 0.25) == [], "a1 waits out a0's backoff"
    [a0] = take(queue, 4.0)
    queue.settle(a0)
    [a1] = take(queue, 4.0)
    assert (a1.offset, a1.attempts) == (1, 1)


def test_a_delayed_record_holds_back_only_the_later_ones_of_its_key() -> None:
    queue = queue_of(KEY, "ABA")
    a0, b1 = take(queue, 0.0)
    queue.give_back(a0, 0.0, delay=5.0)  # a retry with a backoff
    queue.settle(b1)
    assert take(queue, 1.0) == [], "a2 waits for a0, B has nothing left"
    assert offsets(take(queue, 5.0)) == [0], "a0 is due: it goes first"
    [a0] = [queue.entries[0]]
    queue.settle(a0)
    assert offsets(take(queue, 5.0)) == [2]
    assert queue.offsets.mark == 2


def test_a_lease_that_ends_lets_the_key_go_on_behind_the_record() -> None:
    queue = queue_of(KEY, "AA")
    [a0] = take(queue, 0.0)
    assert take(queue, LEASE + 1) == [a0], "out again; a1 still behind it"
    queue.settle(a0)
    assert offsets(take(queue, LEASE + 1)) == [1]


def test_partition_order_hands_out_one_record_at_a_time() -> None:
    queue = queue_of(PARTITION, "ABC")
    [r0] = take(queue, 0.0)
    assert take(queue, 0.0) == []
    queue.give_back(r0, 0.0, delay=2.0)
    assert take(queue, 1.0) == [], "a delayed record blocks its partition"
    assert offsets(take(queue, 2.0)) == [0]
    queue.settle(r0)
    assert offsets(take(queue, 2.0)) == [1]


def test_no_order_lets_everything_out() -> None:
    queue = queue_of(NONE, "AAA")
    r0, r1, _ = take(queue, 0.0)
    queue.give_back(r0, 0.0, delay=5.0)
    queue.give_back(r1, 0.0, delay=0.0)
    assert offsets(take(queue, 1.0)) == [1]


def test_a_lease_that_ends_hands_the_record_out_again_and_stales_its_ack_id() -> None:
    queue = queue_of(NONE, "A")
    [entry] = take(queue, 0.0)
    assert queue.held_entry(0, 1, LEASE - 1) is entry
    queue.extend(entry, LEASE - 1, LEASE)
    assert queue.held_entry(0, 1, LEASE + 1) is entry, "extended"
    assert queue.held_entry(0, 1, 2 * LEASE) is None, "its lease ended"
    [again] = take(queue, 2 * LEASE)
    assert again is entry and entry.attempts == 2
    assert queue.held_entry(0, 1, 2 * LEASE) is None, "the first delivery's ack id"
    assert queue.held_entry(0, 2, 2 * LEASE) is entry


def test_a_revoking_partition_hands_nothing_out() -> None:
    queue = queue_of(NONE, "AB")
    queue.revoking = True
    assert take(queue, 0.0) == []
    assert queue.waiting == 2


def test_settled_records_leave_no_lease_behind() -> None:
    """Every delivery pushes a lease on the heap; one whose record was acked, given back or
    extended must not stay there until its deadline: at 45,000 records a second and a 30 s ack
    deadline that was ~1.35 million tuples held for nothing (found by the cost check's Kafka
    workload), and next_event() named a lease of nothing."""
    records = 5_000
    queue = queue_of(NONE, "x" * records)
    out = take(queue, 0.0, count=records)
    for entry in out[: records // 2]:
        queue.extend(entry, 0.0, LEASE)
    for entry in out:
        queue.settle(entry)
    assert queue.next_event() is None, "nothing is held: no lease is pending"
    assert len(queue._leases) <= LEASE_SLACK, "the leases of settled records are dropped"

    again = queue_of(NONE, "x" * records)
    given = take(again, 0.0, count=records)
    for entry in given:
        again.give_back(entry, 0.0, delay=0.0)
    assert len(again._leases) <= LEASE_SLACK + 1
    assert offsets(take(again, 0.0, count=records)) == list(range(records))
