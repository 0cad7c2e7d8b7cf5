"""The Kafka adapter's settle tracking and commit metadata (adapters/_kafka_offsets.py), with no
broker: whatever order offsets are fetched, delivered and settled in, the committed offset never
passes an unsettled one, what the metadata says comes back whole, and metadata too long for the
broker's limit loses knowledge (a settled offset may run again) but never skips work."""

from __future__ import annotations

import pytest

pytest.importorskip("confluent_kafka", reason='the Kafka tests need "reliable-sub[kafka]"')

from hypothesis import given
from hypothesis import strategies as st

from reliable_sub.adapters._kafka_offsets import (
    PREFIX,
    SETTLED,
    PartitionOffsets,
    decode,
    encode,
    merged,
    settled_between,
)

runs_strategy = st.lists(st.tuples(st.integers(1, 10_000), st.integers(0, 50)), max_size=40)


def expand(mark: int, runs: list[tuple[int, int]]) -> dict[int, int]:
    """Offset -> code, for every offset the runs cover."""
    codes, at = {}, mark
    for length, code in runs:
        for offset in range(at, at + length):
            codes[offset] = code
        at += length
    return codes


@given(runs_strategy)
def test_decode_gives_back_what_encode_wrote(runs: list[tuple[int, int]]) -> None:
    written = merged(runs)
    text = encode(written, limit=1_000_000)
    assert decode(text) == written
    assert text == "" or text.startswith(PREFIX)


@given(runs_strategy, st.integers(0, 300))
def test_metadata_over_the_limit_keeps_a_prefix_of_the_runs(runs: list[tuple[int, int]],
                                                            limit: int) -> None:
    written = merged(runs)
    text = encode(written, limit)
    assert len(text) <= limit
    kept = decode(text)
    assert kept == written[:len(kept)], "only later runs are left out"


@pytest.mark.parametrize("foreign", [None, "", "written by another client", "rs1:***",
                                     "rs1:gA", "rs1:AQ", "rs1:AAE"])
def test_metadata_of_another_writer_or_unreadable_is_ignored(foreign: str | None) -> None:
    assert decode(foreign) == []


@st.composite
def histories(draw: st.DrawFn) -> tuple[int, list[int], list[tuple[str, int]]]:
    """A committed offset, the offsets a fetch returns (increasing, with gaps), and a random
    interleaving of deliveries and settles of them."""
    start = draw(st.integers(0, 1000))
    gaps = draw(st.lists(st.integers(1, 3), min_size=1, max_size=60))
    fetched, at = [], start
    for gap in gaps:
        at += gap - 1  # a gap of 1: the next offset; more: offsets with no record
        fetched.append(at)
        at += 1
    events: list[tuple[str, int]] = []
    for offset in fetched:
        if draw(st.booleans()):
            events.append(("deliver", offset))
        if draw(st.booleans()):
            events.append(("settle", offset))
    return start, fetched, draw(st.permutations(events))


@given(histories(), st.integers(8, 200))
def test_the_commit_never_passes_an_unsettled_offset(
        history: tuple[int, list[int], list[tuple[str, int]]], limit: int) -> None:
    start, fetched, events = history
    tracker = PartitionOffsets(start)
    for offset in fetched:
        assert not tracker.fetched(offset).settled
    settled: set[int] = set()
    attempts: dict[int, int] = {}
    for kind, offset in events:
        if kind == "deliver":
            attempts[offset] = attempts.get(offset, 0) + 1
            tracker.delivered(offset, attempts[offset])
        else:
            tracker.settle(offset)
            settled.add(offset)
        unsettled = [o for o in fetched if o not in settled]
        mark, metadata = tracker.commit(limit)
        assert mark == (min(unsettled) if unsettled else fetched[-1] + 1)
        # what the metadata calls settled is settled; nothing unsettled is called so
        codes = expand(mark, decode(metadata))
        for offset, code in codes.items():
            if offset in fetched and offset not in settled:
                assert code != SETTLED, f"unsettled {offset} recorded as settled"
                assert code - 1 <= attempts.get(offset, 0)
        if len(metadata) < limit - 8:  # it fitted whole: the attempts are exact
            for offset in unsettled:
                if offset in codes:
                    assert codes[offset] - 1 == attempts.get(offset, 0)


@given(histories())
def test_a_new_owner_skips_what_was_settled_and_counts_on(
        history: tuple[int, list[int], list[tuple[str, int]]]) -> None:
    start, fetched, events = history
    first = PartitionOffsets(start)
    for offset in fetched:
        first.fetched(offset)
    settled: set[int] = set()
    attempts: dict[int, int] = {}
    for kind, offset in events:
        if kind == "deliver":
            attempts[offset] = attempts.get(offset, 0) + 1
            first.delivered(offset, attempts[offset])
        else:
            first.settle(offset)
            settled.add(offset)
    mark, metadata = first.commit(1_000_000)
    second = PartitionOffsets(mark, decode(metadata))
    for offset in (o for o in fetched if o >= mark):
        found = second.fetched(offset)
        assert found.settled == (offset in settled)
        if not found.settled:
            assert found.attempts == attempts.get(offset, 0)
    assert second.mark == (min((o for o in fetched if o not in settled), default=mark)
                           if any(o not in settled for o in fetched) else fetched[-1] + 1)


def test_a_record_the_metadata_called_unsettled_and_the_log_lost_does_not_stick() -> None:
    """Compaction or retention removed a record the metadata kept unsettled: the fetch passes
    over it, and the mark moves on instead of waiting for it for ever."""
    tracker = PartitionOffsets(100, [(1, SETTLED), (1, 3), (3, SETTLED), (1, 2)])
    assert tracker.mark == 100
    assert tracker.fetched(100).settled
    found = tracker.fetched(103)  # 101 is gone; 102 was a gap already
    assert found.settled
    assert tracker.mark == 104
    assert tracker.fetched(104).settled
    found = tracker.fetched(105)
    assert (found.settled, found.attempts) == (False, 1)
    assert tracker.mark == 105


def test_the_trailing_records_never_delivered_are_left_out() -> None:
    tracker = PartitionOffsets(0)
    for offset in range(10):
        tracker.fetched(offset)
    tracker.delivered(0, 1)
    tracker.settle(1)
    assert tracker.runs() == [(1, 2), (1, SETTLED)]  # 2..9 unknown: the same as new
    assert settled_between(tracker.mark, tracker.runs(), 10) == 1


def test_a_settled_run_from_the_metadata_is_kept_until_fetched() -> None:
    """Knowledge from the last owner's commit survives this owner's commits before it fetched
    that far."""
    tracker = PartitionOffsets(10, [(1, 2), (5, SETTLED), (2, 1), (1, SETTLED)])
    assert tracker.commit()[1] == encode([(1, 2), (5, SETTLED), (2, 1), (1, SETTLED)])
    tracker.fetched(10)
    tracker.settle(10)
    mark, metadata = tracker.commit()
    assert mark == 11
    assert decode(metadata) == [(5, SETTLED), (2, 1), (1, SETTLED)]
